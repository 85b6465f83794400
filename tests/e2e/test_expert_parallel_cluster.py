"""An expert-parallel prefill server (two ranks, half the experts each) hands its KV to
a decode server of another layout (one rank, every expert) through `pdserve up`: KV is
per attention head, so experts never enter the transfer, and the streamed tokens are
transformers' greedy ones. The prefill server counts each rank's routed tokens."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_model_families_cluster import MAX_TOKENS, _generate, start_cluster
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, make_family_model, random_prompts

pytestmark = pytest.mark.slow


def test_expert_parallel_prefill_to_single_rank_decode(tmp_path, default_model_dir: Path):
    d = make_family_model(tmp_path / "model", "qwen3-moe", seed=41)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, d / f)
    up, ports = start_cluster(d, "--prefill-tensor-parallel-size", "2", "--enable-expert-parallel")
    try:
        prompts = random_prompts([4, 27, 38], seed=42)
        m = hf_model(d)
        want = hf_greedy(m, prompts, MAX_TOKENS)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: _generate(f"127.0.0.1:{ports['grpc']}", p), prompts))
        assert_greedy_match(m, prompts, want, got, tie=1e-4)
        text = httpx.get(f"http://127.0.0.1:{ports['prefill'] + 1000}/metrics", timeout=10).text
        ranks = {line.split('rank="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                 for line in text.splitlines() if line.startswith("pdserve:moe_rank_tokens_total{")}
        assert set(ranks) == {"0", "1"} and sum(ranks.values()) > 0
        decode = httpx.get(f"http://127.0.0.1:{ports['decode'] + 1000}/metrics", timeout=10).text
        assert "pdserve:moe_rank_tokens" not in decode  # one rank: nothing to balance
    finally:
        up.stop()
