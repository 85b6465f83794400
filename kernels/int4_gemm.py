"""int4 weight-only GEMM (W4A16): y = x W^T with W stored as 4-bit integers.

The weight stays packed in device memory and is dequantized in registers, one
[BLOCK_K, BLOCK_N] tile at a time, right before the tile's ``tl.dot``: a
decode step reads 4.25 bits per weight (the 4-bit values plus one 16-bit
scale per group of 64 or more) instead of 16.

Layout (``kernels/int4_reference.py`` has the same in words; AutoAWQ, GPTQ
and compressed-tensors checkpoints are converted to it at load time by
``engine/quantization/int4.py``)::

    qweight [ceil(K/8), N] int32   packed along K, 8 consecutive rows of W^T per word,
                                   nibble k % 8 of word [k // 8, n] = q[k, n] in [0, 15]
    scales  [G, N] float16/bfloat16/float32
    zeros   [G, N] uint8, or None for the symmetric z = 8
    W^T[k, n] = (q[k, n] - z[g(k), n]) * scales[g(k), n],  g(k) = k // group_size (or g_idx[k])

Why this layout: packing along K keeps a row of N words contiguous, so a tile
of BLOCK_K/8 packed rows loads as BLOCK_K/8 coalesced rows of BLOCK_N int32
(16-byte vectors per thread), the same access pattern as a dense weight tile;
the 8 values of a word are 8 consecutive K rows, so unpacking is a broadcast
shift [BLOCK_K/8, 1, BLOCK_N] >> [1, 8, 1] and a reshape, with no gather, and
one scale row serves a whole tile when the group size is a multiple of
BLOCK_K. GPTQ's qweight is already this layout; compressed-tensors' is its
transpose; AutoAWQ's (packed along N in an interleaved order) is repacked.
Zeros are kept unpacked (uint8, 1/8 of a scale row's bytes per group) and
dropped entirely for symmetric weights.

Act-order (GPTQ desc_act): the rows are permuted at load time so that groups
are contiguous; ``perm[k]`` says which column of x multiplies internal row k,
and the kernel gathers x's columns through it (x is small next to W, and the
gathered tile is read once per program). When a tensor-parallel shard leaves
groups of unequal sizes, ``g_idx`` gives each internal row's group and the
scales are read per row instead of per tile.

Grid: one program per (BLOCK_M x BLOCK_N output tile, K split). Small M is
bound by reading W once: few output tiles cannot keep 132 SMs busy, so K is
split (``split_k``); each split writes float32 partials and the last split of
a tile to finish (an atomic counter per tile) adds them in split order and
writes the output, so there is no second launch, the result does not depend
on timing, and the counter is back at 0 for the next call (the FP8 GEMM does
the same: ``kernels/_gemm_common.py``). Large M is bound by the tensor cores:
big tiles, GROUP_M ordering for L2 reuse.

Numerics: each dequantized weight is rounded once to x's dtype, as the
reference does; products accumulate in float32 (float32 inputs use
IEEE-exact dots, not TF32).
"""
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
from kernels._gemm_common import (
    GemmTiles,
    SplitKCounters,
    choose_split,
    first_rows_per_variant,
    grouped_tile,
    split_k_scratch,
    split_steps,
    store_tile,
)
from kernels._gemm_common import num_sms as _num_sms  # looked up here: tests stand in an H200's count

_counter_buffer = SplitKCounters()  # the split-K counters of int4 launches (FP8's are its own)


# ---- kernel ---------------------------------------------------------------------------------------------


