"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before RoPE."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = "plain"
