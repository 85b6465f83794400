"""The engine's CUDA path (Triton kernels, memory profiling): greedy parity
with transformers in float32 on the GPU, and a bf16 run. Skipped without
CUDA; run on the GPU machine."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 7, 33, 100, 250)]


def test_cuda_float32_matches_transformers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).cuda().eval()
    prompts = _prompts(384)
    ref = []
    for p in prompts:
        o = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=20, do_sample=False, pad_token_id=0,
                        eos_token_id=None)
        ref.append(o[0, len(p):].tolist())
    for budget in (16, 2048):
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=budget, kv_cache_memory="64MiB",
                  block_size=16)
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in out] == ref, f"budget {budget}"


def test_cuda_bf16_memory_profile_and_generation(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), gpu_memory_utilization=0.3)
    assert llm.engine.config.model.dtype == "bfloat16"
    total = torch.cuda.get_device_properties(0).total_memory
    kv_bytes = llm.engine.num_blocks * llm.engine.runner.block_bytes
    assert 0.2 * total < kv_bytes < 0.3 * total
    out = llm.generate(_prompts(384), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
