"""Each new family through the whole topology: `pdserve up --model DIR` (gateway,
one prefill server, one decode server), prompts longer than the sliding window sent
over gRPC, the KV computed on the prefill server and moved to the decode server, and
the streamed tokens exactly transformers' greedy ones. The MoE models' servers count
the tokens routed to each expert in Prometheus."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.test_cluster_up import UpProcess, _port_base
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, make_family_model, random_prompts
from tests.processes import wait_every_instance_healthy

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


# One family of each kind of cache and MLP the transfer meets: experts (qwen3-moe; Mixtral's are the
# same layer), windowed and full layers in two cache groups (gemma3), every layer windowed
# (phi3-window). Every family's tokens are held against transformers offline in
# tests/engine/test_model_families.py; a dense family's hand-off is every other cluster test's.
@pytest.fixture(scope="module", params=["qwen3-moe", "gemma3", "phi3-window"])
def cluster(request, tmp_path_factory, default_model_dir: Path):
    name = request.param
    d = make_family_model(tmp_path_factory.mktemp(name) / "model", name, seed=11)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids stay below 384)
        shutil.copy(default_model_dir / f, d / f)
    up, ports = start_cluster(d)
    yield name, d, ports
    up.stop()


def start_cluster(model_dir: Path, *flags: str) -> tuple[UpProcess, dict[str, int]]:
    """`pdserve up --model model_dir` (one prefill, one decode server) on free ports, ready;
    ``flags`` go to `pdserve up` too. The caller stops it."""
    base = _port_base(6)
    ports = dict(http=base, grpc=base + 1, prefill=base + 2, decode=base + 4)
    up = UpProcess("up", "pdserve.cli", [
        "up", "--model", str(model_dir), "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
        "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
        "--kv-cache-memory", "16MiB", "--block-size", "4", "--max-model-len", "256", *flags],
        "pdserve ready", env={"OMP_NUM_THREADS": "1"})
    try:
        up.wait_ready()
        wait_every_instance_healthy(f"http://127.0.0.1:{ports['http']}")  # else the decode server prefills
    except BaseException:
        up.stop()
        raise
    return up, ports


def _generate(address: str, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        tokens = []
        for delta in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=300):
            tokens += delta.token_ids
        return tokens


def test_disaggregated_tokens_are_transformers(cluster):
    name, d, ports = cluster
    prompts = random_prompts([3, 29, 45], seed=12)
    m = hf_model(d)
    want = hf_greedy(m, prompts, MAX_TOKENS)
    with ThreadPoolExecutor(len(prompts)) as pool:  # one decode batch
        got = list(pool.map(lambda p: _generate(f"127.0.0.1:{ports['grpc']}", p), prompts))
    assert_greedy_match(m, prompts, want, got)
    metrics = {role: httpx.get(f"http://127.0.0.1:{ports[role] + 1000}/metrics", timeout=10).text
               for role in ("prefill", "decode")}
    assert 'pdserve:kv_transfer_bytes_total{' in metrics["decode"]
    if "moe" in name:
        for role, text in metrics.items():
            routed = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("pdserve:moe_expert_tokens_total{"))
            assert routed > 0, role
    else:
        assert "pdserve:moe_expert_tokens" not in metrics["decode"]
