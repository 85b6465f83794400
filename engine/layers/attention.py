"""Self-attention over the paged KV cache: the block every supported family uses.

    x -> qkv_proj -> [q_norm, k_norm per head] -> RoPE -> store K/V in the cache
      -> paged attention (causal; within ``sliding_window`` keys on windowed layers)
      -> o_proj (all-reduced under tensor parallelism)

What families change are parameters: QKV bias (Qwen2), per-head q/k norms (Qwen3,
Gemma 3 with its offset norm), the softmax scale (Gemma's query_pre_attn_scalar),
the window and the RoPE table per layer (Gemma 3's local and global layers),
Gemma 4's: a head size and KV head count per layer, V taken from K's projection
(``k_eq_v``), a norm of V, and layers that read an earlier layer's KV and project
only queries (``store=False``), and gpt-oss's: attention sinks (``sinks``: a learned
logit per query head in the softmax's denominator, the checkpoint's
``<prefix>.sinks``, float32, split by query head under tensor parallelism) and a bias
on o_proj (``o_bias``).

An FP8 KV cache (``--kv-cache-dtype fp8``) stores K / k_scale and V / v_scale in
e4m3 and attention reads them back times the scales (kernels/); the model runner
sets each layer's ``k_scale`` and ``v_scale`` (the checkpoint's, else 1.0) after
loading. Other caches keep 1.0, which the kernels require of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.linear import (
    ColumnParallelLinear,
    LinearMethods,
    Part,
    RowParallelLinear,
    attach_loader,
    method_for,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.parallel import Shard, TPGroup
from kernels import cpu_attention, reference


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache (see kernels/)."""

    # Per KV cache group g (engine/kv_cache_groups.py; one group: index 0 is the table):
    slot_mapping: torch.Tensor  # [G, T] int64: block_id * group block_size + offset
    block_tables: torch.Tensor  # [G, B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    # Linear-attention layers: each row's state slot (None: the model has none). A row with
    # context before this step (seq_lens > its query length) continues the slot's state; a
    # row without starts from zeros.
    state_slots: torch.Tensor | None = None  # [B] int32
    # Key-range splits of the Triton attention; None lets the launcher pick
    # from the shapes. A CUDA graph fixes it per captured batch size.
    num_splits: int | None = None
    # Work the layers of one step share (the CPU attention's key positions): new each step.
    step_cache: dict = field(default_factory=dict, compare=False, repr=False)


