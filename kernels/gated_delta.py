"""Gated DeltaNet's recurrence and output norm in Triton (``kernels.linear_reference`` holds
the references and the contract: ``gated_delta_rule``, ``gated_rms_norm``).

Per sequence and v head, with q, k l2-normalised (float32) and q scaled, the state S [Dk, Dv]
(float32) advances token by token:

    S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T q_t

Two ways to run it, the same result to float32 rounding:

- recurrent (``_recurrent_kernel``): one program per (sequence, v head, block of BV value
  columns) holds its slice of S in registers and walks the sequence's tokens. Reads and
  writes the state once per call: the decode path (and short prefills, speculative rows).
- chunked (``_chunk_prepare_kernel`` then ``_chunk_scan_kernel``), for prefill: the WY /
  UT-transform form (DeltaNet, Gated DeltaNet; transformers' ``torch_chunk_gated_delta_rule``,
  fla's ``chunk_gated_delta_rule``) over chunks of 64 tokens. The prepare kernel, parallel
  over (chunk, v head), builds per chunk the cumulative log decay gc, the strictly lower
  A_ij = beta_i (k_i . k_j) exp(gc_i - gc_j), inverts (I + A) blockwise (16 x 16 diagonal
  blocks by forward substitution, the rest by dots) and stores
  w = (I + A)^-1 (beta k exp(gc)) and u = (I + A)^-1 (beta v) (float32, token-indexed). The
  scan kernel, one program per (sequence, v head, value block), walks the chunks:

      v_new = u - w S;   o = (q exp(gc)) S + (causal(q k^T exp(gc_i - gc_j))) v_new
      S = exp(gc_last) S + (k exp(gc_last - gc))^T v_new

Chunks never cross sequences: tiles of a varlen batch are numbered from query_start_loc as
the attention kernels number theirs (``_attention_common``), no host sync.

``gated_delta_rule`` splits a batch by length as the reference does: sequences of 64 tokens or
more take the chunked kernels, the rest the recurrent one. Both are launched over the whole batch
and each program skips the other form's sequences (no host sync, CUDA-graph safe); the chunked
kernels are not launched at all when no sequence can be that long (T < 64 + B - 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._attention_common import _INTERPRETED, _locate_tile
from kernels._checks import (
    FLOAT_DTYPES,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    check_varlen_rows,
    next_pow2,
    require,
)

CHUNK = 64  # tokens per chunk of the chunked form (four 16-row blocks)
_SUB = 16  # rows of a diagonal block of (I + A)
_L2NORM_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# recurrent
# ---------------------------------------------------------------------------------------------


@triton.jit
def _l2norm(x, ON: tl.constexpr):
    if ON:
        return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)
    else:
        return x


@triton.jit
def _recurrent_step(
    S, t, h, hv, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
    dk, dk_ok, dv, dv_ok, L2NORM: tl.constexpr,
):
    t = t.to(tl.int64)
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + dk, mask=dk_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + dk, mask=dk_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + dv, mask=dv_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + hv).to(tl.float32)
    beta = tl.load(beta_ptr + t * stride_bt + hv).to(tl.float32)
    q = _l2norm(q, L2NORM) * scale
    k = _l2norm(k, L2NORM)
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BV]
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(o_ptr + t * stride_ot + hv * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=dv_ok)
    return S


@triton.jit
def _recurrent_kernel(
    o_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    state_ptr,  # [num_slots, Hv, Dk, Dv] float32, in place
    slots_ptr, query_start_loc_ptr, init_ptr,
    scale,
    max_len,  # sequences of max_len tokens or more are the chunked kernels' (skipped here)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
    stride_sn, stride_sh, stride_sk,
    GROUP: tl.constexpr,  # v heads per q/k head
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    seq = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    h = hv // GROUP
    bos = tl.load(query_start_loc_ptr + seq)
    eos = tl.load(query_start_loc_ptr + seq + 1)
    if eos - bos >= max_len:
        return
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    init = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    dk = tl.arange(0, BK)
    dk_ok = dk < DK
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    dv_ok = dv < DV
    s_ptrs = state_ptr + slot * stride_sn + hv * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    s_mask = dk_ok[:, None] & dv_ok[None, :]
    S = tl.load(s_ptrs, mask=s_mask & init, other=0.0)  # [BK, BV] float32
    if _INTERPRETED:
        # Triton 3.6's interpreter cannot take tensor bounds in range() under NumPy >= 2.4.
        t = bos
        while t < eos:
            S = _recurrent_step(S, t, h, hv, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                                stride_bt, stride_ot, stride_oh, dk, dk_ok, dv, dv_ok, L2NORM)
            t += 1
    else:
        for t in range(bos, eos):
            S = _recurrent_step(S, t, h, hv, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                                stride_bt, stride_ot, stride_oh, dk, dk_ok, dv, dv_ok, L2NORM)
    if slot >= 0:
        tl.store(s_ptrs, S, mask=s_mask)


# ---------------------------------------------------------------------------------------------
# chunked: prepare (w, u, gc per chunk, in parallel)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(ptr, rows, row_ok, stride_t, head, stride_h, cols, col_ok):
    return tl.load(ptr + rows[:, None] * stride_t + head * stride_h + cols[None, :],
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _a_block(ki, kj, bi, gi, gj, DIAG: tl.constexpr, PREC: tl.constexpr):
    # Block (i, j) of A: beta_r (k_r . k_c) exp(gc_r - gc_c), strictly lower on the diagonal.
    kk = tl.dot(ki, tl.trans(kj), input_precision=PREC)  # [SUB, SUB]
    if DIAG:
        r = tl.arange(0, 16)
        lower = r[:, None] > r[None, :]
        return tl.where(lower, bi[:, None] * kk * tl.exp(tl.where(lower, gi[:, None] - gj[None, :], 0.0)), 0.0)
    else:
        return bi[:, None] * kk * tl.exp(gi[:, None] - gj[None, :])


@triton.jit
def _inverse16(A):
    # (I + A)^-1 for a strictly lower triangular 16 x 16 A, by forward substitution:
    # row i of X = e_i - sum_{j<i} A[i, j] X[j, :] (rows j >= i of X are still e_j and A[i, j>=i] = 0).
    r = tl.arange(0, 16)
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in tl.static_range(1, 16):
        a = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)  # row i of A, indexed by column
        row = tl.sum(a[:, None] * X, axis=0)  # sum_j A[i, j] X[j, :]
        X = tl.where(r[:, None] == i, X - row[None, :], X)
    return X


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _chunk_prepare_kernel(
    w_ptr,  # [T, Hv, Dk] float32, contiguous (out)
    u_ptr,  # [T, Hv, Dv] float32, contiguous (out)
    gc_ptr,  # [T, Hv] float32, contiguous (out)
    k_ptr, v_ptr, g_ptr, beta_ptr, query_start_loc_ptr,
    num_seqs, HV,
    min_len,  # sequences shorter than min_len are the recurrent kernel's (skipped here)
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    h = hv // GROUP
    seq, start, length, tok0 = _locate_tile(query_start_loc_ptr, num_seqs, tile, 64)
    if (tok0 >= length) | (length < min_len):
        return
    r = tl.arange(0, 16)
    dk = tl.arange(0, BK)
    dk_ok = dk < DK
    dv = tl.arange(0, BV)
    dv_ok = dv < DV
    start = start.to(tl.int64)
    # The chunk's four 16-row blocks: token rows, validity, normalised k, beta, cumulated g.
    t0 = tok0 + r
    t1 = t0 + 16
    t2 = t0 + 32
    t3 = t0 + 48
    ok0 = t0 < length
    ok1 = t1 < length
    ok2 = t2 < length
    ok3 = t3 < length
    k0 = _load_rows(k_ptr, start + t0, ok0, stride_kt, h, stride_kh, dk, dk_ok)
    k1 = _load_rows(k_ptr, start + t1, ok1, stride_kt, h, stride_kh, dk, dk_ok)
    k2 = _load_rows(k_ptr, start + t2, ok2, stride_kt, h, stride_kh, dk, dk_ok)
    k3 = _load_rows(k_ptr, start + t3, ok3, stride_kt, h, stride_kh, dk, dk_ok)
    if L2NORM:
        k0 = k0 * tl.rsqrt(tl.sum(k0 * k0, axis=1) + 1e-6)[:, None]
        k1 = k1 * tl.rsqrt(tl.sum(k1 * k1, axis=1) + 1e-6)[:, None]
        k2 = k2 * tl.rsqrt(tl.sum(k2 * k2, axis=1) + 1e-6)[:, None]
        k3 = k3 * tl.rsqrt(tl.sum(k3 * k3, axis=1) + 1e-6)[:, None]
    b0 = tl.load(beta_ptr + (start + t0) * stride_bt + hv, mask=ok0, other=0.0).to(tl.float32)
    b1 = tl.load(beta_ptr + (start + t1) * stride_bt + hv, mask=ok1, other=0.0).to(tl.float32)
    b2 = tl.load(beta_ptr + (start + t2) * stride_bt + hv, mask=ok2, other=0.0).to(tl.float32)
    b3 = tl.load(beta_ptr + (start + t3) * stride_bt + hv, mask=ok3, other=0.0).to(tl.float32)
    g0 = tl.cumsum(tl.load(g_ptr + (start + t0) * stride_gt + hv, mask=ok0, other=0.0).to(tl.float32), axis=0)
    g1 = tl.cumsum(tl.load(g_ptr + (start + t1) * stride_gt + hv, mask=ok1, other=0.0).to(tl.float32), axis=0)
    g2 = tl.cumsum(tl.load(g_ptr + (start + t2) * stride_gt + hv, mask=ok2, other=0.0).to(tl.float32), axis=0)
    g3 = tl.cumsum(tl.load(g_ptr + (start + t3) * stride_gt + hv, mask=ok3, other=0.0).to(tl.float32), axis=0)
    g1 += tl.sum(tl.where(r == 15, g0, 0.0), axis=0)
    g2 += tl.sum(tl.where(r == 15, g1, 0.0), axis=0)
    g3 += tl.sum(tl.where(r == 15, g2, 0.0), axis=0)
    tl.store(gc_ptr + (start + t0) * HV + hv, g0, mask=ok0)
    tl.store(gc_ptr + (start + t1) * HV + hv, g1, mask=ok1)
    tl.store(gc_ptr + (start + t2) * HV + hv, g2, mask=ok2)
    tl.store(gc_ptr + (start + t3) * HV + hv, g3, mask=ok3)

    # X = (I + A)^-1, block lower triangular: X_ii = inverse of the diagonal block,
    # X_ij = -X_ii sum_{j <= m < i} A_im X_mj.
    X00 = _inverse16(_a_block(k0, k0, b0, g0, g0, True, PREC))
    X11 = _inverse16(_a_block(k1, k1, b1, g1, g1, True, PREC))
    X22 = _inverse16(_a_block(k2, k2, b2, g2, g2, True, PREC))
    X33 = _inverse16(_a_block(k3, k3, b3, g3, g3, True, PREC))
    A10 = _a_block(k1, k0, b1, g1, g0, False, PREC)
    A20 = _a_block(k2, k0, b2, g2, g0, False, PREC)
    A21 = _a_block(k2, k1, b2, g2, g1, False, PREC)
    A30 = _a_block(k3, k0, b3, g3, g0, False, PREC)
    A31 = _a_block(k3, k1, b3, g3, g1, False, PREC)
    A32 = _a_block(k3, k2, b3, g3, g2, False, PREC)
    X10 = -_mm(X11, _mm(A10, X00, PREC), PREC)
    X21 = -_mm(X22, _mm(A21, X11, PREC), PREC)
    X32 = -_mm(X33, _mm(A32, X22, PREC), PREC)
    X20 = -_mm(X22, _mm(A20, X00, PREC) + _mm(A21, X10, PREC), PREC)
    X31 = -_mm(X33, _mm(A31, X11, PREC) + _mm(A32, X21, PREC), PREC)
    X30 = -_mm(X33, _mm(A30, X00, PREC) + _mm(A31, X10, PREC) + _mm(A32, X20, PREC), PREC)

    # w = X (beta k exp(gc)), block row by block row.
    e0 = k0 * (b0 * tl.exp(g0))[:, None]
    e1 = k1 * (b1 * tl.exp(g1))[:, None]
    e2 = k2 * (b2 * tl.exp(g2))[:, None]
    e3 = k3 * (b3 * tl.exp(g3))[:, None]
    w_rows = w_ptr + hv * DK + dk[None, :]
    w_cols = dk_ok[None, :]
    tl.store(w_rows + ((start + t0) * HV * DK)[:, None], _mm(X00, e0, PREC), mask=ok0[:, None] & w_cols)
    tl.store(w_rows + ((start + t1) * HV * DK)[:, None], _mm(X10, e0, PREC) + _mm(X11, e1, PREC),
             mask=ok1[:, None] & w_cols)
    tl.store(w_rows + ((start + t2) * HV * DK)[:, None],
             _mm(X20, e0, PREC) + _mm(X21, e1, PREC) + _mm(X22, e2, PREC), mask=ok2[:, None] & w_cols)
    tl.store(w_rows + ((start + t3) * HV * DK)[:, None],
             _mm(X30, e0, PREC) + _mm(X31, e1, PREC) + _mm(X32, e2, PREC) + _mm(X33, e3, PREC),
             mask=ok3[:, None] & w_cols)

    # u = X (beta v).
    e0 = _load_rows(v_ptr, start + t0, ok0, stride_vt, hv, stride_vh, dv, dv_ok) * b0[:, None]
    e1 = _load_rows(v_ptr, start + t1, ok1, stride_vt, hv, stride_vh, dv, dv_ok) * b1[:, None]
    e2 = _load_rows(v_ptr, start + t2, ok2, stride_vt, hv, stride_vh, dv, dv_ok) * b2[:, None]
    e3 = _load_rows(v_ptr, start + t3, ok3, stride_vt, hv, stride_vh, dv, dv_ok) * b3[:, None]
    u_rows = u_ptr + hv * DV + dv[None, :]
    u_cols = dv_ok[None, :]
    tl.store(u_rows + ((start + t0) * HV * DV)[:, None], _mm(X00, e0, PREC), mask=ok0[:, None] & u_cols)
    tl.store(u_rows + ((start + t1) * HV * DV)[:, None], _mm(X10, e0, PREC) + _mm(X11, e1, PREC),
             mask=ok1[:, None] & u_cols)
    tl.store(u_rows + ((start + t2) * HV * DV)[:, None],
             _mm(X20, e0, PREC) + _mm(X21, e1, PREC) + _mm(X22, e2, PREC), mask=ok2[:, None] & u_cols)
    tl.store(u_rows + ((start + t3) * HV * DV)[:, None],
             _mm(X30, e0, PREC) + _mm(X31, e1, PREC) + _mm(X32, e2, PREC) + _mm(X33, e3, PREC),
             mask=ok3[:, None] & u_cols)


# ---------------------------------------------------------------------------------------------
# chunked: scan (sequential over a sequence's chunks)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _scan_chunk(
    S, tok0, start, length, h, hv, q_ptr, k_ptr, w_ptr, u_ptr, gc_ptr, o_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
    HV, dk, dk_ok, dv, dv_ok,
    DK: tl.constexpr, DV: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    r = tl.arange(0, 64)
    t = tok0 + r
    ok = t < length
    rows = start + t  # int64
    last = tl.minimum(tok0 + 64, length) - 1
    gc = tl.load(gc_ptr + rows * HV + hv, mask=ok, other=0.0)  # [64]
    g_last = tl.load(gc_ptr + (start + last) * HV + hv)
    w = tl.load(w_ptr + (rows * HV + hv)[:, None] * DK + dk[None, :], mask=ok[:, None] & dk_ok[None, :], other=0.0)
    u = tl.load(u_ptr + (rows * HV + hv)[:, None] * DV + dv[None, :], mask=ok[:, None] & dv_ok[None, :], other=0.0)
    v_new = u - tl.dot(w, S, input_precision=PREC)  # [64, BV]
    q = _load_rows(q_ptr, rows, ok, stride_qt, h, stride_qh, dk, dk_ok)
    k = _load_rows(k_ptr, rows, ok, stride_kt, h, stride_kh, dk, dk_ok)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    q = q * scale
    causal = r[:, None] >= r[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    qk = tl.where(causal, qk * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    o = tl.dot(q * tl.exp(gc)[:, None], S, input_precision=PREC) + tl.dot(qk, v_new, input_precision=PREC)
    tl.store(o_ptr + rows[:, None] * stride_ot + hv * stride_oh + dv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=ok[:, None] & dv_ok[None, :])
    k_decayed = k * tl.exp(tl.where(ok, g_last - gc, 0.0))[:, None]
    S = S * tl.exp(g_last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=PREC)
    return S


@triton.jit
def _chunk_scan_kernel(
    o_ptr, q_ptr, k_ptr, w_ptr, u_ptr, gc_ptr,
    state_ptr, slots_ptr, query_start_loc_ptr, init_ptr,
    scale,
    min_len,  # as the prepare kernel's
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
    stride_sn, stride_sh, stride_sk,
    HV,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    seq = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    h = hv // GROUP
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    length = tl.load(query_start_loc_ptr + seq + 1) - start
    if length < min_len:
        return
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    init = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    dk = tl.arange(0, BK)
    dk_ok = dk < DK
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    dv_ok = dv < DV
    s_ptrs = state_ptr + slot * stride_sn + hv * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    s_mask = dk_ok[:, None] & dv_ok[None, :]
    S = tl.load(s_ptrs, mask=s_mask & init, other=0.0)  # [BK, BV] float32
    num_chunks = tl.cdiv(length, 64)
    if _INTERPRETED:
        c = 0
        while c < num_chunks:
            S = _scan_chunk(S, c * 64, start, length, h, hv, q_ptr, k_ptr, w_ptr, u_ptr, gc_ptr, o_ptr, scale,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                            HV, dk, dk_ok, dv, dv_ok, DK, DV, L2NORM, PREC)
            c += 1
    else:
        for c in range(0, num_chunks):
            S = _scan_chunk(S, c * 64, start, length, h, hv, q_ptr, k_ptr, w_ptr, u_ptr, gc_ptr, o_ptr, scale,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                            HV, dk, dk_ok, dv, dv_ok, DK, DV, L2NORM, PREC)
    if slot >= 0:
        tl.store(s_ptrs, S, mask=s_mask)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _check(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state):
    where = "gated_delta_rule"
    check_runnable(where, q=q, k=k, v=v, g=g, beta=beta, ssm_state=ssm_state, state_slots=state_slots,
                   query_start_loc=query_start_loc, has_initial_state=has_initial_state)
    check_dim(where, "q", q, 3, "[num_tokens, num_k_heads, k_head_dim]")
    check_dim(where, "k", k, 3, "[num_tokens, num_k_heads, k_head_dim]")
    check_dim(where, "v", v, 3, "[num_tokens, num_v_heads, v_head_dim]")
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    require(q.shape == k.shape, where, f"q {tuple(q.shape)} and k {tuple(k.shape)} differ")
    require(v.shape[0] == T, where, f"v has {v.shape[0]} tokens for k's {T}")
    require(Hv % Hk == 0, where, f"{Hv} v heads are not a multiple of {Hk} k heads")
    require(g.shape == (T, Hv) and beta.shape == (T, Hv), where,
            f"g and beta must be [{T}, {Hv}], got {tuple(g.shape)} and {tuple(beta.shape)}")
    require(ssm_state.dim() == 4 and ssm_state.shape[1:] == (Hv, Dk, Dv), where,
            f"ssm_state must be [num_slots, {Hv}, {Dk}, {Dv}], got {tuple(ssm_state.shape)}")
    require(ssm_state.dtype == torch.float32, where, f"ssm_state must be float32, got {ssm_state.dtype}")
    require(Dk <= 256 and Dv <= 256, where, f"head dims up to 256 (got Dk {Dk}, Dv {Dv})")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("ssm_state", ssm_state)):
        check_dtype(where, name, t, FLOAT_DTYPES)
        check_inner_contiguous(where, name, t)
    check_varlen_rows(where, state_slots, query_start_loc, has_initial_state)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 models: IEEE float32 dots (as the other kernels); 16-bit models: TF32, whose
    # 10-bit mantissa is finer than the model's own rounding.
    return "ieee" if dtype == torch.float32 else "tf32"


_ALL = 2**31 - 1
# Launch parameters (bench/gpu_linear_attention.py times them).
RECURRENT_CONFIG = {"num_warps": 4}
PREPARE_CONFIG = {"num_warps": 4}
# num_stages 1: pipelined, the chunk loop's float32 tiles overflow shared memory at Dk 128.
# On an H100 the 8k-token scan took 2.36-2.48 ms in every (bv 32/64, warps 4/8, stages 1/2) tried.
SCAN_CONFIG = {"bv": 64, "num_warps": 4, "num_stages": 1}


def launches_chunked(num_tokens: int, num_seqs: int) -> bool:
    """Whether ``gated_delta_rule`` launches the chunked kernels for a batch of these shapes:
    when a sequence of CHUNK tokens can be in it (every sequence holding at least one token)."""
    return num_tokens >= CHUNK + num_seqs - 1


def _launch_recurrent(q, k, v, g, beta, ssm_state, state_slots, qsl, init, o, scale, use_qk_l2norm, max_len):
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    bk = max(16, next_pow2(Dk))
    bv = min(max(16, next_pow2(Dv)), 16 if B * Hv < 512 else 32)
    _recurrent_kernel[(B, Hv, triton.cdiv(Dv, bv))](
        o, q, k, v, g, beta, ssm_state, state_slots, qsl, init, scale, max_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=bk, BV=bv, L2NORM=bool(use_qk_l2norm),
        num_warps=RECURRENT_CONFIG["num_warps"] if bk * bv >= 2048 else 2,
    )


def _launch_chunked(q, k, v, g, beta, ssm_state, state_slots, qsl, init, o, scale, use_qk_l2norm, min_len):
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    prec = _dot_precision(v.dtype)
    bk = max(16, next_pow2(Dk))
    bv_full = max(16, next_pow2(Dv))
    w = torch.empty((T, Hv, Dk), dtype=torch.float32, device=v.device)
    u = torch.empty((T, Hv, Dv), dtype=torch.float32, device=v.device)
    gc = torch.empty((T, Hv), dtype=torch.float32, device=v.device)
    _chunk_prepare_kernel[(T // CHUNK + B, Hv)](
        w, u, gc, k, v, g, beta, qsl, B, Hv, min_len,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=bk, BV=bv_full, L2NORM=bool(use_qk_l2norm), PREC=prec,
        num_warps=PREPARE_CONFIG["num_warps"],
    )
    bv = min(bv_full, SCAN_CONFIG["bv"])
    _chunk_scan_kernel[(B, Hv, triton.cdiv(Dv, bv))](
        o, q, k, w, u, gc, ssm_state, state_slots, qsl, init, scale, min_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), Hv,
        GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=bk, BV=bv, L2NORM=bool(use_qk_l2norm), PREC=prec,
        num_warps=SCAN_CONFIG["num_warps"], num_stages=SCAN_CONFIG["num_stages"],
    )


def _run(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale, use_qk_l2norm,
         recurrent_max_len, chunked_min_len):
    _check(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state)
    T, Hv, Dv = v.shape
    o = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    if state_slots.shape[0] == 0:
        return o
    scale = k.shape[2] ** -0.5 if scale is None else float(scale)
    args = (q, k, v, g, beta, ssm_state, state_slots, query_start_loc.to(torch.int32),
            has_initial_state.view(torch.uint8), o, scale, use_qk_l2norm)
    if recurrent_max_len > 0:
        _launch_recurrent(*args, recurrent_max_len)
    if chunked_min_len < _ALL:
        _launch_chunked(*args, chunked_min_len)
    return o


def gated_delta_rule_recurrent(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state,
                               scale=None, use_qk_l2norm=True):
    """``gated_delta_rule`` by the recurrent kernel alone, every sequence."""
    return _run(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale, use_qk_l2norm,
                recurrent_max_len=_ALL, chunked_min_len=_ALL)


def gated_delta_rule_chunked(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state,
                             scale=None, use_qk_l2norm=True):
    """``gated_delta_rule`` by the chunked kernels (chunks of 64 tokens) alone, every sequence."""
    return _run(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale, use_qk_l2norm,
                recurrent_max_len=0, chunked_min_len=0)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Gated delta rule over a varlen batch with per-sequence state (the contract of
    ``kernels.linear_reference.gated_delta_rule``). Sequences of CHUNK (64) tokens or more take
    the chunked kernels, the others the recurrent kernel, both launched over the whole batch
    (each program skips the other form's sequences: no host sync); a batch with no room for such
    a sequence (``launches_chunked``) launches the recurrent kernel alone.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (any token/head strides, last dim contiguous); g, beta:
    [T, Hv]; ssm_state: [num_slots, Hv, Dk, Dv] float32 (last dim contiguous), updated in place;
    state_slots: [B] int (distinct; < 0: a padding row, starts from zeros, no state written);
    query_start_loc: [B+1] int; has_initial_state: [B] bool. Returns o [T, Hv, Dv] in v's dtype.
    """
    if launches_chunked(v.shape[0], state_slots.shape[0]):
        split = CHUNK
        return _run(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale,
                    use_qk_l2norm, recurrent_max_len=split, chunked_min_len=split)
    return _run(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale, use_qk_l2norm,
                recurrent_max_len=_ALL, chunked_min_len=_ALL)


