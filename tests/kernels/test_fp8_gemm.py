"""FP8 (e4m3) W8A8 GEMM: each launcher against its reference, on fresh random inputs
over hostile shapes (M = 1, 3, 17, 64, 300; N, K off the tile sizes; K off the
group and block size; strided operands; zero rows; codes up to +-448; a value that
lands past 448 after scaling), every tile variant (GEMV rows, split-K, masked
k-block tails), the scaled_mm backend on CUDA, and the argument checks. Each
reference against an oracle of its own: torch's float8 cast applied group by group
for quantization (bit for bit), a float64 sum per k-block for the GEMM."""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES

from kernels import reference
from kernels.fp8_gemm import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, fp8_gemm, fp8_quantize

# The module, not the launcher of the same name that kernels exports.
f8 = importlib.import_module("kernels.fp8_gemm")

CUDA = DEVICE == "cuda"
needs_cuda = pytest.mark.skipif(not CUDA, reason="torch._scaled_mm needs CUDA")

# Relative tolerance of a launcher against its reference: one rounding of out_dtype (the
# float32 sums run in another order; on Hopper the fp8 dots keep fewer bits between
# promotions). Applied as rtol, and as atol times the output's largest magnitude.
REL = {torch.float32: 5e-4 if CUDA else 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_fp8(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Every finite e4m3 code (subnormals, -0, +-448) with equal odds; no NaN (0x7f, 0xff)."""
    codes = torch.randint(0, 254, (rows, cols), generator=g, dtype=torch.int32)
    codes = codes + (codes >= 0x7F).int()  # skip 0x7f ...
    codes = torch.where(codes >= 0xFF, codes - 0x80, codes)  # ... and 0xff
    return codes.to(torch.uint8).view(FP8_DTYPE)


def random_scales(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.exp2(torch.rand(shape, generator=g) * 8 - 14)  # 2^-14 .. 2^-6, like real scales


def hostile_x(m: int, k: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows of magnitudes 1e-3 .. 1e3, a zero row, a row with one outlier, and a row whose
    amax lands past 448 after dividing by its own (float32-rounded) scale."""
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[torch.randperm(m, generator=g)][:, None]
    x[m // 2] = 0.0
    if m > 2:
        x[1, k // 3] = 1e4
    if m > 3:
        x[2] = torch.rand(k, generator=g) * 2 - 1
        x[2, 0] = past_448_after_scaling()
    return x.to(dtype)


def past_448_after_scaling() -> float:
    """A value v with float32(v / float32(v / 448)) > 448, so the clamp (not the cast) bounds it."""
    v = torch.tensor(1.0)
    while True:
        s = v / FP8_MAX
        if float(v / s) > FP8_MAX:
            return float(v)
        v = torch.nextafter(v, torch.tensor(2.0))


def to_dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    rel = REL[dtype]
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * scale + 1e-30)


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# ---- fp8_quantize -------------------------------------------------------------------------------------

# (M, K, group_size)
QUANT_CASES = [
    (1, 64, None),
    (3, 100, None),
    (17, 200, 32),  # 200 = 6 groups of 32 + 8
    (64, 96, 128),  # one group longer than K
    (300, 40, 16),
    (5, 300, 128),  # a short last group
    (4, 1100, 600),  # groups too long for the tile kernel
    (4, 9000, None),  # a row longer than one register block: read twice
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", QUANT_CASES, ids=[f"m{m}_k{k}_g{g}" for m, k, g in QUANT_CASES])
def test_quantize_matches_reference_bit_for_bit(case, dtype):
    m, k, group = case
    x = hostile_x(m, k, gen(m * k), dtype).to(DEVICE)
    q, s = fp8_quantize(x, group)
    want_q, want_s = reference.fp8_quantize(x, group)
    assert q.dtype == FP8_DTYPE and q.shape == (m, k) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.is_contiguous()
    assert s.shape == ((m,) if group is None else (m, cdiv(k, group)))
    assert torch.equal(s, want_s)
    assert torch.equal(bits(q), bits(want_q))
    if CUDA:  # the reference does not depend on the device
        cpu_q, cpu_s = reference.fp8_quantize(x.cpu(), group)
        assert torch.equal(cpu_s, want_s.cpu()) and torch.equal(bits(cpu_q), bits(want_q).cpu())


def test_quantize_strided_x_and_empty():
    wide = hostile_x(6, 300, gen(1), torch.float16).to(DEVICE)
    x = wide[:, 7:207]  # row stride 300
    for group in (None, 64):
        q, s = fp8_quantize(x, group)
        want_q, want_s = reference.fp8_quantize(x.contiguous(), group)
        assert torch.equal(bits(q), bits(want_q)) and torch.equal(s, want_s)
    q, s = fp8_quantize(x[:0], 64)
    assert q.shape == (0, 200) and s.shape == (0, 4)


def quantize_oracle(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One group at a time, from the definition, with torch's float8 cast."""
    m, k = x.shape
    g = k if group is None else group
    q = torch.empty(m, k, dtype=FP8_DTYPE)
    s = torch.empty(m, cdiv(k, g))
    for row in range(m):
        for j in range(cdiv(k, g)):
            part = x[row, j * g:(j + 1) * g].float()
            scale = torch.maximum(part.abs().max() / torch.tensor(FP8_MAX), torch.tensor(FP8_MIN_SCALE))
            s[row, j] = scale
            q[row, j * g:(j + 1) * g] = (part / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, (s[:, 0] if group is None else s)


@pytest.mark.parametrize("group", [None, 16, 48, 100])
def test_quantize_reference_matches_oracle(group):
    x = hostile_x(7, 130, gen(2), torch.float32)
    assert (x[2, 0] / (x[2].abs().max() / FP8_MAX)).item() > FP8_MAX  # the clamp is exercised
    q, s = reference.fp8_quantize(x, group)
    want_q, want_s = quantize_oracle(x, group)
    assert torch.equal(s, want_s) and torch.equal(bits(q), bits(want_q))
    assert not torch.isnan(q.float()).any()
    assert torch.equal(q[3].float(), torch.zeros(130)) and (s[3] == torch.tensor(FP8_MIN_SCALE)).all()  # zero row
    # Nearest rounding: within half an e4m3 step (3 mantissa bits; subnormal step 2^-9) of x / s.
    full_s = s[:, None] if group is None else s.repeat_interleave(group, dim=1)[:, :130]
    y = (x / full_s).clamp(-FP8_MAX, FP8_MAX)
    step = torch.exp2(torch.floor(torch.log2(y.abs().clamp(min=2.0**-6))) - 3)
    assert ((q.float() - y).abs() <= step / 2).all()


# ---- fp8_gemm ---------------------------------------------------------------------------------------------

# (name, M, N, K, block_size)
GEMM_CASES = [
    ("m1_channel", 1, 40, 100, None),
    ("m3_channel", 3, 72, 200, None),
    ("m17_channel", 17, 40, 100, None),
    ("m64_channel", 64, 48, 64, None),
    ("m300_channel", 300, 40, 48, None),
    ("m1_block16", 1, 33, 100, (16, 16)),
    ("m3_block16", 3, 33, 100, (16, 16)),
    ("m17_block32", 17, 70, 96, (32, 32)),
    ("m5_block128_short_blocks", 5, 136, 300, (128, 128)),
    ("m64_block128", 64, 40, 160, (128, 128)),
    ("m300_block32", 300, 24, 80, (32, 32)),
    ("m7_block_16x48_masked_tail", 7, 40, 100, (16, 48)),
]


def gemm_inputs(m: int, n: int, k: int, block_size, seed: int):
    g = gen(seed)
    x8, w8 = random_fp8(m, k, g), random_fp8(n, k, g)
    if block_size is None:
        xs, ws = random_scales((m,), g), random_scales((n,), g)
    else:
        bn, bk = block_size
        xs, ws = random_scales((m, cdiv(k, bk)), g), random_scales((cdiv(n, bn), cdiv(k, bk)), g)
    return to_dev(x8, xs, w8, ws)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_gemm_matches_reference(case, dtype):
    _, m, n, k, block_size = case
    x8, xs, w8, ws = gemm_inputs(m, n, k, block_size, seed=m * n + k)
    got = fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=block_size, backend="triton")
    assert_close(got, reference.fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=block_size), dtype)


TILE_VARIANTS = [
    {"block_m": 1, "block_n": 16, "block_k": 32, "split_k": 1, "kernel": "gemv"},
    {"block_m": 2, "block_n": 32, "block_k": 32, "split_k": 3, "kernel": "gemv"},
    {"block_m": 8, "block_n": 16, "block_k": 64, "split_k": 8, "kernel": "gemv"},
    {"block_m": 16, "block_n": 32, "block_k": 32, "split_k": 1},
    {"block_m": 16, "block_n": 16, "block_k": 32, "split_k": 4, "group_m": 2},
    {"block_m": 32, "block_n": 64, "block_k": 64, "split_k": 2},
]


@pytest.mark.parametrize("block_size", [None, (32, 32), (16, 48)], ids=["channel", "block32", "block16x48"])
@pytest.mark.parametrize("cfg", TILE_VARIANTS, ids=lambda c: "_".join(f"{v}" for v in c.values()))
def test_tile_variants_split_k_and_determinism(cfg, block_size):
    # Every tile config gives the reference's result; a split launch leaves its counters at
    # zero and repeats bitwise (the partials are summed in split order).
    dtype = torch.float32
    x8, xs, w8, ws = gemm_inputs(3, 24, 160, block_size, seed=3)
    got = fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=block_size, backend="triton", config=cfg)
    assert_close(got, reference.fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=block_size), dtype)
    again = fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=block_size, backend="triton", config=cfg)
    assert torch.equal(got, again)
    assert int(f8._counter_buffer(x8.device).abs().sum()) == 0


@pytest.mark.parametrize("block_size", [None, (16, 32)], ids=["channel", "block"])
def test_strided_operands_and_empty_batch(block_size):
    dtype = torch.float16
    m, n, k = 6, 40, 96
    g = gen(4)
    wide_x, wide_w = random_fp8(m, k + 40, g), random_fp8(n, k + 24, g)
    x8, w8 = wide_x[:, 8:8 + k], wide_w[:, 16:16 + k]  # row strides k+40, k+24
    if block_size is None:
        xs, ws = random_scales((m,), g), random_scales((n,), g)
    else:
        wide_s = random_scales((m, 5), g)
        xs, ws = wide_s[:, 1:4], random_scales((cdiv(n, 16), 3), g)  # x_scale row stride 5
    x8, w8, xs, ws = to_dev(x8, w8, xs, ws)
    got = fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=block_size)
    want = reference.fp8_gemm(x8.contiguous(), xs.contiguous(), w8.contiguous(), ws, out_dtype=dtype,
                              block_size=block_size)
    assert_close(got, want, dtype)
    empty = fp8_gemm(x8[:0], xs[:0], w8, ws, out_dtype=dtype, block_size=block_size)
    assert empty.shape == (0, n) and empty.dtype == dtype


