"""The CPU attention keeps each row's key positions in a step's cache for the layers after
the first: every layer (its own cache, the same tables) gets what it gets without one."""
from __future__ import annotations

import torch

from kernels import reference


def test_layers_sharing_a_step_cache_get_what_each_gets_alone():
    g = torch.Generator().manual_seed(3)
    bs, hkv, hq, d, nblk = 4, 2, 6, 8, 64
    q_lens = [1, 1, 5, 1, 0, 3, 1]  # decode rows batched together, prefill chunks, an empty row
    ctx = [9, 17, 3, 1, 6, 0, 30]
    lens = torch.tensor([c + n for c, n in zip(ctx, q_lens)], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = torch.randperm(nblk, generator=g)[:len(q_lens) * 8].view(len(q_lens), 8).to(torch.int32)
    cache: dict = {}
    for layer in range(3):
        kv = torch.randn(nblk, 2, bs, hkv, d, generator=g)
        q = torch.randn(int(qsl[-1]), hq, d, generator=g)
        args = (q, kv[:, 0], kv[:, 1], tables, qsl, lens, d ** -0.5)
        shared = reference.paged_attention(*args, step_cache=cache)
        assert torch.equal(shared, reference.paged_attention(*args))
    assert cache  # the first layer filled it


def test_windowed_and_full_layers_sharing_a_step_cache_get_what_each_gets_alone():
    """Models that mix sliding-window and full layers (Gemma, gpt-oss) run both kinds in
    one step: each window keeps its own entries, so no layer gets another's keys."""
    g = torch.Generator().manual_seed(4)
    bs, hkv, hq, d, nblk = 4, 2, 6, 8, 64
    q_lens = [1, 1, 5, 1, 0, 3, 1, 1]
    ctx = [9, 17, 3, 1, 6, 12, 30, 2]
    lens = torch.tensor([c + n for c, n in zip(ctx, q_lens)], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = torch.randperm(nblk, generator=g)[:len(q_lens) * 8].view(len(q_lens), 8).to(torch.int32)
    cache: dict = {}
    for window in (None, 4, None, 7, 4, 1, None):
        kv = torch.randn(nblk, 2, bs, hkv, d, generator=g)
        q = torch.randn(int(qsl[-1]), hq, d, generator=g)
        args = (q, kv[:, 0], kv[:, 1], tables, qsl, lens, d ** -0.5)
        shared = reference.paged_attention(*args, step_cache=cache, sliding_window=window)
        assert torch.equal(shared, reference.paged_attention(*args, sliding_window=window))
    assert not torch.equal(reference.paged_attention(*args, sliding_window=4), reference.paged_attention(*args))
