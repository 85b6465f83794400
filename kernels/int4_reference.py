"""The int4 weight-only GEMM in PyTorch: the CPU serving path of ``int4_gemm`` and
the oracle the Triton kernel (``kernels/int4_gemm.py``) is tested against.
``kernels.reference`` re-exports both functions.

The internal layout (every checkpoint format is converted to it at load time,
see ``engine/quantization/int4.py``), for a weight W of N output rows and K
input columns, y = x W^T:

    qweight [ceil(K/8), N] int32   packed along K: row k of W^T is nibble k % 8
                                   (bits 4*(k%8) .. 4*(k%8)+3) of word [k // 8, n],
                                   an unsigned value q in [0, 15]
    scales  [G, N] float           G = ceil(K / group_size), or any G with g_idx
    zeros   [G, N] uint8 or None   z in [0, 16] (GPTQ v1 can mean 16); None = 8 everywhere
    perm    [K] int or None        internal row k multiplies x[:, perm[k]] (act-order)
    g_idx   [K] int32 or None      the group of internal row k; None = k // group_size

    W^T[k, n] = (q[k, n] - z[g(k), n]) * scales[g(k), n]

rounded once to the compute dtype (the product of a 5-bit integer and a
float16/bfloat16 scale is exact in float32, so this is the correctly rounded
product, as the kernel's float16/bfloat16 multiply gives).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def unpack_int4_rows(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """[ceil(K/8), N] int32 packed along K -> [K, N] int16 values in [0, 15]."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)  # [8]
    q = (qweight.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return q.reshape(-1, qweight.shape[1])[:k].to(torch.int16)


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    k: int,
    *,
    perm: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The dense weight W [N, K] (y = x W^T, columns in x's order) of the internal
    layout above, in ``dtype`` (default: the scales' dtype)."""
    q = unpack_int4_rows(qweight, k)  # [K, N]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // group_size
    z = zeros[groups].to(torch.int16) if zeros is not None else 8
    wt = ((q - z).to(torch.float32) * scales[groups].to(torch.float32)).to(dtype or scales.dtype)  # [K, N]
    if perm is None:
        return wt.t().contiguous()
    w = torch.empty_like(wt.t())
    w[:, perm.long()] = wt.t()
    return w


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    *,
    perm: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    config=None,
) -> torch.Tensor:
    """y = x W^T for x [M, K] and the int4 weight above; [M, N] in x's dtype.
    Dequantizes W to x's dtype, then ``F.linear`` (``config``, the Triton
    kernel's tile choice, changes nothing here)."""
    w = dequantize_int4(qweight, scales, zeros, group_size, x.shape[-1], perm=perm, g_idx=g_idx, dtype=x.dtype)
    return F.linear(x, w)
