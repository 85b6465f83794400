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
