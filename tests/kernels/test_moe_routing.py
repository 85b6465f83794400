"""The one-launch MoE routing against its reference (transformers' routing): weights,
ids and the expert-load counts, with padding rows left uncounted."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(t: int, e: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * 2).to(dtype).to(DEVICE)


@pytest.mark.parametrize("t, e, k", [(1, 8, 2), (5, 128, 8), (33, 60, 4), (7, 4, 4), (3, 3, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(t, e, k, renormalize, dtype):
    logits = _logits(t, e, dtype, seed=t * e + k)
    counts, ref_counts = (torch.zeros(e, dtype=torch.int64, device=DEVICE) for _ in range(2))
    valid = torch.tensor([max(0, t - 2)], dtype=torch.int32, device=DEVICE)  # the last two rows pad
    w, ids = kernels.moe_route(logits, k, renormalize=renormalize, weight_dtype=dtype, expert_counts=counts,
                               num_tokens=valid)
    rw, rids = reference.moe_route(logits, k, renormalize=renormalize, weight_dtype=dtype,
                                   expert_counts=ref_counts, num_tokens=valid)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-7)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(counts, ref_counts) and int(counts.sum()) == max(0, t - 2) * k
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(t, device=DEVICE), rtol=1e-3, atol=1e-3)


def test_without_counts_and_all_tokens_counted():
    logits = _logits(6, 16, torch.float32, seed=3)
    w, ids = kernels.moe_route(logits, 3, renormalize=False, weight_dtype=torch.float32)
    rw, rids = reference.moe_route(logits, 3, renormalize=False, weight_dtype=torch.float32)
    assert torch.equal(ids, rids) and torch.allclose(w, rw)
    counts = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    kernels.moe_route(logits, 3, renormalize=False, weight_dtype=torch.float32, expert_counts=counts)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=16))


def test_bad_arguments():
    logits = _logits(2, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="top_k"):
        kernels.moe_route(logits, 9, renormalize=True, weight_dtype=torch.float32)
    with pytest.raises(ValueError, match="expert_counts"):
        kernels.moe_route(logits, 2, renormalize=True, weight_dtype=torch.float32,
                          expert_counts=torch.zeros(7, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="router_logits"):
        kernels.moe_route(logits[0], 2, renormalize=True, weight_dtype=torch.float32)