@triton.jit
def _load_weight_tile(qw_ptr, s_ptr, z_ptr, gidx_ptr, k0, offs_n, n_ok, stride_qk, stride_sg, stride_zg,
                      K: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      HAS_G_IDX: tl.constexpr, TILE_GROUPS: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    # The dequantized [BLOCK_K, BLOCK_N] tile of W^T starting at row k0, in DTYPE.
    prow = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # packed rows of this tile
    qw_ptrs = qw_ptr + prow.to(tl.int64)[:, None] * stride_qk + offs_n[None, :]
    if EVEN_K:
        packed = tl.load(qw_ptrs, mask=n_ok[None, :], other=0)
    else:
        packed = tl.load(qw_ptrs, mask=(prow < (K + 7) // 8)[:, None] & n_ok[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    # [BLOCK_K/8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]: row 8 r + j is nibble j of packed row r
    q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
    if TILE_GROUPS:  # the whole tile lies in group k0 // GROUP_SIZE
        g = k0 // GROUP_SIZE
        if EVEN_K:
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0)
        else:  # a split's trailing tiles may start past K
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok & (k0 < K), other=0.0)
        s = s.to(DTYPE)[None, :]
        if HAS_ZEROS:
            if EVEN_K:
                z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0)
            else:
                z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok & (k0 < K), other=0)
            w = (q - z.to(tl.int32)[None, :]).to(DTYPE) * s
        else:
            w = (q - 8).to(DTYPE) * s
    else:  # groups change inside the tile: one scale per row
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if HAS_G_IDX:
            g = tl.load(gidx_ptr + offs_k, mask=k_ok, other=0)
        else:
            g = offs_k // GROUP_SIZE
        mask = k_ok[:, None] & n_ok[None, :]
        s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0).to(DTYPE)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=mask, other=0)
            w = (q - z.to(tl.int32)).to(DTYPE) * s
        else:
            w = (q - 8).to(DTYPE) * s
    return w


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    x_ptr,  # [M, K], stride 1 in K
    qw_ptr,  # [ceil(K/8), N] int32, stride 1 in N
    s_ptr,  # [G, N], stride 1 in N
    z_ptr,  # [G, N] uint8, stride 1 in N (HAS_ZEROS)
    perm_ptr,  # [K] int32/int64: x column of internal row k (HAS_PERM)
    gidx_ptr,  # [K] int32: group of internal row k (HAS_G_IDX)
    out_ptr,  # [M, N] contiguous, x's dtype
    part_ptr,  # [SPLIT_K, M, N] float32 partials (SPLIT_K > 1)
    counter_ptr,  # [tiles] int32 zeros (SPLIT_K > 1)
    M, N, stride_xm, stride_qk, stride_sg, stride_zg,
    K: tl.constexpr, GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_G_IDX: tl.constexpr, TILE_GROUPS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 and every split has TILES_PER_SPLIT whole tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    dtype = x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(TILES_PER_SPLIT):
        k0 = (pid_k * TILES_PER_SPLIT + t) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if HAS_PERM:
            if EVEN_K:
                cols = tl.load(perm_ptr + offs_k)
            else:
                cols = tl.load(perm_ptr + offs_k, mask=offs_k < K, other=0)
        else:
            cols = offs_k
        if EVEN_K:
            x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        w = _load_weight_tile(qw_ptr, s_ptr, z_ptr, gidx_ptr, k0, offs_n, n_ok, stride_qk, stride_sg, stride_zg,
                              K, GROUP_SIZE, HAS_ZEROS, HAS_G_IDX, TILE_GROUPS, EVEN_K, BLOCK_K, BLOCK_N, dtype)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)

    # The scales were applied to each weight tile: none on the sum. out is in x's dtype.
    store_tile(acc, out_ptr, part_ptr, counter_ptr, out_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok,
               pid_m * tl.cdiv(N, BLOCK_N) + pid_n, pid_k, M, N, False, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, counter_ptr,  # as _int4_gemm_kernel's
    M, N, stride_xm, stride_qk, stride_sg, stride_zg,
    K: tl.constexpr, GROUP_SIZE: tl.constexpr,  # every K tile lies in one group
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr,
    ROWS: tl.constexpr,  # rows of x per program (a power of two; decode)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
):
    # No tensor cores and no shared memory: each thread loads whole packed words (16-byte
    # vectors along N), unpacks its 8 K rows in registers and multiplies them by x with
    # float32 FMAs; per tile (one group) acc += s * (sum_k x_k q_k - z * sum_k x_k).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    r = tl.arange(0, BLOCK_K // 8)
    j = tl.arange(0, 8)
    shifts = j * 4
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for t in range(TILES_PER_SPLIT):
        k0 = (pid_k * TILES_PER_SPLIT + t) * BLOCK_K
        prow = k0 // 8 + r
        qw_ptrs = qw_ptr + prow.to(tl.int64)[:, None] * stride_qk + offs_n[None, :]
        k2 = k0 + r[:, None] * 8 + j[None, :]  # [BLOCK_K/8, 8]: the K row of each nibble
        if EVEN_K:
            packed = tl.load(qw_ptrs, mask=n_ok[None, :], other=0)
        else:
            packed = tl.load(qw_ptrs, mask=(prow < (K + 7) // 8)[:, None] & n_ok[None, :], other=0)
        q = ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).to(tl.float32)  # [BLOCK_K/8, 8, BLOCK_N]
        g = k0 // GROUP_SIZE
        if EVEN_K:
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        else:
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok & (k0 < K), other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok & (k0 < K), other=0).to(tl.float32)
        else:
            z = 8.0
        if HAS_PERM:
            cols = tl.load(perm_ptr + k2, mask=k2 < K, other=0)
        else:
            cols = k2
        for i in tl.static_range(ROWS):
            m = pid_m * ROWS + i
            x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + cols, mask=(k2 < K) & (m < M), other=0.0)
            x = x.to(tl.float32)  # [BLOCK_K/8, 8]
            dot = tl.sum(tl.sum(q * x[:, :, None], axis=1), axis=0)  # [BLOCK_N]
            contrib = s * (dot - z * tl.sum(tl.sum(x, axis=1), axis=0))
            acc = tl.where(rows[:, None] == i, acc + contrib[None, :], acc)

    offs_m = pid_m * ROWS + rows
    store_tile(acc, out_ptr, part_ptr, counter_ptr, out_ptr, out_ptr, offs_m, offs_n, offs_m < M, n_ok,
               pid_m * tl.num_programs(0) + pid_n, pid_k, M, N, False, SPLIT_K)


