"""GGUF (ggml) block-quantized weights in PyTorch: the reference of ``kernels/cpu/gguf_gemm.cpp``.

A GGUF weight of N rows and K columns (K, ggml's ``ne[0]``, runs along a row) is stored
row-major as N rows of K / 32 blocks, each block 32 consecutive weights of one row. A
packed weight here is that storage as ``uint8 [N, K / 32 * block_bytes]``. The block
layouts (ggml's ``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``, little-endian) and how
ggml dequantizes them (``dequantize_row_q4_0`` ...), in float32 with d, m fp16 -> float32:

    Q4_0   18 bytes   d fp16 | qs[16]          w[j] = d * (q[j] - 8)
    Q4_1   20 bytes   d fp16 | m fp16 | qs[16] w[j] = d * q[j] + m
    Q8_0   34 bytes   d fp16 | qs[32] int8     w[j] = d * qs[j]

    4-bit: q[j] = qs[j] & 0xF and q[j + 16] = qs[j] >> 4 for j < 16 (the low nibbles hold
    the block's first half, the high nibbles its second half).

``w = d * q + m`` is a product rounded to float32, then a sum rounded to float32 (no fused
multiply-add), as ggml's C and the ``gguf`` package's numpy both compute it: ``dequantize``
gives the very floats they give (tests/kernels/test_gguf.py checks it against
``gguf.quants.dequantize``). ``linear`` is the reference GEMM: dequantize, then a float32
matmul; the compiled kernel computes the same products of x and the same w (activations stay
float32, nothing is quantized on the fly) and differs only in the order it sums them.
"""
from __future__ import annotations

import torch

# type name -> (weights per block, bytes per block)
BLOCK_LAYOUTS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
}
GGUF_TYPES = tuple(BLOCK_LAYOUTS)


def check_type(qtype: str) -> tuple[int, int]:
    if qtype not in BLOCK_LAYOUTS:
        raise ValueError(f"GGUF weight type {qtype!r} is not supported (supported: {', '.join(GGUF_TYPES)})")
    return BLOCK_LAYOUTS[qtype]


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one packed row of ``k`` weights."""
    block, size = check_type(qtype)
    if k % block:
        raise ValueError(f"{qtype}: a row of {k} weights is not a whole number of {block}-weight blocks")
    return k // block * size


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 at byte ``offset`` of each block [..., bytes] -> float32 [..., 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., 16] uint8 -> [..., 32] float32: low nibbles first, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.float32)


def dequantize(packed: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """uint8 [N, row_bytes(qtype, k)] -> float32 [N, k], ggml's values exactly."""
    block, size = check_type(qtype)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype}: a packed weight of {k} columns is uint8 [N, {row_bytes(qtype, k)}], got "
                         f"{packed.dtype} {list(packed.shape)}")
    n = packed.shape[0]
    blocks = packed.reshape(n, k // block, size)
    d = _fp16(blocks, 0)
    if qtype == "Q4_0":
        w = d * (_nibbles(blocks[..., 2:]) - 8.0)
    elif qtype == "Q4_1":
        w = d * _nibbles(blocks[..., 4:]) + _fp16(blocks, 2)  # two roundings, as ggml: no fma
    else:  # Q8_0
        w = d * blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    return w.reshape(n, k)


def linear(x: torch.Tensor, packed: torch.Tensor, qtype: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for x [..., K] and W the packed [N, K] weight: dequantize, then a
    float32 matmul. The result is float32 (x's dtype is cast to it first)."""
    k = x.shape[-1]
    w = dequantize(packed, qtype, k)
    y = torch.nn.functional.linear(x.to(torch.float32), w)
    return y if bias is None else y + bias.to(torch.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [T, K] -> its Q8 blocks (``linear_q8``'s activations): q int8 [T, K] and d float32
    [T, K / 32], per block of 32 d = amax / 127 and q = x * (1 / d) rounded to nearest even (0 where
    the block is all zeros); d stays float32 (llama.cpp's Q8_0 rounds it to fp16)."""
    t, k = x.shape
    b = x.to(torch.float32).reshape(t, k // 32, 32)
    d = b.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None]).to(torch.int8)  # torch.round: half to even
    return q.reshape(t, k), d


def linear_q8(x: torch.Tensor, packed: torch.Tensor, qtype: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of the int8-activation GEMM (``gguf_linear_q8``): x [T, K] quantized by
    ``quantize_activations``, each block's products of integer quants summed exactly, then
    y = sum over blocks of d_w * d_x * that (+ Q4_1's m * d_x * the block's sum of q), in float64,
    rounded to float32 once."""
    block, size = check_type(qtype)
    t, k = x.shape
    n = packed.shape[0]
    q, dx = quantize_activations(x)
    qx = q.reshape(t, k // block, block).double()
    blocks = packed.reshape(n, k // block, size)
    dw = _fp16(blocks, 0)[..., 0].double()  # [N, nb]
    if qtype == "Q8_0":
        qw = blocks[..., 2:].contiguous().view(torch.int8).double()
    else:
        qw = _nibbles(blocks[..., 2 if qtype == "Q4_0" else 4:]).double() - (8 if qtype == "Q4_0" else 0)
    # the block dot products: sums of 32 integer products below 2^14 each, exact in float64
    dots = torch.einsum("tbi,nbi->tnb", qx, qw)
    y = (dots * dw[None] * dx.double()[:, None, :]).sum(-1)
    if qtype == "Q4_1":
        y += (_fp16(blocks, 2)[..., 0].double()[None] * (dx.double() * qx.sum(-1).double())[:, None, :]).sum(-1)
    y = y.to(torch.float32)
    return y if bias is None else y + bias.to(torch.float32)


def quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float [N, K] -> packed uint8, by round to nearest (ggml's ``quantize_row_*_ref`` up to ties);
    for tests and benchmarks that need realistic packed weights (any bytes are valid input to
    ``dequantize`` except fp16 infinities and NaNs)."""
    block, size = check_type(qtype)
    n, k = w.shape
    row_bytes(qtype, k)
    b = w.to(torch.float32).reshape(n, k // block, block)
    if qtype == "Q8_0":
        amax = b.abs().amax(-1, keepdim=True)
        d = (amax / 127.0).to(torch.float16)
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(amax))
        qs = (b * inv).round().clamp(-128, 127).to(torch.int8).view(torch.uint8)
        head = d.view(torch.uint8).reshape(n, k // block, 2)
        return torch.cat([head, qs], -1).reshape(n, -1).contiguous()
    if qtype == "Q4_0":
        idx = b.abs().argmax(-1, keepdim=True)
        mx = b.gather(-1, idx)
        d = (mx / -8.0).to(torch.float16)
        inv = torch.where(d.float() != 0, 1.0 / d.float(), torch.zeros_like(mx))
        q = (b * inv + 8.5).floor().clamp(0, 15).to(torch.uint8)
        head = d.view(torch.uint8).reshape(n, k // block, 2)
    else:  # Q4_1
        lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
        d = ((hi - lo) / 15.0).to(torch.float16)
        m = lo.to(torch.float16)
        inv = torch.where(d.float() != 0, 1.0 / d.float(), torch.zeros_like(lo))
        q = ((b - m.float()) * inv + 0.5).floor().clamp(0, 15).to(torch.uint8)
        head = torch.cat([d.view(torch.uint8).reshape(n, k // block, 2), m.view(torch.uint8).reshape(n, k // block, 2)], -1)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([head, qs], -1).reshape(n, -1).contiguous()
