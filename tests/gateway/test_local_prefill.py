"""A gateway with no prefill server: the decode server prefills locally
(``remote_prefill=false``); also --served-model-name and --max-model-len."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.conftest import SCRIPT_TEXT


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.local.http_url, timeout=20) as c:
        yield c


def test_local_prefill(cluster, client):
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 40}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT and body["model"] == "tiny"
    (dreq,) = cluster.fake_local.state.decode_requests
    assert not dreq.remote_prefill and not cluster.fake_local.state.prefill_requests
    chunks = list(openai.OpenAI(base_url=cluster.local.http_url + "/v1", api_key="unused").completions.create(
        model="tiny", prompt="x", max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_model_len_flag(cluster, client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 64})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("This model's maximum context length is 64 tokens. However, "
                                                   "you requested 65 tokens (1 in the messages, 64 in the completion)")
    # Chat without max_tokens: the completion may use the rest of the 64-token context.
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert cluster.fake_local.state.decode_requests[-1].sampling.max_tokens == 64 - body["usage"]["prompt_tokens"]
    model = client.get("/v1/models").json()["data"][0]
    assert (model["id"], model["max_model_len"]) == ("tiny", 64)
    assert client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "x"}).status_code == 404
