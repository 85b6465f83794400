"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5: Gated DeltaNet layers beside full
attention) through the whole topology: `pdserve up` with one prefill and one decode server,
the prompt computed on the prefill server in chunks of 8 tokens, its KV blocks and then its
linear-attention state (every linear layer's conv and ssm slot) moved to the decode server's
reserved slot, layer by layer or after prefill, and the streamed tokens exactly
transformers' float32 greedy ones. A second wave shares a prefix with the first: the prefill
server restores the state from a snapshot of its prefix cache and computes the rest, and what
it sends is still the state after the whole prompt. The decode server, which holds the first
wave's blocks but no state snapshot of them, takes their prefix from its cache anyway (the
state comes whole) and the prefill server leaves those blocks out of the send."""
from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.test_model_families_cluster import start_cluster
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, random_prompts
from tests.engine.test_qwen3_next import make_checkpoint

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


# each family and each send mode once (the state moves the same way in both families)
@pytest.fixture(scope="module", params=[("qwen3-next", "layerwise"), ("qwen3.5", "after-prefill")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def cluster(request, tmp_path_factory, default_model_dir: Path):
    name, mode = request.param
    d = make_checkpoint(tmp_path_factory.mktemp(name) / "model", name, seed=5)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids stay below 384)
        shutil.copy(default_model_dir / f, d / f)
    # chunks of 8 tokens cut at state snapshots every 8 (engine/linear_state_cache.py)
    up, ports = start_cluster(d, "--kv-send", mode, "--max-num-batched-tokens", "8",
                              "--linear-state-snapshot-interval", "8")
    yield d, ports
    up.stop()


def _generate(address: str, prompt: list[int]) -> tuple[list[int], int]:
    """The streamed tokens and the prompt tokens served from a prefix cache."""
    with grpc.insecure_channel(address) as ch:
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        tokens, cached = [], 0
        for delta in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=300):
            tokens += delta.token_ids
            if delta.HasField("usage"):
                cached = delta.usage.cached_tokens
        return tokens, cached


def test_hybrid_tokens_through_prefill_transfer_decode_are_transformers(cluster):
    d, ports = cluster
    first = random_prompts([3, 29, 45], seed=12)
    second = [first[2] + t for t in random_prompts([6, 11], seed=13)]  # the 45 tokens' prefix, and more
    m = hf_model(d)
    address = f"127.0.0.1:{ports['grpc']}"
    for wave in (first, second):
        want = hf_greedy(m, wave, MAX_TOKENS)
        with ThreadPoolExecutor(len(wave)) as pool:  # one decode batch
            got = list(pool.map(lambda p: _generate(address, p), wave))
        assert_greedy_match(m, wave, want, [tokens for tokens, _ in got])
    # The second wave's prompts came in part from the prefill server's prefix cache (its state from
    # the snapshot at token 40, the last boundary before the shared prefix's end) and in part from the
    # decode server's: the 11 whole blocks of 4 of the 45 shared tokens it received in the first wave
    # (no snapshot there: the state arrives whole). The usage reports the larger.
    assert [cached for _, cached in got] == [44, 44]
    metrics = httpx.get(f"http://127.0.0.1:{ports['decode'] + 1000}/metrics", timeout=10).text
    assert 'pdserve:kv_transfer_bytes_total{' in metrics
    # the decode server's reservations took those 2 x 44 tokens (so the gateway asked the prefill
    # server to skip 11 blocks of each, and the hand-off into the rest went through)
    hits = re.search(r"^pdserve:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", metrics, re.M)
    assert hits is not None and float(hits.group(1)) == 88
