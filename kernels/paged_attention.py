"""Paged attention for a mixed batch of decode tokens and chunked-prefill chunks.

Work split. The new queries of every sequence are cut into tiles of BLOCK_Q
consecutive tokens of one sequence; a program handles one (tile, kv head,
kv split). The G = num_q_heads // num_kv_heads query heads sharing a kv head
are folded into the tile's rows, so each K/V tile is loaded once per group:

    row r of a tile  ->  query token tok0 + r // G,  query head kv_head * G + r % G

Tiles are numbered without a host sync: sequence b's tiles start at

    first_tile(b) = query_start_loc[b] // BLOCK_Q + b

which leaves room for its cdiv(q_len_b, BLOCK_Q) tiles, so the grid has
num_tokens // BLOCK_Q + B tiles and a program finds its sequence by binary
search over query_start_loc (``_locate_tile``: kernels/_attention_common.py,
shared with the dense prefill kernel). Surplus tiles exit at once. The grid
is (kv head, tile, split) and programs take tiles last first: the GPU starts
blocks in grid order, so a causal prefill's longest tiles (its last queries)
start first and the short ones fill the tail (4k causal on an H200: 505 -> 456
us).

Key positions of sequence b (q_len new tokens, seq_len in all):

    [0, seq_len - q_len)        cached earlier: visible to every new query
    [seq_len - q_len, seq_len)  this step's tokens, already in the cache:
                                query i sees keys up to seq_len - q_len + i

A tile reads keys [0, kv_end), kv_end being one past its last query's
position, so pages past it (and block-table padding) are never read.

Sliding window (``sliding_window`` = W, Hugging Face's semantics): the query
at position p sees keys p - W < k <= p, at most W keys including itself. A
tile then reads keys [kv_start, kv_end), kv_start = its first query's position
- W + 1 (at least 0): key tiles wholly before kv_start are skipped (not even
visited) and keys below it are never loaded, so a decode over a 32k context
with a 4k window reads about 4k keys, and pages that left every window may
hold anything. Per key tile of a prefill tile:

    [kv_start, kv_end - W)      window edge: masked (some rows no longer see it)
    [kv_end - W, first query]   seen whole by every row: unmasked
    past the first query        causal diagonal: masked

Whether a window is applied is compiled in (WINDOW); W itself is a runtime
argument, so one compile serves every window size and None runs the code
it ran before windows existed.

FP8 KV cache (float8_e4m3fn, per-tensor k_scale and v_scale): K and V tiles
are loaded as e4m3 and converted to q's dtype in registers (exact: every e4m3
value is a bfloat16 and a float16); under bf16 queries the dots run in float16
instead (FP16_DOTS: Q clamped to float16's range, then K, V and P widened to
float16, which e4m3 reaches in one instruction; on an H200 the decode attention
ran 13-27% faster than with bf16 dots); the scales are applied where they cost
nothing, k_scale folded into the softmax scale (s = q.k8 * scale * k_scale)
and v_scale once on the accumulator (o = sum p v8 * v_scale), which is
K = k8 * k_scale and V = v8 * v_scale up to float rounding.

Split-K (flash decoding): when the grid is too small to fill the GPU (decode
of a few long sequences), each tile's key range [kv_start, kv_end) is cut
into num_splits parts run in parallel; each part writes an unnormalised
partial (sum, running max, running denominator) and _combine_kernel merges
them. The split count is a runtime argument (only whether there are splits,
and the combine's power-of-two width, are compiled in), so ``warm_up`` can
compile every variant a call may pick before serving: a compile met while
serving stalls a step for ~1 s.

Attention sinks (``sinks``, gpt-oss: a logit per query head that joins the softmax's
denominator only; kernels/_attention_common.py): folded in once a row's keys are done,
as one more key of value zero (SINK, compiled in; None runs the code it ran before).
Split, the partials stay sink-free and _combine_kernel folds the sink in, once per row,
whatever the split count.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import prefill_attention
from kernels._attention_common import (
    _INTERPRETED,
    _LOG2E,
    _LOG2E_C,
    _MAX_GRID_Y,
    _NEG_BIG,
    _fold_sink,
    _locate_tile,
)
from kernels._checks import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    check_contiguous,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_kv_cache_dtype,
    check_runnable,
    check_sinks,
    check_window,
    next_pow2,
    require,
)


@triton.jit
def _attend_kv_tile(
    q,  # [BLOCK_M, BLOCK_D]
    m_i,  # [BLOCK_M] running max of the scaled scores (log2 units)
    l_i,  # [BLOCK_M] running softmax denominator
    acc,  # [BLOCK_M, BLOCK_D] running unnormalised output
    n,  # index of the key tile: keys n * BLOCK_N + [0, BLOCK_N)
    q_pos,  # [BLOCK_M] position of each row's query
    kv_start,  # WINDOW: keys below kv_start are not read
    kv_end,  # keys at or past kv_end are not read
    window,  # WINDOW: the query at p sees keys p - window < k <= p
    block_row,  # pointer to the sequence's block-table row
    k_cache_ptr, v_cache_ptr, kv_head,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    dims, dim_ok, qk_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is in [kv_start, kv_end) and visible to every row
    K_ROWS: tl.constexpr,  # load K as [keys, dims] (prefill tiles) rather than [dims, keys] (decode)
    WINDOW: tl.constexpr,  # a sliding window applies
    ONE_QUERY: tl.constexpr,  # every row has the same query (decode tiles): [kv_start, kv_end) is its window
):
    # One online-softmax step over one tile of keys.
    pos = n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    if MASKED:
        if WINDOW:
            pos_ok = (pos < kv_end) & (pos >= kv_start)
        else:
            pos_ok = pos < kv_end
    else:
        pos_ok = tl.full([BLOCK_N], True, tl.int1)
    # Each key finds its own page, so one key tile may span several small
    # pages or part of a large one. int64: block * stride can pass 2^31.
    block = tl.load(block_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    k_off = block * stride_kb + slot * stride_ks + kv_head * stride_kh  # [BLOCK_N]
    v_off = block * stride_vb + slot * stride_vs + kv_head * stride_vh  # [BLOCK_N]
    # On an H200 prefill tiles run 2-10% faster loading each key's row and transposing for
    # the dot; decode tiles 20-35% slower (of a 16-bit cache; an FP8 cache's 4% faster):
    # each kind keeps its own.
    if K_ROWS:
        k = tl.trans(tl.load(
            k_cache_ptr + k_off[:, None] + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(q.dtype))  # [BLOCK_D, BLOCK_N]; an FP8 tile widened before the transpose
    else:
        k = tl.load(
            k_cache_ptr + k_off[None, :] + dims[:, None],
            mask=pos_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
    k = k.to(q.dtype)  # an FP8 cache's e4m3 values, exactly (k_scale is in qk_scale); else a no-op
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if WINDOW and not ONE_QUERY:  # (the per-row compare costs a decode tile ~40 registers)
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated so far
    p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_cache_ptr + v_off[:, None] + dims[None, :],
        mask=pos_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(q.dtype)  # [BLOCK_N, BLOCK_D]; FP8: v_scale is applied to the accumulator at the end
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# per-call counts, the block tables' width and the window: one compile for all
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "stride_bt", "window"])
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]; with SPLIT: [num_splits, T, Hq, D] float32 partial sums
    m_ptr,  # [num_splits, T, Hq] float32 running max (log2 units); used only when split
    l_ptr,  # [num_splits, T, Hq] float32 softmax denominator; used only when split
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks_per_seq]
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    sinks_ptr,  # [Hq] float32 attention sinks (natural-log units); read only when SINK and not SPLIT
    qk_scale,  # softmax scale * log2(e) (* k_scale for an FP8 cache)
    v_scale,  # FP8 cache: V = v_cache * v_scale; read only when KV_FP8
    num_seqs,
    num_tokens,
    num_splits,
    window,  # sliding window in keys (>= 1); read only when WINDOW
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1
    WINDOW: tl.constexpr,  # a sliding window applies
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache is float8_e4m3fn (scaled by k_scale, v_scale)
    K_ROWS: tl.constexpr,  # load K tiles key by key, then transpose (see _attend_kv_tile)
    FP16_DOTS: tl.constexpr,  # an FP8 cache under bf16 queries: Q, K, V and P enter the dots as float16
    SKIP_FRESH: tl.constexpr = False,  # sequences with no cached prefix are prefill_self_attention's rows
    SINK: tl.constexpr = False,  # attention sinks (split: the combine folds them in)
):
    kv_head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # last first: see the module's docstring
    split = tl.program_id(2)

    seq, q_start, q_len, tok0 = _locate_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    if tok0 >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # keys cached before this step
    if SKIP_FRESH:
        if ctx_len == 0:
            return

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP  # [BLOCK_M] query token within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok  # [BLOCK_M] position of each row's query
    token = (q_start + tok).to(tl.int64)  # [BLOCK_M] row in q / out
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if FP16_DOTS:
        # e4m3 widens to float16 in one instruction (to bfloat16 it takes several), and every
        # e4m3 value is a float16; a bf16 query is a float16 too inside float16's range
        # (clamped to it; below 2^-14 it keeps fewer bits, at no cost to a dot's sum).
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # Keys [kv_start, kv_end) in key tiles of BLOCK_N; this split takes a contiguous share.
    kv_end = ctx_len + tl.minimum(tok0 + BLOCK_Q, q_len)
    if WINDOW:
        kv_start = tl.maximum(ctx_len + tok0 - window + 1, 0)  # the first query's window
        # padding rows take the tile's last query position: past it they could see no key (0 / 0)
        q_pos = tl.minimum(q_pos, kv_end - 1)
    else:
        kv_start = 0
    n_start = kv_start // BLOCK_N
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_kv_tiles - n_start, num_splits)
    n_lo = n_start + split * tiles_per_split
    n_hi = tl.minimum(n_lo + tiles_per_split, num_kv_tiles)

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Prefill tiles: key tiles in [n_edge, n_full) are seen whole by every row (inside
    # the last query's window, at or below the first query's position), so they run
    # without masks; only the window's edge, the causal diagonal and kv_end are masked.
    # Decode tiles keep one masked loop: split, they measured 2-15% slower.
    if BLOCK_Q > 1:
        if WINDOW:
            n_edge = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N), n_lo), n_hi)
        else:
            n_edge = n_lo
        n_full = tl.minimum(tl.maximum((ctx_len + tok0 + 1) // BLOCK_N, n_edge), n_hi)
    else:
        n_edge = n_lo
        n_full = n_lo
    # Unmasked tiles first, then the masked ones: the window's edge [n_lo, n_edge) (empty
    # without a window) and [n_full, n_hi), walked by one loop (a third inlined loop body
    # cost the prefill tile registers, and spills when split).
    num_edge = n_edge - n_lo
    num_masked = num_edge + n_hi - n_full
    if _INTERPRETED:
        # Triton 3.6's interpreter cannot take tensor bounds in range() under
        # NumPy >= 2.4 (it calls int() on a 1-element array); compiled, the
        # for loops are kept because only for loops are software-pipelined.
        n = n_edge
        while n < n_full:
            m_i, l_i, acc = _attend_kv_tile(
                q, m_i, l_i, acc, n, q_pos, kv_start, kv_end, window, block_row, k_cache_ptr, v_cache_ptr,
                kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, dims, dim_ok,
                qk_scale, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, False, K_ROWS, WINDOW, BLOCK_Q == 1,
            )
            n += 1
        i = 0
        while i < num_masked:
            n = tl.where(i < num_edge, n_lo + i, n_full + (i - num_edge))
            m_i, l_i, acc = _attend_kv_tile(
                q, m_i, l_i, acc, n, q_pos, kv_start, kv_end, window, block_row, k_cache_ptr, v_cache_ptr,
                kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, dims, dim_ok,
                qk_scale, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, True, K_ROWS, WINDOW, BLOCK_Q == 1,
            )
            i += 1
    else:
        if BLOCK_Q > 1:
            for n in range(n_edge, n_full):
                m_i, l_i, acc = _attend_kv_tile(
                    q, m_i, l_i, acc, n, q_pos, kv_start, kv_end, window, block_row, k_cache_ptr, v_cache_ptr,
                    kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, dims, dim_ok,
                    qk_scale, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, False, K_ROWS, WINDOW, BLOCK_Q == 1,
                )
        if WINDOW and BLOCK_Q > 1:
            for i in range(0, num_masked):
                n = tl.where(i < num_edge, n_lo + i, n_full + (i - num_edge))
                m_i, l_i, acc = _attend_kv_tile(
                    q, m_i, l_i, acc, n, q_pos, kv_start, kv_end, window, block_row, k_cache_ptr, v_cache_ptr,
                    kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, dims, dim_ok,
                    qk_scale, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, True, K_ROWS, WINDOW, BLOCK_Q == 1,
                )
        else:  # no window edge: the loop compiled before windows existed
            for n in range(n_full, n_hi):
                m_i, l_i, acc = _attend_kv_tile(
                    q, m_i, l_i, acc, n, q_pos, kv_start, kv_end, window, block_row, k_cache_ptr, v_cache_ptr,
                    kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, dims, dim_ok,
                    qk_scale, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, True, K_ROWS, WINDOW, BLOCK_Q == 1,
                )

    if KV_FP8:
        acc = acc * v_scale  # sum_k p_k (v8_k * v_scale): partial sums too (the combine is linear in them)
    mask = row_ok[:, None] & dim_ok[None, :]
    if not SPLIT:
        if SINK:  # one more key of value zero, its logit the head's sink
            alpha, l_i = _fold_sink(m_i, l_i, tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * _LOG2E_C)
            acc = acc * alpha[:, None]
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        row = (split * num_tokens + token) * NUM_Q_HEADS + head  # [BLOCK_M] in [S, T, Hq]
        tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask)
        tl.store(m_ptr + row, m_i, mask=row_ok)
        tl.store(l_ptr + row, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _combine_kernel(
    out_ptr,  # [T, Hq, D]
    acc_ptr,  # [num_splits, T, Hq, D] float32
    m_ptr,  # [num_splits, T, Hq] float32
    l_ptr,  # [num_splits, T, Hq] float32
    sinks_ptr,  # [Hq] float32; read only when SINK
    num_tokens,
    num_splits,
    stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK_D: tl.constexpr,
    SINK: tl.constexpr = False,  # attention sinks: folded in here, once, not per split
):
    # One program per (token, query head): softmax-weighted merge of the splits.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    row = (splits * num_tokens + token) * NUM_Q_HEADS + head  # [BLOCK_S]

    m = tl.load(m_ptr + row, mask=split_ok, other=_NEG_BIG)
    l = tl.load(l_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(
        acc_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    if SINK:
        # the sink as one more split: a key of value zero whose logit is the head's sink
        sink = tl.load(sinks_ptr + head) * _LOG2E_C
        m_max = tl.maximum(tl.max(m, axis=0), sink)
        weight = tl.exp2(m - m_max)
        out = tl.sum(acc * weight[:, None], axis=0) / (tl.sum(l * weight, axis=0) + tl.exp2(sink - m_max))
    else:
        weight = tl.exp2(m - tl.max(m, axis=0))  # [BLOCK_S]; 0 for splits that saw no key
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@dataclass(frozen=True)
class _TileConfig:
    block_q: int  # query tokens per tile
    block_m: int  # tile rows: block_q * group, padded to a power of two >= 16
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


def _tile_config(num_tokens: int, num_seqs: int, group: int, head_dim: int, itemsize: int = 2,
                 kv_itemsize: int | None = None) -> _TileConfig:
    block_n = 64 if head_dim <= 128 else 32
    if num_tokens <= num_seqs:
        # Decode-shaped batch (one query per sequence): one token per tile, so
        # a tile's rows are just the G heads of a group. An FP8 cache's tiles take
        # twice the keys for the same bytes (H200, 256 x 1k: 247 us against 256 at 64).
        if kv_itemsize == 1 and head_dim <= 128:
            block_n = 128
        return _TileConfig(1, max(16, next_pow2(group)), block_n, num_warps=4, num_stages=3)
    if itemsize <= 2 and head_dim <= 128:
        # Prefill or mixed, 16-bit: ~128 rows x 128 keys, 8 warps. On an H200 (bf16, D=128,
        # G=4) with the K rows and last-first tiles: 4k causal 448 -> 441 us, a 2k chunk
        # over a 4k prefix 553 -> 540, over 16k 1993 -> 1858 (against ~64 rows x 64 keys).
        block_q = max(1, 128 // group)
        return _TileConfig(block_q, max(16, next_pow2(block_q * group)), 128, num_warps=8, num_stages=2)
    # float32 or wide heads: ~64 rows (the tiles above would not fit in shared memory).
    block_q = max(1, 64 // group)
    return _TileConfig(block_q, max(16, next_pow2(block_q * group)), block_n, num_warps=4, num_stages=2)


# Measured on an H200 under CUDA graphs (bf16, 32 q / 8 kv heads, D=128;
# `pdserve bench kernels --splits ...`, docs/benchmarks.md): the best split
# count fills about 4 programs per SM in one wave and never overflows it
# (8 x 32k: 8 splits 267 us, 9 splits 346 us); one sequence of 32k wants 64
# (41 us; 16 splits: 79 us); 32 x 4k-8k wants 2 (35% faster than none).
_MAX_SPLITS = 64
# An FP8 cache (module settings, so that a benchmark can time each against the other):
FP8_DECODE_K_ROWS = True  # decode tiles load K key by key, widen, then transpose
FP8_FP16_DOTS = True  # under bf16 queries the dots run in float16 (FP16_DOTS)
# Prefill steps given new_k / new_v: sequences without a cached prefix through the dense
# kernel (kernels/prefill_attention.py); a caller that passes neither keeps the paged kernel
# (the engine's PDSERVE_DENSE_PREFILL=0) ...
# ... but not inside a CUDA-graph capture (the engine's graphs are decode steps, speculative
# ones with several tokens a sequence among them: they keep what they captured before);
# a benchmark that times the prefill path under do_bench_cudagraph sets this.
DENSE_PREFILL_IN_GRAPHS = False
_PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(device: torch.device, num_programs: int, max_kv_tiles: int) -> int:
    """Split keys only when the grid fills less than half of one wave and contexts can be long."""
    if device.type != "cuda" or max_kv_tiles < 8:
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return split_count(num_programs, max_kv_tiles, _PROGRAMS_PER_SM * sms)


def split_count(num_programs: int, max_kv_tiles: int, wave: int) -> int:
    """As many splits as fit ``wave`` programs (never a partial second wave), each keeping
    at least 4 key tiles, at most _MAX_SPLITS; none when the grid fills half a wave."""
    if 2 * num_programs > wave:
        return 1
    return max(1, min(wave // num_programs, max_kv_tiles // 4, _MAX_SPLITS))


def paged_attention_num_splits(
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    device: torch.device,
    itemsize: int = 2,
    *,
    sliding_window: int | None = None,
) -> int:
    """The split count ``paged_attention`` picks when ``num_splits`` is None,
    from shapes alone (no device access but the SM count): ``max_seq_len`` is
    the longest context the block tables can describe. A CUDA graph captured
    for one batch shape passes this explicitly, so the count (and the size of
    the partial buffers, allocated once in the graph's pool) is fixed for
    every replay whatever the contexts are at run time. With a
    ``sliding_window`` the count follows the keys a tile can see (the window,
    at most one key tile more for its alignment), not the context."""
    check_window(sliding_window)
    cfg = _tile_config(num_tokens, num_seqs, num_q_heads // num_kv_heads, head_dim, itemsize)
    busy_programs = triton.cdiv(num_tokens, cfg.block_q) * num_kv_heads
    return _default_num_splits(device, busy_programs, _max_kv_tiles(cfg, max_seq_len, sliding_window))


def _max_kv_tiles(cfg: _TileConfig, max_seq_len: int, sliding_window: int | None) -> int:
    """Key tiles one query tile visits at most: [kv_start, kv_end) spans the window plus
    the tile's other queries, and may start mid-tile."""
    tiles = triton.cdiv(max_seq_len, cfg.block_n)
    if sliding_window is None:
        return tiles
    return min(tiles, triton.cdiv(sliding_window + cfg.block_q - 1, cfg.block_n) + 1)


def _check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int | None,
    sliding_window: int | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> None:
    where = "paged_attention"
    check_runnable(
        where, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        query_start_loc=query_start_loc, seq_lens=seq_lens,
    )
    check_dim(where, "q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    check_dim(where, "k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_dim(where, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    check_dim(where, "query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    check_dim(where, "seq_lens", seq_lens, 1, "[num_seqs]")
    require(
        v_cache.shape == k_cache.shape,
        where,
        f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}",
    )
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    num_seqs = seq_lens.shape[0]
    require(cache_head_dim == head_dim, where, f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    require(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        where,
        f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    require(
        query_start_loc.shape[0] == num_seqs + 1,
        where,
        f"query_start_loc has {query_start_loc.shape[0]} entries for {num_seqs} sequences (want B + 1)",
    )
    require(
        block_tables.shape[0] == num_seqs,
        where,
        f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    check_dtype(where, "q", q, FLOAT_DTYPES)
    check_kv_cache_dtype(where, "k_cache", k_cache, q.dtype, k_scale, v_scale)
    require(v_cache.dtype == k_cache.dtype, where, f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        check_dtype(where, name, t, (torch.int32,))
    check_inner_contiguous(where, "q", q)
    check_inner_contiguous(where, "k_cache", k_cache)
    check_inner_contiguous(where, "v_cache", v_cache)
    check_inner_contiguous(where, "block_tables", block_tables)
    check_contiguous(where, "query_start_loc", query_start_loc)
    check_contiguous(where, "seq_lens", seq_lens)
    require(num_splits is None or num_splits >= 1, where, f"num_splits must be >= 1, got {num_splits}")
    check_window(sliding_window)
    check_sinks(where, sinks, q)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    step_cache: dict | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged K/V.

    One call serves decode rows and prefill chunks together.

    q: [num_tokens, num_q_heads, head_dim]; sequence b owns rows
        query_start_loc[b]:query_start_loc[b+1]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], any
        strides with stride 1 in head_dim; the new tokens' K/V must already be
        stored (store_kv_cache); q's dtype, or float8_e4m3fn: then
        K = k_cache * k_scale and V = v_cache * v_scale
    block_tables: [B, max_blocks_per_seq] int32 block ids; entries past a
        sequence's cdiv(seq_lens[b], block_size) blocks are never read
    query_start_loc: [B + 1] int32, non-decreasing, query_start_loc[0] = 0
    seq_lens: [B] int32, each sequence's length including its new tokens
    scale: softmax scale, usually head_dim ** -0.5
    num_splits: key-range splits per tile (flash decoding); None picks from
        the shapes (and the window), 1 disables
    step_cache: unused here (the CPU reference keeps per-step work in it)
    sliding_window: None (full causal attention) or W >= 1: each query sees
        only the last W keys up to itself (Hugging Face's sliding window)
    k_scale, v_scale: an FP8 cache's per-tensor scales (1.0 for any other cache)
    new_k, new_v: optional, [num_tokens, num_kv_heads, head_dim]: this step's K/V
        as stored into the cache (the QKV projection's, stride 1 in head_dim).
        Given, a prefill-shaped step (more tokens than sequences, one split, no
        window, a 16-bit cache) runs the sequences with no cached prefix through
        ``kernels.prefill_attention`` (dense, TMA loads) and the rest through
        this kernel; same results up to float rounding. Otherwise ignored.
    sinks: None, or float32 [num_q_heads] on q's device: attention sinks (gpt-oss),
        one logit per query head in each row's softmax denominator and nowhere else:
        out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink_h - m)), m the
        larger of the row's top score and sink_h (once per row, split or not)

    Query i of sequence b is at position p = seq_lens[b] - q_len_b + i and sees
    keys 0..p, or max(0, p - W + 1)..p with a window; keys before the windows
    of all of a sequence's queries are never read (their pages may hold
    anything). Query head h reads kv head h // (num_q_heads //
    num_kv_heads). Returns [num_tokens, num_q_heads, head_dim] in q's dtype,
    accumulated in float32; rows past query_start_loc[B] are left
    unspecified. Modifies nothing.
    """
    _check_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, num_splits, sliding_window,
                k_scale, v_scale, sinks)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    cfg = _tile_config(num_tokens, num_seqs, group, head_dim, q.element_size(), k_cache.element_size())
    num_tiles = num_tokens // cfg.block_q + num_seqs
    require(num_tiles <= _MAX_GRID_Y, "paged_attention",
            f"{num_tokens} tokens of {num_seqs} sequences make {num_tiles} tiles, more than one launch takes "
            f"({_MAX_GRID_Y}); split the batch")
    if num_splits is None:
        num_splits = paged_attention_num_splits(num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim,
                                                block_tables.shape[1] * block_size, q.device, q.element_size(),
                                                sliding_window=sliding_window)

    # Sequences with no cached prefix to the dense kernel, the others (decode rows among them)
    # to this one: see kernels/prefill_attention.py. Decode-shaped batches (the CUDA-graph
    # decode steps) and split tiles (whose combine writes every row) never take it, nor does a
    # CUDA-graph capture (speculative decode's multi-token graphs stay as they were).
    skip_fresh = False
    if new_k is not None and new_v is not None and num_splits == 1 and scale > 0 \
            and num_tokens > num_seqs and sliding_window is None and k_cache.dtype == q.dtype \
            and (DENSE_PREFILL_IN_GRAPHS or not (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        require(tuple(new_k.shape) == (num_tokens, num_kv_heads, head_dim) and new_v.shape == new_k.shape,
                "paged_attention", f"new_k {tuple(new_k.shape)} / new_v {tuple(new_v.shape)} != "
                f"{(num_tokens, num_kv_heads, head_dim)}")
        if prefill_attention.supports(q, new_k, new_v):
            prefill_attention.prefill_self_attention(q, new_k, new_v, query_start_loc, seq_lens, scale,
                                                     out=out, only_fresh=True, sinks=sinks)
            skip_fresh = True

    if num_splits == 1:
        partial, m, l = out, out, out  # m and l are unused by this variant
    else:
        partial = torch.empty((num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        m = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)

    sinks_arg = q if sinks is None else sinks  # (a pointer the kernel never reads without SINK)
    _paged_attention_kernel[(num_kv_heads, num_tiles, num_splits)](
        partial, m, l, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, sinks_arg,
        # (a window past any context means the same, clamped: the int32 argument warm_up compiled)
        scale * k_scale * _LOG2E, float(v_scale), num_seqs, num_tokens, num_splits, min(sliding_window or 0, 1 << 30),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        SPLIT=num_splits > 1,
        WINDOW=sliding_window is not None,
        # float32 models get exact float32 products, not TF32's 10-bit mantissa.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        # Decode tiles of an FP8 cache too: K loaded key by key and widened before the transpose
        # (an H200, batch 256 x 1k: 9.67 ms of attention a step against 10.11 gathered [dims, keys])
        K_ROWS=cfg.block_q > 1 or (k_cache.dtype == FP8_KV_DTYPE and FP8_DECODE_K_ROWS),
        FP16_DOTS=k_cache.dtype == FP8_KV_DTYPE and q.dtype == torch.bfloat16 and FP8_FP16_DOTS,
        SKIP_FRESH=skip_fresh,
        SINK=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _combine_kernel[(num_tokens, num_q_heads)](
            out, partial, m, l, sinks_arg, num_tokens, num_splits,
            out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            BLOCK_S=next_pow2(num_splits),
            BLOCK_D=next_pow2(head_dim),
            SINK=sinks is not None,
        )
    return out


def warm_up(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
            device: torch.device, *, sliding_window: int | None = None, kv_dtype: torch.dtype | None = None,
            sinks: bool = False) -> None:
    """Compile every variant ``paged_attention`` may pick for these shapes and this
    ``sliding_window`` (None: full attention; any window size compiles the variants of
    all sizes): decode- and prefill-shaped tiles, each whole and split, and the combine
    for every power-of-two split width up to _MAX_SPLITS (tiny launches; their results
    are thrown away). A model with windowed and full layers calls it for each kind.
    ``kv_dtype``: the cache's dtype when it is not ``dtype`` (float8_e4m3fn). ``sinks``:
    the variants of layers with attention sinks (instead of those without)."""
    check_window(sliding_window)
    cache = torch.zeros(1, block_size, num_kv_heads, head_dim, dtype=kv_dtype or dtype, device=device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    sink = dict(sinks=torch.zeros(num_q_heads, dtype=torch.float32, device=device)) if sinks else {}
    for tokens in (1, 2):  # one query per sequence (decode-shaped), more (prefill-shaped)
        q = torch.zeros(tokens, num_q_heads, head_dim, dtype=dtype, device=device)
        starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        lens = torch.tensor([tokens], dtype=torch.int32, device=device)
        splits = 1
        while splits <= _MAX_SPLITS:
            paged_attention(q, cache, cache, tables, starts, lens, 1.0, num_splits=splits,
                            sliding_window=sliding_window, **sink)
            splits *= 2
        if tokens > 1:  # the dense prefill kernel and the paged kernel that skips its rows
            kv = torch.zeros(tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
            paged_attention(q, cache, cache, tables, starts, lens, 1.0, num_splits=1,
                            sliding_window=sliding_window, new_k=kv, new_v=kv, **sink)
