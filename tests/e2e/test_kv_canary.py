"""The KV transfer canary under real processes: a decode server whose every received transfer
gets one sampled block corrupted after it lands (the test hook PDSERVE_TEST_CORRUPT_KV_EVERY=1)
fails each hand-off's checksum, counts it in pdserve:kv_transfer_checksum_mismatches, and the
gateway's --kv-load-failure-policy decides: ``recompute`` returns the exact tokens of an
uncorrupted run (the decode server computes the prompt, resuming after the prefill server's first
token), ``fail`` ends the request with an error that names the mismatch. No KV block stays held
on either tier. One cluster for the module: a prefill and a decode server, a gateway per policy."""
from __future__ import annotations

import grpc
import httpx
import pytest

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess, free_port, stop_all

pytestmark = pytest.mark.slow

MAX_TOKENS = 4
METRIC = "pdserve:kv_transfer_checksum_mismatches_total"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    flags = ["--model", str(tiny_llama_dir), "--kv-cache-memory", "16MiB", "--kv-transfer-timeout", "10"]
    prefill = EngineServer("prefill", flags)
    decode = EngineServer("decode", flags, metrics_port=free_port(), env={"PDSERVE_TEST_CORRUPT_KV_EVERY": "1"})
    tiers = ["--prefill", prefill.address, "--decode", decode.address]
    gateways = {policy: GatewayProcess(f"gw-canary-{policy}", [*tiers, "--kv-load-failure-policy", policy])
                for policy in ("recompute", "fail")}
    procs = [prefill, decode, *gateways.values()]
    try:
        for p in procs:
            p.wait_ready()
        for gw in gateways.values():
            gw.wait_healthy()
        yield prefill, decode, {policy: gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
                                for policy, gw in gateways.items()}
    finally:
        stop_all(procs)


def _prompt(i: int) -> list[int]:
    return [5 + (i * 29 + j * 11) % 370 for j in range(40)]  # 40 tokens: several blocks move


def _generate(stub, prompt: list[int]) -> list[int]:
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [t for d in stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                                                  sampling=sampling), timeout=60)
            for t in d.token_ids]


def _mismatches(decode: EngineServer) -> float:
    text = httpx.get(decode.load().metrics_url, timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(METRIC))


def _reference(model_dir, prompt: list[int]) -> list[int]:
    """The tokens of the request computed in one engine, nothing transferred."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), kv_cache_memory="8MiB"))
    ref = engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return ref.output_token_ids


def test_recompute_returns_the_tokens_of_an_uncorrupted_run(cluster, tiny_llama_dir):
    prefill, decode, stubs = cluster
    before = _mismatches(decode)
    assert _generate(stubs["recompute"], _prompt(1)) == _reference(tiny_llama_dir, _prompt(1))
    assert _mismatches(decode) >= before + 1
    prefill.wait_idle()
    decode.wait_idle()  # the failed hand-off's blocks and the recomputed request's are all free


def test_fail_ends_the_request_with_an_error_naming_the_mismatch(cluster):
    prefill, decode, stubs = cluster
    before = _mismatches(decode)
    with pytest.raises(grpc.RpcError) as err:
        _generate(stubs["fail"], _prompt(2))
    assert "KV checksum mismatch" in err.value.details(), err.value.details()
    assert _mismatches(decode) == before + 1
    prefill.wait_idle()
    decode.wait_idle()
