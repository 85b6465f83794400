"""rms_norm and fused_add_rms_norm against the reference; the reference
against Hugging Face's LlamaRMSNorm."""
from __future__ import annotations

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES

import kernels
from kernels import reference

EPS = 1e-6
SHAPES = [(1, 16), (3, 40), (17, 257)]  # (num_tokens, hidden_size)


def make_inputs(num_tokens, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # x is a row-strided view, as a slice of a wider activation would be.
    x = torch.randn(num_tokens, hidden + 5, generator=gen)[:, :hidden]
    residual = torch.randn(num_tokens, hidden, generator=gen)
    weight = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    return x.to(dtype).to(DEVICE), residual.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_hf(dtype):
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    x, _, weight = make_inputs(17, 257, dtype)
    hf = modeling_llama.LlamaRMSNorm(257, eps=EPS).to(dtype=dtype, device=DEVICE)
    with torch.no_grad():
        hf.weight.copy_(weight)
        want = hf(x)
    torch.testing.assert_close(reference.rms_norm(x, weight, EPS), want, atol=0, rtol=0)


@pytest.mark.parametrize("offset_form", ["gemma3", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_offset_reference_matches_hf(dtype, offset_form):
    """The offset form (1 + w, in float32) against Gemma3RMSNorm and Qwen3NextRMSNorm."""
    module = pytest.importorskip(f"transformers.models.{offset_form}.modeling_{offset_form}")
    cls = {"gemma3": "Gemma3RMSNorm", "qwen3_next": "Qwen3NextRMSNorm"}[offset_form]
    x, _, weight = make_inputs(17, 257, dtype)
    hf = getattr(module, cls)(257, eps=EPS).to(dtype=dtype, device=DEVICE)
    with torch.no_grad():
        hf.weight.copy_(weight - 1.0)  # checkpoint values sit around zero
        want = hf(x)
    torch.testing.assert_close(reference.rms_norm(x, weight - 1.0, EPS, offset=True), want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float32_weight_reference_matches_gemma4(dtype):
    """Gemma 4's form (w, in float32) against Gemma4RMSNorm, which takes pow(-0.5) where the
    reference takes rsqrt: within an ulp of float32 before the cast."""
    module = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    x, _, weight = make_inputs(17, 257, dtype)
    hf = module.Gemma4RMSNorm(257, eps=EPS).to(dtype=dtype, device=DEVICE)
    bare = module.Gemma4RMSNorm(257, eps=EPS, with_scale=False).to(dtype=dtype, device=DEVICE)
    with torch.no_grad():
        hf.weight.copy_(weight)
        want, want_bare = hf(x), bare(x)
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(reference.rms_norm(x, weight, EPS, float32_weight=True), want, atol=atol, rtol=rtol)
    ones = torch.ones_like(weight)
    torch.testing.assert_close(reference.rms_norm(x, ones, EPS, float32_weight=True), want_bare, atol=atol, rtol=rtol)


FORMS = {"plain": {}, "offset": {"offset": True}, "float32_weight": {"float32_weight": True}}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype, form):
    x, _, weight = make_inputs(*shape, dtype)
    x_before = x.clone()
    got = kernels.rms_norm(x, weight, EPS, **FORMS[form])
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, reference.rms_norm(x, weight, EPS, **FORMS[form]), atol=atol, rtol=rtol)
    assert got.is_contiguous() and got.dtype == dtype
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_norms_fused_with_a_residual_add(shape, dtype, form):
    """fused_add_rms_norm adds the residual before the norm (pre-norm layers); rms_norm_add adds
    it after the norm's cast (h + norm(x): Gemma 4's post-norms)."""
    x, residual, weight = make_inputs(*shape, dtype)
    x_before, residual_before = x.clone(), residual.clone()
    atol, rtol = TOLERANCES[dtype]
    out, residual_out = kernels.fused_add_rms_norm(x, residual, weight, EPS, **FORMS[form])
    want_out, want_residual = reference.fused_add_rms_norm(x, residual, weight, EPS, **FORMS[form])
    assert torch.equal(residual_out, want_residual)  # one add in the input dtype: exact
    torch.testing.assert_close(out, want_out, atol=atol, rtol=rtol)
    after = kernels.rms_norm_add(x, residual, weight, EPS, **FORMS[form])
    want_after = reference.rms_norm_add(x, residual, weight, EPS, **FORMS[form])
    assert torch.equal(want_after, residual + reference.rms_norm(x, weight, EPS, **FORMS[form]))
    torch.testing.assert_close(after, want_after, atol=atol, rtol=rtol)
    assert after.is_contiguous() and after.dtype == dtype
    # Gemma 4's layer end: the sum times the layer scalar, then the next layer's norm of it
    scale = torch.tensor([0.75], dtype=dtype, device=x.device)
    next_weight = weight.flip(0)
    scaled = kernels.rms_norm_add(x, residual, weight, EPS, scale=scale, **FORMS[form])
    want_scaled = reference.rms_norm_add(x, residual, weight, EPS, scale=scale, **FORMS[form])
    assert torch.equal(want_scaled, want_after * scale)
    torch.testing.assert_close(scaled, want_scaled, atol=atol, rtol=rtol)
    normed, h = kernels.rms_norm_add_norm(x, residual, weight, next_weight, EPS, scale=scale, **FORMS[form])
    want_normed, want_h = reference.rms_norm_add_norm(x, residual, weight, next_weight, EPS, scale=scale,
                                                      **FORMS[form])
    assert torch.equal(want_h, want_scaled) and torch.equal(h, scaled)  # the same sum, to the bit
    assert torch.equal(want_normed, reference.rms_norm(want_h, next_weight, EPS, **FORMS[form]))
    assert torch.equal(normed, kernels.rms_norm(h, next_weight, EPS, **FORMS[form]))  # as the next norm alone
    torch.testing.assert_close(normed, want_normed, atol=atol, rtol=rtol)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rejects_bad_arguments():
    x, residual, weight = make_inputs(3, 40, torch.float32)
    with pytest.raises(ValueError, match="weight has 39 entries for hidden_size 40"):
        kernels.rms_norm(x, weight[:39], EPS)
    with pytest.raises(ValueError, match="weight dtype"):
        kernels.rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="residual shape"):
        kernels.fused_add_rms_norm(x, residual[:2], weight, EPS)
    with pytest.raises(ValueError, match="residual shape"):
        kernels.rms_norm_add(x, residual[:2], weight, EPS)
    with pytest.raises(ValueError, match="stride 1 in its last dim"):
        kernels.rms_norm(x.t().contiguous().t(), weight, EPS)
    with pytest.raises(ValueError, match="scale must be one value"):
        kernels.rms_norm_add(x, residual, weight, EPS, scale=weight[:2])
    with pytest.raises(ValueError, match="weight has 39 entries"):
        kernels.rms_norm_add_norm(x, residual, weight, weight[:39], EPS)
