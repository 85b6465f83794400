"""Rotary position embedding, neox / HF ``rotate_half`` style."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    next_pow2,
    require,
)


@triton.jit
def _rotate_heads(
    out_ptr, x_ptr, token, stride_xt, stride_xh, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # x = [x1 | x2] per head; out = x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin),
    # in x's dtype like HF (cos and sin arrive already cast to it).
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < HALF)  # [BLOCK_H, BLOCK_HALF]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    # out is contiguous [T, NUM_HEADS, 2 * HALF].
    dst = out_ptr + (token * NUM_HEADS + heads[:, None]) * (2 * HALF) + cols[None, :]
    tl.store(dst, x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(dst + HALF, x2 * cos[None, :] + x1 * sin[None, :], mask=mask)


@triton.jit
def _rope_kernel(
    q_out_ptr,  # [T, Hq, D] contiguous
    k_out_ptr,  # [T, Hk, D] contiguous
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hk, D]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_positions, D] float32: cos | sin
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token: all of its query and key heads share one cos/sin row.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0)  # [BLOCK_HALF] float32
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0)
    _rotate_heads(
        q_out_ptr, q_ptr, token, stride_qt, stride_qh,
        cos.to(q_ptr.dtype.element_ty), sin.to(q_ptr.dtype.element_ty),
        NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF,
    )
    _rotate_heads(
        k_out_ptr, k_ptr, token, stride_kt, stride_kh,
        cos.to(k_ptr.dtype.element_ty), sin.to(k_ptr.dtype.element_ty),
        NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply HF Llama's rotary embedding (``rotate_half`` convention), out of place.

    positions: [num_tokens] int32 or int64, each < max_positions (not checked:
        that would need a device sync)
    q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim];
        any strides with stride 1 in head_dim (views of a fused qkv are fine)
    cos_sin_cache: [max_positions, head_dim] float32; columns [:head_dim/2]
        hold cos(pos * inv_freq), columns [head_dim/2:] sin(pos * inv_freq)

    Returns new contiguous (q_out, k_out) in q's and k's dtypes; cos and sin
    are cast to that dtype before the arithmetic, as HF does. Modifies nothing.
    """
    where = "rotary_embedding"
    check_runnable(where, positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    check_dim(where, "positions", positions, 1, "[num_tokens]")
    check_dim(where, "q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    check_dim(where, "k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_dim(where, "cos_sin_cache", cos_sin_cache, 2, "[max_positions, head_dim]")
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    require(
        k.shape[0] == num_tokens and positions.shape[0] == num_tokens,
        where,
        f"token counts differ: positions {positions.shape[0]}, q {num_tokens}, k {k.shape[0]}",
    )
    require(k.shape[2] == head_dim, where, f"k head_dim {k.shape[2]} != q head_dim {head_dim}")
    require(head_dim % 2 == 0, where, f"head_dim must be even, got {head_dim}")
    require(
        cos_sin_cache.shape[1] == head_dim,
        where,
        f"cos_sin_cache has {cos_sin_cache.shape[1]} columns for head_dim {head_dim}",
    )
    check_dtype(where, "positions", positions, (torch.int32, torch.int64))
    check_dtype(where, "q", q, FLOAT_DTYPES)
    check_dtype(where, "k", k, FLOAT_DTYPES)
    check_dtype(where, "cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_contiguous(where, "positions", positions)
    check_inner_contiguous(where, "q", q)
    check_inner_contiguous(where, "k", k)
    check_inner_contiguous(where, "cos_sin_cache", cos_sin_cache)

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q_out, k_out, q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=half,
        BLOCK_HQ=next_pow2(num_q_heads),
        BLOCK_HK=next_pow2(num_k_heads),
        BLOCK_HALF=next_pow2(half),
    )
    return q_out, k_out
