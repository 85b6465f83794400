"""The OpenAI HTTP API fuzzed from its own OpenAPI schema (schemathesis, on
hypothesis): requests that fit the schema and requests that break it, sent to
the real gateway process in front of the fake engine servers. Whatever the
body, the answer is never a 5xx, an error is always the OpenAI error object,
and the gateway still serves afterwards. Bounded in examples, the same on
every machine (derandomized): a slow machine takes longer, it does not test
less.

Failures these fuzzers found are kept as explicit cases in
tests/reliability/test_bad_input_table.py and below."""
from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from gateway.http_api import create_app
from tests.gateway.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES = 30  # per operation and mode


class _SchemaOnly:
    """create_app needs a service only to answer requests; the schema needs none."""

    def on_error(self, error: Any) -> None:
        pass


SCHEMA = schemathesis.openapi.from_dict(create_app(_SchemaOnly()).openapi())


def _check(response: Any, label: str) -> None:
    assert response.status_code < 500, (label, response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], (label, error)
        assert {"type", "code", "param"} <= set(error), (label, error)
        if response.status_code == 429:
            assert response.headers.get("retry-after"), label


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE


@pytest.mark.parametrize("path, method, mode", [
    ("/v1/completions", "POST", POSITIVE), ("/v1/completions", "POST", NEGATIVE),
    ("/v1/chat/completions", "POST", POSITIVE), ("/v1/chat/completions", "POST", NEGATIVE),
    ("/v1/responses", "POST", POSITIVE), ("/v1/responses", "POST", NEGATIVE),
    ("/v1/models/{model_id}", "GET", POSITIVE),  # GETs without a body: nothing to break but the path
    # The fake servers run without --enable-lora: every load or unload fails there (a 400 naming them).
    ("/v1/load_lora_adapter", "POST", POSITIVE), ("/v1/load_lora_adapter", "POST", NEGATIVE),
    ("/v1/unload_lora_adapter", "POST", POSITIVE),
])
def test_schema_fuzz(cluster, path, method, mode):
    operation = SCHEMA[path][method]
    base_url = cluster.main.http_url
    label = f"{method} {path} ({mode.value})"

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        calls.append(1)
        _check(case.call(base_url=base_url, headers=AUTH, timeout=20), label)

    calls: list[int] = []
    fuzz()
    assert len(calls) >= EXAMPLES // 2, len(calls)  # the cases ran (hypothesis may stop early only if it runs dry)
    ok = httpx.post(base_url + "/v1/completions", headers=AUTH, timeout=20, json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    cluster.fake.wait_idle()


@pytest.mark.parametrize("body", [
    b'{"prompt": "x", "max_tokens": 1e400}',  # float overflow parsed as inf, for an int field
    b'{"prompt": "x", "temperature": -0.0, "top_p": 5e-324}',  # denormal: positive, so accepted
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    b'{"messages": [{"role": "user", "content": "hi", "tool_calls": [{}]}]}',
    b'{"prompt": "x", "stop": "\\u0000"}',
    b'{"prompt": "\\u0000", "max_tokens": 1}',
    b'{"prompt": [[1, 2], [3]]}',
    b'{"prompt": "x", "stream_options": {"include_usage": true}}',
    b'{"prompt": "x", "model": ""}',
])
def test_found_cases_are_answered(cluster, body):
    r = httpx.post(cluster.main.http_url + "/v1/" + ("chat/completions" if b"messages" in body else "completions"),
                   content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=20)
    _check(r, body.decode())
    cluster.fake.wait_idle()
