"""Gemma 4 (text) through the whole topology: `pdserve up` with one prefill and one decode
server, each at one tensor-parallel rank. The tiny dense checkpoint of tests/engine/test_gemma4.py
has layers of two KV shapes (sliding: 2 heads x 16, full: 2 x 32), so its cache groups have
different block sizes (8 and 4 tokens a block, one page size), and two layers that read an
earlier layer's KV; its 8-layer form has two cache slots, each written by layers of several
groups. Prompts longer than the window (8) are computed on the prefill server in chunks of 8
tokens, every group's blocks move to the decode server (layer by layer, a slot once its last
writing layer has run, or after prefill), and the streamed tokens are exactly transformers'
float32 greedy ones. A third wave shares prefixes with the first: the decode server takes them
from its cache in every group (whole blocks of both sizes, the windowed groups' included) and
the prefill server leaves each group's blocks of them out of the send. Between two-rank tiers
each rank's pages go whole to the same rank; a channel that would split pages (two ranks into
one) is refused at open."""
from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from tests.e2e.test_model_families_cluster import _generate, start_cluster
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, random_prompts
from tests.engine.test_gemma4 import make_gemma4
from tests.kv_transfer.test_mixed_shapes import make_two_slot_gemma4
from tests.processes import EngineServer, GatewayProcess, running_cluster

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
BUILDERS = {"dense": lambda d: make_gemma4(d, "dense", seed=3), "two-slots": lambda d: make_two_slot_gemma4(d, seed=4)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_dir: Path):
    """name -> (checkpoint, transformers' model, two waves of (prompts, greedy tokens)), made
    when first asked for."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            d = BUILDERS[name](tmp_path_factory.mktemp(name) / "model")
            for f in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids below 384)
                shutil.copy(default_model_dir / f, d / f)
            m = hf_model(d)
            first = random_prompts([5, 29, 45], seed=12)
            # the first 40 tokens of one of the first wave's prompts, and the whole of another
            shared = [first[2][:40] + random_prompts([6], seed=14)[0], first[1] + random_prompts([11], seed=15)[0]]
            waves = [first, random_prompts([17, 38], seed=13), shared]
            made[name] = d, m, [(wave, hf_greedy(m, wave, MAX_TOKENS)) for wave in waves]
        return made[name]
    return get


# (the two-slot form's layer-wise send covers the one-slot form's: one cluster less)
@pytest.fixture(scope="module", params=[("dense", "after-prefill"), ("two-slots", "layerwise")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def cluster(request, checkpoints):
    name, mode = request.param
    d, m, waves = checkpoints(name)
    up, ports = start_cluster(d, "--kv-send", mode, "--max-num-batched-tokens", "8")
    yield mode, m, waves, up, ports
    up.stop()


def test_gemma4_tokens_through_prefill_transfer_decode_are_transformers(cluster):
    mode, m, waves, up, ports = cluster
    address = f"127.0.0.1:{ports['grpc']}"
    for prompts, want in waves:  # the second wave once the first's blocks are back in the pools
        with ThreadPoolExecutor(len(prompts)) as pool:  # one decode batch
            got = list(pool.map(lambda p: _generate(address, p), prompts))
        assert_greedy_match(m, prompts, want, got)
    metrics = httpx.get(f"http://127.0.0.1:{ports['decode'] + 1000}/metrics", timeout=10).text
    assert 'pdserve:kv_transfer_bytes_total{' in metrics
    # The third wave's reservations took their prefixes from the decode server's cache, in whole blocks
    # of every group (8 tokens, the windowed groups' size): 40 of the first prompt's 46 tokens; 24 of the
    # second's (the first wave's 29-token prompt it received: 7 blocks of 4, 3 of 8). So the gateway
    # asked for the skips, and the hand-offs into the rest of each group's blocks went through.
    hits = re.search(r"^pdserve:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", metrics, re.M)
    assert hits is not None and float(hits.group(1)) == 40 + 24
    if mode == "layerwise":  # the layer-wise sends went through: none was redone after prefill
        assert "layer-wise KV send did not start" not in up.log_text()


def _greedy(gw, prompts: list[list[int]]) -> list[list[int]]:
    return [_generate(gw.grpc_address, p) for p in prompts]


def test_gemma4_between_tensor_parallel_tiers_of_one_size(checkpoints):
    """Two ranks on each tier: each rank's pages whole, rank r into rank r (sent after prefill).
    A one-rank decode server would take a share of each page's bytes as KV heads: the channel is
    refused at open, and the request fails naming both sides. (One two-rank prefill server serves
    both: a gateway in front of each decode server.)"""
    d, m, waves = checkpoints("dense")
    flags = ["--model", str(d), "--kv-cache-memory", "16MiB", "--block-size", "4", "--max-model-len", "256",
             "--max-num-batched-tokens", "8"]
    prefill = EngineServer("prefill", [*flags, "--tensor-parallel-size", "2"], name="prefill")
    decode = EngineServer("decode", [*flags, "--tensor-parallel-size", "2"], name="decode")
    decode_one = EngineServer("decode", flags, name="decode-one-rank")
    gw = GatewayProcess("gw", ["--prefill", prefill.address, "--decode", decode.address])
    gw_one = GatewayProcess("gw-one-rank", ["--prefill", prefill.address, "--decode", decode_one.address])
    prompts, want = waves[0]
    with running_cluster([prefill, decode, decode_one], gw):
        try:
            gw_one.wait_ready()
            gw_one.wait_healthy()
            assert_greedy_match(m, prompts, want, _greedy(gw, prompts))
            assert "2 prefill rank(s), 2 pair(s)" in decode.log_text()
            with pytest.raises(grpc.RpcError) as e:
                _generate(gw_one.grpc_address, prompts[1])
            assert "pages cannot be split by KV heads between tensor-parallel ranks; prefill has 2 rank(s), " \
                "decode 1" in e.value.details()
        finally:
            assert gw_one.stop() == 0, gw_one.logs()