# ---------------------------------------------------------------------------------------------
# gated RMSNorm
# ---------------------------------------------------------------------------------------------

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _gated_rms_norm_kernel(
    out_ptr, x_ptr, gate_ptr, weight_ptr, eps, num_rows, heads,
    stride_xt, stride_xh, stride_gt, stride_gh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PROD_DTYPE: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # row = token * heads + head
    row_ok = rows < num_rows
    tok, head = rows // heads, rows % heads
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + (tok * stride_xt + head * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)[:, None]
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    # weight * h.to(x's dtype), in torch's promoted dtype of the two, then * silu(gate) in float32.
    h = (w[None, :] * h.to(x.dtype).to(tl.float32)).to(PROD_DTYPE).to(tl.float32)
    gate = tl.load(gate_ptr + (tok * stride_gt + head * stride_gh)[:, None] + cols[None, :], mask=mask,
                   other=0.0).to(tl.float32)
    y = h * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _token_head_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, token stride, head stride) of ``t`` [..., D] read as [tokens, heads, D]:
    [T, H, D] as it lies (a view of a wider GEMM output is read in place), else its rows."""
    if t.dim() == 3:
        return t.shape[0], t.shape[1], t.stride(0), t.stride(1)
    rows = t.reshape(-1, t.shape[-1])
    return rows.shape[0], 1, rows.stride(0), 0


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNormGated / Qwen3_5RMSNormGated (the contract of
    ``kernels.linear_reference.gated_rms_norm``). x, gate: [..., D] of one shape; [T, H, D]
    may have any token and head strides, other shapes strided rows; last dim contiguous.
    weight: [D]. Returns a new contiguous tensor of x's shape and dtype."""
    where = "gated_rms_norm"
    check_runnable(where, x=x, gate=gate, weight=weight)
    require(x.dim() >= 1 and gate.shape == x.shape, where,
            f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must have one shape")
    D = x.shape[-1]
    require(weight.shape == (D,), where, f"weight must be [{D}], got {tuple(weight.shape)}")
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        check_dtype(where, name, t, FLOAT_DTYPES)
        check_inner_contiguous(where, name, t)
    tokens, heads, sxt, sxh = _token_head_strides(x)
    _, _, sgt, sgh = _token_head_strides(gate)
    n = tokens * heads
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n:
        block_d = next_pow2(D)
        block_r = max(1, min(16, 4096 // block_d))
        _gated_rms_norm_kernel[(triton.cdiv(n, block_r),)](
            out, x, gate, weight, eps, n, heads, sxt, sxh, sgt, sgh,
            D=D, BLOCK_D=block_d, BLOCK_R=block_r,
            PROD_DTYPE=_TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)],
            num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------
# the decay and write strength (g, beta) from in_proj_ba's outputs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gdn_gating_kernel(
    g_ptr, beta_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, num_rows, stride_ar, stride_br,
    H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    a = tl.load(a_ptr + rows[:, None] * stride_ar + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold
    decay = tl.exp(tl.load(a_log_ptr + cols, mask=col_ok, other=0.0).to(tl.float32))
    tl.store(g_ptr + rows[:, None] * H + cols[None, :], -decay[None, :] * softplus, mask=mask)
    b = tl.load(b_ptr + rows[:, None] * stride_br + cols[None, :], mask=mask, other=0.0)
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    tl.store(beta_ptr + rows[:, None] * H + cols[None, :], beta.to(b.dtype), mask=mask)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's (g, beta) in one launch (the contract of
    ``kernels.linear_reference.gdn_gating``). a, b: [T, Hv] (rows may be strided, last dim
    contiguous); A_log, dt_bias: [Hv]. Returns new contiguous g (float32) and beta (b's dtype)."""
    where = "gdn_gating"
    check_runnable(where, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    require(a.dim() == 2 and b.shape == a.shape, where,
            f"a {tuple(a.shape)} and b {tuple(b.shape)} must be one [T, Hv] shape")
    T, H = a.shape
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        require(t.shape == (H,) and t.is_contiguous(), where, f"{name} must be a contiguous [{H}], got {tuple(t.shape)}")
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        check_dtype(where, name, t, FLOAT_DTYPES)
    check_inner_contiguous(where, "a", a)
    check_inner_contiguous(where, "b", b)
    g = torch.empty((T, H), dtype=torch.float32, device=a.device)
    beta = torch.empty((T, H), dtype=b.dtype, device=b.device)
    if T:
        block_h = next_pow2(H)
        block_r = max(1, min(64, 2048 // block_h))
        _gdn_gating_kernel[(triton.cdiv(T, block_r),)](
            g, beta, a, b, A_log, dt_bias, T, a.stride(0), b.stride(0),
            H=H, BLOCK_H=block_h, BLOCK_R=block_r, num_warps=4,
        )
    return g, beta
