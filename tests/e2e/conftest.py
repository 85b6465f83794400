"""Clusters more than one e2e module runs against (tests/conftest.py puts the modules that use
one on the same pytest-xdist worker, so it starts once a run)."""
from __future__ import annotations

import pytest

from tests.processes import REPO, EngineServer, GatewayProcess, free_port, running_cluster

HERMES_API_KEY = "hermes-e2e"
HERMES_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def hermes_cluster():
    """One prefill and one decode server on the default model and a gateway with the shipped
    Hermes tool template and parser (auto tool choice on) behind an API key: the APIs that
    translate into chat requests (/v1/responses, /v1/messages), the n / best_of tests and the
    structured outputs and tool calls run against it, and the thinking-model tests' gateways
    front its decode server (``prefill`` and ``decode`` are the engine servers, with metrics
    ports). After the
    session, no KV block is held on either server."""
    flags = ["--kv-cache-memory", "64MiB", "--max-model-len", str(HERMES_MAX_MODEL_LEN)]
    prefill = EngineServer("prefill", flags, name="prefill", metrics_port=free_port())
    decode = EngineServer("decode", flags, name="decode", metrics_port=free_port())
    gw = GatewayProcess("hermes", ["--prefill", prefill.address, "--decode", decode.address,
                                   "--chat-template", str(REPO / "deploy" / "chat_templates" / "hermes_tools.jinja"),
                                   "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                                   "--max-model-len", str(HERMES_MAX_MODEL_LEN), "--api-key", HERMES_API_KEY])
    gw.prefill, gw.decode = prefill, decode  # type: ignore[attr-defined]
    with running_cluster([prefill, decode], gw, api_key=HERMES_API_KEY):
        yield gw
        decode.wait_idle()  # every request's blocks freed
        prefill.wait_idle()
