"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture of experts as the
MLP of every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers`` (those
keep a dense MLP of ``intermediate_size``). Top-k weights renormalised when
``norm_topk_prob`` is set."""
from __future__ import annotations

from torch import nn

from engine.layers.activation import activation_name
from engine.layers.moe import FusedMoE
from engine.models.llama import DecoderLayer, LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = "plain"

    def is_sparse(self, index: int) -> bool:
        hf = self.config.hf_config
        step = hf.get("decoder_sparse_step", 1) or 1
        return index not in hf.get("mlp_only_layers", []) and (index + 1) % step == 0

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.config
        if self.is_sparse(index):
            mlp = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                           renormalize=bool(cfg.hf_config.get("norm_topk_prob", False)),
                           activation=activation_name(cfg.hidden_act), ops=self.ops, tp=self.tp,
                           expert_parallel=self.expert_parallel, method=self.moe_method(f"model.layers.{index}.mlp"))
        else:
            mlp = self.dense_mlp(index)
        return DecoderLayer(cfg, self.ops, self.attention(index), mlp)
