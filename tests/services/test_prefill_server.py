"""Real prefill and decode server processes (tiny model), driven over gRPC and
through a real gateway: abort during prefill, a bad num_skip_blocks, a decode
server that refuses the KV channel because its layout differs (a clean error
to the client, no block held on either tier), and first-token logprobs that
travel in the KV header and equal the offline engine's."""
from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess, free_port

pytestmark = pytest.mark.slow


def Engine(name: str, model, *flags: str, metrics_port: int = 0) -> EngineServer:
    return EngineServer(name.split("-")[0], ["--model", str(model), "--num-gpu-blocks-override", "64",
                                             "--kv-transfer-timeout", "20", *flags], name=name,
                        metrics_port=metrics_port)


@pytest.fixture(scope="module", params=["layerwise", "after-prefill"])
def tiers(tiny_llama_dir, request):
    # Budget 1: a 400-token prompt takes 400 engine steps, long enough to abort it mid-prefill.
    # Both --kv-send modes: layer by layer during the last chunk (default), or after the first token.
    pairs = ["--kv-pairs-per-decode", "2"] if request.param == "layerwise" else []
    prefill = Engine("prefill", tiny_llama_dir, "--max-num-batched-tokens", "1", "--kv-send", request.param,
                     *pairs, metrics_port=free_port())
    decode = Engine("decode", tiny_llama_dir)
    other = Engine("decode-other", tiny_llama_dir, "--block-size", "32")  # a different KV layout
    procs = [prefill, decode, other]
    try:
        for p in procs:
            p.wait_ready()
        yield prefill, decode, other
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0, 0, 0], [p.logs() for p in procs]


SP = common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _reserve(decode: Engine, rid: str, prompt: list[int]):
    stream = engine_pb2_grpc.DecodeStub(decode.channel).Generate(
        engine_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=SP, remote_prefill=True),
        timeout=60)
    return stream, next(stream).reserved


def test_abort_during_prefill(tiers):
    prefill, decode, _ = tiers
    prompt = [3 + i % 300 for i in range(400)]
    stream, reserved = _reserve(decode, "a1", prompt)
    stub = engine_pb2_grpc.PrefillStub(prefill.channel)
    result: dict = {}
    call = threading.Thread(target=lambda: result.update(err=_call_error(lambda: stub.Prefill(
        engine_pb2.PrefillRequest(request_id="a1", prompt_token_ids=prompt, sampling=SP,
                                  decode_address=decode.address, dst_block_ids=reserved.block_ids),
        timeout=60))))
    call.start()
    deadline = time.monotonic() + 20
    while prefill.load().num_running == 0:  # mid-prefill: running, blocks held
        assert time.monotonic() < deadline and call.is_alive()
        time.sleep(0.01)
    assert stub.Abort(common_pb2.AbortRequest(request_id="a1"), timeout=10).found
    call.join(20)
    err = result["err"]
    assert err is not None and err.code() == grpc.StatusCode.ABORTED and "aborted during prefill" in err.details()
    prefill.wait_idle()
    stream.cancel()
    decode.wait_idle()


def _call_error(fn) -> grpc.RpcError | None:
    try:
        fn()
    except grpc.RpcError as e:
        return e
    return None


def test_num_skip_blocks_out_of_range_is_refused_and_frees(tiers):
    prefill, decode, _ = tiers
    prompt = list(range(3, 40))
    stream, reserved = _reserve(decode, "s1", prompt)
    err = _call_error(lambda: engine_pb2_grpc.PrefillStub(prefill.channel).Prefill(
        engine_pb2.PrefillRequest(request_id="s1", prompt_token_ids=prompt, sampling=SP,
                                  decode_address=decode.address, dst_block_ids=reserved.block_ids,
                                  num_skip_blocks=99), timeout=60))
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_skip_blocks 99 out of range" in err.details()
    prefill.wait_idle()
    stream.cancel()
    decode.wait_idle()


