"""Paged attention: the Triton launcher against the reference, and the
reference against a dense causal attention over contiguous K/V, both with and
without a sliding window."""
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
    sliding_window: int | None = None,
) -> PagedBatch:
    """seqs: (tokens cached before this step, new query tokens) per sequence.

    Blocks come from a shuffled pool; blocks no sequence owns are filled with
    NaN and table padding points at one of them (or is -1), so any read past
    a sequence's keys poisons the output. With a ``sliding_window`` the cached
    keys before the window of a sequence's first new query are NaN too (keys
    no query sees must not be read); ``keys`` and ``values`` keep them clean.
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
        if sliding_window is not None:
            unseen = max(0, seqs[b][0] - sliding_window + 1)  # keys before the first query's window
            nan = torch.full((unseen, num_kv_heads, head_dim), float("nan"), dtype=dtype)
            reference.store_kv_cache(nan, nan, k_cache, v_cache, slots[:unseen])

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


def dense_causal_attention(batch: PagedBatch, sliding_window: int | None = None) -> torch.Tensor:
    """Textbook attention in float64 straight from contiguous K/V; with a window the
    query at p sees keys k with p - sliding_window < k <= p (transformers' mask)."""
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
        probs = scores.masked_fill(hidden_keys(q_pos, seq_len, sliding_window), float("-inf")).softmax(dim=-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hls,shd->lhd", probs, v)
    return out


def hidden_keys(q_pos: torch.Tensor, seq_len: int, sliding_window: int | None) -> torch.Tensor:
    """[L, S] True where the query at q_pos[i] must not see key j: the future, and with a
    window the keys at or before q_pos[i] - sliding_window."""
    k_pos = torch.arange(seq_len, device=q_pos.device)[None, :]
    hidden = k_pos > q_pos[:, None]
    if sliding_window is not None:
        hidden |= k_pos <= q_pos[:, None] - sliding_window
    return hidden


def test_the_dense_window_mask_is_transformers_mask():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    q_pos, k_pos = torch.arange(9, 30)[:, None], torch.arange(30)[None, :]
    for window in (1, 3, 16, 29, 30, 100):
        visible = masking_utils.sliding_window_causal_mask_function(window)(0, 0, q_pos, k_pos)
        assert torch.equal(~hidden_keys(q_pos[:, 0], 30, window), visible)


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


# ---- sliding window -------------------------------------------------------------------
# (name, [(cached, new) per sequence], num_kv_heads, group, head_dim, block_size, window).
# Key tiles under the interpreter: 64 keys by 64 // group queries in float32, 128 keys by
# 128 // group queries in float16; the long cases skip whole key tiles before the window
# and run unmasked tiles inside it.
WINDOW_CASES = [
    ("w1_mixed", [(40, 1), (0, 3), (13, 20), (70, 1), (6, 33)], 1, 5, 32, 16, 1),
    ("decode_w_in_block", [(0, 1), (15, 1), (32, 1), (99, 1)], 2, 5, 32, 16, 5),
    ("chunks_straddle_blocks", [(37, 9), (5, 17), (20, 3), (11, 1)], 2, 1, 16, 4, 6),
    ("w_eq_context", [(10, 6), (15, 1), (12, 4), (0, 16)], 1, 3, 16, 4, 16),
    ("w_past_context", [(5, 7), (30, 1), (3, 1)], 2, 2, 16, 16, 1000),
    ("decode_shaped_with_chunk", [(30, 2), (12, 0), (20, 1)], 2, 3, 16, 4, 5),  # tokens <= seqs: 1 per tile
    ("gqa5_mixed", [(40, 1), (0, 3), (13, 20), (12, 0), (70, 1), (6, 33)], 1, 5, 32, 16, 10),
    ("long_prefix_g1", [(400, 70), (300, 1), (250, 1)], 1, 1, 16, 16, 200),
    ("long_prefix_g4", [(700, 40), (520, 1)], 1, 4, 16, 16, 300),
]
WINDOW_IDS = [c[0] for c in WINDOW_CASES]


def _window_batch(case, dtype, seed=0):
    _, seqs, num_kv_heads, group, head_dim, block_size, window = case
    return make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed, sliding_window=window), window


@pytest.mark.parametrize("case", WINDOW_CASES, ids=WINDOW_IDS)
def test_reference_window_matches_dense_attention(case):
    batch, window = _window_batch(case, torch.float32)
    got = reference.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale, sliding_window=window,
    )
    torch.testing.assert_close(got.double(), dense_causal_attention(batch, window), atol=1e-5, rtol=1e-5)


