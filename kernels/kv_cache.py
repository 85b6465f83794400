"""Writing new tokens' keys and values into the paged KV cache.

An FP8 cache (torch.float8_e4m3fn) holds each value quantized with its layer's
per-tensor scale: e4m3(clamp(x / scale, -448, 448)), rounded to nearest even,
as ``torch``'s cast does. Compiled for CUDA the cast is the hardware's
(``cvt.rn.satfinite`` on sm_89+); Triton's interpreter truncates instead
(and mis-rounds carries), so interpreted the rounding is done in integer
arithmetic (``_e4m3_bits``), equal to torch's bit for bit.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    check_contiguous,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_kv_cache_dtype,
    check_runnable,
    next_pow2,
    require,
)

# Read once, like triton.jit itself reads it when the kernels are defined.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def _e4m3_bits(x):
    # float32 in [-448, 448] (or NaN) -> its e4m3fn code, rounded to nearest even (uint8).
    sign = ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint32)
    a = tl.abs(x)
    # Below 2^-6 the codes are multiples of 2^-9 (subnormals; 8 * 2^-9 is the smallest normal,
    # code 8): adding 2^23 rounds a * 2^9 to an integer, to nearest even.
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    # Normal: keep 3 of float32's 23 mantissa bits, rounding to nearest even (a carry moves
    # into the exponent, as it should), then rebias the exponent from 127 to 7.
    u = a.to(tl.uint32, bitcast=True)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    code = tl.where(a < 0.015625, subnormal, normal)
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize(x, scale, FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    # x [BLOCK_H, BLOCK_D] -> what the cache holds: x itself, or e4m3(clamp(x / scale)).
    # (every return sits in an if/else branch: compiled, a constexpr if with a return after it
    # is typed as one function that returns both e4m3 and x's dtype, which Triton refuses)
    if FP8:
        y = tl.clamp(x.to(tl.float32) / scale, -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        if INTERPRETED:
            return _e4m3_bits(y).to(tl.float8e4nv, bitcast=True)
        else:
            return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        return x


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, H, D]
    value_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, H, D]
    v_cache_ptr,  # [num_blocks, block_size, H, D]
    slot_mapping_ptr,  # [T]
    block_size,
    k_scale,  # FP8: the cache holds key / k_scale
    v_scale,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the cache is float8_e4m3fn: quantize with the scales
):
    # One program per token: copies (or quantizes) its [H, D] key and value rows.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # int64: block * block stride can pass 2^31 in a large cache.
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM) & (slot >= 0)  # [BLOCK_H, BLOCK_D]

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
    tl.store(k_dst, _quantize(k, k_scale, FP8, _INTERPRETED), mask=mask)
    tl.store(v_dst, _quantize(v, v_scale, FP8, _INTERPRETED), mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key and value into its cache slot, in place.

    key, value: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], any
        strides with stride 1 in head_dim (the engine passes kv_cache[l, :, 0]
        and kv_cache[l, :, 1], which are not contiguous); key's dtype, or
        float8_e4m3fn: then each value is stored as e4m3(clamp(x / scale,
        -448, 448)), rounded to nearest even, with k_scale for keys and
        v_scale for values (1.0 for any other cache)
    slot_mapping: [num_tokens] int32 or int64; slot = block_id * block_size + offset.
        A negative slot skips its token (padding). Slots are not range-checked
        (that would need a device sync): the caller guarantees
        slot < num_blocks * block_size.

    Modifies only k_cache and v_cache.
    """
    where = "store_kv_cache"
    check_runnable(where, key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_dim(where, "key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_dim(where, "k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_dim(where, "slot_mapping", slot_mapping, 1, "[num_tokens]")
    require(value.shape == key.shape, where, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    require(
        v_cache.shape == k_cache.shape,
        where,
        f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}",
    )
    num_tokens, num_heads, head_dim = key.shape
    require(
        tuple(k_cache.shape[2:]) == (num_heads, head_dim),
        where,
        f"cache [num_kv_heads, head_dim] = {tuple(k_cache.shape[2:])} does not match key's {(num_heads, head_dim)}",
    )
    require(
        slot_mapping.shape[0] == num_tokens,
        where,
        f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens",
    )
    check_dtype(where, "key", key, FLOAT_DTYPES)
    require(value.dtype == key.dtype, where, f"value dtype {value.dtype} != key dtype {key.dtype}")
    check_kv_cache_dtype(where, "k_cache", k_cache, key.dtype, k_scale, v_scale)
    require(v_cache.dtype == k_cache.dtype, where, f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    check_dtype(where, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    check_contiguous(where, "slot_mapping", slot_mapping)
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_inner_contiguous(where, name, t)
    if num_tokens == 0:
        return

    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_cache.shape[1],
        float(k_scale), float(v_scale),
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim),
        FP8=k_cache.dtype == FP8_KV_DTYPE,
    )
