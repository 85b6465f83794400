"""Phi-3: the Llama decoder; its checkpoints already stack q|k|v (``qkv_proj``) and
gate|up (``gate_up_proj``), which load as they are into the same fused parameters
(each rank taking its rows of every part). Windowed attention on every layer when the
config names a ``sliding_window``; partial rotary where ``partial_rotary_factor`` < 1."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