def test_reference_window_decode_gathers_rows_or_indexes_alike():
    batch, window = _window_batch(WINDOW_CASES[1], torch.float32)
    spread = [torch.full((*c.shape, 2), float("nan"), device=c.device) for c in (batch.k_cache, batch.v_cache)]
    for wide, c in zip(spread, (batch.k_cache, batch.v_cache)):
        wide[..., 0] = c
    args = (batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    by_rows = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, *args, sliding_window=window)
    by_index = reference.paged_attention(batch.q, spread[0][..., 0], spread[1][..., 0], *args,
                                         sliding_window=window)
    assert torch.equal(by_rows, by_index)
    torch.testing.assert_close(by_rows.double(), dense_causal_attention(batch, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=WINDOW_IDS)
def test_kernel_window_matches_reference(case, dtype):
    batch, window = _window_batch(case, dtype)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens)
    want = reference.paged_attention(*args, batch.scale, sliding_window=window)
    got = kernels.paged_attention(*args, batch.scale, sliding_window=window)
    assert got.dtype == dtype and got.shape == batch.q.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("case", [WINDOW_CASES[i] for i in (1, 5, 6)], ids=[WINDOW_IDS[i] for i in (1, 5, 6)])
def test_window_split_k_matches_reference(case, num_splits):
    # Splits cut only the visible key range; some get no key of a short row.
    batch, window = _window_batch(case, torch.float32, seed=1)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens)
    want = reference.paged_attention(*args, batch.scale, sliding_window=window)
    got = kernels.paged_attention(*args, batch.scale, num_splits=num_splits, sliding_window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_window_covering_every_context_is_full_attention():
    _, seqs, num_kv_heads, group, head_dim, block_size = CASES[3]
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, torch.float32)
    longest = int(batch.seq_lens.max())
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
            batch.scale)
    full = reference.paged_attention(*args)
    for window in (longest, longest + 1, 1 << 20, 1 << 40):  # (past int32: clamped for the kernel)
        assert torch.equal(reference.paged_attention(*args, sliding_window=window), full)
        torch.testing.assert_close(kernels.paged_attention(*args, sliding_window=window),
                                   kernels.paged_attention(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [0, -4, 2.5, True, "16"])
def test_rejects_bad_window(window):
    batch = make_batch([(3, 2)], 2, 2, 16, 4, torch.float32)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
            batch.scale)
    for fn in (kernels.paged_attention, reference.paged_attention):
        with pytest.raises(ValueError, match="sliding_window"):
            fn(*args, sliding_window=window)
    from kernels.paged_attention import paged_attention_num_splits, warm_up

    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_num_splits(1, 1, 4, 2, 16, 64, torch.device("cpu"), sliding_window=window)
    with pytest.raises(ValueError, match="sliding_window"):
        warm_up(torch.float32, 4, 2, 16, 4, torch.device(DEVICE), sliding_window=window)