# ---- tiles ------------------------------------------------------------------------------------------------


# decode batches of at most this many rows use the GEMV kernel by default; measured on an H200
# (2026-12-02, a Llama-3.1-8B layer): 2 rows 149 us either way, 4 rows 287 us against 149 for
# the tensor-core tiles (which pad the rows to 16)
GEMV_MAX_ROWS = 2


class Int4Tiles(GemmTiles):
    """kernel "dot": BLOCK_M x BLOCK_N output tiles through tl.dot (tensor cores); "gemv":
    ``block_m`` (1, 2, 4 or 8) rows of x per program, FMAs in registers, every K tile in one group."""
    launcher = "int4_gemm"


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _gemv_block_k(k: int, group_size: int) -> int | None:
    """The GEMV's K tile: a power of two >= 16, at most 256, dividing the group (one scale
    row per tile); None when no such tile exists."""
    if group_size >= k:
        return max(16, min(256, triton.next_power_of_2(k)))
    bk = group_size & -group_size  # the largest power of two dividing the group size
    return min(bk, 256) if bk >= 16 else None


def default_tiles(m: int, n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device,
                  has_g_idx: bool = False) -> Int4Tiles:
    """Tiles from shapes alone. Up to GEMV_MAX_ROWS rows (decode) use the GEMV kernel, which
    reads the packed words straight into registers; the tensor-core kernel would pad the rows
    to 16 and pass every dequantized tile through shared memory. BLOCK_K is at most the group
    size when that is a power of two >= 16 (one scale row per tile); K is split when the
    output tiles alone would leave most SMs idle."""
    gemv_bk = None if has_g_idx else _gemv_block_k(k, group_size)
    if m <= GEMV_MAX_ROWS and gemv_bk is not None:
        if m == 1:
            # 64 columns a tile, 2 warps, ~32 programs per SM: near the M = 1 sweep's best tiles
            # (H200, 2026-12-02: 77 us a Llama-3.1-8B layer against 91 with the tiles below); with
            # 2-4 rows these tiles ran 2-3x slower than those.
            block_n, warps, per_sm = max(16, min(64, triton.next_power_of_2(n))), 2, 32
        else:
            block_n, warps, per_sm = max(16, min(128, triton.next_power_of_2(n))), 4, 4
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, m)
        split = choose_split(tiles, triton.cdiv(k, gemv_bk), per_sm * _num_sms(device))
        return Int4Tiles(triton.next_power_of_2(m), block_n, gemv_bk, split, 1, warps, 2, "gemv")
    if dtype == torch.float32:  # exact fp32 dots: small tiles (shared memory, registers)
        block_m, block_n, block_k, warps, stages = (16 if m <= 16 else 32), 32, 32, 4, 2
    elif m <= 16:  # bound by reading W: many programs, long K tiles in flight
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
    elif m <= 32:
        block_m, block_n, block_k, warps, stages = 32, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 64, 64, 4, 4
    elif m <= 128:
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    if group_size < k and group_size % 16 == 0:
        block_k = min(block_k, _pow2_at_most(group_size))
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    block_n = max(16, min(block_n, triton.next_power_of_2(n)))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = choose_split(tiles, triton.cdiv(k, block_k), 2 * _num_sms(device))
    return Int4Tiles(block_m, block_n, block_k, split, 8, warps, stages)


