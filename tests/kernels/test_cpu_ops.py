"""The CPU step's kernel module (kernels/cpu_ops.py): its compiled RMSNorm (with and without the
residual add), rotary embedding and SiLU-and-mul against the references on fresh random inputs, in
every float dtype, with strided views as the layers pass them; the rotary embedding and SiLU-and-mul
bit for bit; the calls the
compiled code does not cover going to the reference; the engine choosing the module on CPU."""
from __future__ import annotations


import pytest
import torch

from tests.kernels._common import has_compiler

from kernels import cpu_attention, cpu_ops, reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def ops():
    if not has_compiler():
        pytest.skip("no C++ compiler: the module runs the references")
    assert cpu_attention.extension() is not None, cpu_attention.unavailable_reason()
    return torch.ops.pdserve_cpu


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of a row's float32 sum of squares: one rounding step of the dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 64), (37, 1000)])
def test_rms_norms_match_the_reference(ops, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    wide = torch.randn(rows, hidden + 24, generator=gen).to(dtype)
    x = wide[:, 8:8 + hidden]  # a row stride that is not the width, as a slice of a fused output
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
    _close(cpu_ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    got, got_sum = cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    want, want_sum = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got_sum, want_sum)  # x + residual rounded to the dtype, as the reference
    _close(got, want)
    assert not torch.equal(residual, got_sum)  # the inputs are left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(1, 9, 3, 64), (6, 4, 4, 128), (23, 8, 2, 32)])
def test_the_rotary_embedding_is_the_references_bit_for_bit(ops, dtype, rows, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, :heads * dim].view(rows, heads, dim)  # views of the fused projection, as attention passes them
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    table = torch.randn(300, dim, generator=gen)
    for positions in (torch.randint(0, 300, (rows,), generator=gen), torch.arange(rows, dtype=torch.int32)):
        got = cpu_ops.rotary_embedding(positions, q, k, table)
        want = reference.rotary_embedding(positions, q, k, table)
        for g, w in zip(got, want):
            assert g.dtype == dtype and g.is_contiguous() and torch.equal(g, w)
        # the fused layers' form: q|k|v in one row, v handed back as its view
        q2, k2, v2 = ops.rotary_qkv(positions, qkv, table, heads, kv_heads)
        assert torch.equal(q2, want[0]) and torch.equal(k2, want[1])
        assert torch.equal(v2, qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim))
        assert v2.data_ptr() == qkv.data_ptr() + (heads + kv_heads) * dim * qkv.element_size()
    with pytest.raises(RuntimeError):  # a head count that does not split the row (or not at the table's width)
        ops.rotary_qkv(positions, qkv, table, heads + 1, kv_heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (5, 128), (33, 2 * 1000), (2, 3, 64)])
def test_silu_and_mul_is_the_references_bit_for_bit(ops, dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 4).to(dtype)
    got, want = ops.silu_and_mul(x), reference.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)
    strided = x.transpose(0, -1).contiguous().transpose(0, -1) if x.dim() == 2 else x  # rows not contiguous
    assert torch.equal(ops.silu_and_mul(strided), reference.silu_and_mul(strided))


def test_calls_it_does_not_cover_go_to_the_reference(ops):
    x, weight = torch.randn(3, 16), torch.randn(16, dtype=torch.float64)  # a weight in another dtype
    assert torch.equal(cpu_ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    strided = torch.randn(3, 32)[:, ::2]  # a last dim that is not contiguous
    w = torch.randn(16)
    assert torch.equal(cpu_ops.rms_norm(strided, w, 1e-5), reference.rms_norm(strided, w, 1e-5))
    with pytest.raises(RuntimeError, match="last dim contiguous"):
        ops.rms_norm(strided, w, 1e-5)
    q = torch.randn(2, 2, 8)
    with pytest.raises(IndexError):  # a position past the table: the reference's own error
        cpu_ops.rotary_embedding(torch.tensor([0, 40]), q, q, torch.randn(10, 8))
    assert cpu_ops.swigluoai is reference.swigluoai  # every other name is the reference's
    assert cpu_ops.paged_attention is cpu_attention.paged_attention


def test_the_engine_runs_it_on_cpu():
    from engine.model_runner import select_ops

    assert select_ops(torch.device("cpu"), "auto") is cpu_ops
    assert select_ops(torch.device("cpu"), "reference") is reference
