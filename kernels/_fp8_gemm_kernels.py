"""The Triton kernels of the FP8 W8A8 GEMM; ``kernels/fp8_gemm.py`` is their launcher and
its docstring states the layouts, the grid and the numerics."""
from __future__ import annotations

import triton
import triton.language as tl

from kernels._gemm_common import grouped_tile, store_tile

# The K loop walks "steps": a k-block of STEP_K = bk columns (BLOCK_SCALED), cut into TILES_PER_STEP
# tiles of BLOCK_K, or a single K tile (STEP_K = BLOCK_K, per channel). A split owns STEPS_PER_SPLIT
# consecutive steps. EVEN_K: every step is whole and inside K, so no load needs a K mask.


@triton.jit
def _step_scales(xs_ptr, ws_ptr, step, offs_m, offs_n, m_ok, n_ok, stride_xsm, stride_wsn,
                 SCALE_BN: tl.constexpr, NUM_STEPS: tl.constexpr, EVEN_K: tl.constexpr):
    # Block scales of k-block ``step``: x_scale[offs_m, step] and w_scale[offs_n // bn, step].
    if EVEN_K:
        m_mask, n_mask = m_ok, n_ok
    else:  # a split's trailing steps may lie past K
        m_mask, n_mask = m_ok & (step < NUM_STEPS), n_ok & (step < NUM_STEPS)
    xs = tl.load(xs_ptr + offs_m.to(tl.int64) * stride_xsm + step, mask=m_mask, other=0.0)
    ws = tl.load(ws_ptr + (offs_n // SCALE_BN).to(tl.int64) * stride_wsn + step, mask=n_mask, other=0.0)
    return xs, ws


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr,  # [M, K] float8e4nv, stride 1 in K
    xs_ptr,  # [M] float32, or [M, NUM_STEPS] (BLOCK_SCALED, stride 1 in the last dim)
    w_ptr,  # [N, K] float8e4nv, stride 1 in K
    ws_ptr,  # [N] float32, or [cdiv(N, SCALE_BN), NUM_STEPS]
    out_ptr,  # [M, N] contiguous, out dtype
    part_ptr,  # [SPLIT_K, M, N] float32 partials (SPLIT_K > 1)
    counter_ptr,  # [tiles] int32 zeros (SPLIT_K > 1)
    M, N, stride_xm, stride_wn, stride_xsm, stride_wsn,
    K: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_BN: tl.constexpr, STEP_K: tl.constexpr,
    NUM_STEPS: tl.constexpr, STEPS_PER_SPLIT: tl.constexpr, TILES_PER_STEP: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr, PROMOTE: tl.constexpr,  # fp8 products summed in the tensor core before a float32 add
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]: W^T's columns are W's rows

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(STEPS_PER_SPLIT):
        step = pid_k * STEPS_PER_SPLIT + i
        k_end = tl.minimum((step + 1) * STEP_K, K)  # the step's end (masks only)
        if BLOCK_SCALED:
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            part = acc
        for t in range(TILES_PER_STEP):
            offs_k = step * STEP_K + t * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
                b = tl.load(w_cols + offs_k[:, None], mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < k_end
                a = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            part = tl.dot(a, b, part, max_num_imprecise_acc=PROMOTE)
        if BLOCK_SCALED:
            xs, ws = _step_scales(xs_ptr, ws_ptr, step, offs_m, offs_n, m_ok, n_ok, stride_xsm, stride_wsn,
                                  SCALE_BN, NUM_STEPS, EVEN_K)
            acc += part * xs[:, None] * ws[None, :]
        else:
            acc = part
    # Per-channel scales multiply the (summed) float32 accumulator once; block scales are already in it.
    store_tile(acc, out_ptr, part_ptr, counter_ptr, xs_ptr, ws_ptr, offs_m, offs_n, m_ok, n_ok,
               pid_m * tl.cdiv(N, BLOCK_N) + pid_n, pid_k, M, N, not BLOCK_SCALED, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, counter_ptr,  # as _fp8_gemm_kernel's
    M, N, stride_xm, stride_wn, stride_xsm, stride_wsn,
    K: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_BN: tl.constexpr, STEP_K: tl.constexpr,
    NUM_STEPS: tl.constexpr, STEPS_PER_SPLIT: tl.constexpr, TILES_PER_STEP: tl.constexpr, EVEN_K: tl.constexpr,
    ROWS: tl.constexpr,  # rows of x per program (a power of two; decode)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # No tensor cores and no shared memory: each thread loads 16 contiguous weight bytes of a
    # row, widens them to float32 and multiplies by x with FMAs; a row's dot is a sum over K.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.arange(0, ROWS)
    offs_m = pid_m * ROWS + rows
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for i in range(STEPS_PER_SPLIT):
        step = pid_k * STEPS_PER_SPLIT + i
        k_end = tl.minimum((step + 1) * STEP_K, K)
        part = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for t in range(TILES_PER_STEP):
            offs_k = step * STEP_K + t * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w = w.to(tl.float32)  # [BLOCK_N, BLOCK_K]
            for r in tl.static_range(ROWS):
                m = pid_m * ROWS + r
                x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + offs_k, mask=k_ok & (m < M), other=0.0)
                dot = tl.sum(w * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
                part = tl.where(rows[:, None] == r, part + dot[None, :], part)
        if BLOCK_SCALED:
            xs, ws = _step_scales(xs_ptr, ws_ptr, step, offs_m, offs_n, m_ok, n_ok, stride_xsm, stride_wsn,
                                  SCALE_BN, NUM_STEPS, EVEN_K)
            acc += part * xs[:, None] * ws[None, :]
        else:
            acc += part
    store_tile(acc, out_ptr, part_ptr, counter_ptr, xs_ptr, ws_ptr, offs_m, offs_n, m_ok, n_ok,
               pid_m * tl.num_programs(0) + pid_n, pid_k, M, N, not BLOCK_SCALED, SPLIT_K)