def block_quantize_weight(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's block-scaled weight: one scale per (bn, bk) block, amax / 448."""
    n, k = w.shape
    s = torch.empty(cdiv(n, bn), cdiv(k, bk))
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    for i in range(cdiv(n, bn)):
        for j in range(cdiv(k, bk)):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = block.abs().max() / FP8_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / s[i, j]).to(FP8_DTYPE)
    return q, s


@pytest.mark.parametrize("block_size", [None, (32, 32)], ids=["channel", "block"])
def test_quantize_then_gemm_approximates_the_float_product(block_size):
    # The formats fit together: y of quantized x and W is x W^T up to e4m3's 2^-4 rounding.
    m, n, k = 17, 48, 160
    g = gen(5)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    x[4] = 0.0
    if block_size is None:
        w8, ws = reference.fp8_quantize(w)
    else:
        w8, ws = block_quantize_weight(w, *block_size)
    x_d, w8, ws = to_dev(x, w8, ws)
    x8, xs = fp8_quantize(x_d, block_size[1] if block_size else None)
    y = fp8_gemm(x8, xs, w8, ws, out_dtype=torch.float32, block_size=block_size).cpu().double()
    exact = x.double() @ w.double().t()
    assert ((y - exact).norm() / exact.norm()).item() < 0.05
    assert torch.equal(y[4], torch.zeros(n, dtype=torch.float64))  # a zero row stays exactly zero


