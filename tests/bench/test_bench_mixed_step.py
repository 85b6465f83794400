"""bench.mixed_step's FLOP count, against transformers' own model counted by torch's FLOP counter
(the projections, MLP and LM head exactly; attention counted apart, causal)."""
from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.mixed_step import step_flops

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=64,
              intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)


def test_step_flops_match_a_counted_forward_pass():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    config._attn_implementation = "eager"  # attention as matmuls, which the counter sees
    model = LlamaForCausalLM(config).eval()
    chunk = 24
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.arange(chunk)[None], logits_to_keep=1)  # a prompt: the last position's logits
    counts = counter.get_flop_counts()["Global"]
    attention = sum(v for op, v in counts.items() if "bmm" in str(op))  # the linear layers are aten.mm
    dense = counter.get_total_flops() - attention
    # the counted attention is dense (every query x every key); ours counts the causal half
    q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    causal = 4 * CONFIG["num_hidden_layers"] * q * chunk * (chunk + 1) / 2
    assert attention == 4 * CONFIG["num_hidden_layers"] * q * chunk * chunk
    assert step_flops(CONFIG, chunk, 0, 0) == dense + causal


def test_decode_rows_and_moe():
    base = step_flops(CONFIG, 0, 1, 10)
    two = step_flops(CONFIG, 0, 2, 10)
    q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    assert two - base == base  # rows are independent
    longer = step_flops(CONFIG, 0, 1, 11)
    assert longer - base == 4 * CONFIG["num_hidden_layers"] * q  # one more key
    assert step_flops(dict(CONFIG, num_experts=8), 4, 0, 0) is None
