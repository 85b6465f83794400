"""Gated full attention (Qwen3-Next, Qwen3.5): the paged-cache attention of
engine/layers/attention.py (its ``attend``) with an output gate.

    x -> q_proj (per head: the query's D rows, then its gate's D rows), k_proj, v_proj
      -> (1 + w) q/k RMSNorms per head -> RoPE (partial: the first rotary_dim dims)
      -> store K/V, paged attention -> o * sigmoid(gate) (one call, the gate read where it lies) -> o_proj

The q part of ``qkv_proj`` is twice the heads' width and splits by heads under tensor
parallelism as the query does (a head's query and gate rows stay on one rank).
"""
from __future__ import annotations

from types import ModuleType

import torch

from engine.config import ModelConfig
from engine.layers.attention import QKV_SHARDS, Attention, AttentionMetadata
from engine.layers.linear import ColumnParallelLinear, LinearMethods, Part, RowParallelLinear, method_for
from engine.layers.rotary import RotaryEmbedding
from engine.parallel import Shard, TPGroup


class GatedAttention(Attention):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, shard: Shard, tp: TPGroup | None,
                 rope: RotaryEmbedding, *, methods: LinearMethods | None = None, prefix: str = "") -> None:
        super().__init__(cfg, ops, shard, tp, rope, qk_norm="offset", methods=methods, prefix=prefix)
        d = self.head_dim
        (q_lo, q_hi), (kv_lo, kv_hi) = shard.q_heads, shard.kv_heads
        kv_part = Part(cfg.num_kv_heads * d, kv_lo * d, kv_hi * d)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [Part(2 * cfg.num_heads * d, 2 * q_lo * d, 2 * q_hi * d),
                                                               kv_part, kv_part],
                                             bias=cfg.attention_bias, shard_ids=QKV_SHARDS,
                                             method=method_for(methods, prefix, "qkv_proj",
                                                               [f"{s}_proj" for s in QKV_SHARDS]))
        if cfg.attention_bias:  # transformers gives o_proj the bias too
            self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp, "attention heads", bias=True,
                                            method=method_for(methods, prefix, "o_proj"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t, d, h = x.shape[0], self.head_dim, self.num_heads
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, h, 2 * d).split([d, d], dim=-1)
        q, k, v = self.norm_and_rotate(positions, q, k.view(t, self.num_kv_heads, d),
                                       v.reshape(t, self.num_kv_heads, d))
        o = self.ops.gated_activation(gate, self.attend(q, k, v, kv, meta), "sigmoid")  # o * sigmoid(gate)
        return self.o_proj(o.reshape(t, self.q_size))