QKV_SHARDS = ("q", "k", "v")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, shard: Shard, tp: TPGroup | None,
                 rope: RotaryEmbedding, *, sliding_window: int | None = None, scale: float | None = None,
                 qk_norm: str | Callable[[int], nn.Module] | None = None, methods: LinearMethods | None = None,
                 prefix: str = "", store: bool = True, head_dim: int | None = None, num_kv_heads: int | None = None,
                 k_eq_v: bool = False, v_norm: bool = False, sinks: bool = False,
                 o_bias: bool = False) -> None:
        """``qk_norm``: None, "plain" or "offset" (see engine/layers/norm.py), or what makes the
        norm of one head (``make(head_dim)``, with a ``norm(x)``); ``methods``: the projections'
        linear methods, by their checkpoint names under ``prefix``; ``store``: False for a layer
        that reads another layer's KV (its cache group's, set by the engine): it projects only
        queries. ``head_dim``, ``num_kv_heads``: this layer's, where they are not the config's;
        ``k_eq_v``: no v_proj, V is K's projection (before k_norm and RoPE); ``v_norm``: V's
        heads normed too, with no weight (Gemma 4's; beside ``qk_norm``, in its call). ``sinks``:
        attention sinks, a parameter ``sinks`` of this rank's query heads ([num_heads], float32
        whatever the model dtype), loaded from ``<prefix>.sinks``; ``o_bias``: o_proj has a
        bias (``o_proj.bias``, added once after the all-reduce)."""
        super().__init__()
        d = self.head_dim = head_dim or cfg.head_dim
        if num_kv_heads is not None:
            shard = replace(shard, num_kv_heads=num_kv_heads)
        self.num_heads, self.num_kv_heads = shard.num_local_heads, shard.num_local_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        (q_lo, q_hi), (kv_lo, kv_hi) = shard.q_heads, shard.kv_heads
        kv_part = Part(shard.num_kv_heads * d, kv_lo * d, kv_hi * d)
        self.has_kv, self.k_eq_v = store, k_eq_v  # has_kv: projects K and V of its own
        names = QKV_SHARDS[:1 if not store else 2 if k_eq_v else 3]
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [Part(shard.num_heads * d, q_lo * d, q_hi * d),
                                                               kv_part, kv_part][:len(names)],
                                             bias=cfg.attention_bias, shard_ids=names,
                                             method=method_for(methods, prefix, "qkv_proj",
                                                               [f"{s}_proj" for s in names]))
        self.o_proj = RowParallelLinear(shard.num_heads * d, cfg.hidden_size, tp, "attention heads", bias=o_bias,
                                        method=method_for(methods, prefix, "o_proj"))
        self.sinks = None
        if sinks:  # one logit per query head; this rank's heads [q_lo, q_hi) of the checkpoint's
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
            attach_loader(self.sinks, (shard.num_heads,), [Part(shard.num_heads, q_lo, q_hi)], 0)
            self.sinks.keep_dtype = True  # the kernels take float32 sinks (engine/model_loader.py casts others)
        self.q_norm = self.k_norm = None
        self.v_norm = v_norm and store
        if qk_norm is not None:
            make = qk_norm if callable(qk_norm) else (
                lambda n: RMSNorm(n, cfg.rms_norm_eps, ops, offset=qk_norm == "offset"))
            self.q_norm = make(d)
            self.k_norm = make(d) if store else None
        self.rope, self.ops = rope, ops
        self.scale = d ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.k_scale = self.v_scale = 1.0  # an FP8 cache's scales (plain floats: no parameters to load)
        # Fresh prompts on the dense prefill kernel (the runner's RuntimeConfig.dense_prefill).
        self.dense_prefill = True
        # The KV cache group whose tables this layer reads (engine/kv_cache_groups.py), and
        # whether it writes its own KV there; set from the layout once the model is built.
        self.kv_group = 0
        self.store = store

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; kv: this layer's cache [num_blocks, 2, block_size, H_kv, D] (its group's block size)
        t = x.shape[0]
        q, k, v = self._project(positions, x)
        return self.o_proj(self.attend(q, k, v, kv, meta).reshape(t, self.q_size))

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Store this step's K/V (a layer with KV of its own) and attend over the group's cache:
        q [T, H, D] -> o [T, H, D]."""
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        # The references' cache write and attention, compiled (the reference where it cannot build).
        ops = cpu_attention if self.ops is reference else self.ops
        g = self.kv_group
        if self.store:
            ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping[g], **scales)
        window = {} if self.sliding_window is None else {"sliding_window": self.sliding_window}
        # The Triton launcher also takes this step's K/V as they are: prefill chunks with no
        # cached prefix attend over them directly (kernels/prefill_attention.py).
        new_kv = {"new_k": k, "new_v": v} if self.dense_prefill and self.store and ops.__name__ == "kernels" else {}
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        return ops.paged_attention(q, k_cache, v_cache, meta.block_tables[g], meta.query_start_loc,
                                   meta.seq_lens, self.scale, num_splits=meta.num_splits,
                                   step_cache=meta.step_cache.setdefault(g, {}), **window, **scales, **new_kv,
                                   **sinks)

    def _project(self, positions: torch.Tensor, x: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q [T, H, D] and this layer's own k, v [T, H_kv, D] (None without: store=False), normed and rotated."""
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        if not self.has_kv:
            q, k, v = qkv, None, None
        elif self.k_eq_v:
            q, k = qkv.split([self.q_size, self.kv_size], dim=-1)
            v = k
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, d)
        k, v = (None, None) if k is None else (k.reshape(t, self.num_kv_heads, d), v.reshape(t, self.num_kv_heads, d))
        if self.q_norm is not None:
            return self.norm_and_rotate(positions, q, k, v)
        if k is None:  # the rotation of q alone (a one-head slice of q stands in for k)
            return self.rope(positions, q, q[:, :1])[0], None, None
        q, k = self.rope(positions, q, k)
        return q, k, v

    def norm_and_rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
                        v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The per-head q/k norms (and V's, with ``v_norm``) and RoPE, one call of the kernel
        module (``qk_norm_rope``): q [T, H, D], k, v [T, H_kv, D] or None, views of the projection."""
        qn, kn = self.q_norm, self.k_norm
        q, k, normed_v = self.ops.qk_norm_rope(
            positions, q, k, v if self.v_norm else None, qn.weight, None if kn is None else kn.weight,
            self.rope.cos_sin, qn.eps, offset=qn.offset, float32_weight=qn.float32_weight)
        return q, k, v if normed_v is None else normed_v
