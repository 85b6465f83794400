"""Mixtral: the Llama decoder with a mixture of experts on every layer
(checkpoint ``block_sparse_moe``, served as ``mlp``: router ``gate``, experts ``w1`` = gate, ``w3`` = up, ``w2`` =
down), top-k weights always renormalised."""
from __future__ import annotations

from torch import nn

from engine.layers.activation import activation_name
from engine.layers.moe import FusedMoE
from engine.models.llama import DecoderLayer, LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.config
        moe = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                       renormalize=True, activation=activation_name(cfg.hidden_act), ops=self.ops, tp=self.tp,
                       expert_parallel=self.expert_parallel,
                       method=self.moe_method(f"model.layers.{index}.block_sparse_moe"))
        return DecoderLayer(cfg, self.ops, self.attention(index), moe)

    def map_name(self, name: str) -> tuple[str, object] | None:
        return super().map_name(name.replace(".block_sparse_moe.", ".mlp."))
