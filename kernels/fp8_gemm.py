"""FP8 (e4m3) W8A8 GEMM for dense linear layers: y = x W^T with both operands in
float8_e4m3fn and float32 scales (the math and the two scale formats are stated
in ``kernels/fp8_reference.py``).

Layout::

    x8 [M, K] float8_e4m3fn, stride 1 in K          activations, from fp8_quantize(x[, bk])
    w8 [N, K] float8_e4m3fn, stride 1 in K          the checkpoint's [out, in] weight, unchanged
    per channel:   x_scale [M], w_scale [N]          float32, contiguous
    block scaled:  x_scale [M, cdiv(K, bk)]          float32, stride 1 in the last dim
                   w_scale [cdiv(N, bn), cdiv(K, bk)]

Why the weight stays [N, K]: Hopper's fp8 matrix instructions (wgmma, and the
mma.sync of sm_89+) take both fp8 operands K-major, so the checkpoint's row-major
weight is already the operand layout and a [BLOCK_K, BLOCK_N] tile loads as
BLOCK_N rows of BLOCK_K contiguous bytes. torch._scaled_mm wants it as the
column-major second operand, which ``w8.t()`` is, with no copy.

Why the scales sit where they do: a per-channel scale is constant along K, so it
factors out of the sum and is applied once, in the epilogue, to the float32
accumulator (acc * x_scale[m] * w_scale[n]); the K loop is a plain fp8 dot. A
block scale changes every bk columns, so each k-block's dot is accumulated on its
own (a fresh float32 partial) and added to the total scaled by
x_scale[m, kb] * w_scale[n // bn, kb]; a K tile never straddles two k-blocks
(the loop walks k-blocks, then the tiles inside one, masking a block's tail when
BLOCK_K does not divide bk). This also bounds how far Hopper's fp8 accumulation,
which keeps fewer than float32's bits, runs before it reaches float32: one k-block
(128 columns in the checkpoints); per channel the dots are told to promote every
K tile (``max_num_imprecise_acc``).

Grid: one program per (output tile, K split), as in ``kernels/int4_gemm.py``
(the split-K scheme both share is in ``kernels/_gemm_common.py``). Small M
(decode) is bound by reading W once (N*K bytes): K is split so that several
programs per SM stream the weight, each split stores float32 partials, and the
tile's last split to arrive (an atomic counter) sums them in split order,
applies the per-channel scales and writes y: one launch, deterministic.
A single row uses the "gemv" kernel (no tensor cores: the fp8 weight tile is
widened to float32 in registers); from two rows, 16-row tensor-core tiles are
faster. Large M is bound by the fp8 tensor cores: big tiles, GROUP_M ordering
for L2 reuse. ``torch._scaled_mm`` is the other backend (rowwise scales per
channel; cuBLASLt's 1x128 x 128x128 recipe for 128x128 blocks on sm_90):
``backend="auto"`` takes it from SCALED_MM_MIN_ROWS rows where it fits
(``default_backend``, ``scaled_mm_fits``), as it beats these kernels there.

Numerics: the products of two e4m3 values are exact in float32; sums run in
float32 (Hopper: from every k-block or K tile); the result is rounded once to out_dtype.
``fp8_quantize`` (``kernels/fp8_quant.py``, re-exported here) makes x8 and its
scales, bit for bit the reference's.
"""
from __future__ import annotations

import functools

import torch
import triton

from kernels._checks import (
    FLOAT_DTYPES,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    next_pow2,
    require,
)
from kernels._fp8_gemm_kernels import _fp8_gemm_kernel, _fp8_gemv_kernel
from kernels._gemm_common import (
    GemmTiles,
    SplitKCounters,
    choose_split,
    first_rows_per_variant,
    split_k_scratch,
    split_steps,
)
from kernels._gemm_common import num_sms as _num_sms  # looked up here: tests stand in an H200's count
from kernels.fp8_quant import fp8_quantize
from kernels.fp8_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

__all__ = ["FP8_DTYPE", "FP8_MAX", "FP8_MIN_SCALE", "Fp8Tiles", "default_backend", "default_tiles", "fp8_gemm",
           "fp8_quantize", "warm_up"]

