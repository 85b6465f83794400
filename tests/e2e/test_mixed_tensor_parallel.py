"""Tensor-parallel engines of different sizes hand KV over rank to rank (the
default model's 3 KV heads, one a rank at size 3): a 3-rank prefill server
into a one-rank decode server (each prefill rank sends its own heads), and a
one-rank prefill server into a 3-rank decode server (each decode rank
receives its own heads). The parts come together on the decode server, and
greedy completions equal one rank's (the offline engine's, which a one-rank
server's equal)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess, running_cluster

pytestmark = pytest.mark.slow
FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
PROMPTS = [list(range(100, 140)), list(range(7, 30)), [5, 9, 31, 7, 2, 8] * 9]


def _greedy(gw: GatewayProcess) -> list[list[int]]:
    """PROMPTS' tokens, the requests sent at once (one decode batch)."""
    with grpc.insecure_channel(gw.grpc_address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        sp = common_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

        def generate(p: list[int]) -> list[int]:
            return [t for d in stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=p),
                                                                         sampling=sp), timeout=180)
                    for t in d.token_ids]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(generate, PROMPTS))


@pytest.fixture(scope="module")
def colocated() -> list[list[int]]:
    """One rank's greedy tokens: the offline engine's, which a one-rank server's equal
    (tests/e2e/test_openai_client.py)."""
    from engine import LLM, SamplingParams

    llm = LLM(None, kv_cache_memory="64MiB", max_model_len=1024)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


@pytest.mark.parametrize("prefill_tp, decode_tp", [(3, 1), (1, 3)])
def test_mixed_sizes_match_one_colocated_rank(colocated, prefill_tp, decode_tp):
    prefill = EngineServer("prefill", [*FLAGS, "--tensor-parallel-size", str(prefill_tp)], name="prefill")
    decode = EngineServer("decode", [*FLAGS, "--tensor-parallel-size", str(decode_tp)], name="decode")
    gw = GatewayProcess("gw", ["--prefill", prefill.address, "--decode", decode.address])
    with running_cluster([prefill, decode], gw):
        got = _greedy(gw)
        assert decode.load().num_requests_finished == len(PROMPTS)
        decode.log.flush()
        assert f"{prefill_tp} prefill rank(s), 3 pair(s)" in Path(decode.log.name).read_text()
    assert got == colocated
