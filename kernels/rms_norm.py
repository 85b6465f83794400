"""RMSNorm, alone and fused with the residual add that precedes it (pre-norm layers) or follows
it (Gemma 4's post-norms: h + norm(x), then its layer scalar and the next layer's norm)."""
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
    next_pow2,
    require,
)


@triton.jit
def normed(h, inv_rms, w, OFFSET: tl.constexpr, FLOAT32_WEIGHT: tl.constexpr):
    # h: float32 rows, inv_rms their 1 / rms (broadcast); w: the weight in the input dtype ->
    # the norm in that dtype, in one of the three forms (see _rms_norm_kernel).
    if OFFSET:
        return (h * inv_rms * (1.0 + w.to(tl.float32))).to(w.dtype)
    elif FLOAT32_WEIGHT:
        return (h * inv_rms * w.to(tl.float32)).to(w.dtype)
    else:
        return (h * inv_rms).to(w.dtype) * w


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H]
    residual_out_ptr,  # [T, H]; written only when ADD_RESIDUAL or NORM_AFTER
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H]; read only when ADD_RESIDUAL or ADD_AFTER
    weight_ptr,  # [H]
    scale_ptr,  # [1]; read only when HAS_SCALE
    next_weight_ptr,  # [H]; read only when NORM_AFTER
    eps,
    stride_xt, stride_rt, stride_ot, stride_rot,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    FLOAT32_WEIGHT: tl.constexpr,
    ADD_AFTER: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NORM_AFTER: tl.constexpr,
):
    # One program per token row. The steps and their dtypes follow
    # HF LlamaRMSNorm: add in the input dtype, normalise in float32, cast
    # back, then scale by the weight in the input dtype. OFFSET (Gemma 3's
    # form): scale by 1 + weight in float32, then cast back; FLOAT32_WEIGHT
    # (Gemma 4's): by the weight in float32, then cast back. ADD_AFTER: the
    # residual added to the cast result, in the input dtype (h + norm(x));
    # then HAS_SCALE: that sum times a scalar, in the input dtype (Gemma 4's
    # layer scalar); then NORM_AFTER: the sum kept (residual_out) and the
    # next norm of it, in the same form with next_weight, written to out.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_xt + cols, mask=ok, other=0.0)  # [BLOCK_H]
    if ADD_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_rt + cols, mask=ok, other=0.0)
        tl.store(residual_out_ptr + row * stride_rot + cols, x, mask=ok)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    y = normed(h, inv_rms, w, OFFSET, FLOAT32_WEIGHT)
    if ADD_AFTER:
        y = y + tl.load(residual_ptr + row * stride_rt + cols, mask=ok, other=0.0)
        if HAS_SCALE:
            y = y * tl.load(scale_ptr)
        if NORM_AFTER:
            tl.store(residual_out_ptr + row * stride_rot + cols, y, mask=ok)
            h = y.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
            w = tl.load(next_weight_ptr + cols, mask=ok, other=0.0)
            y = normed(h, inv_rms, w, OFFSET, FLOAT32_WEIGHT)
    tl.store(out_ptr + row * stride_ot + cols, y, mask=ok)


