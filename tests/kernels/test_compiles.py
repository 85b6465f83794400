"""A Triton compile after start-up is logged (it stalls the step that meets it)."""
from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_compile_after_start_up_is_logged_and_a_cached_kernel_is_not(caplog):
    from kernels import compiles, rms_norm

    compiles.watch(logging.getLogger("pdserve-test"))
    caplog.set_level(logging.INFO, logger="pdserve-test")
    x = torch.randn(3, 4000 + torch.randint(1, 999, ()).item(), device="cuda")  # a width no one compiled
    w = torch.ones(x.shape[1], device="cuda")
    n = compiles.count
    rms_norm(x, w, 1e-6)
    assert compiles.count == n + 1 and "compiled _rms_norm_kernel after start-up" in caplog.text
    rms_norm(x, w, 1e-6)
    assert compiles.count == n + 1


def test_after_warm_up_no_split_count_or_batch_shape_compiles_paged_attention():
    from kernels import compiles, paged_attention
    from kernels.paged_attention import warm_up

    dev = torch.device("cuda")
    heads, kv_heads, d, bs = 12, 3, 64, 16  # a shape no other test compiles
    warm_up(torch.bfloat16, heads, kv_heads, d, bs, dev)
    compiles.watch(logging.getLogger("pdserve-test"))
    n = compiles.count
    cache = torch.randn(40, bs, kv_heads, d, dtype=torch.bfloat16, device=dev)
    for tokens, seqs in ((1, 1), (5, 5), (9, 2), (130, 3)):
        lens = torch.randint(tokens // seqs + 1, 600, (seqs,), dtype=torch.int32, device=dev)
        starts = torch.linspace(0, tokens, seqs + 1, device=dev).round().to(torch.int32)
        lens = torch.maximum(lens, (starts[1:] - starts[:-1]))
        tables = torch.randint(0, 40, (seqs, 40), dtype=torch.int32, device=dev)
        q = torch.randn(tokens, heads, d, dtype=torch.bfloat16, device=dev)
        for splits in (None, 1, 3, 7, 13, 33, 64):
            paged_attention(q, cache, cache, tables, starts, lens, d ** -0.5, num_splits=splits)
    torch.cuda.synchronize()
    assert compiles.count == n
