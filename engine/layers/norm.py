"""RMSNorm, in the two forms the supported families use.

    plain    Llama's: normalise in float32, cast back, multiply by ``w`` in the model
             dtype
    offset   Gemma's: multiply by ``(1 + w)`` in float32, then cast back; the weight is
             stored as ``w`` (checkpoint values), norms start at zero

Both are one call of the step's kernel module (``ops.rms_norm``, fused with the residual add
in ``ops.fused_add_rms_norm``).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    float32_weight = False  # the form's flags as kernels take them (``offset`` per instance)

    def __init__(self, size: int, eps: float, ops: ModuleType, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.weight.full_shape = (size,)
        self.eps, self.ops, self.offset = eps, ops, offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, offset=self.offset), x
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) alone (no residual to carry)."""
        return self(x)[0]
