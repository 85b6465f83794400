"""Qwen3.5 (text): Qwen3-Next's hybrid decoder (engine/models/qwen3_next.py) with the
DeltaNet's input projections stored apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``; b and a load stacked into one ``in_proj_ba``). The dense model has an MLP
on every layer; the MoE model (``Qwen3_5MoeForCausalLM``) experts and a sigmoid-gated
shared expert on every layer, top-k weights always renormalised.

Qwen3.5's multimodal RoPE (``mrope_section``, ``mrope_interleaved``) gives each section of
the rotary dims the position of one axis (text, height, width); text has one position on
every axis, so every section turns by it and the rotation is plain (partial) RoPE.
"""
from __future__ import annotations

from engine.models.base import CausalLM
from engine.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    fused_qkvz = False
    always_renormalize = True
    stacked_params = CausalLM.stacked_params + (
        (".in_proj_b.", ".in_proj_ba.", "b"), (".in_proj_a.", ".in_proj_ba.", "a"),
    )
