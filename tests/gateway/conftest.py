"""Gateway test fixtures: the default model's tokenizer, fake engine servers,
and real gateway processes (``python -m gateway.server``) on free ports.

All gateway processes start together the first time any of them is needed
(each takes a few seconds to load its tokenizer), and stop with SIGTERM at
the end of the session; every one must exit 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gateway.fake_engine import FakeEngine
from tests.processes import GatewayProcess

API_KEY = "test-key-123"


@dataclass
class Cluster:
    fake: FakeEngine  # prefill + decode, behind the "main" gateway
    fake_local: FakeEngine  # decode only, behind the "local" gateway
    main: GatewayProcess  # --prefill fake --decode fake --api-key
    local: GatewayProcess  # --decode fake_local (no prefill: local prefill)
    down: GatewayProcess  # unreachable prefill and decode servers
    drain: GatewayProcess  # --decode fake_local; test_drain stops it with SIGTERM


@pytest.fixture(scope="session")
def _cluster_processes(default_model_dir: Path):
    fake, fake_local = FakeEngine().start(), FakeEngine().start()
    procs = {
        "main": GatewayProcess("main", ["--prefill", fake.prefill_address, "--decode", fake.decode_address,
                                        "--api-key", API_KEY, "--request-timeout", "20",
                                        "--shutdown-timeout", "5", "--allow-runtime-lora-updating"]),
        "local": GatewayProcess("local", ["--decode", fake_local.decode_address, "--max-model-len", "64",
                                          "--served-model-name", "tiny"]),
        "down": GatewayProcess("down", ["--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:1,127.0.0.1:7"]),
        "drain": GatewayProcess("drain", ["--decode", fake_local.decode_address, "--disable-log-requests"]),
    }
    yield fake, fake_local, procs
    for p in procs.values():  # signal all first: they drain in parallel
        p.terminate()
    codes = {name: p.stop() for name, p in procs.items()}
    fake.stop()
    fake_local.stop()
    assert codes == {name: 0 for name in procs}, {n: procs[n].logs() for n, c in codes.items() if c != 0}


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


SCRIPT_TEXT = "Hello! I am a fake model. The answer is 42, and that is all."


@pytest.fixture(scope="session")
def cluster(_cluster_processes, tokenizer) -> Cluster:
    fake, fake_local, procs = _cluster_processes
    script = tokenizer.encode(SCRIPT_TEXT)
    for f in (fake, fake_local):
        f.state.script, f.state.eos = list(script), tokenizer.eos_token_id
    for p in procs.values():
        p.wait_ready()
    return Cluster(fake, fake_local, procs["main"], procs["local"], procs["down"], procs["drain"])


@pytest.fixture(autouse=True)
def _reset_fakes(request):
    """Knobs and observations of the fake engines start fresh in every test."""
    if "cluster" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        cluster.fake.reset()
        cluster.fake_local.reset()
    yield
