"""MXFP4 (OCP Microscaling, FP4 e2m1 elements, e8m0 scales, blocks of 32) in PyTorch: the
format of gpt-oss's expert weights, the CPU path's dequantization and the tests' quantizer.

Layout (gpt-oss checkpoints, transformers' ``integrations/mxfp4.py``), for a weight
W [..., rows, K] (K a multiple of 32, the reduced dim)::

    blocks  [..., rows, K / 32, 16] uint8   two e2m1 codes a byte: element 2j of a block in the
                                            low nibble of byte j, element 2j + 1 in the high one
    scales  [..., rows, K / 32] uint8       e8m0: the block's factor 2^(s - 127); 255 is NaN
    W[..., r, 32 g + i] = e2m1(code i of blocks[..., r, g]) * 2^(scales[..., r, g] - 127)

e2m1 code (4 bits): bit 3 the sign, bits 2-0 the magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6.
The fused MoE kernels take the blocks flattened to bytes, [..., rows, K / 2]
(``blocks.flatten(-2)``, a view), beside the scales.

Every e2m1 value times a power of two in e8m0's range is a float32 exactly (subnormal below
2^-126), up to float32's largest (2^128 and past, scale 254 with |value| >= 2, is inf), so
dequantizing is exact in float32; rounding it to bfloat16 is exact too (the same exponent
range, 2 mantissa bits needed of 7), to float16 only within its range.
"""
from __future__ import annotations

import torch

BLOCK = 32  # elements per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255
# Round to nearest, ties to even: magnitude code c + 1 is taken past the midpoint between the
# values of c and c + 1, and at the midpoint when c + 1 is even (its mantissa bit is 0).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"mxfp4: blocks must be [..., groups, {BLOCK // 2}] and scales [..., groups], got "
                         f"{list(blocks.shape)} and {list(scales.shape)}")


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 -> float32 2^(s - 127) (exact, 2^-127 included), NaN for 255."""
    powers = torch.pow(2.0, scales.to(torch.float64) - E8M0_BIAS)  # exact in float64
    return torch.where(scales == E8M0_NAN, float("nan"), powers).to(torch.float32)


def unpack_e2m1(blocks: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] int64 codes: byte j's low nibble is element 2j, its high nibble 2j + 1."""
    b = blocks.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes in [0, 15] -> [..., n] uint8 (the inverse of ``unpack_e2m1``)."""
    c = codes.to(torch.int64)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> W [..., G * 32] float32 (exact)."""
    _check_packed(blocks, scales)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = lut[unpack_e2m1(blocks)]  # [..., G, 32]
    return (values * e8m0_to_float(scales)[..., None]).flatten(-2)


def dequantize_mxfp4_packed(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernels' layout: packed [..., K / 2] uint8 (blocks flattened), scales [..., K / 32] -> [..., K] float32."""
    return dequantize_mxfp4(packed.unflatten(-1, (-1, BLOCK // 2)), scales)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., K] (K a multiple of 32, finite) -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8).

    Each block of 32 takes the least power of two 2^k with amax / 2^k <= 6 (e2m1's largest
    value: nothing clips), k within e8m0's [-127, 127]; an all-zero block takes 2^-127
    (s = 0). Beyond 2^127 * 6 values clip to +-6 * 2^127; below 2^-127 * 0.25 they round
    to zero. Each w / 2^k is rounded to the nearest e2m1 value, ties to the even code;
    the sign is kept (a negative value that rounds to 0 is -0, code 8)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4: the last dim ({w.shape[-1]}) must be a multiple of {BLOCK}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("mxfp4: cannot quantize non-finite values")
    g = w.to(torch.float64).unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    amax = g.abs().amax(dim=-1)  # [..., G]
    # k = ceil(log2(amax / 6)), then nudged so that 6 * 2^(k-1) < amax <= 6 * 2^k exactly.
    k = torch.ceil(torch.log2(torch.where(amax > 0, amax, 1.0) / E2M1_MAX))
    k = torch.where(E2M1_MAX * torch.pow(2.0, k) < amax, k + 1, k)
    k = torch.where(E2M1_MAX * torch.pow(2.0, k - 1) >= amax, k - 1, k)
    k = torch.where(amax > 0, k, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = g / torch.pow(2.0, k)[..., None]  # exact: a power of two
    mag = scaled.abs()
    code = torch.zeros_like(mag, dtype=torch.int64)
    for i, mid in enumerate(_MIDPOINTS):
        code += (mag >= mid) if (i + 1) % 2 == 0 else (mag > mid)
    code |= torch.signbit(scaled).to(torch.int64) << 3  # -0.0 stays negative
    blocks = pack_e2m1(code)  # [..., G, 16]
    return blocks, (k + E8M0_BIAS).to(torch.uint8)
