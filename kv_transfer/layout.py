"""An engine's KV layout: the compatibility record (``KVLayout``) a pair's two sides
compare in the handshake, built from the plain facts the engine exposes (its cache, the
cache's scales, the model's config, a draft model's cache). The engine itself knows
nothing of KV transfer."""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from kv_transfer.protocol import KVLayout

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def engine_layout(engine: LLMEngine) -> KVLayout:
    """The model's whole layout (every KV head, whatever share a tensor-parallel rank
    holds): the cache's dtype and FP8 scales, the model's dtype, the weight quantization,
    and a draft model's cache (``KVLayout.draft``) where there is one."""
    mc = engine.config.model
    weights = mc.quantization.describe() if mc.quantization is not None else ""
    draft = None
    if engine.drafter is not None:
        d = engine.drafter
        draft = KVLayout.of(d.kv_cache, d.model_name, d.kv_scales, d.config.model.dtype)
    groups = engine.cache_layout
    if groups.has_linear:
        raise ValueError(f"{mc.served_model_name}: the state of linear-attention layers is not sent between "
                         "tiers yet; serve this model colocated (pdserve serve)")
    if len(set(mc.layer_kv_shapes)) > 1:
        raise ValueError(f"{mc.served_model_name}: layers of different KV shapes are not sent between tiers yet; "
                         "serve this model colocated (pdserve serve)")
    if not groups.is_simple and engine.kv_scales[0]:  # ((), ()) unless the cache is FP8
        raise ValueError("--kv-cache-dtype fp8 with KV cache groups is not sent between tiers yet: add "
                         "--disable-hybrid-kv-cache-manager on both tiers")
    layout = KVLayout.of(engine.kv_cache, mc.served_model_name, engine.kv_scales, mc.dtype, weights, draft)
    described = "" if len(groups.groups) == 1 else json.dumps(groups.field_list())
    return dataclasses.replace(layout, num_kv_heads=mc.num_kv_heads, groups=described)
