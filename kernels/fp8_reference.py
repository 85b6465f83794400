"""FP8 (e4m3) W8A8 GEMM in PyTorch: the CPU serving path of ``fp8_quantize`` and
``fp8_gemm`` and the oracle the Triton kernels (``kernels/fp8_gemm.py``) are
tested against. ``kernels.reference`` re-exports both functions.

Quantization (activations per call, weights once at load time), for x [M, K]:

    s[m]     = max(amax_k |x[m, k]| / 448, FP8_MIN_SCALE)                        one scale per row
    s[m, g]  = max(amax_{k in group g} |x[m, k]| / 448, FP8_MIN_SCALE)           groups of g columns,
                                                                                the last one may be short
    q[m, k]  = e4m3(clamp(float32(x[m, k]) / s, -448, 448))                      rounded to nearest even

all in float32 (the division is IEEE division, not a multiply by 1/s). The
floor FP8_MIN_SCALE = 1 / (448 * 512) keeps an all-zero row finite (its codes
are zeros) and keeps tiny rows out of e4m3's subnormals' worst precision.

The GEMM, y = x W^T with x ~ x8 * x_scale and W ~ w8 * w_scale:

    per channel (block_size None): x_scale [M], w_scale [N]
        y[m, n] = (sum_k x8[m, k] * w8[n, k]) * x_scale[m] * w_scale[n]
    block scaled (block_size (bn, bk)): x_scale [M, cdiv(K, bk)], w_scale [cdiv(N, bn), cdiv(K, bk)]
        y[m, n] = sum_kb x_scale[m, kb] * w_scale[n // bn, kb] * sum_{k in block kb} x8[m, k] * w8[n, k]

Here both operands are dequantized to float32 (the block scales expanded to
one per element), multiplied in one float32 matmul and rounded once to
``out_dtype``; the Triton kernel computes the same sums in another order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn  # OCP e4m3 "fn": no infinities, max 448
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)


def fp8_quantize(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q [M, K] float8_e4m3fn, scales float32), both contiguous: scales [M]
    for group_size None, else [M, cdiv(K, group_size)]. Does not modify x."""
    m, k = x.shape
    xf = x.float()
    if group_size is None:
        scales = _scales(xf.abs().amax(dim=1))  # [M]
        q = (xf / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scales
    groups = -(-k // group_size)
    xg = F.pad(xf, (0, groups * group_size - k)).view(m, groups, group_size)  # zero padding: amax unchanged
    scales = _scales(xg.abs().amax(dim=2))  # [M, G]
    q = (xg / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group_size)[:, :k].contiguous(), scales


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # Divided by a tensor of 448s, not by the number: on CUDA torch turns a division by a
    # scalar into a multiplication by its (rounded) reciprocal, which is not IEEE division.
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)


def expand_block_scales(scales: torch.Tensor, block_rows: int, block_cols: int, rows: int,
                        cols: int) -> torch.Tensor:
    """[cdiv(rows, block_rows), cdiv(cols, block_cols)] -> [rows, cols]: each block's scale
    repeated over the block (the last blocks may be short)."""
    return scales.repeat_interleave(block_rows, dim=0)[:rows].repeat_interleave(block_cols, dim=1)[:, :cols]


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """q [R, C] float8_e4m3fn -> float32 [R, C]: q * scales[:, None] (block_size None, scales [R]),
    or q times its (br, bc) block's scale (scales [cdiv(R, br), cdiv(C, bc)])."""
    if block_size is None:
        return q.float() * scales.float()[:, None]
    rows, cols = q.shape
    return q.float() * expand_block_scales(scales.float(), block_size[0], block_size[1], rows, cols)


def fp8_gemm(
    x8: torch.Tensor,
    x_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    block_size: tuple[int, int] | None = None,
    backend: str = "auto",
    config=None,
) -> torch.Tensor:
    """y = dequant(x8) dequant(w8)^T for x8 [M, K], w8 [N, K] in the formats above; a new
    contiguous [M, N] of ``out_dtype``. ``backend`` and ``config`` (the CUDA launcher's
    choices) change nothing here."""
    if block_size is None:
        x = dequantize_fp8(x8, x_scale)
        w = dequantize_fp8(w8, w_scale)
    else:
        bn, bk = block_size
        x = dequantize_fp8(x8, x_scale, (1, bk))  # activations: one scale per row and k-block
        w = dequantize_fp8(w8, w_scale, (bn, bk))
    return (x @ w.t()).to(out_dtype)
