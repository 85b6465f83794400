"""store_kv_cache: the Triton launcher against the reference, and the reference
against a per-token loop."""
from __future__ import annotations

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES

import kernels
from kernels import reference

SENTINEL = 7.0  # fills the cache; any slot that should stay untouched must still hold it


def make_inputs(num_tokens, num_heads, head_dim, block_size, dtype, slot_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = (num_tokens + 2 * block_size - 1) // block_size + 3
    # [num_layers, num_blocks, 2, block_size, H, D], the engine's layout.
    kv_cache = torch.full((2, num_blocks, 2, block_size, num_heads, head_dim), SENTINEL, dtype=dtype)
    # Distinct slots scattered over the pool; every third token is skipped.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    # key and value are views of a fused qkv, as the model runner produces them.
    qkv = torch.randn(num_tokens, 3 * num_heads, head_dim, generator=gen).to(dtype)
    return (
        kv_cache.to(DEVICE),
        qkv[:, num_heads : 2 * num_heads].to(DEVICE),
        qkv[:, 2 * num_heads :].to(DEVICE),
        slots.to(slot_dtype).to(DEVICE),
    )


SHAPES = [  # (num_tokens, num_kv_heads, head_dim, block_size)
    (1, 1, 16, 4),
    (17, 3, 32, 16),
    (33, 2, 64, 1),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_writes_each_slot(shape):
    num_tokens, num_heads, head_dim, block_size = shape
    kv_cache, key, value, slots = make_inputs(*shape, torch.float32, torch.int64)
    reference.store_kv_cache(key, value, kv_cache[1, :, 0], kv_cache[1, :, 1], slots)
    want = torch.full_like(kv_cache, SENTINEL)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[1, slot // block_size, 0, slot % block_size] = key[t]
            want[1, slot // block_size, 1, slot % block_size] = value[t]
    assert torch.equal(kv_cache, want)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, dtype, slot_dtype):
    kv_cache, key, value, slots = make_inputs(*shape, dtype, slot_dtype)
    want = kv_cache.clone()
    reference.store_kv_cache(key, value, want[1, :, 0], want[1, :, 1], slots)
    kernels.store_kv_cache(key, value, kv_cache[1, :, 0], kv_cache[1, :, 1], slots)
    assert torch.equal(kv_cache, want)


def test_rejects_bad_arguments():
    kv_cache, key, value, slots = make_inputs(5, 2, 16, 4, torch.float32, torch.int64)
    k_cache, v_cache = kv_cache[0, :, 0], kv_cache[0, :, 1]
    with pytest.raises(ValueError, match="value dtype"):
        kernels.store_kv_cache(key, value.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping has 4 entries for 5 tokens"):
        kernels.store_kv_cache(key, value, k_cache, v_cache, slots[:4])
    with pytest.raises(ValueError, match="does not match key"):
        kernels.store_kv_cache(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        kernels.store_kv_cache(key, value, k_cache, v_cache, slots.float())
