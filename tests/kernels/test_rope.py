"""rotary_embedding against the reference; the reference against Hugging
Face's LlamaRotaryEmbedding + apply_rotary_pos_emb."""
from __future__ import annotations

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES

import kernels
from kernels import reference

MAX_POSITIONS = 512
BASE = 10000.0


def cos_sin_cache(head_dim: int) -> torch.Tensor:
    """[MAX_POSITIONS, head_dim] float32: cos | sin of pos * inv_freq, as HF computes them.

    cos and sin run on DEVICE, as HF's do, so both see the same libm.
    """
    inv_freq = 1.0 / BASE ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freqs = torch.arange(MAX_POSITIONS, device=DEVICE).float()[:, None] * inv_freq.to(DEVICE)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def make_inputs(num_tokens, num_q_heads, num_k_heads, head_dim, dtype, pos_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen).to(pos_dtype)
    # q and k are views of a fused qkv: token stride (Hq + 2 Hk) * D.
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_k_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k = qkv[:, :num_q_heads], qkv[:, num_q_heads : num_q_heads + num_k_heads]
    return positions.to(DEVICE), q, k


SHAPES = [  # (num_tokens, num_q_heads, num_kv_heads, head_dim)
    (1, 1, 1, 16),
    (17, 5, 1, 64),
    (33, 6, 2, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_hf(dtype):
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = modeling_llama.LlamaConfig(
        hidden_size=4 * 64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS, rope_theta=BASE,
    )
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(DEVICE)
    positions, q, k = make_inputs(17, 4, 2, 64, dtype, torch.int64)
    cos, sin = rotary(q, positions[None])  # [1, T, D] each, in q's dtype
    # HF layout: [batch, heads, T, D].
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = reference.rotary_embedding(positions, q, k, cos_sin_cache(64))
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, dtype, pos_dtype):
    positions, q, k = make_inputs(*shape, dtype, pos_dtype)
    q_before, k_before = q.clone(), k.clone()
    cache = cos_sin_cache(shape[-1])
    got_q, got_k = kernels.rotary_embedding(positions, q, k, cache)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cache)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got_q, want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_k, want_k, atol=atol, rtol=rtol)
    assert got_q.is_contiguous() and got_k.is_contiguous() and got_q.dtype == dtype
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_rejects_bad_arguments():
    positions, q, k = make_inputs(3, 2, 1, 16, torch.float32, torch.int64)
    cache = cos_sin_cache(16)
    with pytest.raises(ValueError, match="cos_sin_cache must have dtype"):
        kernels.rotary_embedding(positions, q, k, cache.half())
    with pytest.raises(ValueError, match="cos_sin_cache has 32 columns for head_dim 16"):
        kernels.rotary_embedding(positions, q, k, cos_sin_cache(32))
    with pytest.raises(ValueError, match="token counts differ"):
        kernels.rotary_embedding(positions[:2], q, k, cache)


NORM_FORMS = {"plain": {}, "offset": {"offset": True}, "float32_weight": {"float32_weight": True}}
NORM_ROPE_CASES = [  # (num_tokens, q heads, kv heads, head_dim, rotary_dim, k, v normed), the norm's form
    ((1, 1, 1, 16, 16, True, False), "plain"),  # Qwen3's
    ((17, 5, 1, 64, 64, True, True), "float32_weight"),  # Gemma 4's: V normed beside
    ((9, 4, 2, 32, 32, False, False), "offset"),  # a layer reading another's KV: q alone
    ((33, 6, 2, 64, 16, True, False), "offset"),  # partial rotary (Qwen3.5's quarter)
    ((5, 3, 3, 24, 8, True, True), "plain"),  # a head size that is no power of two
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case, form", NORM_ROPE_CASES)
def test_qk_norm_rope_matches_the_norms_then_the_rotation(case, form, dtype):
    """One pass: each head of q and k normed (their weights, the form), cast back, rotated on
    its first rotary_dim dims; V (when given) normed with no weight, not rotated. Against the
    reference, which is rms_norm then rotary_embedding one after the other."""
    tokens, hq, hk, d, rd, with_k, with_v = case
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen).to(DEVICE)
    qkv = (3 * torch.randn(tokens, hq + 2 * hk, d, generator=gen)).to(dtype).to(DEVICE)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    q_w = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE)
    k_w = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE)
    args = (positions, q, k if with_k else None, v if with_v else None, q_w, k_w, cos_sin_cache(rd), 1e-6)
    before = qkv.clone()
    got = kernels.qk_norm_rope(*args, **NORM_FORMS[form])
    want = reference.qk_norm_rope(*args, **NORM_FORMS[form])
    atol, rtol = TOLERANCES[dtype]
    for name, g, w in zip("qkv", got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
            assert g.is_contiguous() and g.dtype == dtype
    assert torch.equal(qkv, before)
    # the reference: the norms, then the rotation (on the first rotary_dim dims), as two steps
    normed = reference.rms_norm(q.reshape(-1, d), q_w, 1e-6, **NORM_FORMS[form]).view(q.shape)
    turned, _ = reference.rotary_embedding(positions, normed[..., :rd].contiguous(), normed[..., :rd].contiguous(),
                                           cos_sin_cache(rd))
    assert torch.equal(want[0], torch.cat([turned, normed[..., rd:]], dim=-1))
    if with_v:
        unit = reference.rms_norm(v.reshape(-1, d), torch.ones_like(q_w), 1e-6, float32_weight=True).view(v.shape)
        assert torch.equal(want[2], unit)


def test_qk_norm_rope_rejects_bad_arguments():
    q = torch.randn(3, 2, 16, device=DEVICE)
    w, table = torch.ones(16, device=DEVICE), cos_sin_cache(16)
    positions = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="give k too"):
        kernels.qk_norm_rope(positions, q, None, q, w, w, table, 1e-6)
    with pytest.raises(ValueError, match="an even count up to head_dim 16"):
        kernels.qk_norm_rope(positions, q, q, None, w, w, cos_sin_cache(32), 1e-6)
    with pytest.raises(ValueError, match=r"q_weight must be \[16\]"):
        kernels.qk_norm_rope(positions, q, q, None, w[:8], w, table, 1e-6)
