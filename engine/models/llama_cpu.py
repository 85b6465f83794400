"""A Llama-family decoder layer on the CPU as a dozen direct kernel calls.

A decode step of a small model on a CPU is mostly host work: each of its 30 layers runs a dozen
modules (norms, projections, rotary, attention, MLP), and each module call goes through
``nn.Module.__call__``, the layer's method, and the kernel wrapper's checks before the compiled
kernel runs for a few microseconds. Measured on the default model's packed GGUF weights (2-core
AVX2 machine, one sequence): 16.8-18.1 ms a step through the modules, 12.9-13.1 ms with the same
kernels called directly (docs/benchmarks.md).

``fused_layer(layer, ops)`` returns the layer's forward as those direct calls, or None where the
layer is not one it covers; ``DecoderLayer.forward`` (engine/models/llama.py) runs it when set,
and the model runner sets it once the model is loaded (``fuse_layers``).
The calls are the modules' own, on the same tensors, in the same order (the split of q|k|v and
their rotation are one call, ``rotary_qkv``, rotating as ``rotary_embedding`` does; the cache's K
and V halves are taken once, not every step): the outputs are the same bits
(tests/engine/test_cpu_fused.py). The model's forward calls a layer's ``fused`` directly. Covered: the compiled CPU kernels serving
(``kernels.cpu_ops``, both extensions built), a float32 model, one rank, no LoRA, a plain (not
offset) RMSNorm, attention without q/k/v norms, sinks or a sliding window, writing its own K/V
into a float32 cache (so no FP8 scales), full rotary, SiLU-gated dense MLP, and every projection one
direct call without bias (``LinearMethod.direct``: packed GGUF blocks or a float32 weight).
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from engine.models.llama import DecoderLayer, GatedMLP
from kernels import cpu_attention

FusedForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def fused_layer(layer, ops: ModuleType, cache_dtype: torch.dtype) -> FusedForward | None:
    """``layer``'s forward (positions, h, residual, kv, meta) -> (h, residual) as direct
    kernel calls, or None where it is not covered (see the module's docstring); ``cache_dtype``:
    the KV cache's."""
    if ops.__name__ != "kernels.cpu_ops" or cache_dtype != torch.float32 or type(layer) is not DecoderLayer:
        return None
    n1, n2, attn, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp
    ext = cpu_attention.extension()
    if ext is None or type(mlp) is not GatedMLP or mlp.act != "silu" or n1.offset or n2.offset:
        return None
    if n1.weight.dtype != torch.float32 or n1.weight.device.type != "cpu":
        return None
    if (attn.q_norm is not None or attn.k_norm is not None or attn.v_norm or attn.sinks is not None
            or attn.sliding_window is not None or not attn.store or not attn.has_kv or attn.k_eq_v
            or attn.rope.rotary_dim != attn.head_dim or attn.num_heads % attn.num_kv_heads
            or attn.head_dim > cpu_attention.MAX_HEAD_DIM):
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(lin.lora is not None or lin.bias is not None or getattr(lin, "tp", None) is not None for lin in linears):
        return None
    qkv, o_proj, gate_up, down = (lin.method.direct(lin) for lin in linears)
    if qkv is None or o_proj is None or gate_up is None or down is None:
        return None
    glue = torch.ops.pdserve_cpu
    w1, w2, eps1, eps2 = n1.weight, n2.weight, n1.eps, n2.eps
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_size = attn.q_size
    cos_sin, scale, group = attn.rope.cos_sin, float(attn.scale), attn.kv_group
    caches: list = [None, None, None]  # the layer's KV tensor's address, its K and V halves

    def forward(positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, kv: torch.Tensor,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        t = h.shape[0]
        if residual is None:
            x, residual = glue.rms_norm(h, w1, eps1), h
        else:
            x, residual = glue.fused_add_rms_norm(h, residual, w1, eps1)
        q, k, v = glue.rotary_qkv(positions, qkv(x), cos_sin, heads, kv_heads)
        index = cpu_attention.step_index(meta.block_tables[group], meta.query_start_loc, meta.seq_lens,
                                         meta.step_cache.setdefault(group, {}))
        if caches[0] != kv.data_ptr():  # the same cache every step: its halves taken once
            caches[:] = kv.data_ptr(), kv[:, 0], kv[:, 1]
        k_cache, v_cache = caches[1], caches[2]
        ext.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping[group], 1.0, 1.0)
        o = ext.paged_attention(q, k_cache, v_cache, *index, scale, 0, 1.0, 1.0, None)
        x, residual = glue.fused_add_rms_norm(o_proj(o.reshape(t, q_size)), residual, w2, eps2)
        return down(glue.silu_and_mul(gate_up(x))), residual

    return forward


def fuse_layers(model: torch.nn.Module, ops: ModuleType, cache_dtype: torch.dtype) -> int:
    """Set each decoder layer's ``fused`` forward where ``fused_layer`` covers it; the number set."""
    count = 0
    for layer in model.model.layers:
        if hasattr(layer, "fused"):
            layer.fused = fused_layer(layer, ops, cache_dtype)
            count += layer.fused is not None
    return count
