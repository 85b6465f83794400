"""Multi-LoRA (punica-style) shrink and expand: one batch, rows on different adapters.

The layouts are in ``kernels/lora_reference.py``'s docstring (the PyTorch twins);
in short, for a layer of K inputs, N outputs and rank R (P stacked parts)::

    x [T, K]              lora_a [S, P*R, K]   ─lora_shrink─▶  t [T, P*R] float32
    y [T, N] (in place)   lora_b [S, N, R]     ◀─lora_expand── t, part_offsets (0, ..., N)
    sorted_ids [T], slot_starts [S + 1]  = lora_group(token_slots [T], S), once per step

Both kernels read x, t and y rows through ``sorted_ids`` and take the slot's
segment of it from ``slot_starts``; the x and y rows of no slot (-1) are never
read: t is 0 there and y is untouched.

Grid (fixed by shapes, so a CUDA graph captures it): axis 0 numbers row tiles
of BLOCK_M sorted rows, each inside one segment: slot s's tiles come after
those of slots < s, cdiv(count_s, BLOCK_M) of them (the shrink adds the rows
of no slot as a last segment, whose programs write t's zeros, so t needs no
memset). A program finds its segment by a prefix sum over slot_starts
(``_segment_tile``, S + 1 loads); at most cdiv(T, BLOCK_M) + segments - 1
tiles exist whatever the slots (``row_tiles``), so that many are launched and
those past the last tile exit at once (a program per (slot, tile) pair would
launch S times the tiles, most of them idle). Axis 1: the shrink's column
tiles of t (BLOCK_N of the P*R) times its K splits; the expand's column tiles
of each part (``cdiv(widest part, BLOCK_N)`` per part, the ones past a
narrower part's end exit).

Shrink: t tile = gather(x rows) [BLOCK_M, K] @ lora_a[s]^T [K, BLOCK_N] through
``tl.dot`` over K tiles, float32 accumulation. A decode batch has few row tiles
and each reads lora_a[s] whole, so with few tiles K is split, as the int4 and
FP8 GEMMs split it (``kernels/_gemm_common.py``: each split stores a float32
partial, the tile's last split to arrive sums them in split order and writes t;
one launch, deterministic, the lora family's own tile counters).

Expand: y tile += t[rows, part p] [BLOCK_M, R] @ lora_b[s, part p cols]^T
[R, BLOCK_N], one ``tl.dot`` per BLOCK_R of R (any R >= 1: padded to a power
of two >= 16 and masked), then y is loaded, added in float32, rounded once and
stored. Each (row, column) belongs to one program, so there are no races.
The dot's operands are float32 (t as is, lora_b widened exactly): IEEE-exact
for float32 models; 16-bit models use ``tf32x3`` (three TF32 tensor-core dots,
about float32's precision: lora_b's 16-bit values are exact in TF32 and t is
carried in two TF32 halves).
"""
from __future__ import annotations

from typing import NamedTuple

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
from kernels._gemm_common import (
    SplitKCounters,
    first_rows_per_variant,
    split_k_scratch,
    split_steps,
    store_tile,
)
from kernels._gemm_common import num_sms as _num_sms  # looked up here: tests stand in an H200's count
from kernels.lora_reference import lora_group

__all__ = ["ExpandTiles", "ShrinkTiles", "expand_tiles", "lora_expand", "lora_group", "lora_shrink", "row_tiles",
           "shrink_tiles", "warm_up"]

_counter_buffer = SplitKCounters()  # the split-K counters of lora_shrink launches


# ---- kernels ----------------------------------------------------------------------------------------------


