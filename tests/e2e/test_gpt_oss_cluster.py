"""gpt-oss through the whole topology: `pdserve up` with one prefill and one decode server.
The tiny checkpoint of tests/engine/test_gpt_oss.py (attention sinks, windows of 8 keys
alternating with full layers, experts with biases and the clamped SwiGLU): prompts longer than
the window are computed on the prefill server in chunks of 8 tokens, both cache groups' blocks
move to the decode server layer by layer, and the streamed tokens are exactly transformers'
float32 greedy ones."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_model_families_cluster import _generate, start_cluster
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, random_prompts
from tests.engine.test_gpt_oss import make_gpt_oss

pytestmark = pytest.mark.slow
MAX_TOKENS = 10  # test_model_families_cluster._generate's


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir: Path):
    d = make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "model", seed=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids below 384)
        shutil.copy(default_model_dir / f, d / f)
    up, ports = start_cluster(d, "--kv-send", "layerwise", "--max-num-batched-tokens", "8")
    yield d, up, ports
    up.stop()


def test_gpt_oss_tokens_through_prefill_transfer_decode_are_transformers(cluster):
    d, up, ports = cluster
    m = hf_model(d)
    address = f"127.0.0.1:{ports['grpc']}"
    for seed, lengths in ((12, [5, 29, 45]), (13, [17, 38])):  # the second wave once the first's blocks are back
        prompts = random_prompts(lengths, seed=seed)
        want = hf_greedy(m, prompts, MAX_TOKENS)
        with ThreadPoolExecutor(len(prompts)) as pool:  # one decode batch
            got = list(pool.map(lambda p: _generate(address, p), prompts))
        assert_greedy_match(m, prompts, want, got)
    metrics = httpx.get(f"http://127.0.0.1:{ports['decode'] + 1000}/metrics", timeout=10).text
    assert 'pdserve:kv_transfer_bytes_total{' in metrics
    assert "layer-wise KV send did not start" not in up.log_text()
