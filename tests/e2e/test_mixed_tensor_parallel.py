"""A tensor-parallel prefill server (3 ranks: the default model's 3 KV heads,
one a rank) hands its KV to a one-rank decode server: each rank sends its own
heads over a pair of its own, the decode server assembles the three parts,
and greedy completions equal a colocated one-rank server's."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess, running_cluster

pytestmark = pytest.mark.slow
FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
PROMPTS = [list(range(100, 140)), list(range(7, 30)), [5, 9, 31, 7, 2, 8] * 9]


def _greedy(gw: GatewayProcess) -> list[list[int]]:
    with grpc.insecure_channel(gw.grpc_address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        sp = common_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return [[t for d in stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=p),
                                                                      sampling=sp), timeout=180)
                 for t in d.token_ids] for p in PROMPTS]


def test_prefill_tp3_to_decode_tp1_matches_one_colocated_rank():
    local = EngineServer("decode", [*FLAGS, "--prefill-mode", "local"], name="local")
    with running_cluster([local], GatewayProcess("gw-local", ["--decode", local.address])) as gw:
        want = _greedy(gw)
    prefill = EngineServer("prefill", [*FLAGS, "--tensor-parallel-size", "3"], name="prefill-tp3")
    decode = EngineServer("decode", FLAGS, name="decode-tp1")
    gw = GatewayProcess("gw", ["--prefill", prefill.address, "--decode", decode.address])
    with running_cluster([prefill, decode], gw):
        got = _greedy(gw)
        assert decode.load().num_requests_finished == len(PROMPTS)
        decode.log.flush()
        assert "3 prefill rank(s), 3 pair(s)" in Path(decode.log.name).read_text()
    assert got == want
