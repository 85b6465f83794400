"""Fused mixture-of-experts MLP: align, two grouped GEMMs, a sum over the slots.

Each token t picks K experts (topk_ids[t, :]); the T*K (token, slot) pairs are
numbered p = t * K + k. Three steps, all on the device and without a host sync
(the whole launcher can be captured in a CUDA graph):

1. Align. The pairs are sorted by expert and each expert's run is padded to a
   multiple of BLOCK_M, so a tile of BLOCK_M sorted rows belongs to one
   expert::

       sorted_ids:   [max_blocks * BLOCK_M] int32, pair ids; padding = T*K (the sentinel)
       block_expert: [max_blocks] int32, the expert of each tile; -1 past the last tile

   Expert e's rows start at the sum of the padded counts of experts < e, and
   within an expert the pairs keep ascending p. The bound on the number of
   tiles, sum_e cdiv(n_e, BLOCK_M) <= min(E, T*K) + T*K // BLOCK_M, depends on
   shapes alone, so the buffers and grids are sized without reading the counts.
   One program does it all when the pairs fit one chunk (decode); otherwise a
   histogram per chunk (_count_kernel), a scan over chunks per expert
   (_scan_kernel), and one program per chunk places its pairs (_place_kernel).
   Ids outside [0, E) are left out (they contribute nothing, as HF's
   sentinel expert E).

2. Grouped GEMM 1 (_expert_gemm_kernel, GATED): a program takes one tile of
   sorted rows and BLOCK_N intermediate columns, gathers the tile's x rows
   (token = p // K), multiplies by the expert's gate rows and up rows in two
   float32 accumulators and writes act(gate) * up to ``inter[p]``, [T*K, I].

   With biases (gpt-oss) b13[e] is added to the two float32 sums first; the
   activation "swigluoai" (gpt-oss's clamped SwiGLU) gates them as
   (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

3. Grouped GEMM 2 (the same kernel, not GATED): inter rows times w2[e]^T, plus
   b2[e] with biases, the routing weight topk_weights[t, k] multiplied in the float32 epilogue,
   written to ``y[p]``, [T*K, H]; then _sum_slots_kernel adds each token's K
   rows in slot order in float32: deterministic, no atomics.

Padding rows (p = T*K) are masked out of every load and store. Tiles are
ordered in groups of GROUP_M along M (as in Triton's matmul tutorial) so
consecutive programs share weight tiles in L2.

FP8 (W8A8: float8_e4m3fn w13 and w2 with float32 scales). Both GEMMs read e4m3
codes and run fp8 x fp8 dots into float32 (tensor cores on sm_89+); x is
quantized per token by ``kernels.fp8_gemm.fp8_quantize`` before GEMM 1 and the
intermediate per row (pair) after it, in a second launch: a row's scale needs
the amax over all I columns, which GEMM 1 spreads over several programs::

    x [T, H] ─fp8_quantize─▶ x8 [T, H] e4m3, x_scale [T] or [T, cdiv(H, bk)]
    GEMM 1 on x8 ─▶ inter [T*K, I] in x's dtype ─fp8_quantize─▶ inter8, inter_scale ─GEMM 2─▶ y

Per channel (scales [E, rows]) the float32 sum of a tile row is multiplied
once by x_scale[row] * w_scale[e, n]; with (bn, bk) blocks each k-tile lies in
one k-group (BLOCK_K <= bk) and its partial sum is multiplied by
x_scale[row, kb] * w_scale[e, n // bn, kb] before it joins the accumulator.

MXFP4 (weight-only, gpt-oss's experts: uint8 w13 [E, 2I, H/2] and w2 [E, H, I/2], two
e2m1 codes a byte along the reduced dim, uint8 e8m0 scales per 32 of them; the format is in
kernels/mxfp4_reference.py). The GEMMs read [BLOCK_K/2, BLOCK_N] bytes and [BLOCK_K/32,
BLOCK_N] scales per k-tile (BLOCK_K at least 32: whole scale groups), unpack the nibbles with
a shift and a 32-bit lookup word of e2m1 magnitudes, multiply by the scale built from its
float32 bits (exact), round to x's dtype and run the same dot as 16-bit weights: a decode step
reads 4.25 bits per weight. Tiles are the 16-bit ones of x's dtype.

Tile configs (BLOCK_M, and per GEMM BLOCK_N, BLOCK_K, GROUP_M, warps,
stages) matter on the GPU: decode-sized batches are bound by reading each hit
expert's weights once, large prefills by the tensor cores. e4m3 tiles take
twice the 16-bit BLOCK_K (``fp8_block_k`` caps it at bk and raises it to 32 on
CUDA, the least K of an fp8 dot). ``tune`` times a small grid per token count;
``engine.moe_configs`` keeps its result on disk and passes it as ``config``.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

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
from kernels.activation import activate
from kernels.fp8_gemm import fp8_quantize
from kernels.fp8_reference import FP8_DTYPE  # W8A8 experts: e4m3 weights, activations quantized per token

MXFP4_DTYPE = torch.uint8  # weight-only MXFP4 experts: two e2m1 codes a byte, uint8 e8m0 scales
MXFP4_BLOCK = 32  # elements per e8m0 scale

logger = logging.getLogger(__name__)

ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha and swiglu_limit (the defaults)
_FP8_MIN_BLOCK_K = 32  # Triton's fp8 dots on NVIDIA GPUs reduce at least 32 columns per tile
# The align step's one-hot tile (pairs of a chunk x experts) stays at or under
# this many elements: one chunk takes min(T*K, _ALIGN_ELEMS / E) pairs.
_ALIGN_ELEMS = 32768
_SUM_BLOCK_H = 1024


# ---- align ------------------------------------------------------------------------------------------


@triton.jit
def _chunk_one_hot(ids_ptr, chunk, num_pairs, num_experts, stride_it, stride_ik,
                   TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    # The chunk's pairs and a [BLOCK_P, BLOCK_E] int32 one-hot of their experts
    # (an all-zero row for padding and for ids outside [0, E)).
    pair = chunk * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    ok = pair < num_pairs
    expert = tl.load(ids_ptr + (pair // TOP_K).to(tl.int64) * stride_it + (pair % TOP_K) * stride_ik,
                     mask=ok, other=-1)
    # Compared in the ids' own dtype: a wild int64 id must not wrap into range.
    expert = tl.where(ok & (expert >= 0) & (expert < num_experts), expert, -1).to(tl.int32)
    cols = tl.arange(0, BLOCK_E)
    return pair, (expert[:, None] == cols[None, :]).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    ids_ptr,  # [T, K] int32/int64
    counts_ptr,  # [num_chunks, BLOCK_E] int32: pairs of each expert in each chunk
    num_pairs, num_experts, stride_it, stride_ik,
    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    _, hot = _chunk_one_hot(ids_ptr, chunk, num_pairs, num_experts, stride_it, stride_ik, TOP_K, BLOCK_P, BLOCK_E)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(hot, axis=0))


@triton.jit(do_not_specialize=["num_chunks"])
def _scan_kernel(
    counts_ptr,  # [num_chunks, BLOCK_E] int32, in place: becomes the exclusive prefix over chunks
    totals_ptr,  # [BLOCK_E] int32: pairs of each expert
    num_chunks,
    BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,  # BLOCK_C >= num_chunks
):
    # One program per expert: an exclusive scan of its column over the chunks.
    expert = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    ptrs = counts_ptr + c * BLOCK_E + expert
    n = tl.load(ptrs, mask=c < num_chunks, other=0)
    tl.store(ptrs, tl.cumsum(n, axis=0) - n, mask=c < num_chunks)
    tl.store(totals_ptr + expert, tl.sum(n, axis=0))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _place_kernel(
    ids_ptr,  # [T, K] int32/int64
    prefix_ptr,  # [num_chunks, BLOCK_E] int32: pairs of each expert in earlier chunks (unused if ONE_CHUNK)
    totals_ptr,  # [BLOCK_E] int32 (unused if ONE_CHUNK)
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 out: pair ids by expert, padded with num_pairs
    block_expert_ptr,  # [max_blocks] int32 out: expert of each tile, -1 past the last
    num_pairs, num_experts, stride_it, stride_ik, num_chunks, max_blocks,
    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr, ONE_CHUNK: tl.constexpr,
):
    # Program c places chunk c's pairs (c < num_chunks) and sets the experts of
    # tiles [c * BLOCK_B, (c + 1) * BLOCK_B); with ONE_CHUNK every program reads
    # chunk 0 for the counts and only program 0 places it.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    if ONE_CHUNK:
        pair, hot = _chunk_one_hot(ids_ptr, 0, num_pairs, num_experts, stride_it, stride_ik, TOP_K, BLOCK_P, BLOCK_E)
        counts = tl.sum(hot, axis=0)  # [BLOCK_E]
        before = tl.zeros([BLOCK_E], dtype=tl.int32)
    else:
        # past the last chunk every pair is masked: hot is all zero
        pair, hot = _chunk_one_hot(ids_ptr, pid, num_pairs, num_experts, stride_it, stride_ik, TOP_K, BLOCK_P,
                                   BLOCK_E)
        # _scan_kernel wrote columns [0, num_experts) only
        counts = tl.load(totals_ptr + cols, mask=cols < num_experts, other=0)
        before = tl.load(prefix_ptr + pid * BLOCK_E + cols, mask=(cols < num_experts) & (pid < num_chunks), other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M  # [BLOCK_E]
    start = tl.cumsum(padded, axis=0) - padded  # [BLOCK_E] each expert's first sorted row
    end = start + padded

    if pid < num_chunks:
        # A pair's row: its expert's start + pairs of that expert in earlier chunks
        # + pairs of that expert earlier in this chunk (exclusive scan of the one-hot).
        rank = tl.cumsum(hot, axis=0) - hot  # [BLOCK_P, BLOCK_E]
        dest = tl.sum(hot * (rank + (start + before)[None, :]), axis=1)  # [BLOCK_P]
        tl.store(sorted_ptr + dest, pair, mask=tl.sum(hot, axis=1) > 0)

    if pid == 0:
        # Padding rows of each expert's last tile point at the sentinel.
        j = tl.arange(0, BLOCK_M)
        pad_row = (start + counts)[:, None] + j[None, :]  # [BLOCK_E, BLOCK_M]
        tl.store(sorted_ptr + pad_row, tl.zeros([BLOCK_E, BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=j[None, :] < (padded - counts)[:, None])

    # Tile b belongs to the expert whose rows [start, end) hold b * BLOCK_M: the
    # number of experts ending at or before it (empty experts included).
    b = pid * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
    row = b * BLOCK_M
    owner = tl.sum(((end[None, :] <= row[:, None]) & (cols[None, :] < num_experts)).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + b, tl.where(row < tl.sum(padded, axis=0), owner, -1), mask=b < max_blocks)


# ---- grouped GEMMs --------------------------------------------------------------------------------------


@triton.jit
def _gated(g, up, alpha, limit, ACTIVATION: tl.constexpr):
    # g, up: float32. silu and gelu_tanh as kernels.activation's, times up in float32.
    # swigluoai (gpt-oss): g = min(g, limit), up = clamp(up, -limit, limit), (up + 1) g sigmoid(alpha g).
    if ACTIVATION != "swigluoai":
        return activate(g, ACTIVATION) * up
    else:
        g = tl.minimum(g, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))


@triton.jit
def _mxfp4_tile(packed, scales, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # packed [BLOCK_K / 2, BLOCK_N] uint8 (byte j: element 2j in the low nibble, 2j + 1 in the high),
    # scales [BLOCK_K / 32, BLOCK_N] uint8 e8m0 -> the weights [BLOCK_K, BLOCK_N] in float32, exactly.
    shifts = tl.arange(0, 2) * 4
    codes = (packed.to(tl.int32)[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 2, 2, BLOCK_N]
    codes = tl.reshape(codes, (BLOCK_K // 32, 32, BLOCK_N))
    # e2m1 magnitudes in halves (0, 1, 2, 3, 4, 6, 8, 12): nibble 7 - m of the word 0x0123468C
    halves = (0x0123468C >> ((7 - (codes & 7)) * 4)) & 0xF
    values = tl.where(codes >= 8, -halves, halves).to(tl.float32)
    # half the e8m0 factor, 2^(s - 128), built as float32 bits: normal for s >= 2, 2^-127 and 2^-128
    # subnormal, NaN for s = 255
    s = scales.to(tl.int32)
    bits = tl.where(s >= 2, (s - 1) << 23, (1 << 21) << tl.minimum(s, 1))
    bits = tl.where(s == 255, 0x7FC00000, bits)
    half_factor = bits.to(tl.float32, bitcast=True)  # [BLOCK_K / 32, BLOCK_N]
    return tl.reshape(values * half_factor[:, None, :], (BLOCK_K, BLOCK_N))


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _expert_gemm_kernel(
    a_ptr,  # GATED: x [T, KDIM]; else inter [T*K, KDIM] (FP8: their e4m3 codes)
    w_ptr,  # GATED: w13 [E, 2*N, KDIM]; else w2 [E, N, KDIM]
    out_ptr,  # GATED: inter [T*K, N]; else y [T*K, N]
    sorted_ptr,  # [num_m_blocks * BLOCK_M] int32 pair ids, num_pairs = padding
    block_expert_ptr,  # [num_m_blocks] int32, -1 = no tile
    topk_weights_ptr,  # [T, K] float32 (not GATED only)
    bias_ptr,  # HAS_BIAS: GATED b13 [E, 2*N] (gate, then up); else b2 [E, N]
    a_scale_ptr,  # FP8 float32: [rows of a] (GROUP_K == 0) or [rows of a, cdiv(KDIM, GROUP_K)]
    w_scale_ptr,  # FP8 float32: [E, rows of w] (group_n == 1) or [E, cdiv(rows of w, group_n), cdiv(KDIM, GROUP_K)];
    # MXFP4 uint8 [E, rows of w, KDIM / 32]
    num_pairs, num_m_blocks, N,
    group_n,  # FP8: weight rows per scale row (1 per channel)
    swiglu_alpha, swiglu_limit,  # ACTIVATION "swigluoai" only
    stride_am, stride_we, stride_wn, stride_om, stride_rt, stride_rk,
    stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_be,
    KDIM: tl.constexpr,  # the reduced dim (H for GEMM 1, I for GEMM 2): fixed per model
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,  # GEMM 1: A rows are tokens, gate and up accumulators, activation epilogue
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # a and w are e4m3: fp8 dots, scales applied in float32
    GROUP_K: tl.constexpr,  # FP8 block scales: k-groups of GROUP_K columns, a multiple of BLOCK_K; 0 = per channel
    HAS_BIAS: tl.constexpr,  # add the expert's bias in float32 before the activation (GATED) / routing weight
    MXFP4: tl.constexpr,  # w: uint8 [E, rows, KDIM / 2] e2m1 pairs, w_scale: uint8 e8m0 [E, rows, KDIM / 32]
):
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    # Groups of GROUP_M tiles along M walk N together (L2 reuse of weight and A tiles).
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pair < num_pairs
    if GATED:
        a_row = (pair // TOP_K).to(tl.int64)  # the token
    else:
        a_row = pair.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + k[None, :]  # [BLOCK_M, BLOCK_K]
    # int64: expert * stride_we passes 2^31 for large models.
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + n.to(tl.int64)[None, :] * stride_wn + k[:, None]
    # w_ptrs: [BLOCK_K, BLOCK_N], the expert's rows n read along K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP8:
        # The scale rows of weight rows n (and, GATED, of the up rows N + n).
        ws_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse + (n // group_n) * stride_wsn  # [BLOCK_N]
        if GATED:
            ws_up_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse + ((N + n) // group_n) * stride_wsn
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn  # up rows follow the N gate rows
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4:
        # Weight-only MXFP4: packed bytes [BLOCK_K / 2, BLOCK_N] and e8m0 scales [BLOCK_K / 32, BLOCK_N]
        # of rows n, dequantized in registers and rounded to a's dtype before each dot.
        kh = tl.arange(0, BLOCK_K // 2)
        kg = tl.arange(0, BLOCK_K // 32)
        row64 = n.to(tl.int64)[None, :]
        q_ptrs = w_ptr + expert.to(tl.int64) * stride_we + row64 * stride_wn + kh[:, None]
        s_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse + row64 * stride_wsn + kg[:, None] * stride_wsk
        for k0 in range(0, KDIM, BLOCK_K):
            if KDIM % BLOCK_K == 0:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                q_ok = n_ok[None, :]
                s_ok = n_ok[None, :]
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (k < KDIM - k0)[None, :], other=0.0)
                q_ok = (kh < (KDIM - k0) // 2)[:, None] & n_ok[None, :]
                s_ok = (kg < (KDIM - k0) // 32)[:, None] & n_ok[None, :]
            w = _mxfp4_tile(tl.load(q_ptrs, mask=q_ok, other=0), tl.load(s_ptrs, mask=s_ok, other=0),
                            BLOCK_K, BLOCK_N)
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
            if GATED:  # up rows follow the N gate rows
                wu = _mxfp4_tile(tl.load(q_ptrs + N * stride_wn, mask=q_ok, other=0),
                                 tl.load(s_ptrs + N * stride_wsn, mask=s_ok, other=0), BLOCK_K, BLOCK_N)
                acc_up = tl.dot(a, wu.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            q_ptrs += BLOCK_K // 2
            s_ptrs += (BLOCK_K // 32) * stride_wsk
    else:
        for k0 in range(0, KDIM, BLOCK_K):
            if KDIM % BLOCK_K == 0:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = k < KDIM - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8 and GROUP_K > 0:
                # The tile lies in k-group kb: its partial sum times x_scale[row, kb] * w_scale[e, n // bn, kb].
                kb = k0 // GROUP_K
                a_s = tl.load(a_scale_ptr + a_row * stride_asm + kb * stride_ask, mask=row_ok, other=0.0)  # [BLOCK_M]
                w_s = tl.load(ws_ptrs + kb * stride_wsk, mask=n_ok, other=0.0)  # [BLOCK_N]
                acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
            else:
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            if GATED:
                if KDIM % BLOCK_K == 0:
                    wu = tl.load(up_ptrs, mask=n_ok[None, :], other=0.0)
                else:
                    wu = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if FP8 and GROUP_K > 0:
                    wu_s = tl.load(ws_up_ptrs + kb * stride_wsk, mask=n_ok, other=0.0)
                    acc_up += tl.dot(a, wu) * (a_s[:, None] * wu_s[None, :])
                else:
                    acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PRECISION)
                up_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

    if FP8 and GROUP_K == 0:
        # Per channel: one scale per A row and per weight row, applied once to the whole sum.
        a_s = tl.load(a_scale_ptr + a_row * stride_asm, mask=row_ok, other=0.0)[:, None]  # [BLOCK_M, 1]
        acc = acc * (a_s * tl.load(ws_ptrs, mask=n_ok, other=0.0)[None, :])
        if GATED:
            acc_up = acc_up * (a_s * tl.load(ws_up_ptrs, mask=n_ok, other=0.0)[None, :])
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + n  # [BLOCK_N]
        acc += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptrs + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = _gated(acc, acc_up, swiglu_alpha, swiglu_limit, ACTIVATION)
    else:
        token = pair // TOP_K
        weight = tl.load(topk_weights_ptr + token.to(tl.int64) * stride_rt + (pair % TOP_K) * stride_rk,
                         mask=row_ok, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_experts"])
def _pair_gemv_kernel(
    a_ptr,  # GATED: x [T, KDIM]; else inter [T*K, KDIM]
    w_ptr,  # GATED: w13 [E, 2*N, KDIM]; else w2 [E, N, KDIM] (MXFP4: uint8, KDIM / 2 bytes a row)
    out_ptr,  # [T*K, N]
    ids_ptr,  # [T, K] expert ids; ids outside [0, E) are skipped
    topk_weights_ptr,  # [T, K] float32 (not GATED only)
    bias_ptr,  # HAS_BIAS: GATED b13 [E, 2*N]; else b2 [E, N]
    w_scale_ptr,  # MXFP4: uint8 e8m0 [E, rows of w, KDIM / 32]
    num_experts, N, swiglu_alpha, swiglu_limit,
    stride_am, stride_we, stride_wn, stride_om, stride_it, stride_ik, stride_rt, stride_rk,
    stride_wse, stride_wsn, stride_wsk, stride_be,
    KDIM: tl.constexpr, TOP_K: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr,
):
    # One (token, slot) pair and BLOCK_N output columns: the expert's rows n times one A row, reduced
    # along K in float32 registers without a dot (a dot pads the one row to 16). The same products as
    # _expert_gemm_kernel: weights rounded to a's dtype, each product exact in float32.
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + token * stride_it + (pair % TOP_K) * stride_ik).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return
    if GATED:
        a_row = token.to(tl.int64)
    else:
        a_row = pair.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row * stride_am + k  # [BLOCK_K]
    row64 = n.to(tl.int64)[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    if MXFP4:
        kh = tl.arange(0, BLOCK_K // 2)
        kg = tl.arange(0, BLOCK_K // 32)
        q_ptrs = w_ptr + expert * stride_we + row64 * stride_wn + kh[:, None]  # [BLOCK_K / 2, BLOCK_N]
        s_ptrs = w_scale_ptr + expert * stride_wse + row64 * stride_wsn + kg[:, None] * stride_wsk
        for k0 in range(0, KDIM, BLOCK_K):
            if KDIM % BLOCK_K == 0:
                a = tl.load(a_ptrs)
                q_ok = n_ok[None, :]
                s_ok = n_ok[None, :]
            else:
                a = tl.load(a_ptrs, mask=k < KDIM - k0, other=0.0)
                q_ok = (kh < (KDIM - k0) // 2)[:, None] & n_ok[None, :]
                s_ok = (kg < (KDIM - k0) // 32)[:, None] & n_ok[None, :]
            af = a.to(tl.float32)[:, None]
            w = _mxfp4_tile(tl.load(q_ptrs, mask=q_ok, other=0), tl.load(s_ptrs, mask=s_ok, other=0),
                            BLOCK_K, BLOCK_N)
            acc += tl.sum(af * w.to(a.dtype).to(tl.float32), axis=0)
            if GATED:  # up rows follow the N gate rows
                wu = _mxfp4_tile(tl.load(q_ptrs + N * stride_wn, mask=q_ok, other=0),
                                 tl.load(s_ptrs + N * stride_wsn, mask=s_ok, other=0), BLOCK_K, BLOCK_N)
                acc_up += tl.sum(af * wu.to(a.dtype).to(tl.float32), axis=0)
            a_ptrs += BLOCK_K
            q_ptrs += BLOCK_K // 2
            s_ptrs += (BLOCK_K // 32) * stride_wsk
    else:
        w_ptrs = w_ptr + expert * stride_we + row64 * stride_wn + k[:, None]  # [BLOCK_K, BLOCK_N]
        for k0 in range(0, KDIM, BLOCK_K):
            if KDIM % BLOCK_K == 0:
                a = tl.load(a_ptrs)
                w_ok = n_ok[None, :]
            else:
                a = tl.load(a_ptrs, mask=k < KDIM - k0, other=0.0)
                w_ok = (k < KDIM - k0)[:, None] & n_ok[None, :]
            af = a.to(tl.float32)[:, None]
            acc += tl.sum(af * tl.load(w_ptrs, mask=w_ok, other=0.0).to(tl.float32), axis=0)
            if GATED:
                wu = tl.load(w_ptrs + N * stride_wn, mask=w_ok, other=0.0)
                acc_up += tl.sum(af * wu.to(tl.float32), axis=0)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + n
        acc += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)
        if GATED:
            acc_up += tl.load(b_ptrs + N, mask=n_ok, other=0.0).to(tl.float32)
    if GATED:
        acc = _gated(acc, acc_up, swiglu_alpha, swiglu_limit, ACTIVATION)
    else:
        acc = acc * tl.load(topk_weights_ptr + token * stride_rt + (pair % TOP_K) * stride_rk)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_slots_kernel(
    y_ptr,  # [T*K, H]
    ids_ptr,  # [T, K]
    out_ptr,  # [T, H]
    hidden, num_experts, stride_it, stride_ik, stride_ot,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # out[t] = sum over slots k = 0..K-1, in that order, of y[t*K + k], in float32.
    # Slots with an id outside [0, E) were never written and are skipped.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + token * stride_it + k * stride_ik)
        used = (expert >= 0) & (expert < num_experts)
        y = tl.load(y_ptr + (token * TOP_K + k) * hidden + cols, mask=col_ok & used, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# ---- configs ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def as_dict(self) -> dict:
        return {"block_n": self.block_n, "block_k": self.block_k, "group_m": self.group_m,
                "num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class MoeTiles:
    """One token count's tiles: the align step's BLOCK_M (shared by both GEMMs) and each GEMM's own."""
    block_m: int
    gemm1: GemmTiles
    gemm2: GemmTiles

    def as_dict(self) -> dict:
        return {"block_m": self.block_m, "gemm1": self.gemm1.as_dict(), "gemm2": self.gemm2.as_dict()}

    @staticmethod
    def from_dict(d: dict) -> MoeTiles:
        """Raises ValueError (naming ``config``) on anything that is not a valid entry."""
        where = "fused_moe"
        require(isinstance(d, dict) and {"block_m", "gemm1", "gemm2"} <= set(d), where,
                f"config entries need block_m, gemm1 and gemm2, got {d!r}")
        gemms = []
        for name in ("gemm1", "gemm2"):
            g = d[name]
            keys = ("block_n", "block_k", "group_m", "num_warps", "num_stages")
            require(isinstance(g, dict) and all(isinstance(g.get(key), int) for key in keys), where,
                    f"config {name} needs integer {', '.join(keys)}, got {g!r}")
            gemms.append(GemmTiles(*(g[key] for key in keys)))
        tiles = MoeTiles(d["block_m"], *gemms)
        for value in (tiles.block_m, tiles.gemm1.block_n, tiles.gemm1.block_k, tiles.gemm2.block_n,
                      tiles.gemm2.block_k):
            require(isinstance(value, int) and value >= 16 and value & (value - 1) == 0, where,
                    f"config block sizes must be powers of two >= 16, got {d!r}")
        for g in gemms:
            require(g.group_m >= 1 and g.num_warps in (1, 2, 4, 8, 16) and g.num_stages >= 1, where,
                    f"config has a bad group_m, num_warps or num_stages: {d!r}")
        return tiles


