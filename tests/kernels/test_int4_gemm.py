"""int4 weight-only GEMM: the Triton launcher against the reference (group sizes,
zeros or none, act-order permutations, groups of unequal sizes, split-K,
padded K, strides, argument checks), and the reference against a float64
product of weights unpacked one nibble at a time from the layout's definition."""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES

import kernels
from kernels import reference

# The module, not the launcher of the same name that kernels exports.
i4 = importlib.import_module("kernels.int4_gemm")


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] values in [0, 15] -> [ceil(K/8), N] int32, row k in bits 4*(k%8) of word k//8."""
    k, n = q.shape
    words = torch.zeros((k + 7) // 8, n, dtype=torch.int64)
    for row in range(k):
        words[row // 8] |= q[row].long() << (4 * (row % 8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def make_weight(k: int, n: int, group_size: int, *, zeros: bool, dtype: torch.dtype, act_order: bool = False,
                uneven: bool = False, seed: int = 0):
    """Random q, scales (outputs of order one), zeros in [0, 16]; with act_order a random
    perm; with uneven a sorted g_idx whose groups have random sizes."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    perm = torch.randperm(k, generator=gen).to(torch.int32) if act_order else None
    g_idx = None
    if uneven:
        cuts = torch.sort(torch.randperm(k - 1, generator=gen)[:5] + 1).values
        g_idx = torch.zeros(k, dtype=torch.int32)
        for c in cuts:
            g_idx[c:] += 1
        groups = 6
    else:
        groups = -(-k // group_size)
    scales = (torch.rand(groups, n, generator=gen) * 2 + 0.5) / (4 * k**0.5)
    z = torch.randint(0, 17, (groups, n), generator=gen, dtype=torch.uint8) if zeros else None
    return dict(q=q, qweight=pack_rows(q), scales=scales.to(dtype), zeros=z, perm=perm, g_idx=g_idx)


def to_device(w: dict) -> dict:
    return {name: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for name, t in w.items()}


def run(fn, x, w, group_size, config=None):
    return fn(x, w["qweight"], w["scales"], w["zeros"], group_size, perm=w["perm"], g_idx=w["g_idx"], config=config)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


# (name, M, K, N, group_size, zeros, act_order, uneven groups)
CASES = [
    ("decode_g32", 1, 256, 96, 32, True, False, False),
    ("decode_g128_sym", 1, 512, 64, 128, False, False, False),
    ("m64_g64", 64, 256, 80, 64, True, False, False),
    ("m64_g128_sym", 64, 256, 48, 128, False, False, False),
    ("m5_g64_act_order", 5, 256, 40, 64, True, True, False),
    ("m17_g32_act_order_sym", 17, 128, 32, 32, False, True, False),
    ("uneven_groups_act_order", 3, 192, 40, 32, True, True, True),
    ("group_40_not_pow2", 7, 200, 48, 40, True, False, False),
    ("one_group_k_not_multiple_of_8", 3, 100, 24, 100, True, False, False),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_launcher_matches_reference(case, dtype):
    _, m, k, n, g, zeros, act_order, uneven = case
    w = to_device(make_weight(k, n, g, zeros=zeros, dtype=dtype, act_order=act_order, uneven=uneven, seed=m + k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    out = run(kernels.int4_gemm, x, w, g)
    assert out.is_contiguous()
    assert_close(out, run(reference.int4_gemm, x, w, g), dtype)


@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
def test_split_k_and_tiles(split_k):
    # Every split count gives the same result; a split launch leaves its counters at zero
    # and gives bitwise the same output when repeated (the sum runs in split order).
    dtype = torch.float32
    w = to_device(make_weight(512, 72, 64, zeros=True, dtype=dtype, seed=1))
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cfg = {"block_m": 16, "block_n": 32, "block_k": 32, "split_k": split_k, "num_warps": 4, "num_stages": 2}
    out = run(kernels.int4_gemm, x, w, 64, config=cfg)
    assert_close(out, run(reference.int4_gemm, x, w, 64), dtype)
    assert torch.equal(out, run(kernels.int4_gemm, x, w, 64, config=cfg))
    if split_k > 1:
        assert int(i4._counter_buffer(x.device).abs().sum()) == 0


def test_split_with_a_short_last_split_and_tile_groups():
    # 7 K tiles in splits of 2: the last split has a tile past K (masked, EVEN_K off).
    dtype = torch.float32
    w = to_device(make_weight(224, 40, 32, zeros=True, dtype=dtype, seed=3))
    x = torch.randn(2, 224, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cfg = {"block_m": 16, "block_n": 16, "block_k": 32, "split_k": 4}
    assert_close(run(kernels.int4_gemm, x, w, 32, config=cfg), run(reference.int4_gemm, x, w, 32), dtype)


def test_default_tiles_split_decode_and_respect_groups(monkeypatch):
    monkeypatch.setattr(i4, "_num_sms", lambda device: 132)  # an H200's
    dev = torch.device(DEVICE)
    t = i4.default_tiles(1, 4096, 4096, 128, torch.bfloat16, dev)
    assert t.kernel == "gemv" and t.block_m == 1 and t.block_k == 128 and t.split_k > 1
    assert i4.default_tiles(2, 4096, 4096, 128, torch.bfloat16, dev).block_m == 2
    assert i4.default_tiles(3, 4096, 4096, 128, torch.bfloat16, dev).kernel == "dot"  # 3-4 rows: tensor cores
    assert i4.default_tiles(1, 4096, 4096, 128, torch.bfloat16, dev, has_g_idx=True).kernel == "dot"
    assert i4.default_tiles(1, 4096, 4096, 40, torch.bfloat16, dev).kernel == "dot"  # no tile fits a group of 40
    t = i4.default_tiles(16, 4096, 4096, 128, torch.bfloat16, dev)
    assert t.kernel == "dot" and t.block_m == 16 and t.block_k <= 128 and t.split_k > 1
    assert i4.default_tiles(4096, 4096, 4096, 128, torch.bfloat16, dev).split_k == 1
    assert i4.default_tiles(64, 4096, 4096, 32, torch.bfloat16, dev).block_k == 32


def test_strided_x_and_empty_batch():
    dtype = torch.float16
    w = to_device(make_weight(128, 32, 32, zeros=True, dtype=dtype, seed=5))
    wide = torch.randn(6, 200, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    x = wide[:, 10:138]  # row stride 200
    assert_close(run(kernels.int4_gemm, x, w, 32), run(reference.int4_gemm, x.contiguous(), w, 32), dtype)
    empty = run(kernels.int4_gemm, x[:0], w, 32)
    assert empty.shape == (0, 32) and empty.dtype == dtype


def test_reference_matches_float64_from_the_layout():
    # W^T[k, n] = (q - z[g]) * s[g], unpacked here nibble by nibble, product in float64.
    k, n, g = 96, 24, 32
    w = make_weight(k, n, g, zeros=True, dtype=torch.float32, act_order=True, seed=7)
    w["scales"] = w["scales"].half().float()  # float16 scales, as checkpoints have: (q - z) * s is exact in float32
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(8))
    qw = w["qweight"].long() & 0xFFFFFFFF
    wt = torch.empty(k, n, dtype=torch.float64)
    for row in range(k):
        q = (qw[row // 8] >> (4 * (row % 8))) & 0xF
        assert torch.equal(q, w["q"][row].long())
        grp = row // g
        wt[row] = (q - w["zeros"][grp].long()).double() * w["scales"][grp].double()
    dense = torch.empty(n, k, dtype=torch.float64)
    dense[:, w["perm"].long()] = wt.t()  # internal row k multiplies x[:, perm[k]]
    got = run(reference.int4_gemm, x, w, g)
    torch.testing.assert_close(got.double(), x.double() @ dense.t(), atol=1e-5, rtol=1e-5)
    deq = reference.dequantize_int4(w["qweight"], w["scales"], w["zeros"], g, k, perm=w["perm"])
    assert torch.equal(deq.double(), dense)


def test_symmetric_zeros_mean_eight():
    w = make_weight(64, 16, 32, zeros=False, dtype=torch.float32, seed=9)
    eights = torch.full((2, 16), 8, dtype=torch.uint8)
    a = reference.dequantize_int4(w["qweight"], w["scales"], None, 32, 64)
    b = reference.dequantize_int4(w["qweight"], w["scales"], eights, 32, 64)
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad,message", [
    ("qweight_rows", "qweight must have ceil(K/8) = 16 rows"),
    ("scales_rows", "scales must have ceil(K/group_size) = 4 rows"),
    ("zeros_dtype", "zeros must have dtype"),
    ("group_size", "group_size must be an int >= 1"),
    ("perm_shape", "perm must be a contiguous [K = 128]"),
    ("x_dtype", "x must have dtype"),
    ("config", "config block sizes must be powers of two"),
])
def test_argument_checks(bad, message):
    w = to_device(make_weight(128, 32, 32, zeros=True, dtype=torch.float32, seed=10))
    x = torch.randn(2, 128).to(DEVICE)
    g, cfg = 32, None
    if bad == "qweight_rows":
        w["qweight"] = w["qweight"][:-1]
    elif bad == "scales_rows":
        w["scales"], w["zeros"] = w["scales"][:-1], w["zeros"][:-1]
    elif bad == "zeros_dtype":
        w["zeros"] = w["zeros"].to(torch.int32)
    elif bad == "group_size":
        g = 0
    elif bad == "perm_shape":
        w["perm"] = torch.arange(64, dtype=torch.int32, device=DEVICE)
    elif bad == "x_dtype":
        x = x.to(torch.int32)
    elif bad == "config":
        cfg = {"block_m": 16, "block_n": 24, "block_k": 32}
    with pytest.raises(ValueError, match="int4_gemm: " + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        run(kernels.int4_gemm, x, w, g, config=cfg)
