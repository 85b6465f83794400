"""Servers killed under a running cluster (real processes, tiny model): a
restarted decode server is served at once (the prefill side opens a new KV
pair instead of failing on the stale one), a dead prefill server costs no
request (the gateway retries elsewhere with a fresh reservation), and a decode
server killed mid-stream costs its client nothing: the stream migrates to the survivor
and ends with the tokens it would have had, and new requests go to the survivor. No
block stays held anywhere."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import offline_greedy
from tests.processes import EngineServer, GatewayProcess, ServiceProcess, metric_total

pytestmark = pytest.mark.slow


# Decode steps are paced (the servers' hidden --test-step-delay): a tiny model streams 400 tokens
# in well under a second, and the mid-stream kill must find its stream still running.
STEP_DELAY_S = 0.01


def Engine(role: str, model) -> EngineServer:
    paced = ["--test-step-delay", str(STEP_DELAY_S)] if role == "decode" else []
    return EngineServer(role, ["--model", str(model), "--kv-cache-memory", "16MiB", "--kv-transfer-timeout", "10",
                               *paced])


def _prompt(i: int) -> list[int]:
    return [7 + (i * 31 + j * 13) % 370 for j in range(40)]


def _generate(stub, i: int, max_tokens: int = 4):
    prompt = _prompt(i)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling),
                         timeout=60)


def _tokens(stub, i: int) -> list[int]:
    return [t for d in _generate(stub, i) for t in d.token_ids]


def _wait_healthy(gw: GatewayProcess, addresses: set[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        cluster = httpx.get(gw.http_url + "/cluster", timeout=10).json()["instances"]
        if {i["address"] for i in cluster if i["healthy"]} >= addresses:
            return
        assert time.monotonic() < deadline, cluster
        time.sleep(0.1)


@pytest.fixture
def cluster(tiny_llama_dir):
    procs: list[ServiceProcess] = []

    def start(n_prefill: int, n_decode: int):
        prefills = [Engine("prefill", tiny_llama_dir) for _ in range(n_prefill)]
        decodes = [Engine("decode", tiny_llama_dir) for _ in range(n_decode)]
        gw = GatewayProcess("gw-faults", ["--prefill", ",".join(p.address for p in prefills),
                                          "--decode", ",".join(d.address for d in decodes), "--max-model-len", "512"])
        procs.extend([gw, *prefills, *decodes])
        for p in procs:
            p.wait_ready()
        _wait_healthy(gw, {e.address for e in prefills + decodes})
        return gw, prefills, decodes, gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))

    start.procs = procs  # type: ignore[attr-defined]
    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.stop()


def test_restarted_decode_server_is_served_at_once(cluster):
    gw, (prefill,), (decode,), stub = cluster(1, 1)
    expected = _tokens(stub, 0)
    decode.proc.send_signal(signal.SIGKILL)
    decode.proc.wait()
    fresh = decode.restart()
    cluster.procs.append(fresh)
    fresh.wait_ready()
    _wait_healthy(gw, {fresh.address})
    assert _tokens(stub, 0) == expected  # the first request after the restart, over a new KV pair
    cluster_json = httpx.get(gw.http_url + "/cluster", timeout=10).json()["instances"]
    assert all(i["healthy"] for i in cluster_json), cluster_json  # the prefill server was never blamed
    assert prefill.load().kv_blocks_used == 0 and fresh.load().kv_blocks_used == 0


def test_dead_prefill_server_costs_no_request(cluster):
    gw, prefills, (decode,), stub = cluster(2, 1)
    expected = [_tokens(stub, i) for i in range(4)]
    prefills[0].proc.send_signal(signal.SIGKILL)  # the gateway has not noticed yet when the next requests come
    prefills[0].proc.wait()
    assert [_tokens(stub, i) for i in range(4)] == expected
    assert prefills[1].load().kv_blocks_used == 0 and decode.load().kv_blocks_used == 0


def test_decode_server_killed_mid_stream(cluster, tiny_llama_dir):
    expected = offline_greedy(tiny_llama_dir, _prompt(1), 400)
    gw, _, decodes, stub = cluster(1, 2)
    stream = _generate(stub, 1, max_tokens=400)
    first = list(next(stream).token_ids)
    victim = next(d for d in decodes if d.load().kv_blocks_used > 0)
    outcome: dict = {}

    def drain() -> None:
        try:
            outcome["tokens"] = first + [t for d in stream for t in d.token_ids]
            outcome["ended"] = "finished"
        except grpc.RpcError as e:
            outcome["ended"] = e.code()

    reader = threading.Thread(target=drain)
    reader.start()
    victim.proc.send_signal(signal.SIGKILL)
    reader.join(60)
    # migrated to the survivor: one uninterrupted stream with the tokens it would have had
    assert not reader.is_alive() and outcome["ended"] == "finished", outcome
    assert outcome["tokens"] == expected
    # the kill came mid-stream: the stream moved, it did not just end
    assert metric_total(gw.http_url + "/metrics", "pdserve:gateway_migrations_total") == 1
    survivor = next(d for d in decodes if d is not victim)
    for i in range(3):  # new requests go to the survivor
        assert len(_tokens(stub, 10 + i)) == 4
    survivor.wait_idle()


def test_prefill_and_decode_stopped_at_once_exit_cleanly(tiny_llama_dir):
    """A Ctrl-C on ``pdserve up`` reaches every server at once: the prefill server closes its KV
    pair while the decode server stops, whose pair thread then tears the pair's process group
    down as the interpreter exits. Both must exit 0 (the decode server aborted with SIGABRT when
    that teardown was still running at exit)."""
    flags = ["--model", str(tiny_llama_dir), "--kv-cache-memory", "16MiB"]
    prefill, decode = EngineServer("prefill", flags), EngineServer("decode", flags)
    gw = GatewayProcess("gw-stop", ["--prefill", prefill.address, "--decode", decode.address,
                                    "--max-model-len", "512"])
    with prefill, decode, gw:
        for p in (prefill, decode, gw):
            p.wait_ready()
        gw.wait_healthy()
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
        for i in range(3):  # the pair is up and has carried transfers
            assert len(_tokens(stub, i)) == 4
        assert gw.stop() == 0
        prefill.terminate()
        decode.terminate()
        assert (prefill.proc.wait(60), decode.proc.wait(60)) == (0, 0), decode.logs()
