"""What the paged and the dense prefill attention kernels share: tile numbering and constants.

Both kernels number a batch's query tiles from ``query_start_loc`` alone (no
host sync, CUDA-graph safe): sequence b's tiles start at

    first_tile(b) = query_start_loc[b] // BLOCK_Q + b

which leaves room for its cdiv(q_len_b, BLOCK_Q) tiles, so a grid of
num_tokens // BLOCK_Q + B tiles covers every batch of num_tokens tokens and B
sequences; a program finds its sequence by binary search (``_locate_tile``)
and surplus tiles exit at once. ``paged_attention`` and
``prefill_attention`` both import this module; neither imports the other's
helpers.

Attention sinks (gpt-oss): ``sinks`` [num_q_heads] float32, one learned logit per query
head that joins the softmax's denominator and nothing else,

    out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m)),  m = max(max_j s_j, sink_h),

which every attention path takes as an optional argument (None: no sink, the code that
ran before). ``check_sinks`` (kernels/_checks.py) is the launchers' (and the references') argument check; the
kernels fold the sink in once, after the key loop (or in the split-K combine), as a key
whose value is zero.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Finite stand-in for -inf as the running max's start: a row that has seen
# only masked keys (score -inf) keeps it, and then p = exp2(-inf - _NEG_BIG)
# = 0 and alpha = exp2(0) = 1, where a true -inf would give -inf - -inf = NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)  # the same inside the kernels (a sink to log2 units)
# Read once, like triton.jit itself reads it when the kernels are defined.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_MAX_GRID_Y = 65535  # CUDA's bound on a grid's second dimension (the tiles)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    # Largest b < num_seqs with first_tile(b) <= tile; first_tile(0) = 0.
    # Invariant: first_tile(lo) <= tile < first_tile(hi) (first_tile(num_seqs) = inf).
    lo = tl.zeros((), dtype=tl.int32)
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid)
    return lo


@triton.jit
def _locate_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Tile ``tile``'s sequence, that sequence's first query row and query count, and the
    tile's first query token within it (>= the count: a surplus tile)."""
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tok0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    return seq, q_start, q_len, tok0


@triton.jit
def _fold_sink(m_i, l_i, sink):
    """Online-softmax state (running max m_i, in log2 units, and denominator l_i) with the
    sink (log2 units) joined as one more key of value zero: (alpha, l) where the output's
    accumulator is to be multiplied by alpha, and l is the new denominator."""
    m_fin = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_fin)
    return alpha, l_i * alpha + tl.exp2(sink - m_fin)