def test_window_split_count_follows_the_visible_keys(monkeypatch):
    """With a window the default split count is the one of a context about the window's
    length, whatever the context: a decode over 32k with a 4k window splits like a 4k one."""
    import importlib

    pa = importlib.import_module("kernels.paged_attention")  # the module, not the launcher it exports

    monkeypatch.setattr(pa, "_num_sms", lambda index: 132)  # an H200, without a GPU
    cuda = torch.device("cuda", 0)

    def splits(batch: int, ctx: int, window: int | None) -> int:
        return pa.paged_attention_num_splits(batch, batch, 32, 8, 128, ctx, cuda, sliding_window=window)

    assert splits(1, 32768, None) == 64
    assert splits(1, 32768, 4096) == splits(1, 4096 + 64, None) == 16
    assert splits(8, 32768, 4096) == splits(8, 4096, None)
    assert splits(1, 2048, 4096) == splits(1, 2048, None)  # the window covers every context
    assert splits(1, 32768, 64) == 1  # two key tiles at most: nothing to split
    # a prefill tile of 32 queries (16-bit, group 4) spans window + 31 keys
    assert pa._max_kv_tiles(pa._tile_config(64, 1, 4, 128), 1 << 20, 4096) == 34


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 at real sizes needs CUDA")
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_window_bf16_at_model_shapes_matches_reference(num_splits):
    # 8B-like heads (32 q / 8 kv, D=128), 16-token pages: decode rows over contexts past,
    # at and below a 1k window, then a mixed batch with a 700-token chunk over a 6k prefix.
    for seqs in ([(5000, 1), (300, 1), (1023, 1), (9000, 1)], [(6000, 700), (4100, 1), (200, 1), (0, 50)]):
        batch = make_batch(seqs, 8, 4, 128, 16, torch.bfloat16, seed=2, sliding_window=1024)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                batch.scale)
        want = reference.paged_attention(*args, sliding_window=1024)
        got = kernels.paged_attention(*args, num_splits=num_splits, sliding_window=1024)
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiles for CUDA")
def test_after_windowed_warm_up_no_windowed_call_compiles():
    import logging

    from kernels import compiles
    from kernels.paged_attention import warm_up

    dev = torch.device("cuda")
    heads, kv_heads, d, bs = 20, 4, 64, 16  # a shape no other test compiles
    warm_up(torch.bfloat16, heads, kv_heads, d, bs, dev, sliding_window=4096)
    compiles.watch(logging.getLogger("pdserve-test"))
    n = compiles.count
    cache = torch.randn(40, bs, kv_heads, d, dtype=torch.bfloat16, device=dev)
    for tokens, seqs in ((1, 1), (5, 5), (9, 2), (130, 3)):
        lens = torch.randint(tokens // seqs + 1, 600, (seqs,), dtype=torch.int32, device=dev)
        starts = torch.linspace(0, tokens, seqs + 1, device=dev).round().to(torch.int32)
        lens = torch.maximum(lens, (starts[1:] - starts[:-1]))
        tables = torch.randint(0, 40, (seqs, 40), dtype=torch.int32, device=dev)
        q = torch.randn(tokens, heads, d, dtype=torch.bfloat16, device=dev)
        for window in (1, 16, 100, 4096):  # any size: the window is not compiled in
            for splits in (None, 1, 3, 64):
                kernels.paged_attention(q, cache, cache, tables, starts, lens, d ** -0.5, num_splits=splits,
                                        sliding_window=window)
    torch.cuda.synchronize()
    assert compiles.count == n


@pytest.mark.skipif(DEVICE == "cuda", reason="counts interpreted work; on the GPU `pdserve bench kernels` shows it")
@pytest.mark.parametrize("q_len,num_splits", [(1, 1), (1, 4), (8, 1)])
def test_window_skips_the_key_tiles_before_it(q_len, num_splits):
    """Key tiles wholly before the window are not visited, split or not: under the
    interpreter (time proportional to the tiles visited) an 8k context with a 64-key
    window costs about what a 64-key context does, not the ~100x a full scan would."""
    import time

    def seconds(ctx: int, window: int | None) -> float:
        batch = make_batch([(ctx, q_len)], 1, 1, 16, 16, torch.float32)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                batch.seq_lens, batch.scale)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            kernels.paged_attention(*args, num_splits=num_splits, sliding_window=window)
            best = min(best, time.perf_counter() - start)
        return best

    assert seconds(8192, 64) < 5 * seconds(64, None)