def test_layout_mismatch_gives_the_client_a_clean_error_and_frees_both_tiers(tiers):
    prefill, _, other = tiers
    gw = GatewayProcess("gw-mismatch", ["--prefill", prefill.address, "--decode", other.address])
    try:
        gw.wait_ready()
        gw.wait_healthy()
        r = httpx.post(gw.http_url + "/v1/completions", timeout=60,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 3})
        body = r.json()
        assert r.status_code == 503, body
        assert "block_size" in body["error"]["message"] and "KV" in body["error"]["message"]
        prefill.wait_idle()
        other.wait_idle()
        # The prefill server stays healthy for others: the failure was the pair's, not its own.
        info = httpx.get(gw.http_url + "/cluster", timeout=10).json()
        assert all(i["healthy"] for i in info["instances"] if i["role"] == "prefill"), info
    finally:
        assert gw.stop() == 0, gw.logs()


def test_failed_kv_hand_off_is_recomputed_on_decode_by_policy(tiers, tiny_llama_dir):
    """--kv-load-failure-policy recompute: the refused hand-off becomes a
    local prefill on the decode server; the client gets the exact tokens."""
    prefill, _, other = tiers
    gw = GatewayProcess("gw-recompute", ["--prefill", prefill.address, "--decode", other.address,
                                          "--kv-load-failure-policy", "recompute"])
    prompt = [5 + (i * 11) % 370 for i in range(40)]
    try:
        gw.wait_ready()
        gw.wait_healthy()
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        deltas = list(stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                                                sampling=sampling), timeout=60))
    finally:
        assert gw.stop() == 0, gw.logs()
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="8MiB"))
    ref = engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert [t for d in deltas for t in d.token_ids] == ref.output_token_ids
    assert deltas[-1].finish_reason == "length"
    prefill.wait_idle()
    other.wait_idle()


def test_logprobs_through_prefill_and_decode_equal_the_offline_engine(tiers, tiny_llama_dir):
    prefill, decode, _ = tiers
    prompt = [7 + (i * 13) % 350 for i in range(45)]
    gw = GatewayProcess("gw-logprobs", ["--prefill", prefill.address, "--decode", decode.address])
    try:
        gw.wait_ready()
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
        deadline = time.monotonic() + 30
        while True:
            try:
                deltas = list(stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling),
                                            timeout=60))
                break
            except grpc.RpcError as e:  # the gateway may not have seen the servers healthy yet
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e
                time.sleep(0.2)
    finally:
        assert gw.stop() == 0, gw.logs()
    got = [lp for d in deltas for lp in d.logprobs]
    ids = [t for d in deltas for t in d.token_ids]
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="8MiB"))
    ref = engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert ids == ref.output_token_ids
    assert len(got) == 6
    # The prefill server counted what its KV send added to this request's time to first token.
    text = httpx.get(prefill.load().metrics_url, timeout=10).text
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("pdserve:kv_transfer_wait_after_first_token_seconds_count"))
    assert count >= 1
    for g, r in zip(got, ref.logprobs):  # the first one came from the prefill server, in the KV trailer
        assert (g.token_id, g.rank) == (r.token_id, r.rank)
        assert g.logprob == pytest.approx(r.logprob, abs=1e-5)
        assert [(t.token_id, pytest.approx(t.logprob, abs=1e-5)) for t in g.top] == r.top
    prefill.wait_idle()
    decode.wait_idle()


def test_only_the_prefill_tier_runs_prefill_only(tiers):
    """The prefill server's engine is prefill-only (no CUDA graphs: none of its steps could
    replay one); a decode server's is not."""
    prefill, decode, _ = tiers
    assert "prefill_only=True" in next(line for line in prefill.log_text().splitlines() if "engine config:" in line)
    assert "prefill_only=False" in next(line for line in decode.log_text().splitlines() if "engine config:" in line)
