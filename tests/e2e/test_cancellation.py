"""A client that goes away frees its request's KV blocks on every tier, whatever
stage the request was in: waiting for a decode slot, prefilling, or decoding
(real gateway, prefill and decode processes on the tiny model; receiving KV is
covered by the engine's state tests). The tests wait for the blocks to come
back, then check from the servers' token counters that the request was cut
short by the cancel, not run to its end: no claim on how fast a machine is."""
from __future__ import annotations

import time

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess, free_port

pytestmark = pytest.mark.slow


def Engine(role: str, model, *flags: str) -> EngineServer:
    return EngineServer(role, ["--model", str(model), "--kv-cache-memory", "16MiB", *flags], metrics_port=free_port())


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    # Prefill: one token per step, so a 400-token prompt prefills for hundreds of steps.
    # Decode: one sequence at a time, so a second request waits for a slot.
    # Both paced (their hidden --test-step-delay): unpaced, the tiny model's 400 steps take well
    # under a second, and a cancel must find its request still prefilling or decoding.
    prefill = Engine("prefill", tiny_llama_dir, "--max-num-batched-tokens", "1", "--test-step-delay", "0.005")
    decode = Engine("decode", tiny_llama_dir, "--max-num-seqs", "1", "--test-step-delay", "0.01")
    gw = GatewayProcess("gw-cancel", ["--prefill", prefill.address, "--decode", decode.address,
                                      "--max-model-len", "512"])
    procs = [gw, prefill, decode]
    try:
        for p in procs:
            p.wait_ready()
        deadline = time.monotonic() + 30
        while not all(i["healthy"] for i in httpx.get(gw.http_url + "/cluster").json()["instances"]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield gw, prefill, decode, gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0, 0, 0], [p.logs() for p in procs]


def _start(stub, n_prompt: int, max_tokens: int, seed: int):
    prompt = [7 + (seed * 17 + j * 13) % 370 for j in range(n_prompt)]
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling),
                         timeout=120)


def _until(cond, what: str, timeout: float = 20.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.02)
    return time.monotonic() - t0


def _all_free(gw) -> bool:
    return not any(i["kv_blocks_used"] for i in httpx.get(gw.http_url + "/cluster").json()["instances"])


def _engines_free(*engines) -> bool:
    return all(e.load().kv_blocks_used == 0 for e in engines)


def _generated(engine: EngineServer) -> float:
    """Tokens the server has sampled (the prefill server one per completed prompt)."""
    text = httpx.get(engine.load().metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:generation_tokens_total{"))


def test_cancel_while_prefilling(cluster):
    gw, prefill, decode, stub = cluster
    before = _generated(prefill), _generated(decode)
    completed = prefill.load().num_requests_finished, decode.load().num_requests_finished
    call = _start(stub, 400, 4, seed=1)  # 400 prefill steps
    _until(lambda: prefill.load().num_running == 1, "the prefill never started")
    assert decode.load().kv_blocks_used > 0  # reserved for the KV to come
    call.cancel()
    _until(lambda: _engines_free(prefill, decode), "blocks still held")
    # The prompt never completed (no first token) and nothing was decoded; the servers count
    # no completed request (LoadInfo.num_requests_finished leaves aborted ones out).
    assert (_generated(prefill), _generated(decode)) == before
    assert (prefill.load().num_requests_finished, decode.load().num_requests_finished) == completed
    _until(lambda: _all_free(gw), "/cluster still shows blocks held")


def test_cancel_while_waiting_for_a_decode_slot_and_while_decoding(cluster):
    gw, prefill, decode, stub = cluster
    before = _generated(prefill), _generated(decode)
    running = _start(stub, 40, 400, seed=2)
    next(running)  # decoding: the decode server's only slot is taken
    waiting = _start(stub, 40, 4, seed=3)
    _until(lambda: decode.load().num_waiting == 1, "the second request is not waiting")
    waiting.cancel()
    _until(lambda: decode.load().num_waiting == 0, "still waiting")
    running.cancel()
    _until(lambda: _engines_free(prefill, decode), "blocks still held")
    # Only the running request was ever prefilled (the waiting one left the queue by its
    # cancel, not by getting the slot), and it was cut short of its 400 tokens.
    assert _generated(prefill) - before[0] == 1
    assert _generated(decode) - before[1] < 399
    _until(lambda: _all_free(gw), "/cluster still shows blocks held")
