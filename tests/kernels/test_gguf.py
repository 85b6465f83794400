"""GGUF block-quantized weights: the reference (kernels/gguf_reference.py) against the ``gguf``
package's dequantization, and the compiled CPU GEMM (kernels/cpu/gguf_gemm.cpp, through
kernels.cpu_gemm.gguf_linear) against the reference linear (dequantize, then matmul)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_gemm, gguf_reference as R

gguf = pytest.importorskip("gguf")
TYPES = R.GGUF_TYPES


def random_packed(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random bytes as blocks, with finite fp16 scales (and mins) in the headers."""
    g = torch.Generator().manual_seed(seed)
    block, size = R.BLOCK_LAYOUTS[qtype]
    packed = torch.randint(0, 256, (n, R.row_bytes(qtype, k)), dtype=torch.uint8, generator=g)
    blocks = packed.view(n, k // block, size)
    heads = 2 if qtype == "Q4_1" else 1
    blocks[..., :2 * heads] = (torch.randn(n, k // block, heads, generator=g) * 0.05).half().view(torch.uint8)
    return packed


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_the_gguf_package(qtype: str) -> None:
    packed = random_packed(qtype, 7, 160)
    want = gguf.quants.dequantize(packed.numpy(), getattr(gguf.GGMLQuantizationType, qtype))
    got = R.dequantize(packed, qtype, 160)
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32)))


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_round_trips_within_a_step(qtype: str) -> None:
    """Each weight comes back within half its block's step (rounding to nearest), except where
    Q4_0 clamps: its scale is the largest magnitude over -8, so the other sign reaches only 7
    steps; plus the fp16 rounding of the block's scale and minimum."""
    w = torch.randn(200, 64, generator=torch.Generator().manual_seed(0)) * 3
    blocks = w.reshape(200, 2, 32)
    err = (R.dequantize(R.quantize(w, qtype), qtype, 64) - w).abs().reshape(200, 2, 32)
    amax, lo = blocks.abs().amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)
    step = {"Q8_0": amax / 127, "Q4_0": amax / 8, "Q4_1": (blocks.amax(-1, keepdim=True) - lo) / 15}[qtype]
    bound = step / 2
    if qtype == "Q4_0":
        largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        clamped = (blocks * largest < 0) & (blocks.abs() > 7.5 * step)
        bound = torch.where(clamped, blocks.abs() - 7 * step, bound)
    bound = bound + (amax + lo.abs()) * 2 ** -10
    assert bool((err <= bound).all()), float((err - bound).max())


def test_layout_errors_are_named() -> None:
    with pytest.raises(ValueError, match="Q5_K"):
        R.row_bytes("Q5_K", 64)
    with pytest.raises(ValueError, match="whole number"):
        R.row_bytes("Q4_0", 48)
    with pytest.raises(ValueError, match="uint8"):
        R.dequantize(torch.zeros(2, 10, dtype=torch.uint8), "Q4_0", 64)


@pytest.fixture(scope="module")
def ext():
    module = cpu_gemm.gguf_extension()
    assert module is not None, f"the compiled GGUF GEMM did not build: {cpu_gemm.gguf_unavailable_reason()}"
    return module


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((ln for ln in f if ln.startswith("flags")), "").split())


def test_the_widest_vector_path_serves_where_the_cpu_has_it(ext) -> None:
    flags = _cpu_flags()
    want = ["avx512"] if "avx512f" in flags else []
    want += ["avx2"] if {"avx2", "fma"} <= flags else []
    assert ext.paths() == [*want, "portable"]


def _linear_case(qtype: str, t: int, seed: int, k: int = 576, n: int = 37):
    """(k, packed [n, k] weights, x [t, k], a bias on odd t) drawn afresh for one GEMM case."""
    packed = random_packed(qtype, n, k, seed=seed)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, k, generator=g)
    return k, packed, x, torch.randn(n, generator=g) if t % 2 else None


@pytest.mark.parametrize("path", ["avx2", "portable"])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("t", [1, 3, 8, 11])
def test_the_narrower_paths_equal_the_reference_linear(ext, path: str, qtype: str, t: int) -> None:
    """The AVX2 loop (a laptop without AVX-512 serves with it) and the portable one, asked for
    by name where the widest serves."""
    if path not in ext.paths():
        pytest.skip(f"no {path} path on this CPU")
    k, packed, x, bias = _linear_case(qtype, t, seed=t + 7)
    want = R.linear(x, packed, qtype, bias)
    got = ext.gguf_linear(x, packed, cpu_gemm.GGUF_QTYPES[qtype], bias, path=path)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5 * float(want.abs().max()))


def test_an_unknown_path_is_refused(ext) -> None:
    with pytest.raises(RuntimeError, match="no path neon"):
        ext.gguf_linear(torch.zeros(1, 32), random_packed("Q8_0", 2, 32), 2, None, path="neon")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("t", [1, 3, 8, 33])
