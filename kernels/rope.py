"""Rotary position embedding, neox / HF ``rotate_half`` style; alone, and after the per-head q/k
(and V) norms of the families that have them, in one pass (``qk_norm_rope``)."""
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
from kernels.rms_norm import normed


@triton.jit
def _store_turned(dst, x1, x2, cos, sin, HALF: tl.constexpr, mask):
    # The halves [x1 | x2] of heads turned and stored at dst (its first half; the second HALF
    # on): x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin), in x's dtype like HF (cos and sin
    # [BLOCK_HALF] arrive already cast to it).
    tl.store(dst, x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(dst + HALF, x2 * cos[None, :] + x1 * sin[None, :], mask=mask)


@triton.jit
def _rotate_heads(
    out_ptr, x_ptr, token, stride_xt, stride_xh, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # x = [x1 | x2] per head, turned (_store_turned).
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < HALF)  # [BLOCK_H, BLOCK_HALF]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    # out is contiguous [T, NUM_HEADS, 2 * HALF].
    dst = out_ptr + (token * NUM_HEADS + heads[:, None]) * (2 * HALF) + cols[None, :]
    _store_turned(dst, x1, x2, cos, sin, HALF, mask)


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


@triton.jit
def _norm_rotate_heads(
    out_ptr, x_ptr, w_ptr, token, stride_xt, stride_xh, cos, sin, eps,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, OFFSET: tl.constexpr, FLOAT32_WEIGHT: tl.constexpr,
    ROTATE: tl.constexpr, UNIT_WEIGHT: tl.constexpr,
):
    # Each head's RMSNorm over HEAD_DIM (kernels.rms_norm's forms; UNIT_WEIGHT: no weight, the
    # norm cast back), then, with ROTATE, its first 2 * HALF dims turned as rotary_embedding
    # turns them (_store_turned); dims from 2 * HALF on (partial rotary) pass through normed.
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    rest = 2 * HALF + tl.arange(0, BLOCK_REST)
    head_ok = heads[:, None] < NUM_HEADS
    mask = head_ok & (cols[None, :] < HALF)  # [BLOCK_H, BLOCK_HALF]
    rest_mask = head_ok & (rest[None, :] < HEAD_DIM)
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(src + cols[None, :], mask=mask, other=0.0)
    x2 = tl.load(src + HALF + cols[None, :], mask=mask, other=0.0)
    h1, h2 = x1.to(tl.float32), x2.to(tl.float32)
    squares = tl.sum(h1 * h1, axis=1) + tl.sum(h2 * h2, axis=1)
    if HEAD_DIM > 2 * HALF:
        x3 = tl.load(src + rest[None, :], mask=rest_mask, other=0.0)
        h3 = x3.to(tl.float32)
        squares += tl.sum(h3 * h3, axis=1)
    inv_rms = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]
    dst = out_ptr + (token * NUM_HEADS + heads[:, None]) * HEAD_DIM
    if UNIT_WEIGHT:
        y1, y2 = (h1 * inv_rms).to(x1.dtype), (h2 * inv_rms).to(x1.dtype)
        if HEAD_DIM > 2 * HALF:
            tl.store(dst + rest[None, :], (h3 * inv_rms).to(x1.dtype), mask=rest_mask)
    else:
        y1 = normed(h1, inv_rms, tl.load(w_ptr + cols, mask=cols < HALF, other=0.0)[None, :], OFFSET, FLOAT32_WEIGHT)
        y2 = normed(h2, inv_rms, tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0)[None, :], OFFSET,
                    FLOAT32_WEIGHT)
        if HEAD_DIM > 2 * HALF:
            w3 = tl.load(w_ptr + rest, mask=rest < HEAD_DIM, other=0.0)[None, :]
            tl.store(dst + rest[None, :], normed(h3, inv_rms, w3, OFFSET, FLOAT32_WEIGHT), mask=rest_mask)
    if ROTATE:
        _store_turned(dst + cols[None, :], y1, y2, cos, sin, HALF, mask)
    else:
        tl.store(dst + cols[None, :], y1, mask=mask)
        tl.store(dst + HALF + cols[None, :], y2, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_out_ptr, k_out_ptr, v_out_ptr,  # [T, H, D] contiguous each
    q_ptr, k_ptr, v_ptr,  # [T, H, D], any token and head strides
    q_w_ptr, k_w_ptr,  # [D]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_positions, 2 * HALF] float32: cos | sin
    eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    OFFSET: tl.constexpr, FLOAT32_WEIGHT: tl.constexpr, HAS_K: tl.constexpr, NORM_V: tl.constexpr,
):
    # One program per token: its query heads, then its key heads (HAS_K), normed and rotated;
    # its value heads (NORM_V) normed with a unit weight.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cache
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0).to(dtype)
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0).to(dtype)
    _norm_rotate_heads(q_out_ptr, q_ptr, q_w_ptr, token, stride_qt, stride_qh, cos, sin, eps, NUM_Q_HEADS,
                       HEAD_DIM, HALF, BLOCK_HQ, BLOCK_HALF, BLOCK_REST, OFFSET, FLOAT32_WEIGHT, True, False)
    if HAS_K:
        _norm_rotate_heads(k_out_ptr, k_ptr, k_w_ptr, token, stride_kt, stride_kh, cos, sin, eps, NUM_K_HEADS,
                           HEAD_DIM, HALF, BLOCK_HK, BLOCK_HALF, BLOCK_REST, OFFSET, FLOAT32_WEIGHT, True, False)
    if NORM_V:
        _norm_rotate_heads(v_out_ptr, v_ptr, q_w_ptr, token, stride_vt, stride_vh, cos, sin, eps, NUM_K_HEADS,
                           HEAD_DIM, HALF, BLOCK_HK, BLOCK_HALF, BLOCK_REST, OFFSET, FLOAT32_WEIGHT, False, True)


