"""Paged attention over a step padded as a mixed-step graph pads it (engine/cuda_graphs.py,
``MixedInputs``): the real sequences, then one padding sequence holding the bucket's spare
tokens over a clean block, then empty sequences (no query, no key). The real rows equal the
unpadded call's, on the Triton launcher (the interpreter on CPU) and the reference."""
from __future__ import annotations

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES
from tests.kernels.test_paged_attention import make_batch

import kernels
from kernels import reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ops", [kernels, reference], ids=["triton", "reference"])
def test_padded_mixed_step_keeps_the_real_rows(dtype, ops):
    seqs = [(5, 3), (0, 6), (9, 1), (0, 1)]  # chunks over a prefix, a fresh chunk, decode rows
    batch = make_batch(seqs, num_kv_heads=2, group=2, head_dim=32, block_size=4, dtype=dtype, seed=3)
    want = ops.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                               batch.query_start_loc, batch.seq_lens, batch.scale, num_splits=1)
    n, total, bucket, max_seqs = len(seqs), int(batch.query_start_loc[-1]), 16, 8
    pad = bucket - total
    q = torch.zeros(bucket, *batch.q.shape[1:], dtype=dtype, device=DEVICE)
    q[:total] = batch.q
    q[total:] = 0.5  # the padding tokens' queries: anything finite
    tables = torch.zeros(max_seqs, batch.block_tables.shape[1], dtype=torch.int32, device=DEVICE)
    tables[:n] = batch.block_tables
    tables[n] = batch.block_tables[0, 0]  # the padding sequence reads one block that holds real keys, page after page
    qsl = torch.full((max_seqs + 1,), bucket, dtype=torch.int32, device=DEVICE)
    qsl[:n + 1] = batch.query_start_loc
    lens = torch.zeros(max_seqs, dtype=torch.int32, device=DEVICE)
    lens[:n] = batch.seq_lens
    lens[n] = pad
    got = ops.paged_attention(q, batch.k_cache, batch.v_cache, tables, qsl, lens, batch.scale, num_splits=1)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got[:total], want, atol=atol, rtol=rtol)
    assert torch.isfinite(got[:total]).all()