@dataclass(frozen=True)
class GemvTiles:
    """The pair GEMV's tiles (a few tokens): BLOCK_N output columns of one pair a program, BLOCK_K a step."""
    block_n: int
    block_k: int
    num_warps: int


# The pair GEMV serves at most this many tokens (each pair reads its expert's rows on its own: a few
# tokens sharing an expert read them again) for MXFP4 and 16-bit experts; 0: the grouped GEMMs serve
# every count. 1: on an H100 one MoE layer's GEMMs alone favour it up to 4 tokens (1.4x at 1, 1.02-1.13x
# at 4: `python -m bench.moe_small_batch`), but the gpt-oss-20b decode step with it up to 4 tokens took
# 6.43 / 10.58 ms at batch 2 / 4 against 5.72 / 6.21 without (its random router sends the batch's
# tokens to the same experts, which the pair GEMV then reads once a pair); at 1 token 4.5 against
# 5.6 ms (docs/benchmarks.md).
PAIR_GEMV_MAX_TOKENS = 1


def gemv_tiles(num_tokens: int, w: torch.Tensor, x: torch.Tensor) -> GemvTiles | None:
    """The pair GEMV's tiles for ``num_tokens`` tokens of x times experts ``w`` (w13), or None when the
    grouped GEMMs serve them (more tokens, e4m3 weights)."""
    if num_tokens > PAIR_GEMV_MAX_TOKENS or w.dtype == FP8_DTYPE:
        return None
    if x.dtype == torch.float32:  # the exact float32 path: smaller register tiles
        return GemvTiles(16, 64, 4)
    return GemvTiles(16, 256, 4)