_counter_buffer = SplitKCounters()  # the split-K counters of FP8 launches (int4's are its own)


# ---- tiles and backends ---------------------------------------------------------------------------------


BACKENDS = ("auto", "triton", "scaled_mm")
GEMV_MAX_ROWS = 1  # calls of at most this many rows use the GEMV kernel by default
# "auto": GEMMs of at least this many rows go to torch._scaled_mm where it fits (scaled_mm_fits),
# fewer to Triton. Measured on an H200 (README): Triton is faster up to 64 rows, torch._scaled_mm
# from 96, per channel and with 128x128 blocks alike.
SCALED_MM_MIN_ROWS = 65


class Fp8Tiles(GemmTiles):
    """kernel "dot": BLOCK_M x BLOCK_N output tiles through tl.dot (tensor cores); "gemv":
    ``block_m`` (1, 2, 4 or 8) rows of x per program, float32 FMAs in registers."""
    launcher = "fp8_gemm"


def _min_block_k(device: torch.device) -> int:
    return 32 if device.type == "cuda" else 16  # an fp8 MMA instruction takes 32 K values


def _fit_block_k(block_k: int, k: int, block_size: tuple[int, int] | None, device: torch.device) -> int:
    """BLOCK_K no longer than K needs; with block scales, the largest power of two dividing bk
    when that is long enough (no masked tail per k-block), else bk rounded up to a power of two."""
    low = _min_block_k(device)
    block_k = min(block_k, max(low, next_pow2(k)))
    if block_size is not None:
        bk = block_size[1]
        divisor = bk & -bk
        block_k = min(block_k, divisor if divisor >= low else max(low, next_pow2(bk)))
    return block_k


def _steps(k: int, block_k: int, block_size: tuple[int, int] | None) -> tuple[int, int, int]:
    """(STEP_K, NUM_STEPS, TILES_PER_STEP) of the K loop."""
    if block_size is None:
        return block_k, triton.cdiv(k, block_k), 1
    bk = block_size[1]
    return bk, triton.cdiv(k, bk), triton.cdiv(bk, block_k)


def default_tiles(m: int, n: int, k: int, block_size: tuple[int, int] | None, device: torch.device) -> Fp8Tiles:
    """Tiles from shapes alone, set from ``python -m bench.fp8_gemm --sweep`` on an H200 (README).
    One row (decode of a single sequence): the GEMV kernel, 16 weight rows x 512 columns a tile
    (256 for K past 8192), 2 warps, K split until ~16 programs per SM (near the M = 1 sweep's best
    tiles per shape, 2026-12-02: 69 us a Llama-3.1-8B layer against 77 with 64 x 256 tiles, 4 warps
    and ~8 programs per SM).
    More rows: tensor-core tiles growing with M; up to 64 rows K is split until ~3 programs per
    SM, with long K tiles (256) when K is long and the scales allow (per channel)."""
    sms = _num_sms(device)
    if m <= GEMV_MAX_ROWS:
        block_n, block_k = 16, _fit_block_k(512 if k <= 8192 else 256, k, block_size, device)
        _, num_steps, _ = _steps(k, block_k, block_size)
        split = choose_split(triton.cdiv(n, block_n) * triton.cdiv(m, next_pow2(m)), num_steps, 16 * sms)
        return Fp8Tiles(next_pow2(m), block_n, block_k, split, 1, 2, 2, "gemv")
    if m <= 16:  # bound by reading W: many programs, long K tiles in flight
        block_m, block_n, block_k, warps, stages = 16, 64, (256 if k >= 8192 else 128), 4, 4
    elif m <= 32:
        block_m, block_n, block_k, warps, stages = 32, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 64, 128, 4, 3
    elif m <= 256:
        block_m, block_n, block_k, warps, stages = 64, 128, 128, (8 if block_size is None else 4), 4
    elif block_size is None:  # bound by the tensor cores
        block_m, block_n, block_k, warps, stages = 256, 128, 128, 8, 3
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 128, 8, 4
    block_k = _fit_block_k(block_k, k, block_size, device)
    block_n = max(16, min(block_n, next_pow2(n)))
    _, num_steps, _ = _steps(k, block_k, block_size)
    split = 1
    if m <= 64:  # measured: from 96 rows on, splitting K costs more than the idle SMs it fills
        split = choose_split(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), num_steps, 3 * sms)
    return Fp8Tiles(block_m, block_n, block_k, split, 8, warps, stages)