@pytest.mark.parametrize("k,n", [(64, 7), (576, 33), (1536, 17)])
def test_kernel_equals_reference_linear(ext, qtype: str, t: int, k: int, n: int) -> None:
    packed = random_packed(qtype, n, k, seed=t * 1000 + k + n)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, k, generator=g)
    bias = torch.randn(n, generator=g) if t % 2 else None
    want = R.linear(x, packed, qtype, bias)
    got = cpu_gemm.gguf_linear(x, packed, qtype, bias)
    assert got.shape == (t, n) and got.dtype == torch.float32
    # the same products summed in another order: float32 rounding of sums of k terms
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5 * float(want.abs().max()))


def test_kernel_takes_leading_dims_and_other_dtypes(ext) -> None:
    packed = random_packed("Q4_1", 9, 64)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(cpu_gemm.gguf_linear(x, packed, "Q4_1"), R.linear(x, packed, "Q4_1"))
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(cpu_gemm.gguf_linear(xb, packed, "Q4_1"), R.linear(xb, packed, "Q4_1"))


@pytest.mark.parametrize("activations", ["float32", "q8_0"])
def test_every_byte_of_a_block_reaches_the_output(ext, activations: str) -> None:
    """A kernel that skipped or misplaced part of a block (a nibble half, the min, a scale byte)
    would still match on some inputs; flipping each byte of one row changes that row's output."""
    reference = R.linear if activations == "float32" else R.linear_q8
    g = torch.Generator().manual_seed(5)
    for qtype in TYPES:
        packed = random_packed(qtype, 3, 32, seed=5)
        # every weight's input far from 0 (int8 activations round |x| < amax / 254 to 0)
        x = (torch.rand(1, 32, generator=g) + 1) * (torch.randint(0, 2, (1, 32), generator=g) * 2 - 1)
        base = cpu_gemm.gguf_linear(x, packed, qtype, None, activations)
        for byte in range(packed.shape[1]):
            changed = packed.clone()
            changed[1, byte] ^= 0x11 if byte >= 2 else 0x01
            got = cpu_gemm.gguf_linear(x, changed, qtype, None, activations)
            torch.testing.assert_close(got, reference(x, changed, qtype), rtol=1e-5, atol=1e-5)
            assert torch.equal(got[:, [0, 2]], base[:, [0, 2]]) and not torch.equal(got[:, 1], base[:, 1]), (qtype, byte)


@pytest.mark.parametrize("activations", ["float32", "q8_0"])
def test_without_the_extension_the_reference_serves(monkeypatch, activations: str) -> None:
    monkeypatch.setitem(cpu_gemm._gguf_state, "module", None)
    packed = random_packed("Q8_0", 5, 64)
    x = torch.randn(2, 3, 64)
    want = (R.linear(x, packed, "Q8_0") if activations == "float32"
            else R.linear_q8(x.reshape(6, 64), packed, "Q8_0").reshape(2, 3, 5))
    assert torch.equal(cpu_gemm.gguf_linear(x, packed, "Q8_0", None, activations), want)
    with pytest.raises(ValueError, match="float32 or q8_0"):
        cpu_gemm.gguf_linear(x, packed, "Q8_0", None, "int4")


# ---- int8 activations (--gguf-activations q8_0) ---------------------------------------------------------

def test_activations_quantize_as_the_reference(ext) -> None:
    """Per block of 32: d = amax / 127 and q = x / d rounded to nearest even, both exactly the
    reference's (an all-zero block gives d 0 and q 0)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=g) * 3
    x[1, 32:64] = 0
    x[2, :32] = 0
    x[2, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5])  # d = 1: ties
    q, d = ext.quantize_q8(x)
    rq, rd = R.quantize_activations(x)
    assert q.dtype == torch.int8 and torch.equal(q, rq) and torch.equal(d, rd)
    assert q[2, 1:6].tolist() == [2, -4, 0, 0, 2] and d[1, 1] == 0 and not q[1, 32:64].any()


def test_the_int8_paths_compiled(ext) -> None:
    assert ext.q8_paths() == (["avx2"] if {"avx2", "fma"} <= _cpu_flags() else []) + ["portable"]


@pytest.mark.parametrize("path", ["avx2", "portable"])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("t", [1, 3, 8, 11])
def test_int8_activations_equal_their_reference(ext, path: str, qtype: str, t: int) -> None:
    """Each path's products are the reference's integers; only the float32 sum over blocks
    differs in order. They are not the float32 activations' numbers (x was rounded)."""
    if path not in ext.q8_paths():
        pytest.skip(f"no {path} path on this CPU")
    k, packed, x, bias = _linear_case(qtype, t, seed=t + 17)
    want = R.linear_q8(x, packed, qtype, bias)
    got = ext.gguf_linear_q8(x, packed, cpu_gemm.GGUF_QTYPES[qtype], bias, path=path)
    tol = 1e-5 * k ** 0.5 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=tol)
    assert (got - R.linear(x, packed, qtype, bias)).abs().max() > 10 * tol