def gemm_oracle(x8, xs, w8, ws, block_size) -> torch.Tensor:
    """float64, from the definition: per channel scales after the sum; block scales per k-block."""
    x, w = x8.double(), w8.double()
    if block_size is None:
        return (x @ w.t()) * xs.double()[:, None] * ws.double()[None, :]
    bn, bk = block_size
    n, k = w.shape
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    rows = torch.arange(n) // bn
    for kb in range(cdiv(k, bk)):
        cols = slice(kb * bk, (kb + 1) * bk)
        y += xs.double()[:, kb, None] * ws.double()[rows, kb][None, :] * (x[:, cols] @ w[:, cols].t())
    return y


@pytest.mark.parametrize("block_size", [None, (16, 16), (32, 48), (128, 128)])
def test_gemm_reference_matches_float64_oracle(block_size):
    m, n, k = 9, 50, 200
    x8, xs, w8, ws = [t.cpu() for t in gemm_inputs(m, n, k, block_size, seed=6)]
    want = gemm_oracle(x8, xs, w8, ws, block_size)
    got = reference.fp8_gemm(x8, xs, w8, ws, out_dtype=torch.float32, block_size=block_size)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for dtype in (torch.float16, torch.bfloat16):  # one rounding of the float32 result
        assert torch.equal(reference.fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=block_size), got.to(dtype))