def _check(where: str, x: torch.Tensor, weight: torch.Tensor, **others: torch.Tensor) -> None:
    check_runnable(where, x=x, weight=weight, **others)
    check_dim(where, "x", x, 2, "[num_tokens, hidden_size]")
    check_dim(where, "weight", weight, 1, "[hidden_size]")
    require(
        weight.shape[0] == x.shape[1],
        where,
        f"weight has {weight.shape[0]} entries for hidden_size {x.shape[1]}",
    )
    check_dtype(where, "x", x, FLOAT_DTYPES)
    require(weight.dtype == x.dtype, where, f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    check_inner_contiguous(where, "x", x)
    check_inner_contiguous(where, "weight", weight)
    for name, t in others.items():
        require(t.shape == x.shape, where, f"{name} shape {tuple(t.shape)} != x shape {tuple(x.shape)}")
        require(t.dtype == x.dtype, where, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
        check_inner_contiguous(where, name, t)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: bool,
    float32_weight: bool, add_after: bool = False, scale: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    keeps_sum = residual is not None and (not add_after or next_weight is not None)
    residual_out = torch.empty_like(out) if keeps_sum else None
    if num_tokens == 0:
        return out, residual_out
    block_h = next_pow2(hidden)
    # Placeholders for the unused pointers when there is no residual, scale or next norm.
    res_in = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else out
    _rms_norm_kernel[(num_tokens,)](
        out, res_out, x, res_in, weight, weight if scale is None else scale,
        weight if next_weight is None else next_weight, eps,
        x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
        HIDDEN=hidden,
        BLOCK_H=block_h,
        ADD_RESIDUAL=residual is not None and not add_after,
        OFFSET=offset,
        FLOAT32_WEIGHT=float32_weight,
        ADD_AFTER=add_after,
        HAS_SCALE=scale is not None,
        NORM_AFTER=next_weight is not None,
        num_warps=min(16, max(1, block_h // 512)),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             float32_weight: bool = False) -> torch.Tensor:
    """HF LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)), the norm in float32.
    ``offset``: Gemma 3's form, (1 + weight) * the norm in float32, cast back once;
    ``float32_weight``: Gemma 4's, weight * the norm in float32, cast back once.

    x: [num_tokens, hidden_size] (any row stride), weight: [hidden_size] in x's dtype.
    Returns a new contiguous [num_tokens, hidden_size] tensor in x's dtype.
    Modifies nothing.
    """
    _check("rms_norm", x, weight)
    out, _ = _launch(x, None, weight, eps, offset, float32_weight)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
    float32_weight: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; out = rms_norm(residual_out, weight, eps, offset, float32_weight).

    x, residual: [num_tokens, hidden_size] in one dtype; weight: [hidden_size].
    Returns new contiguous (out, residual_out); the add runs in the input
    dtype as in HF's decoder layer. Modifies neither x nor residual.
    """
    _check("fused_add_rms_norm", x, weight, residual=residual)
    out, residual_out = _launch(x, residual, weight, eps, offset, float32_weight)
    assert residual_out is not None
    return out, residual_out


def _check_scale(where: str, x: torch.Tensor, scale: torch.Tensor | None) -> None:
    if scale is not None:
        check_runnable(where, scale=scale)
        require(scale.numel() == 1 and scale.dtype == x.dtype, where,
                f"scale must be one value in x's dtype {x.dtype}, got {tuple(scale.shape)} {scale.dtype}")


def rms_norm_add(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
    float32_weight: bool = False, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """residual + rms_norm(x, weight, eps, offset, float32_weight), the add in the input dtype
    after the norm's cast (a post-norm layer's ``h + norm(x)``, Gemma 4's); with ``scale`` (one
    value in x's dtype: Gemma 4's layer scalar) that sum times it, in the input dtype.

    x, residual: [num_tokens, hidden_size] in one dtype; weight: [hidden_size].
    Returns a new contiguous tensor. Modifies neither x nor residual.
    """
    _check("rms_norm_add", x, weight, residual=residual)
    _check_scale("rms_norm_add", x, scale)
    out, _ = _launch(x, residual, weight, eps, offset, float32_weight, add_after=True, scale=scale)
    return out


def rms_norm_add_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor, eps: float,
    offset: bool = False, float32_weight: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = rms_norm_add(x, residual, weight, eps, offset, float32_weight, scale), and the next
    norm of h (``next_weight``, the same form and eps): returns (rms_norm(h, next_weight), h),
    one pass (a post-norm layer's sum feeding the next pre-norm: Gemma 4's).

    x, residual: [num_tokens, hidden_size] in one dtype; weight, next_weight: [hidden_size].
    Returns new contiguous tensors. Modifies neither x nor residual.
    """
    _check("rms_norm_add_norm", x, weight, residual=residual)
    _check("rms_norm_add_norm", x, next_weight)
    _check_scale("rms_norm_add_norm", x, scale)
    out, h = _launch(x, residual, weight, eps, offset, float32_weight, add_after=True, scale=scale,
                     next_weight=next_weight)
    assert h is not None
    return out, h