def pick_tiles(config: Int4Tiles | dict | None, m: int, n: int, k: int, group_size: int, dtype: torch.dtype,
               device: torch.device, has_g_idx: bool = False) -> Int4Tiles:
    """``config`` itself (an Int4Tiles or its dict), else ``default_tiles``."""
    if config is None:
        return default_tiles(m, n, k, group_size, dtype, device, has_g_idx)
    return config if isinstance(config, Int4Tiles) else Int4Tiles.from_dict(config)


# ---- launcher ---------------------------------------------------------------------------------------------


def _check_args(x, qweight, scales, zeros, group_size, perm, g_idx) -> None:
    where = "int4_gemm"
    tensors = dict(x=x, qweight=qweight, scales=scales)
    for name, t in (("zeros", zeros), ("perm", perm), ("g_idx", g_idx)):
        if t is not None:
            tensors[name] = t
    check_runnable(where, **tensors)
    check_dim(where, "x", x, 2, "[M, K]")
    check_dim(where, "qweight", qweight, 2, "[ceil(K/8), N] int32 packed along K")
    check_dim(where, "scales", scales, 2, "[groups, N]")
    check_dtype(where, "x", x, FLOAT_DTYPES)
    check_dtype(where, "qweight", qweight, (torch.int32,))
    check_dtype(where, "scales", scales, FLOAT_DTYPES)
    m, k = x.shape
    n = qweight.shape[1]
    require(k > 0, where, "x has K = 0 columns")
    require(qweight.shape[0] == triton.cdiv(k, 8), where,
            f"qweight must have ceil(K/8) = {triton.cdiv(k, 8)} rows for x's K = {k}, got {tuple(qweight.shape)}")
    require(isinstance(group_size, int) and group_size >= 1, where, f"group_size must be an int >= 1, got {group_size!r}")
    require(scales.shape[1] == n, where, f"scales must have N = {n} columns, got {tuple(scales.shape)}")
    if g_idx is None:
        groups = triton.cdiv(k, group_size)
        require(scales.shape[0] == groups, where,
                f"scales must have ceil(K/group_size) = {groups} rows (K = {k}, group_size = {group_size}), "
                f"got {tuple(scales.shape)}")
    else:
        check_dtype(where, "g_idx", g_idx, (torch.int32,))
        require(tuple(g_idx.shape) == (k,) and g_idx.is_contiguous(), where,
                f"g_idx must be a contiguous [K = {k}], got shape {tuple(g_idx.shape)}")
    if zeros is not None:
        check_dtype(where, "zeros", zeros, (torch.uint8,))
        require(zeros.shape == scales.shape, where,
                f"zeros shape {tuple(zeros.shape)} != scales shape {tuple(scales.shape)}")
        check_inner_contiguous(where, "zeros", zeros)
    if perm is not None:
        check_dtype(where, "perm", perm, (torch.int32, torch.int64))
        require(tuple(perm.shape) == (k,) and perm.is_contiguous(), where,
                f"perm must be a contiguous [K = {k}], got shape {tuple(perm.shape)}")
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales)):
        check_inner_contiguous(where, name, t)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    *,
    perm: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    config: Int4Tiles | dict | None = None,
) -> torch.Tensor:
    """y = x W^T with W in the int4 layout of this module's docstring.

    x: [M, K] float16/bfloat16/float32, any row stride (stride 1 in K)
    qweight: [ceil(K/8), N] int32, packed along K (stride 1 in N)
    scales: [G, N] float16/bfloat16/float32, G = ceil(K / group_size) (any G with g_idx)
    zeros: [G, N] uint8 zero points, or None (symmetric: 8)
    group_size: rows of W^T per scale row (K or more: one group)
    perm: None, or [K] int32/int64: internal row k multiplies x[:, perm[k]] (act-order)
    g_idx: None, or [K] int32: the group of internal row k (overrides k // group_size)
    config: None (tiles from shapes) or an Int4Tiles / its dict (block_m, block_n,
        block_k, split_k, group_m, num_warps, num_stages)

    Returns a new contiguous [M, N] in x's dtype. Each weight is rounded to x's
    dtype after dequantizing; the products accumulate in float32. No host sync:
    it can be captured in a CUDA graph. Split-K launches share one counter
    buffer per device, so calls must not run concurrently on two streams.
    """
    _check_args(x, qweight, scales, zeros, group_size, perm, g_idx)
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    tiles = pick_tiles(config, m, n, k, group_size, x.dtype, x.device, g_idx is not None)
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    one_group = group_size >= k
    gemv = tiles.kernel == "gemv"
    require(not gemv or (g_idx is None and (one_group or group_size % bk == 0)), "int4_gemm",
            f"the gemv kernel needs every K tile in one group: no g_idx and block_k {bk} dividing group_size "
            f"{group_size}")
    k_tiles = triton.cdiv(k, bk)
    split, per_split = split_steps(k_tiles, tiles.split_k)
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    part, counters = split_k_scratch("int4_gemm", out, split, m_tiles * n_tiles, _counter_buffer)
    even_k = k % bk == 0 and k_tiles % per_split == 0
    zeros_arg = zeros if zeros is not None else scales
    perm_arg = perm if perm is not None else qweight
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0)
    group = k if one_group else group_size
    if gemv:
        _int4_gemv_kernel[(n_tiles, split, m_tiles)](
            x, qweight, scales, zeros_arg, perm_arg, out, part, counters, m, n, *strides,
            K=k, GROUP_SIZE=group, HAS_ZEROS=zeros is not None, HAS_PERM=perm is not None, EVEN_K=even_k,
            ROWS=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, TILES_PER_SPLIT=per_split,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        return out
    _int4_gemm_kernel[(m_tiles * n_tiles, split)](
        x, qweight, scales, zeros_arg, perm_arg, g_idx if g_idx is not None else qweight, out, part, counters,
        m, n, *strides,
        K=k, GROUP_SIZE=group,
        HAS_ZEROS=zeros is not None, HAS_PERM=perm is not None, HAS_G_IDX=g_idx is not None,
        TILE_GROUPS=g_idx is None and (one_group or group_size % bk == 0), EVEN_K=even_k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, TILES_PER_SPLIT=per_split, GROUP_M=tiles.group_m,
        # float32 models get exact float32 products, not TF32's 10-bit mantissa.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def warm_up(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, k: int,
            max_tokens: int, dtype: torch.dtype, *, perm: torch.Tensor | None = None,
            g_idx: torch.Tensor | None = None, config: Int4Tiles | dict | None = None) -> int:
    """Compile every kernel variant ``int4_gemm`` can meet for 1..max_tokens rows of x
    with this weight (a compile met while serving stalls a step), and allocate the
    split-K counters before any CUDA-graph capture. Returns the number of calls."""
    n = qweight.shape[1]
    rows = first_rows_per_variant(
        max_tokens, lambda m: pick_tiles(config, m, n, k, group_size, dtype, qweight.device, g_idx is not None))
    for m in rows:
        x = torch.zeros(m, k, dtype=dtype, device=qweight.device)
        int4_gemm(x, qweight, scales, zeros, group_size, perm=perm, g_idx=g_idx, config=config)
    return len(rows)