def pick_tiles(config: Fp8Tiles | dict | None, m: int, n: int, k: int, block_size: tuple[int, int] | None,
               device: torch.device) -> Fp8Tiles:
    """``config`` itself (an Fp8Tiles or its dict), else ``default_tiles``."""
    if config is None:
        return default_tiles(m, n, k, block_size, device)
    return config if isinstance(config, Fp8Tiles) else Fp8Tiles.from_dict(config)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def scaled_mm_fits(x8: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                   block_size: tuple[int, int] | None) -> bool:
    """Whether torch._scaled_mm takes this call: CUDA, bfloat16 out, contiguous 16-byte-aligned
    x8 and w8, and either per-channel scales with K and N multiples of 16 (rowwise scaling), or
    128x128 block scales on sm_90 (cuBLASLt's 1x128 x 128x128 recipe) with N a multiple of 128
    and K of 512: cuBLASLt reads the weight scales in groups of 4 k-blocks, and with a k-block
    count that is not a multiple of 4 it returned wrong results here without an error."""
    n, k = w8.shape
    common = (x8.device.type == "cuda" and out_dtype == torch.bfloat16 and x8.is_contiguous()
              and w8.is_contiguous() and x8.data_ptr() % 16 == 0 and w8.data_ptr() % 16 == 0)
    if not common:
        return False
    if block_size is None:
        return k % 16 == 0 and n % 16 == 0
    return (tuple(block_size) == (128, 128) and k % 512 == 0 and n % 128 == 0 and w_scale.is_contiguous()
            and _capability(x8.device) == (9, 0))


def default_backend(m: int, x8: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                    block_size: tuple[int, int] | None) -> str:
    """What ``backend="auto"`` runs for an M-row call: "scaled_mm" from SCALED_MM_MIN_ROWS rows
    where it fits, else "triton"."""
    if m >= SCALED_MM_MIN_ROWS and scaled_mm_fits(x8, w8, w_scale, out_dtype, block_size):
        return "scaled_mm"
    return "triton"


def _scaled_mm(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype, block_size: tuple[int, int] | None) -> torch.Tensor:
    """torch._scaled_mm on a call that scaled_mm_fits; w8.t() is the column-major [K, N] operand."""
    m, n = x8.shape[0], w8.shape[0]
    if block_size is None:  # rowwise scales as [M, 1] and [1, N]
        return torch._scaled_mm(x8, w8.t(), scale_a=x_scale.view(m, 1), scale_b=w_scale.view(1, n),
                                out_dtype=out_dtype, use_fast_accum=False)
    # cuBLASLt's layouts: activation scales M-major ([M, K/128] with strides (1, M), a copy),
    # weight scales as W^T's [K/128, N/128] K-major (w_scale.t(), a view); M a multiple of 4
    # (zero rows appended, their outputs dropped).
    pad = -m % 4
    if pad:
        x8 = torch.cat([x8, x8.new_zeros(pad, x8.shape[1])])
        x_scale = torch.cat([x_scale, x_scale.new_ones(pad, x_scale.shape[1])])
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale.t().contiguous().t(), scale_b=w_scale.t(), out_dtype=out_dtype)
    return y[:m] if pad else y


# ---- launchers ------------------------------------------------------------------------------------------