# ---- tiles, backends, warm-up -------------------------------------------------------------------------


def test_default_tiles(monkeypatch):
    monkeypatch.setattr(f8, "_num_sms", lambda device: 132)  # an H200's
    cuda = torch.device("cuda")
    t = f8.default_tiles(1, 4096, 4096, None, cuda)
    assert t.kernel == "gemv" and t.block_m == 1 and t.split_k > 1
    t = f8.default_tiles(3, 4096, 4096, None, cuda)
    assert t.kernel == "dot" and t.block_m == 16 and t.split_k > 1
    assert f8.default_tiles(16, 14336, 4096, None, cuda).block_k == 128
    assert f8.default_tiles(16, 4096, 14336, None, cuda).block_k == 256  # long K: long tiles
    assert f8.default_tiles(16, 4096, 14336, (128, 128), cuda).block_k == 128  # ... within a k-block
    assert f8.default_tiles(8192, 4096, 4096, None, cuda).split_k == 1
    assert f8.default_tiles(64, 4096, 4096, (128, 128), cuda).block_k == 128
    assert f8.default_tiles(64, 4096, 4096, (128, 96), cuda).block_k == 32  # divides bk
    assert f8.default_tiles(64, 4096, 4096, (16, 16), cuda).block_k == 32  # fp8 MMA minimum, tail masked
    assert f8.default_tiles(64, 4096, 4096, (16, 16), torch.device("cpu")).block_k == 16


def test_backend_choice():
    on_cuda = "scaled_mm" if CUDA else "triton"
    x8, xs, w8, ws = gemm_inputs(300, 48, 64, None, seed=7)
    assert f8.default_backend(300, x8, w8, ws, torch.float32, None) == "triton"  # scaled_mm: bfloat16 out only
    assert f8.default_backend(300, x8, w8, ws, torch.bfloat16, None) == on_cuda
    assert f8.default_backend(1, x8, w8, ws, torch.bfloat16, None) == "triton"
    assert f8.default_backend(300, x8[:, :48], w8[:, :48], ws, torch.bfloat16, None) == "triton"  # strided
    x8, xs, w8, ws = gemm_inputs(600, 256, 1024, (128, 128), seed=7)
    sm90 = CUDA and torch.cuda.get_device_capability() == (9, 0)
    assert f8.default_backend(600, x8, w8, ws, torch.bfloat16, (128, 128)) == ("scaled_mm" if sm90 else "triton")
    assert f8.default_backend(30, x8, w8, ws, torch.bfloat16, (128, 128)) == "triton"  # few rows
    assert f8.default_backend(600, x8, w8, ws, torch.bfloat16, (64, 128)) == "triton"  # not cuBLASLt's blocks
    x8, w8, ws = x8[:, :384].contiguous(), w8[:, :384].contiguous(), ws[:, :3].contiguous()
    assert f8.default_backend(600, x8, w8, ws, torch.bfloat16, (128, 128)) == "triton"  # 3 k-blocks


@needs_cuda
@pytest.mark.parametrize("m", [1, 17, 300])
def test_scaled_mm_backend_matches_reference(m):
    dtype = torch.bfloat16
    x8, xs, w8, ws = gemm_inputs(m, 96, 160, None, seed=m)
    for backend in ("scaled_mm", "auto", "triton"):
        got = fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, backend=backend)
        assert_close(got, reference.fp8_gemm(x8, xs, w8, ws, out_dtype=dtype), dtype)


@needs_cuda
@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() != (9, 0), reason="cuBLASLt's block recipe: sm_90")
@pytest.mark.parametrize("m", [1, 6, 513])  # 6 and 513 rows: padded to a multiple of 4
def test_scaled_mm_block_backend_matches_reference(m):
    dtype, bs = torch.bfloat16, (128, 128)
    x8, xs, w8, ws = gemm_inputs(m, 384, 1536, bs, seed=m)
    for backend in ("scaled_mm", "auto", "triton"):
        got = fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=bs, backend=backend)
        assert_close(got, reference.fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=bs), dtype)
    x8, xs, w8, ws = gemm_inputs(m, 256, 384, bs, seed=m)  # 3 k-blocks: cuBLASLt would be wrong
    with pytest.raises(ValueError, match="K a multiple of 512"):
        fp8_gemm(x8, xs, w8, ws, out_dtype=dtype, block_size=bs, backend="scaled_mm")


