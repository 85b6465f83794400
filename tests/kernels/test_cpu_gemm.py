"""kernels.cpu_gemm.linear against F.linear on fresh random inputs: float32 CPU calls through
oneDNN (float32 rounding apart), everything else F.linear itself, bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm


@pytest.mark.parametrize("rows,k,n,bias", [(1, 576, 1536, False), (7, 100, 33, True), (300, 64, 576, False),
                                           (2048, 576, 3072, True)])
def test_float32_matches_f_linear(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * k + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    got, want = cpu_gemm.linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_leading_dims_strided_rows_and_empty():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(3, 5, 24, generator=g)
    torch.testing.assert_close(cpu_gemm.linear(x, w), F.linear(x, w), rtol=2e-5, atol=2e-5)
    wide = torch.randn(6, 50, generator=g)[:, 3:27]  # a row stride of 50
    torch.testing.assert_close(cpu_gemm.linear(wide, w), F.linear(wide, w), rtol=2e-5, atol=2e-5)
    assert cpu_gemm.linear(x[:0], w).shape == (0, 5, 40)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_dtypes_are_f_linear_exactly(dtype):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 32, generator=g).to(dtype), torch.randn(16, 32, generator=g).to(dtype)
    assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))


def test_float32_runs_onednn_where_it_is_available(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    assert cpu_gemm._onednn_ok()  # probed before the count starts
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Ops:
        @staticmethod
        def _linear_pointwise(*args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(torch.ops, "mkldnn", Ops, raising=False)
    cpu_gemm.linear(torch.randn(4, 8), torch.randn(3, 8))
    assert calls == [torch.Size([4, 8])]
