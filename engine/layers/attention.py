"""Self-attention over the paged KV cache: the block every supported family uses.

    x -> qkv_proj -> [q_norm, k_norm per head] -> RoPE -> store K/V in the cache
      -> paged attention (causal; within ``sliding_window`` keys on windowed layers)
      -> o_proj (all-reduced under tensor parallelism)

What families change are parameters: QKV bias (Qwen2), per-head q/k norms (Qwen3,
Gemma 3 with its offset norm), the softmax scale (Gemma's query_pre_attn_scalar),
the window and the RoPE table per layer (Gemma 3's local and global layers).

An FP8 KV cache (``--kv-cache-dtype fp8``) stores K / k_scale and V / v_scale in
e4m3 and attention reads them back times the scales (kernels/); the model runner
sets each layer's ``k_scale`` and ``v_scale`` (the checkpoint's, else 1.0) after
loading. Other caches keep 1.0, which the kernels require of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.linear import ColumnParallelLinear, LinearMethods, Part, RowParallelLinear, method_for
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.parallel import Shard, TPGroup
from kernels import cpu_attention, reference


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache (see kernels/)."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    # Key-range splits of the Triton attention; None lets the launcher pick
    # from the shapes. A CUDA graph fixes it per captured batch size.
    num_splits: int | None = None
    # Work the layers of one step share (the CPU attention's key positions): new each step.
    step_cache: dict = field(default_factory=dict, compare=False, repr=False)


QKV_SHARDS = ("q", "k", "v")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, shard: Shard, tp: TPGroup | None,
                 rope: RotaryEmbedding, *, sliding_window: int | None = None, scale: float | None = None,
                 qk_norm: str | None = None, methods: LinearMethods | None = None, prefix: str = "") -> None:
        """``qk_norm``: None, "plain" or "offset" (see engine/layers/norm.py); ``methods``: the
        projections' linear methods, by their checkpoint names under ``prefix``."""
        super().__init__()
        d = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = shard.num_local_heads, shard.num_local_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        (q_lo, q_hi), (kv_lo, kv_hi) = shard.q_heads, shard.kv_heads
        kv_part = Part(cfg.num_kv_heads * d, kv_lo * d, kv_hi * d)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [Part(cfg.num_heads * d, q_lo * d, q_hi * d),
                                                               kv_part, kv_part],
                                             bias=cfg.attention_bias, shard_ids=QKV_SHARDS,
                                             method=method_for(methods, prefix, "qkv_proj",
                                                               [f"{s}_proj" for s in QKV_SHARDS]))
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp, "attention heads",
                                        method=method_for(methods, prefix, "o_proj"))
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ops, offset=qk_norm == "offset")
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ops, offset=qk_norm == "offset")
        self.rope, self.ops = rope, ops
        self.scale = d ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.k_scale = self.v_scale = 1.0  # an FP8 cache's scales (plain floats: no parameters to load)
        # Fresh prompts on the dense prefill kernel (the runner's RuntimeConfig.dense_prefill).
        self.dense_prefill = True

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; kv: this layer's cache [num_blocks, 2, block_size, H_kv, D]
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm.norm(q.reshape(-1, d)), self.k_norm.norm(k.reshape(-1, d))
        q = q.reshape(t, self.num_heads, d)
        k = k.reshape(t, self.num_kv_heads, d)
        v = v.reshape(t, self.num_kv_heads, d)
        q, k = self.rope(positions, q, k)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        # The references' cache write and attention, compiled (the reference where it cannot build).
        ops = cpu_attention if self.ops is reference else self.ops
        ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        window = {} if self.sliding_window is None else {"sliding_window": self.sliding_window}
        # The Triton launcher also takes this step's K/V as they are: prefill chunks with no
        # cached prefix attend over them directly (kernels/prefill_attention.py).
        new_kv = {"new_k": k, "new_v": v} if self.dense_prefill and ops.__name__ == "kernels" else {}
        o = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                meta.seq_lens, self.scale, num_splits=meta.num_splits,
                                step_cache=meta.step_cache, **window, **scales, **new_kv)
        return self.o_proj(o.reshape(t, self.q_size))