def qk_norm_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    q_weight: torch.Tensor, k_weight: torch.Tensor | None, cos_sin_cache: torch.Tensor, eps: float,
    offset: bool = False, float32_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-head RMSNorm of q (``q_weight``) and k (``k_weight``) in ``kernels.rms_norm``'s form
    (``offset``, ``float32_weight``), then ``rotary_embedding`` of both, in one pass; with
    ``v``, V's per-head norm with no weight (Gemma 4's), not rotated. The norm of each head is
    cast back to its dtype before the rotation, as the two kernels one after the other do. A
    table narrower than the head (partial rotary: ``rotary_dim`` columns) turns the first
    ``rotary_dim`` dims of each head; the rest pass through normed.

    positions: [num_tokens]; q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens,
        num_kv_heads, head_dim] or None (k None: a layer that reads another's KV, q alone);
        any strides with stride 1 in head_dim (views of a fused qkv projection)
    q_weight, k_weight: [head_dim] in q's dtype;
    cos_sin_cache: [max_positions, rotary_dim] float32, rotary_dim even and <= head_dim

    Returns new contiguous (q_out, k_out, v_out), None where not given. Modifies nothing.
    """
    where = "qk_norm_rope"
    check_runnable(where, positions=positions, q=q, q_weight=q_weight, cos_sin_cache=cos_sin_cache)
    check_dim(where, "q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    num_tokens, num_q_heads, head_dim = q.shape
    others = {name: t for name, t in (("k", k), ("v", v)) if t is not None}
    require(v is None or k is not None, where, "v is normed beside k: give k too")
    require(k is None or k_weight is not None, where, "k needs k_weight")
    for name, t in others.items():
        check_runnable(where, **{name: t})
        check_dim(where, name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        require(t.shape == others["k"].shape and t.shape[0] == num_tokens and t.shape[2] == head_dim, where,
                f"{name} shape {tuple(t.shape)} does not match q {tuple(q.shape)} and k")
        require(t.dtype == q.dtype, where, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
        check_inner_contiguous(where, name, t)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight if k is not None else None)):
        if w is not None:
            require(w.shape == (head_dim,) and w.dtype == q.dtype, where,
                    f"{name} must be [{head_dim}] in q's dtype {q.dtype}, got {tuple(w.shape)} {w.dtype}")
    rotary_dim = cos_sin_cache.shape[-1]
    require(positions.shape == (num_tokens,), where, f"positions must be [{num_tokens}]")
    require(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, where,
            f"cos_sin_cache has {rotary_dim} columns: an even count up to head_dim {head_dim}")
    check_dtype(where, "positions", positions, (torch.int32, torch.int64))
    check_dtype(where, "q", q, FLOAT_DTYPES)
    check_dtype(where, "cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_contiguous(where, "positions", positions)
    check_inner_contiguous(where, "q", q)
    check_inner_contiguous(where, "cos_sin_cache", cos_sin_cache)

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = None if k is None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    v_out = None if v is None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_tokens == 0:
        return q_out, k_out, v_out
    num_k_heads = 1 if k is None else k.shape[1]
    kk, vv = (q if k is None else k), (q if v is None else v)  # placeholders for absent pointers
    _qk_norm_rope_kernel[(num_tokens,)](
        q_out, q_out if k_out is None else k_out, q_out if v_out is None else v_out,
        q, kk, vv, q_weight, q_weight if k_weight is None else k_weight, positions, cos_sin_cache, eps,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim, HALF=rotary_dim // 2,
        BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(num_k_heads), BLOCK_HALF=next_pow2(rotary_dim // 2),
        BLOCK_REST=next_pow2(max(1, head_dim - rotary_dim)),
        OFFSET=offset, FLOAT32_WEIGHT=float32_weight, HAS_K=k is not None, NORM_V=v is not None,
    )
    return q_out, k_out, v_out