def default_tiles(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> MoeTiles:
    """Tiles from shapes alone, used when no tuned config is given. ``dtype`` is the
    weights' dtype: e4m3 weights take twice the 16-bit BLOCK_K (the same bytes per tile)."""
    rows = num_tokens * top_k / max(1, min(num_experts, num_tokens * top_k))  # pairs per hit expert
    if dtype == torch.float32:  # exact fp32 dots: small tiles (shared memory, registers)
        tiles = GemmTiles(32, 32, 8, 4, 2)
        return MoeTiles(16 if rows <= 16 else 32, tiles, tiles)
    k = 2 if dtype == FP8_DTYPE else 1
    if rows <= 16:  # decode: read each hit expert's weights once, many programs in flight
        return MoeTiles(16, GemmTiles(64, 128 * k, 1, 4, 4), GemmTiles(64, 128 * k, 1, 4, 4))
    if rows <= 64:
        return MoeTiles(32, GemmTiles(64, 64 * k, 8, 4, 4), GemmTiles(64, 64 * k, 8, 4, 4))
    if rows <= 256:
        return MoeTiles(64, GemmTiles(64, 64 * k, 8, 4, 4), GemmTiles(128, 64 * k, 8, 4, 4))
    return MoeTiles(128, GemmTiles(64, 64 * k, 8, 8, 4), GemmTiles(128, 64 * k, 8, 8, 4))


# Parsed configs by id(config), holding the dict so its id stays its own: the
# launcher runs once per MoE layer per step, and parsing each time costs ~10 us
# of host time. A config is taken as immutable once passed.
_parsed_configs: dict[int, tuple[dict, list[tuple[int, MoeTiles]]]] = {}


def _parse_config(config: dict) -> list[tuple[int, MoeTiles]]:
    hit = _parsed_configs.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    require(isinstance(config, dict) and len(config) > 0, "fused_moe",
            "config must be None or a non-empty dict {token count: tiles}")
    try:
        counts = sorted((int(c), c) for c in config)
    except (TypeError, ValueError):
        raise ValueError(f"fused_moe: config keys must be token counts, got {sorted(map(str, config))}") from None
    parsed = [(n, MoeTiles.from_dict(config[c])) for n, c in counts]
    if len(_parsed_configs) >= 64:
        _parsed_configs.clear()
    _parsed_configs[id(config)] = (config, parsed)
    return parsed


def pick_tiles(config: dict | None, num_tokens: int, num_experts: int, top_k: int,
               dtype: torch.dtype) -> MoeTiles:
    """The tiles ``fused_moe`` runs T tokens with: the config's entry for the
    smallest count >= T (else the largest), or ``default_tiles`` without a config.
    ``dtype`` is the weights' (w13's) dtype."""
    if config is None:
        return default_tiles(num_tokens, num_experts, top_k, dtype)
    parsed = _parse_config(config)
    return next((tiles for n, tiles in parsed if n >= num_tokens), parsed[-1][1])


# ---- launcher ---------------------------------------------------------------------------------------------


def _check_args(x, w13, w2, topk_weights, topk_ids, activation) -> None:
    where = "fused_moe"
    check_runnable(where, x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    check_dim(where, "x", x, 2, "[num_tokens, hidden]")
    check_dim(where, "w13", w13, 3, "[num_experts, 2 * intermediate, hidden]")
    check_dim(where, "w2", w2, 3, "[num_experts, hidden, intermediate]")
    check_dim(where, "topk_weights", topk_weights, 2, "[num_tokens, top_k]")
    check_dim(where, "topk_ids", topk_ids, 2, "[num_tokens, top_k]")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    require(num_experts > 0, where, "w13 has no experts")
    require(two_inter > 0 and two_inter % 2 == 0, where, f"w13's dim 1 must be 2 * intermediate, got {two_inter}")
    if w13.dtype == MXFP4_DTYPE or w2.dtype == MXFP4_DTYPE:  # two e2m1 codes a byte along the reduced dim
        for name, t in (("w13", w13), ("w2", w2)):
            require(t.dtype == MXFP4_DTYPE, where, f"{name} dtype {t.dtype}: w13 and w2 are both {MXFP4_DTYPE} "
                    "(MXFP4) or neither")
        require(hidden % MXFP4_BLOCK == 0 and (two_inter // 2) % MXFP4_BLOCK == 0, where,
                f"MXFP4 experts need x hidden ({hidden}) and w13's intermediate ({two_inter // 2}) to be multiples "
                f"of {MXFP4_BLOCK}")
        require(w13.shape[2] * 2 == hidden, where, f"MXFP4 w13 must be [E, 2I, hidden / 2] for x hidden {hidden}, "
                f"got {tuple(w13.shape)}")
        want = (num_experts, hidden, two_inter // 4)
        require(tuple(w2.shape) == want, where, f"MXFP4 w2 must be [num_experts, hidden, intermediate / 2] = {want}, "
                f"got {tuple(w2.shape)}")
    else:
        require(w13.shape[2] == hidden, where, f"w13 hidden {w13.shape[2]} != x hidden {hidden}")
        want = (num_experts, hidden, two_inter // 2)
        require(tuple(w2.shape) == want, where, f"w2 must be [num_experts, hidden, intermediate] = {want}, "
                f"got {tuple(w2.shape)}")
    require(topk_ids.shape[0] == num_tokens and topk_ids.shape[1] > 0, where,
            f"topk_ids must be [num_tokens={num_tokens}, top_k >= 1], got {tuple(topk_ids.shape)}")
    require(topk_weights.shape == topk_ids.shape, where,
            f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}")
    check_dtype(where, "x", x, FLOAT_DTYPES)
    if w13.dtype == FP8_DTYPE or w2.dtype == FP8_DTYPE:
        for name, t in (("w13", w13), ("w2", w2)):
            require(t.dtype == FP8_DTYPE, where, f"{name} dtype {t.dtype}: w13 and w2 are both {FP8_DTYPE} or neither")
    elif w13.dtype != MXFP4_DTYPE:
        for name, t in (("w13", w13), ("w2", w2)):
            require(t.dtype == x.dtype, where, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
    check_dtype(where, "topk_weights", topk_weights, (torch.float32,))
    check_dtype(where, "topk_ids", topk_ids, (torch.int32, torch.int64))
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        check_inner_contiguous(where, name, t)
    require(activation in ACTIVATIONS, where, f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")


def _check_biases(x, w13, w2, w13_bias, w2_bias, swiglu_alpha, swiglu_limit) -> None:
    where = "fused_moe"
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], w2.shape[1]
    for name, t, want in (("w13_bias", w13_bias, (num_experts, two_inter)),
                          ("w2_bias", w2_bias, (num_experts, hidden))):
        if t is None:
            continue
        require(isinstance(t, torch.Tensor), where, f"{name} must be a tensor or None")
        require(t.device == x.device, where, f"{name} is on {t.device}, x on {x.device}")
        require(t.dtype == x.dtype, where, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
        require(tuple(t.shape) == want, where, f"{name} must be {list(want)}, got {list(t.shape)}")
        check_inner_contiguous(where, name, t)
    for name, v in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
        require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), where,
                f"{name} must be a finite number, got {v!r}")


def _check_mxfp4_args(x, w13, w2, w13_scale, w2_scale, block_size) -> None:
    """The e8m0 scales of MXFP4 weights: uint8 [E, 2I, H / 32] and [E, H, I / 32], stride 1 in the last dim."""
    where = "fused_moe"
    require(block_size is None, where, f"block_size is for {FP8_DTYPE} weights, not MXFP4 ({MXFP4_DTYPE})")
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], x.shape[1]
    for name, t, want in (("w13_scale", w13_scale, (num_experts, two_inter, hidden // MXFP4_BLOCK)),
                          ("w2_scale", w2_scale, (num_experts, hidden, two_inter // 2 // MXFP4_BLOCK))):
        require(isinstance(t, torch.Tensor), where, f"{name} (uint8 e8m0) is required for MXFP4 weights")
        require(t.device == x.device, where, f"{name} is on {t.device}, x on {x.device}")
        check_dtype(where, name, t, (torch.uint8,))
        require(tuple(t.shape) == want, where, f"{name} must be {list(want)} for MXFP4 weights, got {list(t.shape)}")
        check_inner_contiguous(where, name, t)


def fp8_scale_shapes(w13: torch.Tensor, w2: torch.Tensor, block_size: tuple[int, int] | None
                     ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes w13_scale and w2_scale must have for these weights: per channel
    [E, 2I] and [E, H]; with (bn, bk) blocks [E, cdiv(2I, bn), cdiv(H, bk)] and
    [E, cdiv(H, bn), cdiv(I, bk)]."""
    num_experts, two_inter, hidden = w13.shape
    if block_size is None:
        return (num_experts, two_inter), (num_experts, hidden)
    bn, bk = block_size
    return ((num_experts, triton.cdiv(two_inter, bn), triton.cdiv(hidden, bk)),
            (num_experts, triton.cdiv(hidden, bn), triton.cdiv(two_inter // 2, bk)))


def _check_fp8_args(x, w13, w2, w13_scale, w2_scale, block_size) -> tuple[int, int] | None:
    """Validates the scales and block size of e4m3 weights (and that others have none);
    returns block_size as a tuple of ints."""
    where = "fused_moe"
    if w13.dtype != FP8_DTYPE:
        for name, value in (("w13_scale", w13_scale), ("w2_scale", w2_scale), ("block_size", block_size)):
            require(value is None, where, f"{name} is for {FP8_DTYPE} weights, got {w13.dtype} weights")
        return None
    if block_size is not None:
        ok = (isinstance(block_size, (tuple, list)) and len(block_size) == 2
              and all(isinstance(b, int) and not isinstance(b, bool) for b in block_size))
        require(ok and block_size[0] >= 1 and block_size[1] >= 16 and block_size[1] & (block_size[1] - 1) == 0,
                where, f"block_size must be (bn >= 1, bk a power of two >= 16), got {block_size!r}")
        block_size = (block_size[0], block_size[1])
        # fp8 dots on the GPU take K tiles of at least 32 columns, and a tile lies in one k-group.
        require(x.device.type != "cuda" or block_size[1] >= _FP8_MIN_BLOCK_K, where,
                f"block_size[1] must be >= {_FP8_MIN_BLOCK_K} on CUDA, got {block_size[1]}")
    for name, t, want in zip(("w13_scale", "w2_scale"), (w13_scale, w2_scale), fp8_scale_shapes(w13, w2, block_size)):
        require(isinstance(t, torch.Tensor), where, f"{name} is required for {FP8_DTYPE} weights")
        require(t.device == x.device, where, f"{name} is on {t.device}, x on {x.device}")
        check_dtype(where, name, t, (torch.float32,))
        require(tuple(t.shape) == want, where, f"{name} must be {list(want)} for block_size {block_size}, "
                f"got {list(t.shape)}")
    return block_size


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    config: dict | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    float32_weights: bool = False,
) -> torch.Tensor:
    """Mixture-of-experts MLP over the experts each token picked.

    x: [T, H] float32/float16/bfloat16, any row stride (stride 1 in H)
    w13: [E, 2*I, H] in x's dtype or float8_e4m3fn; rows [:I] gate, rows [I:] up (stride 1 in H);
        or MXFP4, uint8 [E, 2*I, H/2] (below)
    w2: [E, H, I] in w13's dtype (stride 1 in I); MXFP4: uint8 [E, H, I/2]
    topk_weights: [T, K] float32 routing weights, any strides
    topk_ids: [T, K] int32/int64 expert ids, any strides; ids outside [0, E)
        contribute nothing (an expert-parallel rank's foreign experts)
    activation: "silu" (silu(gate) * up), "gelu_tanh" (gelu(gate, approximate="tanh") * up) or
        "swigluoai" (gpt-oss: g = min(gate, swiglu_limit), u = clamp(up, -swiglu_limit, swiglu_limit),
        (u + 1) * g * sigmoid(swiglu_alpha * g); alpha and limit are unused by the others)
    w13_bias: None or [E, 2I] in x's dtype (gate part, then up part), stride 1 in its last dim:
        added to the gate and up sums (float32) before the activation
    w2_bias: None or [E, H] in x's dtype, stride 1 in H: added to each expert's down projection
        before the routing weight multiplies it (gpt-oss: ``(gated @ down + bias) * weight``)
    float32_weights: the reference's choice between the routing weight rounded to x's dtype
        before its product (Mixtral, Qwen) and a float32 product (Gemma 4); this kernel always
        multiplies in its float32 epilogue, so it takes the flag and changes nothing
    config: None (tiles from shapes) or {token count: tiles} as ``tune`` (and
        engine.moe_configs) returns: the entry of the smallest count >= T, else the largest
    w13_scale, w2_scale, block_size: e4m3 weights only (W8A8), float32 scales, any strides:
        per channel (block_size None): w13_scale [E, 2I], w2_scale [E, H], one per weight row;
        blocks (block_size = (bn, bk), bk a power of two, >= 32 on CUDA):
        w13_scale [E, cdiv(2I, bn), cdiv(H, bk)], w2_scale [E, cdiv(H, bn), cdiv(I, bk)];
        weight w[e, r, c] stands for float32(w) * scale[e, r // bn, c // bk].
    MXFP4 (weight-only, gpt-oss): uint8 w13 [E, 2I, H/2] and w2 [E, H, I/2] hold two e2m1 codes a
        byte along the reduced dim (element 2j in the low nibble of byte j: a checkpoint's
        ``*_blocks`` [..., K/32, 16] flattened), w13_scale [E, 2I, H/32] and w2_scale [E, H, I/32]
        uint8 e8m0 (2^(s - 127) for 32 consecutive elements), H and I multiples of 32
        (kernels/mxfp4_reference.py). Each weight tile is dequantized in registers (exact in
        float32), rounded to x's dtype and fed to the dot as a 16-bit weight would be.

    Returns a new contiguous [T, H] in x's dtype:
    out[t] = sum_k topk_weights[t, k] * (act(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)) @ w2[e].T,
    e = topk_ids[t, k]; with biases and any activation,
    out[t] = sum_k w[t, k] * (gated(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]).
    Accumulates in float32; the intermediate and each
    slot's output are rounded to x's dtype, the sum over slots is float32.
    With e4m3 weights both GEMM inputs are quantized per token as
    ``kernels.fp8_gemm.fp8_quantize(., bk or None)`` does (x before GEMM 1, the
    intermediate after its rounding to x's dtype), the dots run on e4m3 codes
    into float32, and the scales multiply each k-group's partial sum (blocks)
    or the whole sum (per channel) before the activation / routing weight.
    No host sync, so it can be captured in a CUDA graph. Modifies nothing.
    """
    _check_args(x, w13, w2, topk_weights, topk_ids, activation)
    mxfp4 = w13.dtype == MXFP4_DTYPE
    if mxfp4:
        _check_mxfp4_args(x, w13, w2, w13_scale, w2_scale, block_size)
    else:
        block_size = _check_fp8_args(x, w13, w2, w13_scale, w2_scale, block_size)
    _check_biases(x, w13, w2, w13_bias, w2_bias, swiglu_alpha, swiglu_limit)
    swiglu = (swiglu_alpha, swiglu_limit)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if config is not None:  # refused whichever path serves this count
        _parse_config(config)
    if num_tokens == 0:
        return out
    gemv = gemv_tiles(num_tokens, w13, x)
    if gemv is not None:
        inter_out = _pair_gemv(x, w13, topk_ids, topk_weights, inter, gemv, gated=True, activation=activation,
                               w_scale=w13_scale, bias=w13_bias, swiglu=swiglu)  # [T*K, I]
        y = _pair_gemv(inter_out, w2, topk_ids, topk_weights, hidden, gemv, gated=False, activation=activation,
                       w_scale=w2_scale, bias=w2_bias)  # [T*K, H]
        _sum_slots(y, topk_ids, out, num_experts)
        return out
    tiles = pick_tiles(config, num_tokens, num_experts, top_k, x.dtype if mxfp4 else w13.dtype)
    sorted_ids, block_expert = _align(topk_ids, num_experts, tiles.block_m)
    fp8 = w13.dtype == FP8_DTYPE
    if fp8:
        group = None if block_size is None else block_size[1]
        a, a_scale = fp8_quantize(x, group)  # [T, H] e4m3, [T] or [T, cdiv(H, bk)]
    else:
        a, a_scale = x, None
    inter_out = _gemm(a, w13, sorted_ids, block_expert, topk_weights, top_k, inter, tiles.block_m, tiles.gemm1,
                      gated=True, activation=activation, out_dtype=x.dtype, a_scale=a_scale, w_scale=w13_scale,
                      block_size=block_size, bias=w13_bias, swiglu=swiglu)  # [T*K, I]
    if fp8:
        # Per row of the whole intermediate, so a separate launch: a row spans every N tile of
        # GEMM 1. Rows of pairs outside [0, E) were never written; their (garbage) codes and
        # scales stay in their own rows, which GEMM 2 never reads.
        a, a_scale = fp8_quantize(inter_out, group)  # [T*K, I] e4m3, [T*K] or [T*K, cdiv(I, bk)]
    else:
        a = inter_out
    y = _gemm(a, w2, sorted_ids, block_expert, topk_weights, top_k, hidden, tiles.block_m, tiles.gemm2,
              gated=False, activation=activation, out_dtype=x.dtype, a_scale=a_scale, w_scale=w2_scale,
              block_size=block_size, bias=w2_bias)  # [T*K, H]
    _sum_slots(y, topk_ids, out, num_experts)
    return out


def _sum_slots(y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, num_experts: int) -> None:
    """out[t] = the sum of y's rows t*K .. t*K + K-1 in slot order (float32), skipping foreign ids."""
    (num_tokens, top_k), hidden = topk_ids.shape, out.shape[1]
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, _SUM_BLOCK_H))](
        y, topk_ids, out, hidden, num_experts, topk_ids.stride(0), topk_ids.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_H=min(_SUM_BLOCK_H, max(16, next_pow2(hidden))),
    )


def _pair_gemv(a: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, n: int,
               tiles: GemvTiles, *, gated: bool, activation: str, w_scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, swiglu: tuple[float, float] = (SWIGLU_ALPHA, SWIGLU_LIMIT)
               ) -> torch.Tensor:
    """One pair GEMV (a few tokens) into a new [T*K, n] in a's dtype: as ``_gemm`` without the align
    step; rows of pairs with a foreign expert id are never written (the slot sum skips them)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.empty((num_tokens * top_k, n), dtype=a.dtype, device=a.device)
    mxfp4 = w.dtype == MXFP4_DTYPE
    block_k = max(tiles.block_k, MXFP4_BLOCK) if mxfp4 else tiles.block_k
    ws = (w_scale.stride(0), w_scale.stride(1), w_scale.stride(2)) if mxfp4 else (0, 0, 0)
    _pair_gemv_kernel[(num_tokens * top_k, triton.cdiv(n, tiles.block_n))](
        a, w, out, topk_ids, topk_weights, topk_weights if bias is None else bias,
        w_scale if mxfp4 else topk_weights, w.shape[0], n, float(swiglu[0]), float(swiglu[1]),
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), topk_ids.stride(0), topk_ids.stride(1),
        topk_weights.stride(0), topk_weights.stride(1), *ws, 0 if bias is None else bias.stride(0),
        KDIM=a.shape[1], TOP_K=top_k, GATED=gated, ACTIVATION=activation, BLOCK_N=tiles.block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, MXFP4=mxfp4, num_warps=tiles.num_warps,
    )
    return out


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the aligned tiles: sum_e cdiv(n_e, block_m) over the hit experts."""
    return min(num_experts, num_pairs) + num_pairs // block_m


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sorted_ids [max_blocks * block_m] int32, block_expert [max_blocks] int32); see the docstring."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    dev = topk_ids.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    block_e, block_p, num_chunks = _align_shape(num_pairs, num_experts)
    block_b = 64
    grid = (max(num_chunks, triton.cdiv(blocks, block_b)),)
    args = (num_pairs, num_experts, topk_ids.stride(0), topk_ids.stride(1))
    if num_chunks == 1:
        prefix = totals = block_expert  # unused
    else:
        prefix = torch.empty((num_chunks, block_e), dtype=torch.int32, device=dev)
        totals = torch.empty(block_e, dtype=torch.int32, device=dev)
        _count_kernel[(num_chunks,)](topk_ids, prefix, *args, TOP_K=top_k, BLOCK_P=block_p, BLOCK_E=block_e)
        _scan_kernel[(num_experts,)](prefix, totals, num_chunks, BLOCK_E=block_e, BLOCK_C=next_pow2(num_chunks))
    _place_kernel[grid](
        topk_ids, prefix, totals, sorted_ids, block_expert, *args, num_chunks, blocks,
        TOP_K=top_k, BLOCK_P=block_p, BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_B=block_b,
        ONE_CHUNK=num_chunks == 1, num_warps=8 if block_p * block_e >= 8192 else 4,
    )
    return sorted_ids, block_expert


def _gemm(a, w, sorted_ids, block_expert, topk_weights, top_k, n, block_m, tiles: GemmTiles, *, gated: bool,
          activation: str, out_dtype: torch.dtype | None = None, a_scale: torch.Tensor | None = None,
          w_scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
          bias: torch.Tensor | None = None, swiglu: tuple[float, float] = (SWIGLU_ALPHA, SWIGLU_LIMIT)
          ) -> torch.Tensor:
    """One grouped GEMM into a new [T*K, n] in ``out_dtype`` (default a's). e4m3 ``a`` and ``w``
    come with their scales (``a_scale`` per row of a, and per k-group with ``block_size``).
    ``bias``: [E, 2n] (gated) or [E, n], stride 1 along its last dim; ``swiglu``: (alpha, limit)."""
    num_pairs = topk_weights.shape[0] * top_k
    kdim = a.shape[1]
    out = torch.empty((num_pairs, n), dtype=out_dtype or a.dtype, device=a.device)
    num_m_blocks = block_expert.shape[0]
    grid = (num_m_blocks * triton.cdiv(n, tiles.block_n),)
    fp8 = a.dtype == FP8_DTYPE
    block_k, group_n, group_k = tiles.block_k, 1, 0
    mxfp4 = w.dtype == MXFP4_DTYPE
    if fp8:
        block_k = fp8_block_k(block_k, block_size, a.device)
        if block_size is not None:
            group_n, group_k = block_size
        a_strides = (a_scale.stride(0), a_scale.stride(1) if a_scale.dim() == 2 else 0)
        w_strides = (w_scale.stride(0), w_scale.stride(1), w_scale.stride(2) if w_scale.dim() == 3 else 0)
    elif mxfp4:
        block_k = max(block_k, MXFP4_BLOCK)  # a tile takes whole scale groups
        a_scale = topk_weights  # never read
        a_strides, w_strides = (0, 0), (w_scale.stride(0), w_scale.stride(1), w_scale.stride(2))
    else:
        a_scale = w_scale = topk_weights  # never read
        a_strides, w_strides = (0, 0), (0, 0, 0)
    _expert_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, topk_weights, topk_weights if bias is None else bias, a_scale, w_scale,
        num_pairs, num_m_blocks, n, group_n, float(swiglu[0]), float(swiglu[1]),
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), topk_weights.stride(0), topk_weights.stride(1),
        *a_strides, *w_strides, 0 if bias is None else bias.stride(0),
        KDIM=kdim, TOP_K=top_k, GATED=gated, ACTIVATION=activation,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, GROUP_M=tiles.group_m,
        # float32 models get exact float32 products, not TF32's 10-bit mantissa (fp8 dots ignore it).
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        FP8=fp8, GROUP_K=group_k, HAS_BIAS=bias is not None, MXFP4=mxfp4,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def fp8_block_k(block_k: int, block_size: tuple[int, int] | None, device: torch.device) -> int:
    """The BLOCK_K an e4m3 GEMM runs with for a config's ``block_k``: at most the scale
    blocks' bk (a tile lies in one k-group), at least 32 on CUDA (fp8 dots)."""
    if block_size is not None:
        block_k = min(block_k, block_size[1])
    return max(block_k, _FP8_MIN_BLOCK_K) if device.type == "cuda" else block_k


def _align_shape(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_E, BLOCK_P, number of chunks) of the align step."""
    block_e = max(16, next_pow2(num_experts))
    block_p = max(16, min(next_pow2(num_pairs), _ALIGN_ELEMS // block_e))
    return block_e, block_p, triton.cdiv(num_pairs, block_p)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, *, activation: str = "silu",
            config: dict | None = None, ids_dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64),
            x_dtype: torch.dtype | None = None, w13_scale: torch.Tensor | None = None,
            w2_scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
            w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
            swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT,
            float32_weights: bool = False) -> int:
    """Compile every kernel variant ``fused_moe`` can meet for 1..max_tokens tokens
    with these weights and config (a compile met while serving stalls a step for
    about a second): one call per distinct set of compile-time choices (the
    config entry, the align chunking) and ids dtype (the align and sum kernels
    read the ids: pass the one the layer uses to halve the calls). ``x_dtype``
    is the model's dtype (default w13's; required for e4m3 weights, which also
    pass their scales and block size as to ``fused_moe``; fp8_quantize compiles
    once for every token count; required for MXFP4 weights too, with their scales).
    Biases and the swiglu arguments: as the layer passes them to ``fused_moe`` (a bias is
    a compile-time choice). Results are thrown away. Returns the number of calls."""
    num_experts, hidden = w13.shape[0], w2.shape[1]
    quantized = w13.dtype in (FP8_DTYPE, MXFP4_DTYPE)
    require(not quantized or x_dtype is not None, "fused_moe.warm_up",
            f"x_dtype is required for {w13.dtype} weights")
    x_dtype = x_dtype or w13.dtype
    tiles_dtype = x_dtype if w13.dtype == MXFP4_DTYPE else w13.dtype
    seen = set()
    calls = 0
    for num_tokens in range(1, max_tokens + 1):
        block_e, block_p, chunks = _align_shape(num_tokens * top_k, num_experts)
        gemv = gemv_tiles(num_tokens, w13, torch.empty(0, dtype=x_dtype))
        key = (gemv,) if gemv is not None else (
            pick_tiles(config, num_tokens, num_experts, top_k, tiles_dtype), block_p, chunks == 1 or next_pow2(chunks))
        if key in seen:
            continue
        seen.add(key)
        x = torch.zeros(num_tokens, hidden, dtype=x_dtype, device=w13.device)
        ids = (torch.arange(num_tokens * top_k, device=w13.device) % num_experts).view(num_tokens, top_k)
        weights = torch.zeros(num_tokens, top_k, dtype=torch.float32, device=w13.device)
        for ids_dtype in ids_dtypes:
            fused_moe(x, w13, w2, weights, ids.to(ids_dtype), activation=activation, config=config,
                      w13_scale=w13_scale, w2_scale=w2_scale, block_size=block_size, w13_bias=w13_bias,
                      w2_bias=w2_bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
            calls += 1
    return calls


# ---- tuning -----------------------------------------------------------------------------------------------

TOKEN_COUNTS = tuple(1 << i for i in range(14))  # 1, 2, 4, ..., 8192

# (block_n, block_k, num_warps, num_stages) candidates per BLOCK_M. Small tiles
# (decode) are bound by reading the weights: narrow N tiles give many programs
# and deep K tiles long loads in flight. Large ones want the biggest tiles the
# registers hold (GEMM 1 keeps two accumulators).
_GEMM_CANDIDATES = {
    16: [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (64, 64, 4, 5), (128, 128, 4, 3),
         (128, 64, 4, 4), (32, 64, 4, 5)],
    32: [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (64, 64, 4, 3), (32, 128, 4, 4)],
    64: [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    128: [(64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (64, 128, 8, 3)],
}
_GEMM_CANDIDATES_FP32 = [(32, 32, 4, 3), (64, 32, 4, 3), (32, 64, 4, 2), (64, 64, 4, 2)]


def _candidate_block_ms(num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    """Up to three BLOCK_M around twice the pairs per hit expert (padding wastes the rest)."""
    rows = num_tokens * top_k / max(1, min(num_experts, num_tokens * top_k))
    fit = [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * next_pow2(int(rows + 0.999)))]
    return fit[-3:]


def _candidate_tiles(block_m: int, dtype: torch.dtype, num_m_tiles: int,
                     block_size: tuple[int, int] | None = None) -> list[GemmTiles]:
    """``dtype``: the weights'. e4m3 tiles take twice the 16-bit BLOCK_K (the same bytes of
    shared memory per stage), capped at the scale blocks' bk (one k-group per tile)."""
    group_m = 1 if num_m_tiles <= 1 or block_m == 16 else 8
    if dtype == torch.float32:
        table = _GEMM_CANDIDATES_FP32
    elif dtype == FP8_DTYPE:
        cap = block_size[1] if block_size is not None else 1 << 30
        table = list(dict.fromkeys((bn, min(2 * bk, cap), warps, stages)
                                   for bn, bk, warps, stages in _GEMM_CANDIDATES[block_m]))
    else:
        table = _GEMM_CANDIDATES[block_m]
    return [GemmTiles(bn, bk, group_m, warps, stages) for bn, bk, warps, stages in table]


def _fastest(run, candidates: list[GemmTiles], rep_ms: int) -> tuple[float, GemmTiles | None]:
    """(median ms, tiles) of the fastest candidate of ``run(tiles)``; (inf, None) if none ran."""
    import triton.testing

    best: tuple[float, GemmTiles | None] = (float("inf"), None)
    for tiles in candidates:
        try:
            ms = triton.testing.do_bench(lambda: run(tiles), warmup=5, rep=rep_ms, return_mode="median")
        except Exception as e:  # noqa: BLE001 - e.g. OutOfResources: the candidate does not fit
            logger.debug("fused_moe.tune: skipping %s: %s", tiles, e)
            continue
        if ms < best[0]:
            best = (ms, tiles)
    return best


def _tune_one(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, gen: torch.Generator,
              rep_ms: int, max_candidates: int | None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None) -> dict:
    """The best tiles for x's token count, with uniform random routing (e4m3 weights:
    the GEMMs alone are timed, on inputs quantized once)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    ids = torch.rand(num_tokens, num_experts, device=x.device, generator=gen).topk(top_k, dim=-1).indices
    ids = ids.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, device=x.device, generator=gen)
    fp8 = w13.dtype == FP8_DTYPE
    group = None if block_size is None else block_size[1]
    if fp8:
        a, a_scale = fp8_quantize(x, group)
    else:
        a, a_scale = x, None
    best: tuple[float, MoeTiles | None] = (float("inf"), None)
    for block_m in _candidate_block_ms(num_tokens, num_experts, top_k):
        sorted_ids, block_expert = _align(ids, num_experts, block_m)
        tiles_dtype = x.dtype if w13.dtype == MXFP4_DTYPE else w13.dtype  # MXFP4 dots run in x's dtype
        cands = _candidate_tiles(block_m, tiles_dtype, block_expert.shape[0], block_size)[:max_candidates]

        def gemm1(tiles: GemmTiles) -> torch.Tensor:
            return _gemm(a, w13, sorted_ids, block_expert, weights, top_k, inter, block_m, tiles, gated=True,
                         activation="silu", out_dtype=x.dtype, a_scale=a_scale, w_scale=w13_scale,
                         block_size=block_size)

        ms1, g1 = _fastest(gemm1, cands, rep_ms)
        if g1 is None:
            continue
        h, h_scale = fp8_quantize(gemm1(g1), group) if fp8 else (gemm1(g1), None)
        ms2, g2 = _fastest(lambda tiles: _gemm(h, w2, sorted_ids, block_expert, weights, top_k, hidden, block_m,
                                               tiles, gated=False, activation="silu", out_dtype=x.dtype,
                                               a_scale=h_scale, w_scale=w2_scale, block_size=block_size),
                           cands, rep_ms)
        if g2 is not None and ms1 + ms2 < best[0]:
            best = (ms1 + ms2, MoeTiles(block_m, g1, g2))
    require(best[1] is not None, "fused_moe.tune", f"no candidate tile config ran for {num_tokens} tokens")
    logger.info("fused_moe.tune: %d tokens: %.1f us with %s", num_tokens, best[0] * 1e3, best[1])
    return best[1].as_dict()


def tune(
    num_experts: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    token_counts: tuple[int, ...] = TOKEN_COUNTS,
    *,
    rep_ms: int = 25,
    max_candidates: int | None = None,
    block_size: tuple[int, int] | None = None,
    x_dtype: torch.dtype = torch.bfloat16,
) -> dict[int, dict]:
    """Time a small grid of tiles per token count on this GPU; {count: tiles} for ``fused_moe(config=...)``.

    ``intermediate`` is a rank's share of the experts' intermediate dim;
    ``dtype`` is the weights' dtype. Inputs are random with uniform routing.
    For each count, every candidate BLOCK_M aligns once, then GEMM 1's and GEMM
    2's candidates are timed separately (``triton.testing.do_bench``, L2 flushed
    between runs); the BLOCK_M with the least GEMM 1 + GEMM 2 time wins.
    Candidates that fail to compile or launch (shared memory) are skipped.
    Takes a minute or two, mostly compiles; ``max_candidates`` keeps only the
    first few per BLOCK_M (for tests). For float8_e4m3fn weights, ``block_size``
    is the scale blocks' (None: per channel) and activations are ``x_dtype``;
    ``dtype`` torch.uint8 is MXFP4 experts (random codes), activations ``x_dtype``.
    """
    device = torch.device(device)
    require(device.type == "cuda", "fused_moe.tune", f"tuning needs a CUDA device, got {device}")
    require(len(token_counts) > 0 and all(n >= 1 for n in token_counts), "fused_moe.tune",
            f"token_counts must be positive, got {token_counts}")
    fp8, mxfp4 = dtype == FP8_DTYPE, dtype == MXFP4_DTYPE
    require(fp8 or block_size is None, "fused_moe.tune", f"block_size is for {FP8_DTYPE} weights, got {dtype}")
    require(not mxfp4 or (hidden % MXFP4_BLOCK == 0 and intermediate % MXFP4_BLOCK == 0), "fused_moe.tune",
            f"MXFP4 experts need hidden ({hidden}) and intermediate ({intermediate}) multiples of {MXFP4_BLOCK}")
    started = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    # Made in the model dtype: the engine tunes before it allocates the KV cache, but beside the weights.
    made = x_dtype if fp8 or mxfp4 else dtype
    scales: dict = {}
    if mxfp4:  # random codes (RMS about 2.9) with one scale bringing them to the 16-bit path's magnitudes
        def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
            codes = torch.randint(0, 256, (num_experts, rows, cols // 2), device=device, dtype=torch.uint8,
                                  generator=gen)
            exp = 127 + round(math.log2(cols**-0.5 / 2.9))
            return codes, torch.full((num_experts, rows, cols // MXFP4_BLOCK), exp, device=device, dtype=torch.uint8)

        (w13, s13), (w2, s2) = packed(2 * intermediate, hidden), packed(hidden, intermediate)
        scales = dict(w13_scale=s13, w2_scale=s2)
    else:
        w13 = torch.randn(num_experts, 2 * intermediate, hidden, device=device, dtype=made, generator=gen)
        w2 = torch.randn(num_experts, hidden, intermediate, device=device, dtype=made, generator=gen)
    if fp8:  # unit-normal codes; scales bring the weights to the 16-bit path's magnitudes
        w13, w2 = w13.to(dtype), w2.to(dtype)
        shape13, shape2 = fp8_scale_shapes(w13, w2, block_size)
        scales = dict(w13_scale=torch.full(shape13, hidden**-0.5, device=device),
                      w2_scale=torch.full(shape2, intermediate**-0.5, device=device), block_size=block_size)
    elif not mxfp4:
        w13 *= hidden**-0.5
        w2 *= intermediate**-0.5
    xs = torch.randn(max(token_counts), hidden, device=device, dtype=made, generator=gen)
    result: dict[int, dict] = {}
    with torch.cuda.device(device):  # do_bench times and flushes L2 on the current device
        for num_tokens in sorted(set(token_counts)):
            result[num_tokens] = _tune_one(xs[:num_tokens], w13, w2, top_k, gen, rep_ms, max_candidates, **scales)
    logger.info("fused_moe.tune: E=%d H=%d I=%d K=%d %s%s: %d token counts in %.1f s", num_experts, hidden,
                intermediate, top_k, dtype, f" blocks {block_size}" if block_size else "", len(result),
                time.perf_counter() - started)
    return result