def _check_gemm_args(x8, x_scale, w8, w_scale, out_dtype, block_size, backend) -> None:
    where = "fp8_gemm"
    require(backend in BACKENDS, where, f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    require(out_dtype in FLOAT_DTYPES, where,
            f"out_dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {out_dtype!r}")
    tensors = dict(x8=x8, x_scale=x_scale, w8=w8, w_scale=w_scale)
    if backend == "scaled_mm":
        require(all(t.device.type == "cuda" for t in tensors.values()), where,
                'backend "scaled_mm" (torch._scaled_mm) needs CUDA tensors')
    check_runnable(where, **tensors)
    check_dim(where, "x8", x8, 2, "[M, K]")
    check_dim(where, "w8", w8, 2, "[N, K] (the checkpoint's [out, in] layout)")
    for name, t in tensors.items():
        check_dtype(where, name, t, (FP8_DTYPE,) if name.endswith("8") else (torch.float32,))
        check_inner_contiguous(where, name, t)
    m, k = x8.shape
    n = w8.shape[0]
    require(k > 0, where, "x8 has K = 0 columns")
    require(w8.shape[1] == k, where, f"w8 must have K = {k} columns (x8's), got shape {tuple(w8.shape)}")
    if block_size is None:
        require(tuple(x_scale.shape) == (m,), where,
                f"x_scale must be [M = {m}] (per-token scales; block_size is None), got {tuple(x_scale.shape)}")
        require(tuple(w_scale.shape) == (n,), where,
                f"w_scale must be [N = {n}] (per-channel scales; block_size is None), got {tuple(w_scale.shape)}")
        return
    require(isinstance(block_size, (tuple, list)) and len(block_size) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_size), where,
            f"block_size must be None or a pair of ints >= 1 (bn, bk), got {block_size!r}")
    bn, bk = block_size
    kb = triton.cdiv(k, bk)
    require(tuple(x_scale.shape) == (m, kb), where,
            f"x_scale must be [M, cdiv(K, bk)] = [{m}, {kb}] (K = {k}, bk = {bk}), got {tuple(x_scale.shape)}")
    require(tuple(w_scale.shape) == (triton.cdiv(n, bn), kb), where,
            f"w_scale must be [cdiv(N, bn), cdiv(K, bk)] = [{triton.cdiv(n, bn)}, {kb}] (N = {n}, K = {k}, "
            f"block_size = {tuple(block_size)}), got {tuple(w_scale.shape)}")


