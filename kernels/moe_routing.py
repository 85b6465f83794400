"""Mixture-of-experts routing in one launch: router logits -> top-k weights and ids.

One program per token: softmax over the E logits in float32, the top k by k
passes of an argmax (highest first; equal values: the lowest expert id first),
renormalised to sum 1 when asked, rounded to the model dtype (as transformers
rounds them before weighting the experts) and returned in float32. With
``expert_counts`` it also adds each routed (token, slot) to its expert's counter
(an atomic add per slot), counting only tokens below ``num_tokens[0]``: rows past
it pad a CUDA graph. The eager PyTorch form of the same routing takes ~7 launches
plus 3 for the count; at a decode step's size each costs about as much as the work.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_dim, check_dtype, check_inner_contiguous, check_runnable, next_pow2, require

_OUT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, K] float32 out
    ids_ptr,  # [T, K] int64 out
    counts_ptr,  # [E] int64, or a dummy when not COUNT
    num_tokens_ptr,  # [1] int32: rows at or past it are not counted
    stride_lt,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # TOP_K rounded up to a power of two
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_TO: tl.constexpr,  # the model dtype the weights are rounded to
    COUNT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < num_experts
    x = tl.load(logits_ptr + t * stride_lt + e, mask=ok, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # [BLOCK_E] softmax; padding lanes 0
    p = tl.where(ok, p, -1.0)  # below every probability: never picked
    k = tl.arange(0, BLOCK_K)
    k_ok = k < TOP_K
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        top_w = tl.where(k == j, best, top_w)
        top_i = tl.where(k == j, idx.to(tl.int64), top_i)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    top_w = top_w.to(ROUND_TO).to(tl.float32)
    tl.store(weights_ptr + t * TOP_K + k, top_w, mask=k_ok)
    tl.store(ids_ptr + t * TOP_K + k, top_i, mask=k_ok)
    if COUNT:
        counted = t < tl.load(num_tokens_ptr).to(tl.int64)
        tl.atomic_add(counts_ptr + top_i, tl.full([BLOCK_K], 1, tl.int64), mask=k_ok & counted)


def moe_route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weight_dtype: torch.dtype,
              expert_counts: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of each token over the experts.

    router_logits: [T, E], any float dtype, stride 1 in E
    top_k: experts per token (<= E); renormalize: the k weights rescaled to sum 1
    weight_dtype: the model dtype the weights are rounded to (returned as float32)
    expert_counts: [E] int64, added to in place: tokens routed to each expert
    num_tokens: [1] int32/int64 on the device: only tokens below it are counted (None: all)
    returns (weights [T, K] float32, ids [T, K] int64), highest weight first.
    """
    where = "moe_route"
    check_dim(where, "router_logits", router_logits, 2, "[num_tokens, num_experts]")
    check_dtype(where, "router_logits", router_logits, FLOAT_DTYPES)
    check_inner_contiguous(where, "router_logits", router_logits)
    num_tok, num_experts = router_logits.shape
    require(1 <= top_k <= num_experts, where, f"top_k must be in [1, {num_experts}], got {top_k}")
    require(weight_dtype in _OUT_DTYPES, where, f"weight_dtype must be one of {list(_OUT_DTYPES)}, got {weight_dtype}")
    tensors = {"router_logits": router_logits}
    if expert_counts is not None:
        require(expert_counts.shape == (num_experts,) and expert_counts.dtype == torch.int64
                and expert_counts.is_contiguous(), where,
                f"expert_counts must be a contiguous [{num_experts}] int64 tensor, got {tuple(expert_counts.shape)} "
                f"{expert_counts.dtype}")
        tensors["expert_counts"] = expert_counts
    if num_tokens is None:
        num_tokens = torch.full((1,), num_tok, dtype=torch.int32, device=router_logits.device)
    require(num_tokens.numel() == 1, where, f"num_tokens must hold one count, got shape {tuple(num_tokens.shape)}")
    check_runnable(where, num_tokens=num_tokens, **tensors)
    weights = torch.empty(num_tok, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tok, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tok == 0:
        return weights, ids
    _route_kernel[(num_tok,)](
        router_logits, weights, ids, expert_counts if expert_counts is not None else ids, num_tokens,
        router_logits.stride(0), num_experts,
        TOP_K=top_k, BLOCK_K=next_pow2(top_k), BLOCK_E=max(16, next_pow2(num_experts)), RENORMALIZE=renormalize,
        ROUND_TO=_OUT_DTYPES[weight_dtype], COUNT=expert_counts is not None,
    )
    return weights, ids
