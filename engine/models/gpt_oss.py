"""gpt-oss (OpenAI's open-weight 20b and 120b): Llama's pre-norm decoder with

- attention sinks: a learned logit per query head in the softmax's denominator
  (``Attention(sinks=True)``; every attention kernel takes them), QKV and output biases;
- sliding-window (128 keys) and full layers alternating, from ``layer_types`` (the cache
  groups give the windowed layers only their window's blocks);
- YaRN RoPE (``rope_parameters``, ``truncate: false``);
- experts on every layer: a router with a bias (top-k of the logits, softmax over those k:
  the same weights as softmax then renormalise), expert biases, and the clamped SwiGLU
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, l)`` ("swigluoai").

Checkpoint layout (transformers 5): ``mlp.router.{weight,bias}``; the experts stacked and
transposed, the gate and up columns interleaved (column 2j gate j, 2j + 1 up j):

    experts.gate_up_proj       [E, H, 2I]   -> gate_up_proj [E, 2I, H], gate rows then up rows
    experts.gate_up_proj_bias  [E, 2I]      -> gate part then up part
    experts.down_proj          [E, I, H]    -> down_proj [E, H, I]
    experts.down_proj_bias     [E, H]

MXFP4 checkpoints (``quantization_config.quant_method: mxfp4``, as gpt-oss ships) store the
experts packed, already [out, in]: ``gate_up_proj_blocks [E, 2I, H/32, 16]`` with the same
interleaved rows and ``..._scales [E, 2I, H/32]``; their rows are put in gate-then-up order
and they stay packed (engine/quantization/mxfp4.py).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from engine.layers.attention import Attention
from engine.layers.moe import FusedMoE
from engine.models.base import CausalLM
from engine.models.llama import DecoderLayer

# Expert tensors whose gate/up rows (or columns) interleave, by the row dim after any transpose.
_INTERLEAVED = ("gate_up_proj", "gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales")
_TRANSPOSED = ("gate_up_proj", "down_proj")  # stored [E, in, out] in 16-bit checkpoints


def _expert_tensor(name: str) -> str | None:
    """The expert tensor ``name`` is (``gate_up_proj_bias``, ...), or None."""
    head, _, last = name.rpartition(".")
    return last if head.endswith("mlp.experts") else None


def to_engine_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """A gpt-oss checkpoint tensor in the layout pdserve's experts keep (see the docstring)."""
    which = _expert_tensor(name)
    if which in _TRANSPOSED:
        t = t.transpose(1, 2)
    if which in _INTERLEAVED:  # dim 1: interleaved gate/up -> gate rows then up rows
        t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
    return t.contiguous() if which is not None else t


def to_checkpoint_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_engine_layout``."""
    which = _expert_tensor(name)
    if which in _INTERLEAVED:
        half = t.shape[1] // 2
        t = torch.stack([t[:, :half], t[:, half:]], dim=2).flatten(1, 2)
    if which in _TRANSPOSED:
        t = t.transpose(1, 2)
    return t.contiguous() if which is not None else t


class GptOssForCausalLM(CausalLM):
    def make_layer(self, index: int) -> nn.Module:
        cfg, hf = self.config, self.config.hf_config
        prefix = f"model.layers.{index}"
        attn = Attention(cfg, self.ops, self.shard, self.tp, self.rope_for(index),
                         sliding_window=cfg.layer_windows[index], methods=self.quant, prefix=f"{prefix}.self_attn",
                         sinks=True, o_bias=cfg.attention_bias)
        moe = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                       renormalize=True, activation="swigluoai", swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                       swiglu_limit=float(hf.get("swiglu_limit", 7.0)), bias=True, router_bias=True, ops=self.ops,
                       tp=self.tp, expert_parallel=self.expert_parallel, method=self.moe_method(f"{prefix}.mlp"))
        return DecoderLayer(cfg, self.ops, attn, moe)

    def map_name(self, name: str) -> tuple[str, object] | None:
        if ".mlp.router." in name:
            name = name.replace(".mlp.router.", ".mlp.gate.")
        return super().map_name(name)

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | None:
        # re-laid tensors are read whole: the parameter's loader takes this rank's part
        return None if _expert_tensor(name) is not None else super().checkpoint_slice(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, to_engine_layout(name, t)) for name, t in weights)

    def dummy_weights(self, seed: int, dtype: torch.dtype, device: torch.device
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        # drawn in the parameters' layout, handed over in the checkpoint's (load_weights re-lays it)
        for name, t in super().dummy_weights(seed, dtype, device):
            yield name, to_checkpoint_layout(name, t)