def fp8_gemm(
    x8: torch.Tensor,
    x_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    block_size: tuple[int, int] | None = None,
    backend: str = "auto",
    config: Fp8Tiles | dict | None = None,
) -> torch.Tensor:
    """y = (x8 * x_scale) (w8 * w_scale)^T in the formats of this module's docstring.

    x8: [M, K] float8_e4m3fn, any row stride (stride 1 in K)
    w8: [N, K] float8_e4m3fn, any row stride (stride 1 in K)
    block_size None: x_scale [M], w_scale [N] float32 (per token, per channel), applied in the epilogue
    block_size (bn, bk): x_scale [M, cdiv(K, bk)] (fp8_quantize(x, bk)), w_scale [cdiv(N, bn), cdiv(K, bk)]
        float32; each k-block's partial sum is scaled by x_scale[m, kb] * w_scale[n // bn, kb]
    out_dtype: float16/bfloat16/float32
    backend: "auto" (``default_backend``), "triton", or "scaled_mm" (bfloat16 out, contiguous
        operands, per channel or 128x128 blocks: ``scaled_mm_fits``; a ValueError where it does not fit)
    config: None (tiles from shapes) or an Fp8Tiles / its dict, for the Triton kernels

    Returns a new contiguous [M, N] of out_dtype: float32 sums, one rounding. No host sync: it can
    be captured in a CUDA graph. Split-K launches share one counter buffer per device, so calls
    must not run concurrently on two streams.
    """
    where = "fp8_gemm"
    _check_gemm_args(x8, x_scale, w8, w_scale, out_dtype, block_size, backend)
    m, k = x8.shape
    n = w8.shape[0]
    if backend == "scaled_mm":
        require(scaled_mm_fits(x8, w8, w_scale, out_dtype, block_size), where,
                'backend "scaled_mm" needs bfloat16 out, contiguous 16-byte-aligned x8 and w8, and K, N multiples '
                "of 16 (per channel) or block_size (128, 128) on sm_90 with K a multiple of 512 and N of 128; got "
                f"out_dtype {out_dtype}, K = {k}, N = {n}, block_size {block_size}, x8 strides {x8.stride()}, "
                f"w8 strides {w8.stride()}")
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=x8.device)
    if (backend if backend != "auto" else default_backend(m, x8, w8, w_scale, out_dtype, block_size)) == "scaled_mm":
        return _scaled_mm(x8, x_scale, w8, w_scale, out_dtype, block_size)
    tiles = pick_tiles(config, m, n, k, block_size, x8.device)
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    require(tiles.kernel == "gemv" or bk >= _min_block_k(x8.device), where,
            f"config block_k must be >= {_min_block_k(x8.device)} for fp8 tensor-core dots, got {bk}")
    step_k, num_steps, tiles_per_step = _steps(k, bk, block_size)
    split, per_split = split_steps(num_steps, tiles.split_k)
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    out = torch.empty((m, n), dtype=out_dtype, device=x8.device)
    part, counters = split_k_scratch(where, out, split, m_tiles * n_tiles, _counter_buffer)
    even_k = step_k % bk == 0 and k % step_k == 0 and num_steps % per_split == 0
    scale_strides = (x_scale.stride(0), w_scale.stride(0)) if block_size is not None else (1, 1)
    common = dict(K=k, BLOCK_SCALED=block_size is not None, SCALE_BN=block_size[0] if block_size else 1,
                  STEP_K=step_k, NUM_STEPS=num_steps, STEPS_PER_SPLIT=per_split, TILES_PER_STEP=tiles_per_step,
                  EVEN_K=even_k, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    args = (x8, x_scale, w8, w_scale, out, part, counters, m, n, x8.stride(0), w8.stride(0), *scale_strides)
    if tiles.kernel == "gemv":
        _fp8_gemv_kernel[(n_tiles, split, m_tiles)](*args, ROWS=bm, **common)
    else:
        # Hopper's fp8 sums keep fewer bits than float32: per channel they are promoted to the
        # float32 accumulator once per K tile; with block scales each k-block's dot is already a
        # fresh partial added in float32, so no promotion inside it (None: the compiler's default).
        promote = bk if block_size is None else None
        _fp8_gemm_kernel[(m_tiles * n_tiles, split)](*args, BLOCK_M=bm, GROUP_M=tiles.group_m, PROMOTE=promote,
                                                    **common)
    return out


def warm_up(w8: torch.Tensor, w_scale: torch.Tensor, max_tokens: int, x_dtype: torch.dtype, *,
            out_dtype: torch.dtype | None = None, block_size: tuple[int, int] | None = None,
            backend: str = "auto", config: Fp8Tiles | dict | None = None) -> int:
    """Compile every kernel variant ``fp8_quantize`` and ``fp8_gemm`` can meet for 1..max_tokens
    rows of x (x_dtype; out_dtype defaults to it) with this weight, quantized as the layer does
    (group bk with block scales), and allocate the split-K counters and cuBLAS workspaces before
    any CUDA-graph capture (a compile met while serving stalls a step). Returns the number of
    GEMM calls made."""
    n, k = w8.shape
    out_dtype = out_dtype or x_dtype
    group = block_size[1] if block_size is not None else None
    # One quantize compile serves every M (M is not specialized); row slices keep x8 contiguous.
    x8_all, x_scale_all = fp8_quantize(torch.zeros(max_tokens, k, dtype=x_dtype, device=w8.device), group)

    def variant(m: int) -> tuple:
        chosen = backend if backend != "auto" else default_backend(m, x8_all[:m], w8, w_scale, out_dtype, block_size)
        return chosen, (pick_tiles(config, m, n, k, block_size, w8.device) if chosen == "triton" else None)

    rows = first_rows_per_variant(max_tokens, variant)
    for m in rows:
        fp8_gemm(x8_all[:m], x_scale_all[:m], w8, w_scale, out_dtype=out_dtype, block_size=block_size,
                 backend=backend, config=config)
    return len(rows)
