"""Paged attention: the Triton launcher against the reference, and the
reference against a dense causal attention over contiguous K/V."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES

import kernels
from kernels import reference


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D], a non-contiguous view of a fused qkv
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] view of kv_cache[1, :, 0]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence, [seq_len, Hkv, D] contiguous
    values: list[torch.Tensor]
    scale: float


def make_batch(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """seqs: (tokens cached before this step, new query tokens) per sequence.

    Blocks come from a shuffled pool; blocks no sequence owns are filled with
    NaN and table padding points at one of them (or is -1), so any read past
    a sequence's keys poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q_len for ctx, q_len in seqs]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # + unowned, poisoned blocks
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    poison = pool[-1]
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.empty((len(seqs), max_blocks), dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        owned, pool = pool[:n], pool[n:]
        pad = -1 if b % 2 else poison
        block_tables[b] = torch.tensor(owned + [pad] * (max_blocks - n))

    shape = (2, num_blocks, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_cache, v_cache = kv_cache[1, :, 0], kv_cache[1, :, 1]
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        reference.store_kv_cache(keys[b], values[b], k_cache, v_cache, slots)

    q_lens = [q_len for _, q_len in seqs]
    num_tokens, num_q_heads = sum(q_lens), num_kv_heads * group
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE)

    return PagedBatch(
        q=dev(qkv)[:, :num_q_heads],
        k_cache=dev(kv_cache)[1, :, 0],
        v_cache=dev(kv_cache)[1, :, 1],
        block_tables=dev(block_tables),
        query_start_loc=dev(query_start_loc),
        seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
        keys=[dev(k) for k in keys],
        values=[dev(v) for v in values],
        scale=head_dim**-0.5,
    )


def dense_causal_attention(batch: PagedBatch) -> torch.Tensor:
    """Textbook attention in float64 straight from contiguous K/V."""
    q = batch.q.double()
    out = torch.empty_like(q)
    group = q.shape[1] // batch.keys[0].shape[1]
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        qb = q[starts[b] : starts[b + 1]]  # [L, Hq, D]
        q_len = qb.shape[0]
        k = batch.keys[b].double().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = batch.values[b].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", qb, k) * batch.scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]  # [L, S]
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hls,shd->lhd", probs, v)
    return out


# (name, [(cached tokens, new tokens) per sequence], num_kv_heads, group, head_dim, block_size)
CASES = [
    ("decode", [(0, 1), (15, 1), (32, 1), (99, 1)], 2, 5, 32, 16),
    ("prefill", [(0, 17), (0, 33)], 1, 3, 64, 4),
    ("chunk_mid_block", [(5, 17), (37, 3)], 2, 1, 16, 4),
    ("mixed", [(40, 1), (0, 3), (13, 20), (12, 0), (70, 1), (6, 33)], 1, 5, 32, 16),
    ("block_size_1", [(9, 1), (3, 5), (0, 2)], 2, 3, 16, 1),
    ("long_decode", [(150, 1), (3, 1)], 1, 1, 64, 16),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_matches_dense_attention(case):
    _, seqs, num_kv_heads, group, head_dim, block_size = case
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, torch.float32)
    got = reference.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale,
    )
    torch.testing.assert_close(got.double(), dense_causal_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_decode_gathers_rows_or_indexes_alike():
    """Single-token rows gather whole head vectors by row (caches whose head vectors are
    contiguous, as the engine's are) or by advanced indexing (any other strides): one answer."""
    batch = make_batch(CASES[0][1], *CASES[0][2:], torch.float32)
    spread = [torch.full((*c.shape, 2), float("nan"), device=c.device) for c in (batch.k_cache, batch.v_cache)]
    for wide, c in zip(spread, (batch.k_cache, batch.v_cache)):
        wide[..., 0] = c
    k_strided, v_strided = spread[0][..., 0], spread[1][..., 0]  # head_dim stride 2: no row view
    assert reference._as_vector_rows(k_strided) is None and reference._as_vector_rows(batch.k_cache) is not None
    args = (batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    by_rows = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, *args)
    by_index = reference.paged_attention(batch.q, k_strided, v_strided, *args)
    assert torch.equal(by_rows, by_index)
    torch.testing.assert_close(by_rows.double(), dense_causal_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(case, dtype):
    _, seqs, num_kv_heads, group, head_dim, block_size = case
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens)
    want = reference.paged_attention(*args, batch.scale)
    got = kernels.paged_attention(*args, batch.scale)
    assert got.dtype == dtype and got.shape == batch.q.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[CASE_IDS[0], CASE_IDS[3]])
