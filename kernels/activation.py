"""Gated activations, act(gate) * up: the MLPs' (SiLU, GELU-tanh) and gated attention's output
gate (sigmoid)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    require,
)

_BLOCK = 1024
ACTIVATIONS = ("silu", "gelu_tanh", "sigmoid")
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def activate(g, ACTIVATION: tl.constexpr):
    # g: float32. silu(g) = g * sigmoid(g); gelu_tanh(g) = g * sigmoid(2u) with
    # u = sqrt(2/pi) (g + 0.044715 g^3), since 0.5 (1 + tanh(u)) = sigmoid(2u).
    if ACTIVATION == "silu":
        return g / (1.0 + tl.exp(-g))
    elif ACTIVATION == "sigmoid":
        return 1.0 / (1.0 + tl.exp(-g))
    else:
        u = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        return g / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def _act_mul_kernel(
    out_ptr,  # [R, I] contiguous, R = T * HEADS rows
    gate_ptr,  # [T, HEADS, I]
    up_ptr,  # [T, HEADS, I]
    stride_gt, stride_gh,
    stride_ut, stride_uh,
    inter_size,
    HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    # Program (row, chunk of BLOCK columns); a row is one head of one token. Like F.silu,
    # F.gelu and torch.sigmoid, the activation runs in float32 and is rounded to the input
    # dtype before the product with up.
    row = tl.program_id(0).to(tl.int64)
    token, head = row // HEADS, row % HEADS
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter_size
    gate = tl.load(gate_ptr + token * stride_gt + head * stride_gh + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + token * stride_ut + head * stride_uh + cols, mask=ok, other=0.0)
    act = activate(gate, ACTIVATION).to(up.dtype)
    tl.store(out_ptr + row * inter_size + cols, act * up, mask=ok)


def _launch(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate, up: [T, I] or [T, H, I] (strides of their own, the last dim contiguous)."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    g3, u3 = (gate[:, None], up[:, None]) if gate.dim() == 2 else (gate, up)
    num_tokens, heads, inter_size = g3.shape
    if out.numel() == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter_size))
    _act_mul_kernel[(num_tokens * heads, triton.cdiv(inter_size, block))](
        out, g3, u3, g3.stride(0), g3.stride(1), u3.stride(0), u3.stride(1), inter_size,
        HEADS=heads, BLOCK=block, ACTIVATION=activation,
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x: [num_tokens, 2 * I] (any row stride).

    Returns a new contiguous [num_tokens, I] tensor in x's dtype. Modifies nothing.
    """
    where = "silu_and_mul"
    check_runnable(where, x=x)
    check_dim(where, "x", x, 2, "[num_tokens, 2 * intermediate_size]")
    require(x.shape[1] % 2 == 0, where, f"x's last dim must be even (gate | up), got {x.shape[1]}")
    check_dtype(where, "x", x, FLOAT_DTYPES)
    check_inner_contiguous(where, "x", x)
    inter_size = x.shape[1] // 2
    return _launch(x[:, :inter_size], x[:, inter_size:], "silu")


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up, act "silu", "gelu_tanh" (F.gelu(approximate="tanh")) or "sigmoid", for
    gate and up: [num_tokens, I] or [num_tokens, heads, I] in one dtype, any strides with the
    last dim contiguous (halves of a gate_up projection; a per-layer input's slice; gated
    attention's per-head gate, interleaved with its query, times the attention's output).
    Returns a new contiguous tensor of gate's shape. Modifies nothing."""
    where = "gated_activation"
    check_runnable(where, gate=gate, up=up)
    require(activation in ACTIVATIONS, where, f"activation must be one of {', '.join(ACTIVATIONS)}, "
            f"got {activation!r}")
    require(gate.dim() in (2, 3), where, f"gate must be [num_tokens, I] or [num_tokens, heads, I], "
            f"got {gate.dim()} dims")
    require(up.shape == gate.shape, where, f"up shape {tuple(up.shape)} != gate shape {tuple(gate.shape)}")
    check_dtype(where, "gate", gate, FLOAT_DTYPES)
    require(up.dtype == gate.dtype, where, f"up dtype {up.dtype} != gate dtype {gate.dtype}")
    check_inner_contiguous(where, "gate", gate)
    check_inner_contiguous(where, "up", up)
    return _launch(gate, up, activation)
