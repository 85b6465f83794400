"""FP8 (e4m3) KV cache in the kernels: ``store_kv_cache`` quantizes (x / scale, clamped to
+-448, rounded to nearest even) and ``paged_attention`` reads K * k_scale and V * v_scale.

Each Triton launcher against its reference, and each reference against an oracle of
its own: torch's e4m3 cast for the store (bit for bit), dense float64 attention over the
round-tripped K/V for attention. Under Triton's interpreter the kernels run the same
code as on CUDA except the float32 -> e4m3 conversion of the store, which the
interpreter gets wrong (it truncates): there the kernel rounds in integer arithmetic;
on CUDA (sm_89+) the same tests run the hardware conversion."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels._common import DEVICE, TOLERANCES
from tests.kernels.test_paged_attention import CASES, CASE_IDS, WINDOW_CASES, dense_causal_attention, make_batch

import kernels
from kernels import reference

FP8 = torch.float8_e4m3fn
FP8_DTYPES = [torch.float32, torch.float16,
              pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 needs CUDA"))]
K_SCALE, V_SCALE = 0.37, 1.9  # not powers of two: x / scale rounds, and dropping a scale shows


def fp8_supported() -> bool:
    return DEVICE != "cuda" or torch.cuda.get_device_capability() >= (8, 9)


pytestmark = pytest.mark.skipif(not fp8_supported(), reason="FP8 needs compute capability 8.9+")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # torch.equal has no float8 version


def awkward_values(n: int, seed: int) -> torch.Tensor:
    """Values over every e4m3 range once scaled: subnormals, exact ties between codes, past 448."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[codes.isfinite()].unique()
    ties = (finite[1:] + finite[:-1]) / 2  # round to the even code
    spread = torch.randn(n, generator=gen) * torch.logspace(-4, 3, n)
    return torch.cat([spread, ties, finite, torch.tensor([0.0, -0.0, 500.0, -1e6])])


# ---- store_kv_cache ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_store_quantizes_like_torch_and_the_kernel_like_the_reference(dtype):
    values = awkward_values(700, seed=1)
    heads, dim, block_size = 2, 16, 4
    num_tokens = -(-values.numel() // (2 * heads * dim))
    flat = torch.zeros(num_tokens * 2 * heads * dim)
    flat[:values.numel()] = values
    kv = flat.view(num_tokens, 2 * heads, dim).to(dtype)
    key = (kv[:, :heads] * K_SCALE).to(DEVICE)  # scaled so that key / K_SCALE hits the awkward values
    value = (kv[:, heads:] * V_SCALE).to(DEVICE)
    num_blocks = -(-num_tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(2))[:num_tokens]
    slots[::5] = -1
    slots = slots.to(DEVICE)
    fill = torch.full((2, num_blocks, 2, block_size, heads, dim), 0x55, dtype=torch.uint8, device=DEVICE)
    want, got = fill.clone().view(FP8), fill.clone().view(FP8)
    reference.store_kv_cache(key, value, want[1, :, 0], want[1, :, 1], slots, k_scale=K_SCALE, v_scale=V_SCALE)
    kernels.store_kv_cache(key, value, got[1, :, 0], got[1, :, 1], slots, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(bits(got), bits(want))
    # The reference against torch's cast, token by token; skipped tokens leave the fill.
    oracle = fill.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for side, x, scale in ((0, key[t], K_SCALE), (1, value[t], V_SCALE)):
                q = (x.float() / scale).clamp(-448, 448).to(FP8)
                oracle[1, slot // block_size, side, slot % block_size] = bits(q)
    assert torch.equal(bits(want), oracle)


def test_store_rejects_scales_without_an_fp8_cache():
    key = torch.randn(3, 2, 16, device=DEVICE)
    cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="scales apply to FP8 caches only"):
        kernels.store_kv_cache(key, key, cache, cache, slots, k_scale=0.5)
    fp8 = cache.to(FP8)
    with pytest.raises(ValueError, match="k_scale must be a positive finite float"):
        kernels.store_kv_cache(key, key, fp8, fp8, slots, k_scale=0.0)
    with pytest.raises(ValueError, match="v_cache dtype"):
        kernels.store_kv_cache(key, key, fp8, cache, slots)
    with pytest.raises(ValueError, match="neither the model's"):
        kernels.store_kv_cache(key, key, cache.half(), cache.half(), slots)


# ---- paged_attention --------------------------------------------------------------------


def fp8_batch(case, dtype, k_scale=K_SCALE, v_scale=V_SCALE, window=None, seed=0):
    """make_batch's paged batch with its cache quantized to FP8 (the NaN poison of blocks no
    sequence owns stays NaN), and its contiguous keys and values round-tripped through
    e4m3 as the dense oracle must see them."""
    seqs, num_kv_heads, group, head_dim, block_size = case[1:6]
    b = make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed, sliding_window=window)

    def round_trip(x, scale):
        return (x.float() / scale).clamp(-448, 448).to(FP8).double() * scale

    return dataclasses.replace(
        b, k_cache=reference.quantize_fp8(b.k_cache, k_scale), v_cache=reference.quantize_fp8(b.v_cache, v_scale),
        keys=[round_trip(k, k_scale) for k in b.keys], values=[round_trip(v, v_scale) for v in b.values])


def _args(b):
    return (b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.scale)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_reads_k_and_v_times_their_scales(case):
    b = fp8_batch(case, torch.float32)
    got = reference.paged_attention(*_args(b), k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got.double(), dense_causal_attention(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(case, dtype):
    b = fp8_batch(case, dtype)
    want = reference.paged_attention(*_args(b), k_scale=K_SCALE, v_scale=V_SCALE)
    got = kernels.paged_attention(*_args(b), k_scale=K_SCALE, v_scale=V_SCALE)
    assert got.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_k_applies_v_scale_to_every_partial(num_splits):
    case = CASES[3]  # mixed: some splits see no key of a short row
    b = fp8_batch(case, torch.float32, seed=1)
    want = reference.paged_attention(*_args(b), k_scale=K_SCALE, v_scale=V_SCALE)
    got = kernels.paged_attention(*_args(b), num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_sliding_window_over_an_fp8_cache():
    name, seqs, num_kv_heads, group, head_dim, block_size, window = WINDOW_CASES[6]
    b = fp8_batch((name, seqs, num_kv_heads, group, head_dim, block_size), torch.float32, window=window)
    want = reference.paged_attention(*_args(b), sliding_window=window, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(want.double(), dense_causal_attention(b, window), atol=1e-5, rtol=1e-5)
    got = kernels.paged_attention(*_args(b), sliding_window=window, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_attention_rejects_a_scale_without_an_fp8_cache():
    b = make_batch([(3, 2)], 2, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="scales apply to FP8 caches only"):
        kernels.paged_attention(*_args(b), v_scale=2.0)
    b8 = fp8_batch(("x", [(3, 2)], 2, 2, 16, 4), torch.float32)
    with pytest.raises(ValueError, match="v_cache dtype"):
        kernels.paged_attention(b8.q, b8.k_cache, b.v_cache, *_args(b)[3:])