def test_split_k_matches_reference(case, num_splits):
    # Flash-decoding path: some splits see no key at all for short sequences.
    _, seqs, num_kv_heads, group, head_dim, block_size = case
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, torch.float32, seed=1)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens)
    want = reference.paged_attention(*args, batch.scale)
    got = kernels.paged_attention(*args, batch.scale, num_splits=num_splits)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs ~4 GiB of device memory")
def test_block_offsets_past_int32():
    # Block stride 2 * 16 * 1 * 64 = 2048 elements: blocks past 2^20 sit beyond 2^31.
    block_size, head_dim, num_blocks = 16, 64, (1 << 20) + 64
    kv_cache = torch.zeros((1, num_blocks, 2, block_size, 1, head_dim), dtype=torch.float16, device=DEVICE)
    k_cache, v_cache = kv_cache[0, :, 0], kv_cache[0, :, 1]
    seq_len = 40
    blocks = torch.tensor([num_blocks - 1, num_blocks - 40, num_blocks - 7], device=DEVICE)
    pos = torch.arange(seq_len, device=DEVICE)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    key = torch.randn(seq_len, 1, head_dim, dtype=torch.float16, device=DEVICE)
    value = torch.randn_like(key)
    kernels.store_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[blocks[2], 7], key[39]) and torch.equal(v_cache[blocks[0], 3], value[3])
    q = torch.randn(5, 2, head_dim, dtype=torch.float16, device=DEVICE)
    args = (
        q, k_cache, v_cache, blocks[None].to(torch.int32),
        torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
        torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
    )
    torch.testing.assert_close(
        kernels.paged_attention(*args, 0.125), reference.paged_attention(*args, 0.125), atol=1e-2, rtol=1e-2
    )


def test_rejects_bad_arguments():
    batch = make_batch([(3, 2)], 2, 2, 16, 4, torch.float32)
    args = [batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens]
    bad_dtype = list(args)
    bad_dtype[5] = batch.seq_lens.long()
    with pytest.raises(ValueError, match="seq_lens must have dtype"):
        kernels.paged_attention(*bad_dtype, batch.scale)
    bad_heads = list(args)
    bad_heads[0] = batch.q[:, :3]
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        kernels.paged_attention(*bad_heads, batch.scale)
    bad_stride = list(args)
    # Same shape, but head_dim is the outer of the last two dims in memory.
    bad_stride[1] = batch.k_cache.transpose(2, 3).contiguous().transpose(2, 3)
    bad_stride[2] = batch.v_cache.transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match="stride 1 in its last dim"):
        kernels.paged_attention(*bad_stride, batch.scale)


def test_split_count_fills_one_wave():
    """The split choice for the H200's 132 SMs (a wave of 528 programs), on the decode
    shapes measured with `pdserve bench kernels` (8 KV heads: programs = 8 x sequences)."""
    from kernels.paged_attention import split_count

    wave = 4 * 132
    tiles = {1024: 16, 4096: 64, 8192: 128, 32768: 512}  # 64-key tiles of a context
    assert split_count(8 * 1, tiles[32768], wave) == 64  # capped
    assert split_count(8 * 1, tiles[1024], wave) == 4  # each split keeps 4 key tiles
    assert split_count(8 * 4, tiles[8192], wave) == 16
    assert split_count(8 * 8, tiles[32768], wave) == 8  # 9 would start a second, mostly idle wave
    assert split_count(8 * 32, tiles[4096], wave) == 2
    assert split_count(8 * 64, tiles[4096], wave) == 1  # the grid already fills the wave
    assert split_count(8 * 256, tiles[1024], wave) == 1
    for programs in range(1, 600):
        s = split_count(programs, 10_000, wave)
        assert s == 1 or programs * s <= wave
