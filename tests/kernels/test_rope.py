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
