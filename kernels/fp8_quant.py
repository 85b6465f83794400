"""Dynamic FP8 (e4m3) quantization of activations, and of weight rows at load time:
one float32 scale per row, or per row and group of columns (the math is stated in
``kernels/fp8_reference.py``). ``kernels.fp8_gemm`` re-exports ``fp8_quantize``.

The scale divides in IEEE float32 (``div_rn``; Triton's ``/`` on float32 is an
approximate division on CUDA) and each value is rounded to the nearest e4m3 code,
ties to even, as torch's cast does: the launcher equals the reference bit for
bit. Compiled for CUDA the cast is the hardware's (``cvt.rn.satfinite`` on
sm_89+); Triton's interpreter truncates instead, so interpreted the rounding is
done in integer arithmetic (``kernels.kv_cache._e4m3_bits``).

Two kernels: groups of at most 512 columns go several to a program as one
[groups, group] tile (one amax per tile row); a row (group_size None) or a
longer group is one program that reads its segment once into registers, or
twice when it is longer than 8192 columns (amax, then codes).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    next_pow2,
    require,
)
from kernels.fp8_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from kernels.kv_cache import _e4m3_bits

# Read once, like triton.jit itself reads it when the kernels are defined.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)
GROUP_TILE_MAX = 512  # groups up to this long are quantized several to a program
SEGMENT_BLOCK_MAX = 8192  # longer segments are read twice


# ---- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _to_e4m3(x, scale, INTERPRETED: tl.constexpr):
    # x, scale float32 of one shape -> e4m3(clamp(x / scale, -448, 448)), nearest even.
    y = tl.clamp(tl.math.div_rn(x, scale), -_MAX, _MAX)
    if INTERPRETED:
        return _e4m3_bits(y).to(tl.float8e4nv, bitcast=True)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _quantize_segments_kernel(
    x_ptr,  # [M, K] float, stride 1 in K
    q_ptr,  # [M, K] float8e4nv, contiguous
    s_ptr,  # [M, NUM_SEGMENTS] float32, contiguous
    stride_xm,
    K: tl.constexpr, SEGMENT: tl.constexpr, NUM_SEGMENTS: tl.constexpr, BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # One program per (row, segment of SEGMENT columns, the last one short): a row's scale
    # (SEGMENT = K) or one large group's. Segments longer than BLOCK are read twice.
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    start = seg * SEGMENT
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    cols = tl.arange(0, BLOCK)
    if SEGMENT <= BLOCK:  # the segment stays in registers
        offs = start + cols
        ok = (cols < SEGMENT) & (offs < K)
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        running = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, SEGMENT, BLOCK):
            offs = start + c + cols
            ok = (c + cols < SEGMENT) & (offs < K)
            running = tl.maximum(running, tl.abs(tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)))
        amax = tl.max(running, axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, _MAX), _MIN_SCALE)
    tl.store(s_ptr + row * NUM_SEGMENTS + seg, scale)
    scales = tl.full([BLOCK], 1.0, tl.float32) * scale
    if SEGMENT <= BLOCK:
        tl.store(q_row + offs, _to_e4m3(x, scales, INTERPRETED), mask=ok)
    else:
        for c in range(0, SEGMENT, BLOCK):
            offs = start + c + cols
            ok = (c + cols < SEGMENT) & (offs < K)
            x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_row + offs, _to_e4m3(x, scales, INTERPRETED), mask=ok)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, stride_xm,  # as _quantize_segments_kernel's, s [M, NUM_GROUPS]
    K: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr, GROUP_PAD: tl.constexpr,  # GROUP_PAD = next_pow2(GROUP)
    INTERPRETED: tl.constexpr,
):
    # One program per (row, GROUPS_PER_PROGRAM consecutive small groups): a [groups, GROUP_PAD]
    # tile, one amax per tile row.
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)  # [GPP]
    j = tl.arange(0, GROUP_PAD)
    offs = g[:, None] * GROUP + j[None, :]  # [GPP, GROUP_PAD]
    ok = (j < GROUP)[None, :] & (offs < K)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [GPP]
    scale = tl.maximum(tl.math.div_rn(amax, tl.full([GROUPS_PER_PROGRAM], _MAX, tl.float32)), _MIN_SCALE)
    tl.store(s_ptr + row * NUM_GROUPS + g, scale, mask=g < NUM_GROUPS)
    scales = tl.broadcast_to(scale[:, None], [GROUPS_PER_PROGRAM, GROUP_PAD])
    tl.store(q_ptr + row * K + offs, _to_e4m3(x, scales, INTERPRETED), mask=ok)


# ---- launcher ------------------------------------------------------------------------------------------


def fp8_quantize(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization (kernels/fp8_reference.py states the math), bit for bit the reference's.

    x: [M, K] float16/bfloat16/float32, any row stride (stride 1 in K)
    group_size: None (one scale per row) or g >= 1 (one per row and g columns; the last group may be short)

    Returns (q [M, K] float8_e4m3fn, scales [M] or [M, cdiv(K, g)] float32), new and contiguous.
    Does not modify x. No host sync: it can be captured in a CUDA graph.
    """
    where = "fp8_quantize"
    check_runnable(where, x=x)
    check_dim(where, "x", x, 2, "[M, K]")
    check_dtype(where, "x", x, FLOAT_DTYPES)
    check_inner_contiguous(where, "x", x)
    integer = isinstance(group_size, int) and not isinstance(group_size, bool)
    require(group_size is None or (integer and group_size >= 1), where,
            f"group_size must be None or an int >= 1, got {group_size!r}")
    m, k = x.shape
    require(k > 0, where, "x has K = 0 columns")
    segment = k if group_size is None else min(group_size, k)
    num_segments = triton.cdiv(k, segment)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m,) if group_size is None else (m, num_segments), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    pad = next_pow2(segment)
    if segment < k and pad <= GROUP_TILE_MAX:  # small groups: several per program
        per_program = min(max(1, 2048 // pad), next_pow2(num_segments))
        _quantize_groups_kernel[(m, triton.cdiv(num_segments, per_program))](
            x, q, scales, x.stride(0), K=k, GROUP=segment, NUM_GROUPS=num_segments,
            GROUPS_PER_PROGRAM=per_program, GROUP_PAD=pad, INTERPRETED=_INTERPRETED, num_warps=4)
    else:
        block = min(pad, SEGMENT_BLOCK_MAX)
        _quantize_segments_kernel[(m, num_segments)](
            x, q, scales, x.stride(0), K=k, SEGMENT=segment, NUM_SEGMENTS=num_segments, BLOCK=block,
            INTERPRETED=_INTERPRETED, num_warps=max(1, min(16, block // 512)))
    return q, scales


