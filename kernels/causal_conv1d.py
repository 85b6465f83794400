"""Gated DeltaNet's short convolution: a depthwise causal conv1d over a varlen batch with
per-sequence state (``kernels.linear_reference.causal_conv1d`` is the reference).

One program per (token tile, channel block). Token tiles are numbered from
``query_start_loc`` alone, as the attention kernels' query tiles are
(``_attention_common``): sequence b's tiles start at query_start_loc[b] // BLOCK_T + b, so a
grid of T // BLOCK_T + B tiles covers any batch of T tokens and B sequences without a host
sync (CUDA-graph safe), and every sequence owns at least one tile, even with no tokens.

Output t of a sequence reads inputs t-K+1..t; those before the sequence's first token come
from its conv state (or are zeros). Only a sequence's first tile reads the state
(BLOCK_T >= K-1), and that same program writes the new state: the last K-1 inputs of
(state ++ tokens), read from x and the old state, stored after a barrier. So no other
program races on the slot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._attention_common import _locate_tile
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



@triton.jit
def _causal_conv1d_kernel(
    out_ptr,  # [T, C]
    x_ptr,  # [T, C]
    weight_ptr,  # [C, K]
    bias_ptr,  # [C] (read only when HAS_BIAS)
    state_ptr,  # [num_slots, C, K-1], in place
    slots_ptr,  # [B] int
    query_start_loc_ptr,  # [B+1] int32
    init_ptr,  # [B] bool (as uint8)
    num_seqs,
    C,
    stride_xt, stride_ot, stride_wc, stride_sn, stride_sc,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next_pow2(K - 1): the state's columns, padded
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    tile = tl.program_id(0)
    seq, start, length, tok0 = _locate_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_T)
    if (tok0 > 0) & (tok0 >= length):
        return  # surplus tile (tile 0 of a sequence always runs: it writes the state)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    init = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    state_row = state_ptr + slot * stride_sn + cols.to(tl.int64) * stride_sc  # [BLOCK_C] pointers
    start = start.to(tl.int64)

    t = tok0 + tl.arange(0, BLOCK_T)  # [BLOCK_T] token within the sequence
    t_ok = t < length
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + b[None, :]
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        p = t - (K - 1) + j  # [BLOCK_T] input position in the sequence; < 0: in the state
        from_x = t_ok & (p >= 0)
        from_state = t_ok & (p < 0) & init
        xv = tl.load(x_ptr + (start + p)[:, None] * stride_xt + cols[None, :],
                     mask=from_x[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        sv = tl.load(state_row[None, :] + (K - 1 + p)[:, None],
                     mask=from_state[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + cols * stride_wc + j, mask=col_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * (xv + sv)
    # Rounded to the output dtype, then the activation on that (F.conv1d then ACT2FN).
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    rows = (start + t).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & col_ok[None, :])

    if (tok0 == 0) & (slot >= 0):
        # New state: column s holds input position length - (K-1) + s of (state ++ tokens).
        s = tl.arange(0, BLOCK_S)
        s_ok = s < K - 1
        p_new = length - (K - 1) + s  # [BLOCK_S]
        x_new = tl.load(x_ptr + (start + p_new)[None, :] * stride_xt + cols[:, None],
                        mask=col_ok[:, None] & (s_ok & (p_new >= 0))[None, :], other=0.0)
        s_old = tl.load(state_row[:, None] + (K - 1 + p_new)[None, :],
                        mask=col_ok[:, None] & (s_ok & (p_new < 0) & init)[None, :], other=0.0)
        new = x_new.to(tl.float32) + s_old.to(tl.float32)  # [BLOCK_C, BLOCK_S]
        tl.debug_barrier()  # every read of the old state (above, any thread) before the writes
        tl.store(state_row[:, None] + s[None, :], new.to(state_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & s_ok[None, :])


def _check(x, weight, bias, conv_state, state_slots, query_start_loc, has_initial_state, activation):
    where = "causal_conv1d"
    tensors = dict(x=x, weight=weight, conv_state=conv_state, state_slots=state_slots,
                   query_start_loc=query_start_loc, has_initial_state=has_initial_state)
    if bias is not None:
        tensors["bias"] = bias
    check_runnable(where, **tensors)
    require(activation in ("silu", None), where, f"activation must be 'silu' or None, got {activation!r}")
    check_dim(where, "x", x, 2, "[num_tokens, channels]")
    check_dim(where, "weight", weight, 2, "[channels, kernel_size]")
    check_dim(where, "conv_state", conv_state, 3, "[num_slots, channels, kernel_size - 1]")
    T, C = x.shape
    K = weight.shape[1]
    require(weight.shape[0] == C, where, f"weight has {weight.shape[0]} channels for x's {C}")
    require(K >= 2, where, f"kernel_size must be >= 2, got {K}")
    require(conv_state.shape[1:] == (C, K - 1), where,
            f"conv_state must be [num_slots, {C}, {K - 1}], got {tuple(conv_state.shape)}")
    if bias is not None:
        require(bias.shape == (C,), where, f"bias must be [{C}], got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight), ("conv_state", conv_state)):
        check_dtype(where, name, t, FLOAT_DTYPES)
        check_inner_contiguous(where, name, t)
    if bias is not None:
        check_dtype(where, "bias", bias, FLOAT_DTYPES)
        require(bias.stride(0) == 1 or C == 1, where, "bias must be contiguous")
    check_varlen_rows(where, state_slots, query_start_loc, has_initial_state)
    for name, t in (("state_slots", state_slots), ("query_start_loc", query_start_loc),
                    ("has_initial_state", has_initial_state)):
        check_inner_contiguous(where, name, t)


# Tiles (bench/gpu_linear_attention.py times them): decode-shaped batches (num_tokens <= 2 *
# num_seqs) and the rest.
CONFIG = {"decode": {"block_t": 4, "block_c": 256, "num_warps": 4},
          "prefill": {"block_t": 16, "block_c": 128, "num_warps": 4}}  # H100, 8k tokens: 254 us (64 x 128: 455)


def _tiles(num_tokens: int, num_seqs: int, kernel_size: int) -> tuple[int, int, int]:
    """(tokens per tile, channels per tile, warps); never fewer than K-1 tokens, so only a
    sequence's first tile reads its state."""
    cfg = CONFIG["decode" if num_tokens <= 2 * num_seqs else "prefill"]
    return max(cfg["block_t"], next_pow2(kernel_size - 1)), cfg["block_c"], cfg["num_warps"]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv1d over a varlen batch with per-sequence state (the contract of
    ``kernels.linear_reference.causal_conv1d``).

    x: [T, C] (any row stride); weight: [C, K]; bias: [C] or None; conv_state:
    [num_slots, C, K-1] (any slot/channel strides, updated in place); state_slots: [B] int
    (distinct, < 0: a padding row, no state read or written); query_start_loc: [B+1] int32;
    has_initial_state: [B] bool. Returns a new contiguous [T, C] tensor in x's dtype.
    """
    _check(x, weight, bias, conv_state, state_slots, query_start_loc, has_initial_state, activation)
    T, C = x.shape
    K = weight.shape[1]
    B = state_slots.shape[0]
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    block_t, block_c, num_warps = _tiles(T, B, K)
    block_c = min(block_c, next_pow2(C))
    grid = (T // block_t + B, triton.cdiv(C, block_c))
    _causal_conv1d_kernel[grid](
        out, x, weight, bias if bias is not None else x, conv_state, state_slots,
        query_start_loc.to(torch.int32), has_initial_state.view(torch.uint8),
        B, C,
        x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=K, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_S=next_pow2(K - 1),
        HAS_BIAS=bias is not None, SILU=activation == "silu",
        num_warps=num_warps,
    )
    return out
