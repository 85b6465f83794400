"""On a GPU (CI runs the CPU tests): the cache groups and hybrid models served on CUDA (Triton
kernels, CUDA graphs with state slots in their buffers, chunked prefill, prefix hits restoring
linear state) against transformers' float32 greedy tokens on the same GPU; tiny random Qwen3-Next,
Qwen3.5 and Gemma 3 checkpoints written by transformers."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, make_family_model, random_prompts
from tests.engine.test_qwen3_next import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _float32_convolutions():
    """transformers' reference runs Qwen3-Next's short convolution through cuDNN, which rounds
    float32 inputs as TF32 unless told not to: the reference is float32 here, as pdserve's kernels are."""
    before, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    yield
    torch.backends.cudnn.allow_tf32 = before

CASES = [("qwen3-next", {}), ("qwen3-next", dict(max_num_batched_tokens=8, linear_state_snapshot_interval=8)),
         ("qwen3.5", {}), ("qwen3.5", dict(max_num_batched_tokens=8, linear_state_snapshot_interval=8)),
         ("gemma3", {}), ("gemma3", dict(max_num_batched_tokens=8))]


@pytest.mark.parametrize("name, kw", CASES)
def test_served_on_cuda_token_for_token(tmp_path: Path, name: str, kw: dict):
    d = (make_family_model(tmp_path / name, name, seed=4) if name == "gemma3"
         else make_checkpoint(tmp_path / name, name, seed=1))
    m = hf_model(d, device="cuda")
    base = random_prompts([41], seed=3)[0]
    prompts = [base + t for t in random_prompts([5, 13, 2], seed=4)] + random_prompts([23, 70], seed=5)
    want = hf_greedy(m, prompts, 12)
    llm = LLM(str(d), dtype="float32", device="cuda", kv_cache_memory="256MiB", block_size=4, max_num_seqs=8, **kw)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts[:1], sp) + llm.generate(prompts[1:], sp)
    graphs = llm.engine.runner.graphs
    try:
        # float32 throughout (--dtype auto would be bf16 on CUDA): a first difference only at a near-tie
        assert_greedy_match(m, prompts, want, [o.outputs[0].token_ids for o in outs], tie=1e-4, relative=1e-4)
        assert graphs is not None and graphs.num_replays > 0  # decode steps replayed graphs
        if "linear_state_snapshot_interval" in kw:
            assert [o.num_cached_tokens for o in outs][1:3] == [40, 40]
    finally:
        del llm, m, graphs  # a failed case's traceback keeps this frame: nothing here may hold the cache
        gc.collect()
        torch.cuda.empty_cache()
