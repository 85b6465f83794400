"""Gemma 4 (text) through the whole topology: `pdserve up` with one prefill and one decode
server, each at one tensor-parallel rank. The tiny dense checkpoint of tests/engine/test_gemma4.py
has layers of two KV shapes (sliding: 2 heads x 16, full: 2 x 32), so its cache groups have
different block sizes (8 and 4 tokens a block, one page size), and two layers that read an
earlier layer's KV; its 8-layer form has two cache slots, each written by layers of several
groups. Prompts longer than the window (8) are computed on the prefill server in chunks of 8
tokens, every group's blocks move to the decode server (layer by layer, a slot once its last
writing layer has run, or after prefill), and the streamed tokens are exactly transformers'
float32 greedy ones. Between two-rank tiers each rank's pages go whole to the same rank; a
channel that would split pages (two ranks into one) is refused at open."""
from __future__ import annotations

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
            waves = [random_prompts([5, 29, 45], seed=12), random_prompts([17, 38], seed=13)]
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
    if mode == "layerwise":  # the layer-wise sends went through: none was redone after prefill
        assert "layer-wise KV send did not start" not in up.log_text()


def _greedy(gw, prompts: list[list[int]]) -> list[list[int]]:
    return [_generate(gw.grpc_address, p) for p in prompts]


def test_gemma4_between_tensor_parallel_tiers_of_one_size(checkpoints):
    """Two ranks on each tier: each rank's pages whole, rank r into rank r (sent after prefill).
    A one-rank decode server would take a share of each page's bytes as KV heads: the channel is
    refused at open, and the request fails naming both sides."""
    d, m, waves = checkpoints("dense")
    flags = ["--model", str(d), "--kv-cache-memory", "16MiB", "--block-size", "4", "--max-model-len", "256",
             "--max-num-batched-tokens", "8"]
    prefill = EngineServer("prefill", [*flags, "--tensor-parallel-size", "2"], name="prefill")
    decode = EngineServer("decode", [*flags, "--tensor-parallel-size", "2"], name="decode")
    gw = GatewayProcess("gw", ["--prefill", prefill.address, "--decode", decode.address])
    prompts, want = waves[0]
    with running_cluster([prefill, decode], gw):
        assert_greedy_match(m, prompts, want, _greedy(gw, prompts))
        decode.log.flush()
        assert "2 prefill rank(s), 2 pair(s)" in decode.log_text()

    prefill = EngineServer("prefill", [*flags, "--tensor-parallel-size", "2"], name="prefill")
    decode = EngineServer("decode", flags, name="decode")
    gw = GatewayProcess("gw", ["--prefill", prefill.address, "--decode", decode.address])
    with running_cluster([prefill, decode], gw):
        with pytest.raises(grpc.RpcError) as e:
            _generate(gw.grpc_address, prompts[1])
        assert "pages cannot be split by KV heads between tensor-parallel ranks; prefill has 2 rank(s), decode 1" \
            in e.value.details()
