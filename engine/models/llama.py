"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2 with QKV bias): pre-norm
attention and a SiLU-gated MLP, the residual carried beside the hidden states so
each norm can add it in (``fused_add_rms_norm``).

    h, res = input_layernorm(h, res)           # res += h; h = norm(res)
    h = self_attn(h)
    h, res = post_attention_layernorm(h, res)
    h = mlp(h)
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.activation import act_and_mul, activation_name
from engine.layers.attention import Attention
from engine.layers.linear import ColumnParallelLinear, LinearMethods, RowParallelLinear, column_parts, method_for
from engine.layers.norm import RMSNorm
from engine.models.base import CausalLM
from engine.parallel import TPGroup


class GatedMLP(nn.Module):
    """down(act(gate x) * up x), gate and up stacked in one column-parallel weight."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType, tp: TPGroup | None, intermediate_size: int, *,
                 methods: LinearMethods | None = None, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, column_parts([intermediate_size] * 2, tp,
                                                                               "intermediate size"),
                                                 shard_ids=(0, 1),
                                                 method=method_for(methods, prefix, "gate_up_proj",
                                                                   ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(intermediate_size, cfg.hidden_size, tp, "intermediate size",
                                           method=method_for(methods, prefix, "down_proj"))
        self.act, self.ops = activation_name(cfg.hidden_act), ops

    def forward(self, x: torch.Tensor, meta=None) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act, self.ops))


class DecoderLayer(nn.Module):
    """Pre-norm attention + an MLP (dense or experts), as Llama, Qwen and Mixtral stack them."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = mlp
        # The same layer as direct kernel calls on a CPU (engine/models/llama_cpu.py), where set.
        self.fused = None

    def forward(self, positions, h, residual, kv, meta):
        if self.fused is not None:
            return self.fused(positions, h, residual, kv, meta)
        h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, kv, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta), residual


class LlamaForCausalLM(CausalLM):
    qk_norm: str | None = None

    def attention(self, index: int) -> Attention:
        cfg = self.config
        return Attention(cfg, self.ops, self.shard, self.tp, self.rope_for(index),
                         sliding_window=cfg.layer_windows[index], qk_norm=self.qk_norm, methods=self.quant,
                         prefix=f"model.layers.{index}.self_attn")

    def dense_mlp(self, index: int) -> GatedMLP:
        return GatedMLP(self.config, self.ops, self.tp, self.config.intermediate_size, methods=self.quant,
                        prefix=f"model.layers.{index}.mlp")

    def make_layer(self, index: int) -> nn.Module:
        return DecoderLayer(self.config, self.ops, self.attention(index), self.dense_mlp(index))
