"""Gated activations of the MLPs: act(x[:, :I]) * x[:, I:] for x = [gate | up]."""
from __future__ import annotations

from types import ModuleType

import torch

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def activation_name(hf_name: str) -> str:
    """The name ``kernels`` use for a config's ``hidden_act`` / ``hidden_activation``."""
    if hf_name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {hf_name!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[hf_name]


def act_and_mul(x: torch.Tensor, name: str, ops: ModuleType) -> torch.Tensor:
    """x: [T, 2*I] -> [T, I] in x's dtype, one call of the kernel module."""
    if name == "silu":
        return ops.silu_and_mul(x)
    return ops.gated_activation(*x.chunk(2, dim=-1), name)
