"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention (engine/layers/gated_delta_net.py)
and gated full attention (engine/layers/gated_attention.py), by ``layer_types`` (three
linear layers, then a full one, by default), with (1 + w) RMSNorms everywhere but the
DeltaNet's gated norm, partial RoPE (``partial_rotary_factor``, 0.25 by default) and a
mixture of experts with a sigmoid-gated shared expert on the layers ``decoder_sparse_step``
/ ``mlp_only_layers`` name (the others: a dense MLP of ``intermediate_size``).

    h, res = input_layernorm(h, res)            # res += h; h = norm(res), (1 + w)
    h = linear_attn(h)   or   self_attn(h)      # per layer_types
    h, res = post_attention_layernorm(h, res)
    h = mlp(h)                                  # experts + sigmoid(g x) * shared_expert(x)

The checkpoint's multi-token-prediction head (``mtp.*``) is not used: its weights are
skipped. Qwen3.5 (engine/models/qwen3_5.py) is the same model with its DeltaNet
projections stored apart.
"""
from __future__ import annotations

from types import ModuleType
from typing import Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.activation import activation_name
from engine.layers.attention import AttentionMetadata
from engine.layers.gated_attention import GatedAttention
from engine.layers.gated_delta_net import GatedDeltaNet
from engine.layers.moe import FusedMoE
from engine.layers.norm import RMSNorm
from engine.models.base import CausalLM
from engine.models.llama import GatedMLP

LINEAR = "linear_attention"


class HybridDecoderLayer(nn.Module):
    """Pre-norm (1 + w) decoder layer whose token mixer is linear attention (``linear_attn``,
    no KV) or gated full attention (``self_attn``)."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, offset=True)
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, offset=True)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                kv: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(h, residual)
        h = self.linear_attn(h, meta) if self.is_linear else self.self_attn(positions, h, kv, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta), residual


class Qwen3NextForCausalLM(CausalLM):
    norm_offset = True
    fused_qkvz = True  # the DeltaNet's in_proj_qkvz / in_proj_ba (Qwen3.5: apart)
    always_renormalize = False  # top-k weights renormalised by norm_topk_prob (Qwen3.5-MoE: always)

    def is_sparse(self, index: int) -> bool:
        cfg = self.config
        hf = cfg.hf_config
        step = hf.get("decoder_sparse_step", 1) or 1
        return cfg.num_experts > 0 and index not in (hf.get("mlp_only_layers") or []) and (index + 1) % step == 0

    def mixer(self, index: int) -> nn.Module:
        prefix = f"model.layers.{index}"
        if self.config.layer_types[index] == LINEAR:
            return GatedDeltaNet(self.config, self.ops, self.tp, fused_qkvz=self.fused_qkvz, methods=self.quant,
                                 prefix=f"{prefix}.linear_attn")
        return GatedAttention(self.config, self.ops, self.shard, self.tp, self.rope_for(index), methods=self.quant,
                              prefix=f"{prefix}.self_attn")

    def mlp(self, index: int) -> nn.Module:
        cfg, prefix = self.config, f"model.layers.{index}.mlp"
        if not self.is_sparse(index):
            return GatedMLP(cfg, self.ops, self.tp, cfg.intermediate_size, methods=self.quant, prefix=prefix)
        hf = cfg.hf_config
        shared = None
        if hf.get("shared_expert_intermediate_size"):
            shared = GatedMLP(cfg, self.ops, self.tp, hf["shared_expert_intermediate_size"], methods=self.quant,
                              prefix=f"{prefix}.shared_expert")
        return FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                        renormalize=self.always_renormalize or bool(hf.get("norm_topk_prob", True)),
                        activation=activation_name(cfg.hidden_act), ops=self.ops, tp=self.tp,
                        expert_parallel=self.expert_parallel, method=self.moe_method(prefix),
                        shared_expert=shared, shared_expert_gate=shared is not None)

    def make_layer(self, index: int) -> nn.Module:
        return HybridDecoderLayer(self.config, self.ops, self.mixer(index), self.mlp(index))

    def map_name(self, name: str) -> tuple[str, object] | None:
        if name.startswith("mtp."):  # the multi-token-prediction head: not served
            return None
        return super().map_name(name)

    def dummy_weights(self, seed: int, dtype: torch.dtype, device: torch.device
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        # The DeltaNet's gated norm multiplies by w, not 1 + w: neutral at 1.
        for name, t in super().dummy_weights(seed, dtype, device):
            if name.endswith("linear_attn.norm.weight"):
                t.fill_(1.0)
            yield name, t
