"""Greedy parity with transformers generate() in float32, token for token:
random tiny GQA models and the default SmolLM2, across chunk budgets, mixed
batches, prefix-cache hits and forced preemption."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import make_tiny_model


def hf_greedy(model_dir, prompts, max_new_tokens, eos=None):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        o = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                        eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        outs.append(o[0, len(p):].tolist())
    return outs


def random_prompts(n_list, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_list]


def engine_greedy(llm, prompts, max_new_tokens):
    sp = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {
        "llama-gqa3": make_tiny_model(root / "llama"),
        "llama-gqa5": make_tiny_model(root / "llama5", seed=1, num_attention_heads=10, num_key_value_heads=2,
                                      hidden_size=80),
        "qwen2-bias": make_tiny_model(root / "qwen2", arch="qwen2", seed=2),
        "mistral": make_tiny_model(root / "mistral", arch="mistral", seed=3, sliding_window=None),
    }


@pytest.mark.parametrize("name", ["llama-gqa3", "llama-gqa5", "qwen2-bias", "mistral"])
def test_tiny_models_match_transformers(tiny_models, name):
    d = tiny_models[name]
    prompts = random_prompts([1, 5, 17, 33, 64, 3], 384, seed=len(name))
    ref = hf_greedy(d, prompts, 24)
    for budget in (16, 64, 2048):
        llm = LLM(str(d), max_num_batched_tokens=budget, kv_cache_memory="8MiB", block_size=4)
        assert engine_greedy(llm, prompts, 24) == ref, f"budget {budget}"


def test_prefix_hits_and_preemption_keep_parity(tiny_models):
    d = tiny_models["llama-gqa3"]
    base = random_prompts([40], 384, seed=9)[0]
    prompts = [base + t for t in random_prompts([3, 9, 1, 14], 384, seed=10)]
    ref = hf_greedy(d, prompts, 30)
    # 16 blocks of 4 tokens: far too small for 4 x ~75 tokens at once.
    llm = LLM(str(d), max_num_batched_tokens=32, num_gpu_blocks_override=32, block_size=4)
    assert engine_greedy(llm, prompts[:1], 30) == ref[:1]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert max(o.num_cached_tokens for o in outs) >= 40  # the shared prefix came from the cache
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked


@pytest.fixture(scope="module")
def smollm(default_model_dir):
    return LLM(None, max_num_batched_tokens=2048)


def test_default_model_answers_france(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_dir, smollm):
    tok = smollm.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Why is the sky blue? Answer briefly."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True) for q in questions]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    prompts.append(prompts[0][:-3] + prompts[1][-3:])  # shares a long prefix with prompt 0
    ref = hf_greedy(default_model_dir, prompts, 16)
    # Whole prompts (the module's engine, budget 2048), then chunks of 16 tokens.
    assert engine_greedy(smollm, prompts, 16) == ref
    assert engine_greedy(LLM(None, max_num_batched_tokens=16, kv_cache_memory="64MiB"), prompts, 16) == ref
    # A cache of 14 blocks forces preemption of a 5-request batch of ~50 tokens each, in chunks of 64.
    llm = LLM(None, max_num_batched_tokens=64, num_gpu_blocks_override=14)
    assert engine_greedy(llm, prompts, 16) == ref
    assert llm.engine.scheduler.num_preemptions_total > 0
