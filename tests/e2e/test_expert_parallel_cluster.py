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

from tests.e2e.test_cluster_up import UpProcess, _port_base
from tests.e2e.test_model_families_cluster import MAX_TOKENS, _generate
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, make_family_model, random_prompts

pytestmark = pytest.mark.slow


def test_expert_parallel_prefill_to_single_rank_decode(tmp_path, default_model_dir: Path):
    d = make_family_model(tmp_path / "model", "qwen3-moe", seed=41)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, d / f)
    base = _port_base(6)
    ports = dict(http=base, grpc=base + 1, prefill=base + 2, decode=base + 4)
    up = UpProcess("up", "pdserve.cli", [
        "up", "--model", str(d), "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
        "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
        "--prefill-tensor-parallel-size", "2", "--enable-expert-parallel",
        "--kv-cache-memory", "16MiB", "--block-size", "4", "--max-model-len", "256"],
        "pdserve ready", env={"OMP_NUM_THREADS": "1"})
    try:
        up.wait_ready()
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