@triton.jit
def _segment_tile(starts_ptr, tile, num_slots, num_tokens, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                  TAIL: tl.constexpr):
    # Row tile number `tile` -> (segment, its first sorted row, the end of the segment's rows).
    # Segment s < num_slots: slot s's rows [starts[s], starts[s+1]); with TAIL, segment num_slots:
    # the rows of no slot [starts[S], T). Segment s owns tiles [ends[s] - tiles[s], ends[s]);
    # past the last tile the segment is num_slots + TAIL (or more).
    offs = tl.arange(0, BLOCK_S)
    if TAIL:
        in_range = offs <= num_slots
    else:
        in_range = offs < num_slots
    lo = tl.load(starts_ptr + offs, mask=in_range, other=0)
    hi = tl.load(starts_ptr + offs + 1, mask=offs < num_slots, other=0)
    if TAIL:
        hi = tl.where(offs == num_slots, num_tokens, hi)
    tiles = tl.where(in_range, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, axis=0)
    slot = tl.sum((ends <= tile).to(tl.int32), axis=0)
    here = offs == slot
    first_tile = tl.sum(tl.where(here, ends - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(here, lo, 0), axis=0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(here, hi, 0), axis=0)
    return slot, row0, row_end


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K], stride 1 in K
    a_ptr,  # [S, RT, K], stride 1 in K
    out_ptr,  # [T, RT] float32, contiguous
    part_ptr,  # [SPLIT_K, T, RT] float32 partials (SPLIT_K > 1)
    counter_ptr,  # [tiles] int32 zeros (SPLIT_K > 1)
    ids_ptr,  # [T] int32: sorted_ids
    starts_ptr,  # [S + 1] int32: slot_starts
    num_slots, num_tokens, K, RT, stride_xm, stride_as, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 and every split has TILES_PER_SPLIT whole tiles
    DOT_PRECISION: tl.constexpr,
):
    slot, row0, row_end = _segment_tile(starts_ptr, tl.program_id(0), num_slots, num_tokens, BLOCK_M, BLOCK_S,
                                        True)
    if slot > num_slots:  # past the last tile
        return
    pid_n = tl.program_id(1) // SPLIT_K
    pid_k = tl.program_id(1) % SPLIT_K

    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < row_end
    rows = tl.load(ids_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < RT
    if slot == num_slots:  # rows of no slot: t = 0, written by split 0 (no partials to sum)
        if pid_k == 0:
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            tl.store(out_ptr + rows[:, None] * RT + offs_n[None, :], zeros, mask=m_ok[:, None] & n_ok[None, :])
        return
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + offs_n.to(tl.int64)[None, :] * stride_ar

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(TILES_PER_SPLIT):
        offs_k = (pid_k * TILES_PER_SPLIT + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xt = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
            at = tl.load(a_cols + offs_k[:, None], mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K
            xt = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)

    store_tile(acc, out_ptr, part_ptr, counter_ptr, out_ptr, out_ptr, rows, offs_n, m_ok, n_ok,
               tl.program_id(0) * tl.cdiv(RT, BLOCK_N) + pid_n, pid_k, num_tokens, RT, False, SPLIT_K)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, N], stride 1 in N, updated in place
    t_ptr,  # [T, P*R] float32, stride 1
    b_ptr,  # [S, N, R], stride 1 in R
    ids_ptr,  # [T] int32: sorted_ids
    starts_ptr,  # [S + 1] int32: slot_starts
    num_slots, n_tiles, stride_ym, stride_tm, stride_bs, stride_bn,
    PART_OFFSETS,  # P + 1 ints: part p owns columns [PART_OFFSETS[p], PART_OFFSETS[p + 1])
    R: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    slot, row0, row_end = _segment_tile(starts_ptr, tl.program_id(0), num_slots, 0, BLOCK_M, BLOCK_S, False)
    if slot >= num_slots:  # past the last tile
        return
    part = tl.program_id(1) // n_tiles
    pid_n = tl.program_id(1) % n_tiles
    col_lo = 0
    col_hi = 0
    for q in tl.static_range(P):
        col_lo = tl.where(part == q, PART_OFFSETS[q], col_lo)
        col_hi = tl.where(part == q, PART_OFFSETS[q + 1], col_hi)
    col0 = col_lo + pid_n * BLOCK_N
    if col0 >= col_hi:  # a column tile past a narrower part's end
        return

    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < row_end
    rows = tl.load(ids_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < col_hi
    t_rows = t_ptr + rows[:, None] * stride_tm + part * R
    b_cols = b_ptr + slot.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[None, :] * stride_bn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in tl.static_range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        tt = tl.load(t_rows + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_cols + offs_r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(tt, bt.to(tl.float32), acc, input_precision=DOT_PRECISION)

    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


# ---- tiles (from shapes alone) ----------------------------------------------------------------------------


class ShrinkTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    tiles_per_split: int  # K tiles of BLOCK_K per split
    num_warps: int = 4
    num_stages: int = 3


class ExpandTiles(NamedTuple):
    block_m: int
    block_n: int
    block_r: int
    num_warps: int = 4
    num_stages: int = 2


def _block_m(num_tokens: int) -> int:
    return max(16, min(64, next_pow2(num_tokens)))


def row_tiles(num_tokens: int, segments: int, block_m: int) -> int:
    """The row tiles launched for T rows in ``segments`` segments (slots, and the rows of no
    slot for the shrink): a bound on sum_s cdiv(count_s, block_m) however the rows fall
    (cdiv(a) + cdiv(b) <= cdiv(a + b) + 1), and never more than segments * cdiv(T, block_m)."""
    m = triton.cdiv(num_tokens, block_m)
    return min(m + segments - 1, m * segments)


_MIN_SPLIT_K_TILES = 8  # K tiles a split keeps at least (more splits cost more than they gain, on an H200)


def shrink_tiles(num_tokens: int, num_slots: int, rt: int, k: int, dtype: torch.dtype,
                 device: torch.device) -> ShrinkTiles:
    """Tiles of a shrink of T rows into rt (= P*R) columns over K with S slots. BLOCK_N covers
    t's columns (up to 128; 64 for float32), so x is read once; K is split in powers of two
    while the launched tiles stay within two per SM and each split keeps _MIN_SPLIT_K_TILES
    K tiles (on an H200, qkv of K = 4096 at rank 16: 5 us for 1-8 rows, 7 at 128, 8 at 512)."""
    fp32 = dtype == torch.float32
    block_m = _block_m(num_tokens)
    block_n = max(16, min(64 if fp32 else 128, next_pow2(rt)))
    block_k = max(16, min(32 if fp32 else 64, next_pow2(k)))
    k_tiles = triton.cdiv(k, block_k)
    tiles = max(1, row_tiles(num_tokens, num_slots + 1, block_m)) * triton.cdiv(rt, block_n)
    split = 1
    while tiles * split * 2 <= 2 * _num_sms(device) and split * 2 * _MIN_SPLIT_K_TILES <= k_tiles:
        split *= 2
    split, per_split = split_steps(k_tiles, split)
    return ShrinkTiles(block_m, block_n, block_k, split, per_split)


def expand_tiles(num_tokens: int, rank: int, dtype: torch.dtype) -> ExpandTiles:
    """Tiles of an expand of T rows at rank R: BLOCK_R = R padded to a power of two in [16, 64]
    (larger R loops); BLOCK_M x BLOCK_N 16 or 32 x 64 up to 128 rows, beyond that 32 x 128
    (memory-bound ranks <= 32) or 64 x 64 (larger ranks, bound by the tf32x3 dots); BLOCK_N 32
    for float32 (its IEEE dot runs on FMAs). The best of those tried on an H200 (bf16 qkv,
    ranks 16 and 64, 1 to 4096 rows)."""
    block_r = max(16, min(64, next_pow2(rank)))
    if dtype == torch.float32:
        return ExpandTiles(min(32, _block_m(num_tokens)), 32, block_r)
    if num_tokens <= 128:
        return ExpandTiles(min(32, _block_m(num_tokens)), 64, block_r)
    return ExpandTiles(32, 128, block_r) if rank <= 32 else ExpandTiles(64, 64, block_r)


# ---- launchers --------------------------------------------------------------------------------------------


def _check_rows(where: str, num_tokens: int, num_slots: int, token_slots: torch.Tensor,
                sorted_ids: torch.Tensor, slot_starts: torch.Tensor) -> None:
    for name, t, layout in (("token_slots", token_slots, "[T] int32"), ("sorted_ids", sorted_ids, "[T] int32"),
                            ("slot_starts", slot_starts, "[S + 1] int32")):
        check_dim(where, name, t, 1, layout)
        check_dtype(where, name, t, (torch.int32,))
        check_inner_contiguous(where, name, t)
    for name, t in (("token_slots", token_slots), ("sorted_ids", sorted_ids)):
        require(t.shape[0] == num_tokens, where, f"{name} must have T = {num_tokens} rows, got {tuple(t.shape)}")
    require(slot_starts.shape[0] == num_slots + 1, where,
            f"slot_starts must have S + 1 = {num_slots + 1} entries, got {tuple(slot_starts.shape)}")


def _check_shrink_args(x, lora_a, token_slots, sorted_ids, slot_starts) -> None:
    where = "lora_shrink"
    check_runnable(where, x=x, lora_a=lora_a, token_slots=token_slots, sorted_ids=sorted_ids,
                   slot_starts=slot_starts)
    check_dim(where, "x", x, 2, "[T, K]")
    check_dim(where, "lora_a", lora_a, 3, "[S, P*R, K]")
    check_dtype(where, "x", x, FLOAT_DTYPES)
    require(lora_a.dtype == x.dtype, where, f"lora_a must have x's dtype {x.dtype}, got {lora_a.dtype}")
    num_tokens, k = x.shape
    require(k >= 1, where, "x has K = 0 columns")
    require(lora_a.shape[2] == k, where, f"lora_a must have K = {k} columns (x's), got {tuple(lora_a.shape)}")
    require(lora_a.shape[0] >= 1 and lora_a.shape[1] >= 1, where,
            f"lora_a must have S >= 1 slots and P*R >= 1 rows, got {tuple(lora_a.shape)}")
    _check_rows(where, num_tokens, lora_a.shape[0], token_slots, sorted_ids, slot_starts)
    check_inner_contiguous(where, "x", x)
    check_inner_contiguous(where, "lora_a", lora_a)


def _check_part_offsets(where: str, part_offsets, n: int) -> None:
    ok = (isinstance(part_offsets, (tuple, list)) and len(part_offsets) >= 2
          and all(isinstance(o, int) and not isinstance(o, bool) for o in part_offsets))
    require(ok, where, f"part_offsets must be a tuple of P + 1 >= 2 ints, got {part_offsets!r}")
    require(part_offsets[0] == 0 and part_offsets[-1] == n
            and all(a < b for a, b in zip(part_offsets, part_offsets[1:])), where,
            f"part_offsets must increase strictly from 0 to N = {n} (y's columns), got {tuple(part_offsets)}")


def _check_expand_args(y, t, lora_b, token_slots, sorted_ids, slot_starts, part_offsets) -> None:
    where = "lora_expand"
    check_runnable(where, y=y, t=t, lora_b=lora_b, token_slots=token_slots, sorted_ids=sorted_ids,
                   slot_starts=slot_starts)
    check_dim(where, "y", y, 2, "[T, N]")
    check_dim(where, "t", t, 2, "[T, P*R] float32")
    check_dim(where, "lora_b", lora_b, 3, "[S, N, R]")
    check_dtype(where, "y", y, FLOAT_DTYPES)
    check_dtype(where, "t", t, (torch.float32,))
    require(lora_b.dtype == y.dtype, where, f"lora_b must have y's dtype {y.dtype}, got {lora_b.dtype}")
    num_tokens, n = y.shape
    num_slots, _, rank = lora_b.shape
    require(num_slots >= 1 and rank >= 1, where, f"lora_b must have S >= 1 slots and R >= 1, got {tuple(lora_b.shape)}")
    require(lora_b.shape[1] == n, where, f"lora_b must have N = {n} rows (y's columns), got {tuple(lora_b.shape)}")
    _check_part_offsets(where, part_offsets, n)
    parts = len(part_offsets) - 1
    require(tuple(t.shape) == (num_tokens, parts * rank), where,
            f"t must be [T, P*R] = [{num_tokens}, {parts} * {rank}] for {parts} parts of rank {rank}, "
            f"got {tuple(t.shape)}")
    _check_rows(where, num_tokens, num_slots, token_slots, sorted_ids, slot_starts)
    for name, tensor in (("y", y), ("t", t), ("lora_b", lora_b)):
        check_inner_contiguous(where, name, tensor)


def _block_s(num_slots: int) -> int:
    return max(2, next_pow2(num_slots))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, sorted_ids: torch.Tensor,
                slot_starts: torch.Tensor) -> torch.Tensor:
    """t = x @ lora_a[slot]^T per row, for a batch whose rows use different adapters.

    x: [T, K] float16/bfloat16/float32, any row stride (stride 1 in K)
    lora_a: [S, R, K] in x's dtype (stride 1 in K). A stacked layer of P parts passes the
        parts' A matrices stacked along rows, [S, P*R, K], part p in rows [p*R, (p+1)*R),
        and hands the resulting t [T, P*R] to ``lora_expand`` with its part_offsets.
    token_slots: [T] int32, each row's slot (-1: none); checked for its shape only
    sorted_ids, slot_starts: ``lora_group(token_slots, S)`` (once per step)

    Returns a new contiguous t [T, R] (P*R) float32: t[i] = x[i] @ lora_a[token_slots[i]].T
    with float32 accumulation, 0 for rows of no slot. No host sync, grid from shapes:
    CUDA-graph capturable (``warm_up`` first allocates the split-K counters, which calls
    share: they must not run concurrently on two streams).
    """
    _check_shrink_args(x, lora_a, token_slots, sorted_ids, slot_starts)
    num_tokens, k = x.shape
    num_slots, rt, _ = lora_a.shape
    out = torch.empty(num_tokens, rt, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    tiles = shrink_tiles(num_tokens, num_slots, rt, k, x.dtype, x.device)
    split = tiles.split_k
    m_tiles, n_tiles = row_tiles(num_tokens, num_slots + 1, tiles.block_m), triton.cdiv(rt, tiles.block_n)
    part, counters = split_k_scratch("lora_shrink", out, split, m_tiles * n_tiles, _counter_buffer)
    even_k = k % tiles.block_k == 0 and triton.cdiv(k, tiles.block_k) == split * tiles.tiles_per_split
    _lora_shrink_kernel[(m_tiles, n_tiles * split)](
        x, lora_a, out, part, counters, sorted_ids, slot_starts,
        num_slots, num_tokens, k, rt, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, BLOCK_S=_block_s(num_slots + 1),
        SPLIT_K=split, TILES_PER_SPLIT=tiles.tiles_per_split, EVEN_K=even_k,
        # float32 models get exact float32 products, not TF32's 10-bit mantissa.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def lora_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                sorted_ids: torch.Tensor, slot_starts: torch.Tensor, part_offsets: tuple[int, ...]) -> None:
    """In place: y[i, part p] += t[i, p*R:(p+1)*R] @ lora_b[slot_i, part p columns]^T.

    y: [T, N] float16/bfloat16/float32, any row stride (stride 1 in N), e.g. the base
        layer's output
    t: [T, P*R] float32 from ``lora_shrink`` (stride 1 in its columns)
    lora_b: [S, N, R] in y's dtype (stride 1 in R); R columns, not P*R
    token_slots, sorted_ids, slot_starts: as for ``lora_shrink``
    part_offsets: (0, N_0, N_0 + N_1, ..., N), P + 1 strictly increasing ints: columns
        [part_offsets[p], part_offsets[p+1]) of y and rows of lora_b[s] are part p's
        (q|k|v: (0, q, q+k, q+k+v)); (0, N) for an ordinary layer

    The product is float32, added to y in float32 and rounded once to y's dtype. Rows of
    no slot are left untouched. No host sync, grid from shapes: CUDA-graph capturable.
    """
    _check_expand_args(y, t, lora_b, token_slots, sorted_ids, slot_starts, part_offsets)
    num_tokens = y.shape[0]
    num_slots, _, rank = lora_b.shape
    if num_tokens == 0:
        return
    parts = len(part_offsets) - 1
    tiles = expand_tiles(num_tokens, rank, y.dtype)
    widest = max(b - a for a, b in zip(part_offsets, part_offsets[1:]))
    n_tiles = triton.cdiv(widest, tiles.block_n)
    grid = (row_tiles(num_tokens, num_slots, tiles.block_m), parts * n_tiles)
    _lora_expand_kernel[grid](
        y, t, lora_b, sorted_ids, slot_starts,
        num_slots, n_tiles, y.stride(0), t.stride(0), lora_b.stride(0), lora_b.stride(1),
        tuple(part_offsets),
        R=rank, P=parts, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_r,
        BLOCK_S=_block_s(num_slots),
        # float32 operands: IEEE-exact for float32 models, three TF32 dots (about as exact) otherwise.
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32x3",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def warm_up(lora_a: torch.Tensor, lora_b: torch.Tensor, part_offsets: tuple[int, ...], max_tokens: int) -> int:
    """Compile every kernel variant ``lora_shrink`` and ``lora_expand`` can meet for
    1..max_tokens rows with these stacked adapters (a compile met while serving stalls a
    step) and allocate the split-K counters before any CUDA-graph capture: one shrink and
    one expand per distinct pair of tile choices, every row on slot 0. Results are thrown
    away. Returns the number of (shrink, expand) calls."""
    num_slots, rt, k = lora_a.shape
    n, rank = lora_b.shape[1], lora_b.shape[2]
    dtype, dev = lora_a.dtype, lora_a.device
    rows = first_rows_per_variant(
        max_tokens, lambda m: (shrink_tiles(m, num_slots, rt, k, dtype, dev), expand_tiles(m, rank, dtype)))
    for m in rows:
        slots = torch.zeros(m, dtype=torch.int32, device=dev)
        sorted_ids, slot_starts = lora_group(slots, num_slots)
        t = lora_shrink(torch.zeros(m, k, dtype=dtype, device=dev), lora_a, slots, sorted_ids, slot_starts)
        y = torch.zeros(m, n, dtype=dtype, device=dev)
        lora_expand(y, t, lora_b, slots, sorted_ids, slot_starts, part_offsets)
    return len(rows)
