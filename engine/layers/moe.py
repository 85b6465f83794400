"""Mixture-of-experts block: a router and the experts' weights, run by the fused MoE
kernel (``ops.fused_moe``: Triton on CUDA, its PyTorch reference on CPU).

    router   logits = x W_r^T [T, E]; softmax in float32; top-k; renormalised to sum 1
             where the config says so (Mixtral always, Qwen3-MoE by norm_topk_prob);
             the weights rounded to the model dtype, as transformers does (``ops.moe_route``,
             one Triton launch on CUDA)
    experts  gate_up_proj [E, 2 * I, H] (gate rows, then up rows), down_proj [E, H, I]:
             out[t] = sum_k w[t, k] * down_e(act(gate_e x) * up_e x), e = ids[t, k]

Tensor parallelism splits each expert's intermediate dimension I (every rank holds
every expert's slice; the partial outputs are all-reduced), like a dense MLP.

Checkpoints name experts one by one (``experts.{e}.gate_proj`` or Mixtral's
``w1``/``w3``/``w2``) or stacked as here (transformers 5's ``experts.gate_up_proj``);
the loader's shard ids say which: ("gate", e), ("up", e), ("down", e), or None for
a stacked tensor.

Per-expert load: the routing op adds the tokens routed to each expert into the layer's
row of a counter the model owns (on the device, no host sync; CUDA-graph padding rows
are not counted), read when metrics are scraped.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata
from engine.layers.linear import Part, ReplicatedLinear, copy_rows, split_range, tp_rank_size
from engine.parallel import TPGroup


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, activation: str, ops: ModuleType, tp: TPGroup | None,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        rank, size = tp_rank_size(tp)
        if expert_parallel:  # whole experts [first, first + local) on this rank
            first, stop = split_range(num_experts, rank, size, "number of experts")
            lo, hi = 0, intermediate_size
        else:  # every expert, a slice of its intermediate dimension
            first, stop = 0, num_experts
            lo, hi = split_range(intermediate_size, rank, size, "expert intermediate size")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.first_expert, self.num_local_experts = first, stop - first
        self.activation, self.ops, self.tp = activation, ops, tp
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(stop - first, 2 * (hi - lo), hidden_size))
        self.experts.down_proj = nn.Parameter(torch.empty(stop - first, hidden_size, hi - lo))
        _attach_expert_loaders(self.experts.gate_up_proj, self.experts.down_proj, num_experts, hidden_size,
                               Part(intermediate_size, lo, hi), Part(num_experts, first, stop))
        self.expert_load: torch.Tensor | None = None  # [E] int64 counter row, set by the model
        self.kernel_config: Any = None  # the fused kernel's tile configs (engine/moe_configs.py), CUDA only

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        # Routing, and the expert-load count of the step's tokens (rows past
        # query_start_loc[-1] pad a CUDA graph), in one launch on CUDA.
        num_tokens = None if meta is None else meta.query_start_loc[-1:]
        weights, ids = self.ops.moe_route(self.gate(x), self.top_k, renormalize=self.renormalize,
                                          weight_dtype=x.dtype, expert_counts=self.expert_load,
                                          num_tokens=num_tokens)
        if self.num_local_experts != self.num_experts:
            # Other ranks' experts fall outside [0, local): the kernel skips them, and the
            # all-reduce below adds up every rank's experts (tokens are on every rank already:
            # attention is tensor-parallel, so no dispatch is needed).
            ids = ids - self.first_expert
        out = self.ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                                 activation=self.activation, config=self.kernel_config)
        return out if self.tp is None else self.tp.all_reduce(out)


def _attach_expert_loaders(gate_up: nn.Parameter, down: nn.Parameter, num_experts: int, hidden: int,
                           part: Part, experts: Part) -> None:
    """``part``: this rank's slice of each expert's intermediate dim; ``experts``: the
    experts it holds (all of them, unless expert-parallel). Other experts' checkpoint
    tensors are read as nothing and skipped."""
    split = part.size != part.full
    gate_up.full_shape = (num_experts, 2 * part.full, hidden)
    gate_up.shard_ids = tuple((w, e) for e in range(experts.lo, experts.hi) for w in ("gate", "up"))
    down.full_shape = (num_experts, hidden, part.full)
    down.shard_ids = tuple(("down", e) for e in range(experts.lo, experts.hi))

    def local(e: int) -> int | None:
        return e - experts.lo if experts.lo <= e < experts.hi else None

    def load_gate_up(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # [E, 2I, H] (or this rank's experts only)
            if src.shape[0] != experts.size:
                src = src[experts.lo:experts.hi]
            for e in range(experts.size):
                copy_rows(p.data[e], src[e], [part, part], 0, None)
            return
        which, e = shard_id
        if local(e) is not None:
            copy_rows(p.data[local(e)], src, [part, part], 0, 0 if which == "gate" else 1)

    def load_down(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # [E, H, I]
            if src.shape[0] != experts.size:
                src = src[experts.lo:experts.hi]
            p.data.copy_(src if src.shape[2] == part.size else src[:, :, part.lo:part.hi])
            return
        if local(shard_id[1]) is not None:
            copy_rows(p.data[local(shard_id[1])], src, [part], 1, None)

    def slice_gate_up(shard_id=None) -> tuple[int, int, int] | None:
        if shard_id is None:
            return None if experts.size == experts.full else (0, experts.lo, experts.hi)
        if local(shard_id[1]) is None:
            return 0, 0, 0  # another rank's expert: read nothing
        return (0, part.lo, part.hi) if split else None

    def slice_down(shard_id=None) -> tuple[int, int, int] | None:
        if shard_id is None:
            if experts.size != experts.full:
                return 0, experts.lo, experts.hi
            return (2, part.lo, part.hi) if split else None
        if local(shard_id[1]) is None:
            return 0, 0, 0
        return (1, part.lo, part.hi) if split else None

    gate_up.weight_loader, down.weight_loader = load_gate_up, load_down
    gate_up.checkpoint_slice, down.checkpoint_slice = slice_gate_up, slice_down
