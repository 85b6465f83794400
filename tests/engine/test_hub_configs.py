"""Model configs in the format the Hub ships them, served as transformers serves them.

Every other test checkpoint is written by transformers 5, which always writes
``rope_parameters`` and ``layer_types``. Published checkpoints carry the older keys:
``rope_scaling`` (with ``rope_type`` or ``type``), Gemma 3's ``rope_local_base_freq``
and ``sliding_window_pattern``, Qwen2's ``use_sliding_window`` / ``max_window_layers``,
Phi-3's top-level ``original_max_position_embeddings``. Here each config.json is the
published one's fields (Llama-3.1-8B-Instruct, gemma-3-1b-it, gemma-3-4b-it's text
config, Phi-3-mini-128k-instruct, Qwen2.5-7B-Instruct) with the sizes shrunk (hidden
size, layers, heads, vocabulary and its special ids, the sliding windows, Phi-3's
original context, the LongRoPE factor lists sized head_dim / 2), random weights saved
beside it, and transformers reading the SAME file is the oracle: greedy tokens, and the
log-probability of each one.

LongRoPE: transformers picks the short or the long factors per call, by the longest
position in it; pdserve per position (a paged cache keeps each key as it was first
rotated: engine/layers/rotary.py). The oracle therefore runs the prompt in two calls
with its cache, the positions below ``original_max_position_embeddings`` and then the
rest, and decodes one token a call: every position then gets the factors pdserve gives
it, and a prompt past the original context reaches the long factors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from tests.engine.families import hf_model, random_prompts

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
VOCAB = 384
LOGPROB_TOL = 1e-4  # agreement is ~1e-6 (float32 on both sides)
# The shrunk sizes every config shares (the published ones' special ids are past VOCAB).
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)

LLAMA_3_1 = {  # meta-llama/Llama-3.1-8B-Instruct
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, **TINY, "eos_token_id": [2, 3]}

GEMMA_3_1B = {  # google/gemma-3-1b-it (sliding_window 512 there)
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "cache_implementation": "hybrid", "final_logit_softcapping": None,
    "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_hidden_layers": 7, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 16, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, **TINY}

# google/gemma-3-4b-it's text_config (sliding_window 1024 there): linear scaling on the full layers.
GEMMA_3_4B = {**GEMMA_3_1B, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}

# microsoft/Phi-3-mini-128k-instruct (original context 4096 of 131072 there, the same ratio of 32 here); the
# factor lists have 48 values there, 8 here, shaped like them: short ones near 1, long ones rising to about 64.
PHI_3_128K = {
    "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "embd_pdrop": 0.0, "hidden_act": "silu",
    "max_position_embeddings": 2048, "model_type": "phi3", "num_hidden_layers": 2, "num_key_value_heads": 4,
    "original_max_position_embeddings": 64, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [1.07, 1.42, 2.13, 6.95, 14.61, 38.28, 53.66, 63.84],
                     "short_factor": [1.05, 1.05, 1.1, 1.15, 1.3, 1.55, 1.9, 2.3], "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2", "use_cache": True, **TINY}

QWEN_2_5 = {  # Qwen/Qwen2.5-7B-Instruct: a window named, and switched off
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, **TINY}

# The same keys with the window on from layer 1 (of 3): Qwen2's max_window_layers.
QWEN_2_WINDOW = {**QWEN_2_5, "num_hidden_layers": 3, "use_sliding_window": True, "max_window_layers": 1,
                 "sliding_window": 16}

CONFIGS = {"llama-3.1": LLAMA_3_1, "gemma-3-1b": GEMMA_3_1B, "gemma-3-4b": GEMMA_3_4B, "phi-3-128k": PHI_3_128K,
           "qwen-2.5": QWEN_2_5, "qwen-2-window": QWEN_2_WINDOW}
# A short prompt; one past every window and Phi-3's original context; one far along
# Llama 3.1's scaled wavelengths.
PROMPT_LENGTHS = [5, 100, 300]


def write_checkpoint(path: Path, config: dict, seed: int) -> Path:
    """``config`` as config.json, and random weights of the model transformers builds from it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch.float32)
    model.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps(config, indent=2))  # the Hub's format, not transformers 5's
    return path


def hf_stepwise(model, prompt: list[int], max_new_tokens: int, split: int | None = None
                ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's log-probabilities ([V]), the prompt in
    one call (two: ``prompt[:split]``, then the rest), then one token a call, on its cache."""
    chunks = [prompt] if split is None or split >= len(prompt) else [prompt[:split], prompt[split:]]
    cache, logits = None, None
    with torch.no_grad():
        for chunk in chunks:
            out = model(input_ids=torch.tensor([chunk]), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]
        tokens, logprobs = [], []
        for _ in range(max_new_tokens):
            logprobs.append(torch.log_softmax(logits.float(), dim=-1))
            tokens.append(int(logits.argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]
    return tokens, logprobs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-configs")
    return {name: write_checkpoint(root / name, cfg, seed=i) for i, (name, cfg) in enumerate(CONFIGS.items())}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hub_config_serves_as_transformers_reads_it(checkpoints, name):
    d = checkpoints[name]
    cfg = CONFIGS[name]
    model = hf_model(d)
    split = cfg.get("original_max_position_embeddings")  # LongRoPE's switch (module docstring)
    prompts = random_prompts(PROMPT_LENGTHS, vocab=VOCAB, seed=50)
    llm = LLM(str(d), max_model_len=512, kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1))
    for p, o in zip(prompts, outs):
        want, want_lp = hf_stepwise(model, p, MAX_TOKENS, split)
        got = o.outputs[0]
        for step, (w, g, lp) in enumerate(zip(want, got.token_ids, got.logprobs)):
            # Each token's log-probability is transformers' (of transformers' token where a
            # near tie picked another, after which the two continuations differ).
            assert abs(lp.logprob - float(want_lp[step][g])) < LOGPROB_TOL, (
                f"{name}: prompt of {len(p)} tokens, step {step}: logprob {lp.logprob:.5f} of token {g}, "
                f"transformers {float(want_lp[step][g]):.5f}")
            if w != g:
                top2 = torch.topk(want_lp[step], 2).values
                assert float(top2[0] - top2[1]) < 1e-4, (name, len(p), step, want, got.token_ids)
                break
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_hub_configs_read_as_published(checkpoints):
    """What each config resolves to: the RoPE variant per layer type, the window layers."""
    def read(name: str) -> ModelConfig:
        return ModelConfig.from_dir(checkpoints[name], dtype="float32", load_format="auto", served_model_name="m")

    llama = read("llama-3.1")
    assert llama.rope["full_attention"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3",
                                            "rope_theta": 500000.0}
    assert llama.layer_windows == (None, None) and llama.eos_token_ids == (2, 3)
    gemma = read("gemma-3-1b")
    assert gemma.layer_windows == (16, 16, 16, 16, 16, None, 16)  # every sixth layer full
    assert gemma.rope == {"full_attention": {"rope_type": "default", "rope_theta": 1000000},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000}}
    assert read("gemma-3-4b").rope["full_attention"] == {"factor": 8.0, "rope_type": "linear",
                                                        "rope_theta": 1000000}
    phi = read("phi-3-128k")
    assert phi.rope["full_attention"]["rope_type"] == "longrope"
    assert phi.rope["full_attention"]["original_max_position_embeddings"] == 64
    assert phi.layer_windows == (262144, 262144)
    assert read("qwen-2.5").layer_windows == (None, None)
    assert read("qwen-2-window").layer_windows == (None, 16, 16)
