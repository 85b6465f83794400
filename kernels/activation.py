"""The gated activation of Llama's MLP: silu(gate) * up."""
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


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I] contiguous
    x_ptr,  # [T, 2 * I]: gate | up
    stride_xt,
    inter_size,
    BLOCK: tl.constexpr,
):
    # Program (token, chunk of BLOCK columns). Like F.silu, silu runs in
    # float32 and is rounded to the input dtype before the product with up.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter_size
    row = x_ptr + token * stride_xt
    gate = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(row + inter_size + cols, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + token * inter_size + cols, act * up, mask=ok)


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
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or inter_size == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter_size))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter_size, block))](
        out, x, x.stride(0), inter_size, BLOCK=block
    )
    return out
