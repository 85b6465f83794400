"""An engine's KV layout: the compatibility record (``KVLayout``) a pair's two sides
compare in the handshake, built from the plain facts the engine exposes (its cache, the
cache's scales, the model's config, a draft model's cache, the linear-attention state
slots). The engine itself knows nothing of KV transfer."""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from engine.kv_cache_groups import KVCacheLayout, needs_groups
from kv_transfer.protocol import KVLayout, _dtype_name, describe_state

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def engine_layout(engine: LLMEngine) -> KVLayout:
    """The model's whole layout (every KV head, whatever share a tensor-parallel rank
    holds): the cache's dtype and FP8 scales, the model's dtype, the weight quantization,
    a draft model's cache (``KVLayout.draft``) where there is one, a hybrid model's
    linear-attention state (``KVLayout.linear_state``), and the KV cache groups
    (``KVLayout.groups``; layers of different KV shapes: the shapes are the widest group's,
    and each group's is in the groups' record)."""
    mc = engine.config.model
    weights = mc.quantization.describe() if mc.quantization is not None else ""
    draft = None
    if engine.drafter is not None:
        d = engine.drafter
        draft = KVLayout.of(d.kv_cache, d.model_name, d.kv_scales, d.config.model.dtype)
    groups = engine.cache_layout
    if not groups.is_simple and engine.kv_scales[0]:  # ((), ()) unless the cache is FP8
        way_out = ("serve this model with the model's KV dtype on both tiers, or colocated (pdserve serve)"
                   if needs_groups(mc) else "add --disable-hybrid-kv-cache-manager on both tiers")
        raise ValueError(f"--kv-cache-dtype fp8 with KV cache groups is not sent between tiers yet: {way_out}")
    layout = KVLayout.of(engine.kv_cache, mc.served_model_name, engine.kv_scales, mc.dtype, weights, draft)
    described = "" if len(groups.groups) == 1 else json.dumps(_group_fields(groups))
    return dataclasses.replace(layout, num_kv_heads=_widest_kv_heads(engine), groups=described,
                               linear_state=_state_of(engine) if groups.has_linear else "")


def _shapes(groups: KVCacheLayout) -> set[tuple[int, int]]:
    return {(g.num_kv_heads, g.head_dim) for g in groups.groups if g.num_kv_heads}


def _group_fields(groups: KVCacheLayout) -> list[tuple[str, Any]]:
    """The groups' record (``KVCacheLayout.field_list``: kinds, layers, block sizes, windows),
    with each group's KV heads and head size where the groups' layers store more than one
    shape per token (every head of the model: the same record at any tensor-parallel size)."""
    return groups.field_list(with_shapes=len(_shapes(groups)) > 1)


def _widest_kv_heads(engine: LLMEngine) -> int:
    """The model's KV heads (all ranks') of the layers whose shape the cache has: the widest
    group's (engine/cache_spec.py), whose head size is the cache's; a narrower group's pages
    are views of the same bytes at its own block size."""
    mc = engine.config.model
    shapes = _shapes(engine.cache_layout)
    if len(shapes) <= 1:
        return mc.num_kv_heads
    widest = max(h * d for h, d in shapes)
    head_dim = engine.kv_cache.shape[-1]
    heads = [h for h, d in shapes if h * d == widest and d == head_dim]
    if len(heads) != 1:
        raise ValueError(f"{mc.served_model_name}: the KV cache's head size {head_dim} is no widest group's "
                         f"(groups' KV shapes {sorted(shapes)})")
    return heads[0]


def _state_of(engine: LLMEngine) -> str:
    """The linear-attention state of the whole model: each linear layer's slot, every head.
    A tensor-parallel rank holds its share of the conv channels (q | k | v of its heads) and of
    the value heads (the ssm's first dimension), split evenly."""
    tp = engine.config.tensor_parallel_size
    specs = []
    for st in engine.linear_states:
        conv, ssm = tuple(st.conv.shape[1:]), tuple(st.ssm.shape[1:])
        specs.append(((conv[0] * tp, *conv[1:]), _dtype_name(st.conv.dtype),
                      (ssm[0] * tp, *ssm[1:]), _dtype_name(st.ssm.dtype)))
    return describe_state(engine.cache_layout.linear_layers, specs)
