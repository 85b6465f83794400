"""silu_and_mul against the reference; the reference against the formula."""
from __future__ import annotations

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES

import kernels
from kernels import reference

SHAPES = [(1, 16), (3, 100), (33, 1500)]  # (num_tokens, intermediate_size); 1500 spans two programs


def make_x(num_tokens, inter_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # A row-strided view, like a slice of a wider gate_up projection.
    x = torch.randn(num_tokens, 2 * inter_size + 3, generator=gen)[:, : 2 * inter_size]
    return (3 * x).to(dtype).to(DEVICE)


def test_reference_matches_formula():
    x = make_x(17, 100, torch.float64)
    gate, up = x[:, :100], x[:, 100:]
    torch.testing.assert_close(reference.silu_and_mul(x), gate / (1 + torch.exp(-gate)) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, dtype):
    x = make_x(*shape, dtype)
    got = kernels.silu_and_mul(x)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, reference.silu_and_mul(x), atol=atol, rtol=rtol)
    assert got.shape == (shape[0], shape[1]) and got.is_contiguous() and got.dtype == dtype


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="must be even"):
        kernels.silu_and_mul(make_x(2, 8, torch.float32)[:, :15])
    with pytest.raises(ValueError, match="must have dtype"):
        kernels.silu_and_mul(make_x(2, 8, torch.float32).long())


ACTS = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
        "sigmoid": torch.sigmoid}


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_activation_matches_reference(shape, dtype, activation):
    """act(gate) * up over two tensors of their own strides (a per-layer input's slice beside a
    projection's output); the reference is transformers' F.silu / F.gelu(approximate="tanh") /
    torch.sigmoid, in the inputs' dtype."""
    gate = make_x(*shape, dtype, seed=1)[:, :shape[1]]
    up = make_x(*shape, dtype, seed=2)[:, shape[1]:]
    got = kernels.gated_activation(gate, up, activation)
    want = reference.gated_activation(gate, up, activation)
    assert torch.equal(want, ACTS[activation](gate) * up)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert got.shape == shape and got.is_contiguous() and got.dtype == dtype
    if activation == "silu":  # the [gate | up] form takes the same kernel
        x = make_x(*shape, dtype)
        assert torch.equal(kernels.silu_and_mul(x), kernels.gated_activation(x[:, :shape[1]], x[:, shape[1]:], "silu"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_attention_output_gate(dtype):
    """Qwen3.5's o * sigmoid(gate): per head, the gate interleaved with the query in one
    projection ([T, H, 2D] -> its second half, strided), the output contiguous [T, H, D]."""
    gen = torch.Generator().manual_seed(5)
    qg = (3 * torch.randn(7, 4 * 24 + 10, generator=gen))[:, :4 * 24].to(dtype).to(DEVICE).view(7, 4, 24)
    gate = qg[..., 12:]
    o = torch.randn(7, 4, 12, generator=gen).to(dtype).to(DEVICE)
    got = kernels.gated_activation(gate, o, "sigmoid")
    want = o.reshape(7, 48) * torch.sigmoid(gate.reshape(7, 48))  # as transformers: flat heads
    assert torch.equal(reference.gated_activation(gate, o, "sigmoid").reshape(7, 48), want)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.reshape(7, 48), want, atol=atol, rtol=rtol)
    assert got.shape == (7, 4, 12) and got.is_contiguous()


def test_gated_activation_rejects_bad_arguments():
    x = make_x(2, 8, torch.float32)
    with pytest.raises(ValueError, match="activation must be one of silu, gelu_tanh, sigmoid"):
        kernels.gated_activation(x[:, :8], x[:, 8:], "relu")
    with pytest.raises(ValueError, match="up shape"):
        kernels.gated_activation(x[:, :8], x[:, 8:15], "silu")
