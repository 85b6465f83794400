"""Rotary position embeddings: the frequency table of each RoPE variant the
supported configs name, and the layer that applies it.

A table is ``[max_positions, rotary_dim]`` float32: ``[:, :rd/2]`` = cos(pos *
inv_freq) * attention_factor, ``[:, rd/2:]`` = sin(...) * attention_factor — the
layout ``kernels`` take. The arithmetic follows transformers 5's
``modeling_rope_utils`` (float32 frequencies, cos/sin scaled by the variant's
attention factor, then cast to the model dtype when applied).

Variants (``rope_type``):
    default   theta ** -(2i / d)
    linear    default / factor
    llama3    Llama 3.1's smooth blend of scaled and unscaled wavelengths
    yarn      NTK-by-parts blend, cos/sin scaled by the yarn attention factor
    dynamic   default: transformers recomputes the base only past
              max_position_embeddings, which is also the longest length served
    longrope  short factors for positions below original_max_position_embeddings,
              long factors from there on, cos/sin scaled by the attention factor.
              (transformers switches a whole sequence to the long factors once it
              passes that length, re-rotating keys it has cached: a paged KV cache
              keeps each key as first rotated, so here the factor goes by position.)
    proportional  Gemma 4's full layers: a table as wide as the head whose first
              partial_rotary_factor * head_dim / 2 frequencies are theta ** -(2i / head_dim)
              and the rest 0 (cos 1, sin 0: those pairs do not turn), all divided by
              ``factor``; built with rotary_dim = head_dim (the caller's).
Any other ``rope_type`` is refused when the config is read (engine/config.py).
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kernels import reference

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "proportional")


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def _proportional(theta: float, head_dim: int, p: dict[str, Any]) -> torch.Tensor:
    angles = int(p.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv = torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32)])
    return inv / p.get("factor", 1.0)


def _yarn(theta: float, dim: int, p: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # share of the unscaled frequency per dimension
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def rope_cos_sin_cache(rotary_dim: int, rope: dict[str, Any], max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] float32 table for one layer type's RoPE parameters
    (``rope``: ``rope_type``, ``rope_theta`` and the variant's own keys)."""
    kind, theta = rope.get("rope_type", "default"), float(rope["rope_theta"])
    pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
    inv, scale = _default_inv_freq(theta, rotary_dim), 1.0
    if kind == "linear":
        inv = inv / rope["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, rope)
    elif kind == "yarn":
        inv, scale = _yarn(theta, rotary_dim, rope, max_positions)
    elif kind == "proportional":
        inv = _proportional(theta, rotary_dim, rope)
    elif kind == "longrope":
        original = rope["original_max_position_embeddings"]
        factor = rope.get("factor") or max_positions / original
        scale = rope.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        short = 1.0 / (torch.tensor(rope["short_factor"], dtype=torch.float32) * theta ** shape)
        long = 1.0 / (torch.tensor(rope["long_factor"], dtype=torch.float32) * theta ** shape)
        freqs = torch.where(pos < original, pos * short[None, :], pos * long[None, :])
        return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
    elif kind not in ("default", "dynamic"):
        raise ValueError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    freqs = pos * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, sin], dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies one RoPE table to q and k ([T, H, head_dim]) by position; with
    ``rotary_dim < head_dim`` (partial rotary) only the first ``rotary_dim`` dims turn.
    The table stays float32 whatever the model dtype (it is not a parameter or buffer,
    so casting the model leaves it alone); one instance serves every layer that shares it."""

    def __init__(self, head_dim: int, rotary_dim: int, rope: dict[str, Any], max_positions: int,
                 ops: ModuleType) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim, self.ops = head_dim, rotary_dim, ops
        self.cos_sin = rope_cos_sin_cache(rotary_dim, rope, max_positions).to(torch.get_default_device())

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.rotate_partial(self.ops.rotary_embedding, positions, q, k, self.cos_sin)
