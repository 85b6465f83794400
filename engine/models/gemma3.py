"""Gemma 3 (text): (1 + w) RMSNorms before *and after* attention and the MLP, per-head
q/k norms, a GELU-tanh MLP, embeddings scaled by sqrt(hidden), the softmax scale
``query_pre_attn_scalar ** -0.5``, and two kinds of layers: sliding-window ones with
the local RoPE base, full-attention ones with the global base (and its scaling).

    h, res = input_layernorm(h, res)            # res += h; h = norm(res)
    h = post_attention_layernorm(self_attn(h))
    h, res = pre_feedforward_layernorm(h, res)
    h = post_feedforward_layernorm(mlp(h))
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import Attention
from engine.layers.norm import RMSNorm
from engine.models.base import CausalLM
from engine.models.llama import GatedMLP


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, attn: Attention, mlp: GatedMLP) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, ops, offset=True)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(size, eps, ops, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, ops, offset=True)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(size, eps, ops, offset=True)

    def forward(self, positions, h, residual, kv, meta):
        h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm.norm(self.self_attn(positions, h, kv, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm.norm(self.mlp(h)), residual


class Gemma3ForCausalLM(CausalLM):
    norm_offset = True

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.config
        attn = Attention(cfg, self.ops, self.shard, self.tp, self.rope_for(index),
                         sliding_window=cfg.layer_windows[index], qk_norm="offset",
                         scale=cfg.hf_config.get("query_pre_attn_scalar", cfg.head_dim) ** -0.5,
                         methods=self.quant, prefix=f"model.layers.{index}.self_attn")
        mlp = GatedMLP(cfg, self.ops, self.tp, cfg.intermediate_size, methods=self.quant,
                       prefix=f"model.layers.{index}.mlp")
        return Gemma3DecoderLayer(cfg, self.ops, attn, mlp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        # transformers keeps sqrt(hidden) as a float32 scalar and rounds it to the model dtype
        return h * torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(h.dtype)