@needs_cuda
def test_gemm_and_quantize_capture_in_a_cuda_graph():
    # No host sync in either launcher: both run inside a captured graph, replayed on new data.
    dtype = torch.bfloat16
    x = torch.randn(4, 256, device=DEVICE, dtype=dtype)
    w8, ws = fp8_quantize(torch.randn(192, 256, device=DEVICE))
    f8.warm_up(w8, ws, 4, dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x8, xs = fp8_quantize(x)
        y = fp8_gemm(x8, xs, w8, ws, out_dtype=dtype)
    x.copy_(torch.randn_like(x))
    graph.replay()
    x8_ref, xs_ref = reference.fp8_quantize(x)
    assert_close(y, reference.fp8_gemm(x8_ref, xs_ref, w8, ws, out_dtype=dtype), dtype)


def test_warm_up_runs_each_variant_once():
    x8, xs, w8, ws = gemm_inputs(1, 40, 64, (16, 16), seed=8)
    calls = f8.warm_up(w8, ws, 6, torch.float32, block_size=(16, 16))
    variants = {f8.default_tiles(m, 40, 64, (16, 16), w8.device) for m in range(1, 7)}
    assert calls == len(variants) == 2  # the one-row gemv and one dot tile


# ---- argument checks ------------------------------------------------------------------------------------


def escape(message: str) -> str:
    for ch in "()[]":
        message = message.replace(ch, "\\" + ch)
    return message


@pytest.mark.parametrize("bad,message", [
    ("x8_dtype", "x8 must have dtype"),
    ("w8_k", "w8 must have K = 64 columns"),
    ("x_scale_shape", "x_scale must be [M = 4]"),
    ("w_scale_dtype", "w_scale must have dtype"),
    ("block_w_scale", "w_scale must be [cdiv(N, bn), cdiv(K, bk)] = [3, 4]"),
    ("block_size", "block_size must be None or a pair of ints >= 1"),
    ("backend", "backend must be one of"),
    ("out_dtype", "out_dtype must be one of"),
    ("x8_inner_stride", "x8 must have stride 1 in its last dim"),
    ("config", "config block sizes must be powers of two"),
    ("scaled_mm", "scaled_mm"),
])
def test_gemm_argument_checks(bad, message):
    x8, xs, w8, ws = gemm_inputs(4, 40, 64, None, seed=9)
    kw = dict(out_dtype=torch.float32)
    if bad == "x8_dtype":
        x8 = x8.float()
    elif bad == "w8_k":
        w8 = w8[:, :32]
    elif bad == "x_scale_shape":
        xs = xs[:3]
    elif bad == "w_scale_dtype":
        ws = ws.double()
    elif bad == "block_w_scale":
        kw["block_size"] = (16, 16)
        xs = torch.ones(4, 4, device=DEVICE)
    elif bad == "block_size":
        kw["block_size"] = (16, 0)
    elif bad == "backend":
        kw["backend"] = "cublas"
    elif bad == "out_dtype":
        kw["out_dtype"] = torch.int32
    elif bad == "x8_inner_stride":
        x8 = random_fp8(64, 4, gen(0)).to(DEVICE).t()
    elif bad == "config":
        kw["config"] = {"block_m": 16, "block_n": 24, "block_k": 32}
    elif bad == "scaled_mm":
        kw["backend"] = "scaled_mm"  # float32 out (CUDA), or CPU tensors
    with pytest.raises(ValueError, match="fp8_gemm: .*" + escape(message)):
        fp8_gemm(x8, xs, w8, ws, **kw)


@pytest.mark.parametrize("bad,message", [
    ("dtype", "x must have dtype"),
    ("group_size", "group_size must be None or an int >= 1"),
    ("dim", "x must be [M, K]"),
    ("inner_stride", "x must have stride 1 in its last dim"),
])
def test_quantize_argument_checks(bad, message):
    x, group = torch.randn(4, 64, device=DEVICE), None
    if bad == "dtype":
        x = x.to(torch.int32)
    elif bad == "group_size":
        group = 0
    elif bad == "dim":
        x = x[0]
    elif bad == "inner_stride":
        x = x.t()
    with pytest.raises(ValueError, match="fp8_quantize: " + escape(message)):
        fp8_quantize(x, group)
