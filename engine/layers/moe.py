"""Mixture-of-experts block: a router and the experts' weights, run by the fused MoE
kernel (``ops.fused_moe``: Triton on CUDA, its PyTorch reference on CPU).

    router   logits = x W_r^T [T, E]; softmax in float32; top-k; renormalised to sum 1
             where the config says so (Mixtral always, Qwen3-MoE by norm_topk_prob);
             the weights rounded to the model dtype, as transformers does (``ops.moe_route``,
             one Triton launch on CUDA)
    experts  gate_up_proj [E, 2 * I, H] (gate rows, then up rows), down_proj [E, H, I]:
             out[t] = sum_k w[t, k] * down_e(act(gate_e x) * up_e x), e = ids[t, k]

gpt-oss's twists, each a constructor argument: ``router_bias`` (the router's linear has a
bias, ``gate.bias``), ``bias`` (expert biases ``experts.gate_up_proj_bias`` [E, 2I], gate
part then up part, and ``experts.down_proj_bias`` [E, H]:
out[t] = sum_k w[t, k] * (down_e(act(gate_up_e x + b13_e)) + b2_e), the routing weight
multiplying the down bias too, as transformers' GptOssExperts does) and the activation
"swigluoai" (g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) g sigmoid(alpha g),
with ``swiglu_alpha`` and ``swiglu_limit`` from the config). gpt-oss's top-k-then-softmax
routing equals softmax, top-k and renormalise (``renormalize=True``).

Tensor parallelism splits each expert's intermediate dimension I (every rank holds
every expert's slice; the partial outputs are all-reduced), like a dense MLP. The
gate/up bias splits with its rows; the down bias is added on rank 0 only, so the
all-reduce adds it once. Expert parallelism (whole experts per rank) adds each rank's
experts' down biases on that rank.

Checkpoints name experts one by one (``experts.{e}.gate_proj`` or Mixtral's
``w1``/``w3``/``w2``) or stacked as here (transformers 5's ``experts.gate_up_proj``);
the loader's shard ids say which: ("gate", e), ("up", e), ("down", e), or None for
a stacked tensor. A quantized checkpoint's per-expert tensors beside the weight
(``experts.{e}.gate_proj.weight_scale``) load the same way into
``experts.gate_up_proj_weight_scale`` (``MoEMethod``: the plain one here, FP8 in
engine/quantization/fp8.py).

A shared expert (Qwen3-Next, Qwen3.5-MoE: ``shared_expert``, a dense gated MLP every token
goes through, scaled by ``sigmoid(shared_expert_gate x)`` where the block has that gate) is
added to the experts' output. Under tensor parallelism its down projection is not reduced
on its own: its partial sum joins the experts' in the block's one all-reduce.

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
from engine.layers.linear import Part, ReplicatedLinear, RowParallelLinear, copy_rows, split_range, tp_rank_size
from engine.parallel import TPGroup
from kernels.reference import MOE_GATED_ACTIVATIONS as MOE_ACTIVATIONS
from kernels.reference import SWIGLU_ALPHA, SWIGLU_LIMIT


class MoEMethod:
    """How a FusedMoE layer keeps and runs its experts' weights. The plain method: 16-bit
    ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]`` (this rank's
    experts and slice of I). Quantized methods (engine/quantization/fp8.py) subclass this."""

    def create_weights(self, layer: FusedMoE) -> None:
        e, i, h = layer.num_local_experts, layer.part.size, layer.hidden_size
        layer.add_expert_param("gate_up_proj", torch.empty(e, 2 * i, h), "gate_up")
        layer.add_expert_param("down_proj", torch.empty(e, h, i), "down")

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Called once, after every checkpoint tensor is in place (or dummy weights drawn)."""

    block_size: tuple[int, int] | None = None  # block-scaled weights' (rows, columns) a scale covers

    def apply(self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.kernel_weights(layer)
        return layer.ops.fused_moe(x, w13, w2, weights, ids, config=layer.kernel_config, **layer.activation_args(),
                                   **self.kernel_args(layer))

    def kernel_weights(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the fused kernel takes them (after ``process_weights_after_loading``)."""
        return layer.experts.gate_up_proj, layer.experts.down_proj

    def kernel_args(self, layer: FusedMoE) -> dict:
        """What the fused kernel takes beyond the weights (a quantized method's scales)."""
        return {}

    def tuned_tiles(self, layer: FusedMoE, device: torch.device) -> dict | None:
        """The fused kernel's tile configs for this layer's experts on ``device``: tuned once per
        GPU and shape, then read from disk (engine/moe_configs.py); None off CUDA."""
        from engine.moe_configs import moe_kernel_config

        w13 = layer.experts.gate_up_proj  # [E_local, 2 * I_local, H]
        return moe_kernel_config(w13.shape[0], w13.shape[2], w13.shape[1] // 2, layer.top_k, w13.dtype, device,
                                 block_size=self.block_size)

    def warm_up(self, layer: FusedMoE, max_tokens: int, dtype: torch.dtype) -> None:
        """Compile every variant of the fused kernel for 1..max_tokens tokens (CUDA)."""
        from kernels.fused_moe import warm_up

        w13, w2 = self.kernel_weights(layer)
        warm_up(w13, w2, layer.top_k, max_tokens, config=layer.kernel_config, x_dtype=dtype,
                **layer.activation_args(), **self.kernel_args(layer))


class FusedMoE(nn.Module):
    # Whether the routing weight multiplies each expert's output in float32 (transformers'
    # Gemma 4) rather than rounded to the model dtype first (Mixtral, Qwen, gpt-oss)
    float32_weights: bool = False

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, activation: str, ops: ModuleType, tp: TPGroup | None,
                 expert_parallel: bool = False, method: MoEMethod | None = None,
                 shared_expert: nn.Module | None = None, shared_expert_gate: bool = False,
                 bias: bool = False, router_bias: bool = False,
                 swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT) -> None:
        """``activation``: "silu", "gelu_tanh" or "swigluoai" (gpt-oss, with ``swiglu_alpha`` and
        ``swiglu_limit``, the config's). ``bias``: the experts have biases (``experts.gate_up_proj_bias``
        [E, 2I], ``experts.down_proj_bias`` [E, H]); ``router_bias``: the router (``gate``) has one.
        ``shared_expert``: a dense MLP (``forward(x)``) added to every token's output, scaled
        by ``sigmoid(shared_expert_gate x)`` when ``shared_expert_gate``."""
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"MoE activation {activation!r} is not supported ({', '.join(MOE_ACTIVATIONS)})")
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
        self.hidden_size = hidden_size
        self.part, self.expert_part = Part(intermediate_size, lo, hi), Part(num_experts, first, stop)
        self.activation, self.ops, self.tp = activation, ops, tp
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=router_bias)
        self.experts = nn.Module()
        self.method = method or MoEMethod()
        self.method.create_weights(self)
        self.has_bias = bias
        # Under tensor parallelism each rank's output is a partial sum: the down bias joins rank 0's.
        self.adds_down_bias = bias and (expert_parallel or rank == 0)
        if bias:  # in the model dtype, whatever the method stores the weights in
            self.add_expert_param("gate_up_proj_bias", torch.zeros(self.num_local_experts, 2 * self.part.size),
                                  "gate_up")
            self.add_expert_param("down_proj_bias", torch.zeros(self.num_local_experts, hidden_size), "expert")
        self.expert_load: torch.Tensor | None = None  # [E] int64 counter row, set by the model
        self.kernel_config: Any = None  # the fused kernel's tile configs (engine/moe_configs.py), CUDA only
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1) if shared_expert is not None and \
            shared_expert_gate else None
        for m in () if shared_expert is None else shared_expert.modules():
            if isinstance(m, RowParallelLinear):  # reduced with the experts' output (forward)
                if m.bias is not None:
                    raise ValueError("a shared expert's row-parallel projection with a bias is not supported")
                m.tp = None

    def add_expert_param(self, name: str, tensor: torch.Tensor, kind: str, *, div: int = 1, split: bool = True,
                         keep_dtype: bool = False) -> nn.Parameter:
        """Register ``tensor`` ([local experts, ...], this rank's shape) as ``experts.<name>``
        with its loader. kind "gate_up": dim 1 stacks the gate rows then the up rows of the
        intermediate dim; kind "down": dim 2 runs along the intermediate dim (``split``
        False: it does not, e.g. a per-row scale [E, H, 1]); kind "expert": nothing runs along
        the intermediate dim (the down bias [E, H]), loaded as stacked [E, ...] or per expert
        with the shard id ("down", e). ``div``: intermediate rows one entry covers (block scales)."""
        param = nn.Parameter(tensor, requires_grad=False)
        part = self.part.packed(div, f"experts.{name}")
        if kind == "gate_up":
            _attach_gate_up_loader(param, self.num_experts, part, self.expert_part)
        elif kind == "down":
            _attach_down_loader(param, self.num_experts, part if split else None, self.expert_part)
        elif kind == "expert":
            _attach_expert_loader(param, self.num_experts, self.expert_part)
        else:
            raise ValueError(f"experts.{name}: unknown kind {kind!r}")
        param.keep_dtype = keep_dtype
        setattr(self.experts, name, param)
        return param

    def activation_args(self) -> dict:
        """The fused kernel's keyword arguments beyond the weights and their scales: the
        activation, and the biases and swiglu constants where the layer has them (a layer
        without either passes what it passed before they existed)."""
        args: dict = {"activation": self.activation}
        if self.float32_weights:
            args["float32_weights"] = True
        if self.activation == "swigluoai":
            args.update(swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        if self.has_bias:
            args["w13_bias"] = self.experts.gate_up_proj_bias
            args["w2_bias"] = self.experts.down_proj_bias if self.adds_down_bias else None
        return args

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
        out = self.method.apply(self, x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out if self.tp is None else self.tp.all_reduce(out)


def _local(experts: Part, e: int) -> int | None:
    return e - experts.lo if experts.lo <= e < experts.hi else None


def _attach_gate_up_loader(param: nn.Parameter, num_experts: int, part: Part, experts: Part) -> None:
    """``param`` [local experts, 2 * part.size, ...]: each expert's gate rows then up rows,
    this rank's ``part`` of each. Other ranks' experts read as nothing and are skipped."""
    param.full_shape = (num_experts, 2 * part.full, *param.shape[2:])
    param.shard_ids = tuple((w, e) for e in range(experts.lo, experts.hi) for w in ("gate", "up"))

    def load(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # [E, 2I, ...] (or this rank's experts only)
            if src.shape[0] != experts.size:
                src = src[experts.lo:experts.hi]
            for e in range(experts.size):
                copy_rows(p.data[e], src[e], [part, part], 0, None)
            return
        which, e = shard_id
        if _local(experts, e) is not None:
            copy_rows(p.data[_local(experts, e)], src.reshape(-1, *p.shape[2:]), [part, part], 0,
                      0 if which == "gate" else 1)

    def checkpoint_slice(shard_id=None) -> tuple[int, int, int] | None:
        if shard_id is None:
            return None if experts.size == experts.full else (0, experts.lo, experts.hi)
        if _local(experts, shard_id[1]) is None:
            return 0, 0, 0  # another rank's expert: read nothing
        return (0, part.lo, part.hi) if part.size != part.full else None

    param.weight_loader, param.checkpoint_slice = load, checkpoint_slice


def _attach_expert_loader(param: nn.Parameter, num_experts: int, experts: Part) -> None:
    """``param`` [local experts, ...]: nothing split but the experts (a down bias [E, H])."""
    param.full_shape = (num_experts, *param.shape[1:])
    param.shard_ids = tuple(("down", e) for e in range(experts.lo, experts.hi))

    def load(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # [E, ...] (or this rank's experts only)
            if src.shape[0] != experts.size:
                src = src[experts.lo:experts.hi]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} where {tuple(p.full_shape)} "
                                 "is expected")
            p.data.copy_(src)
            return
        if _local(experts, shard_id[1]) is not None:
            p.data[_local(experts, shard_id[1])].copy_(src.reshape(p.shape[1:]))

    def checkpoint_slice(shard_id=None) -> tuple[int, int, int] | None:
        if shard_id is None:
            return None if experts.size == experts.full else (0, experts.lo, experts.hi)
        return (0, 0, 0) if _local(experts, shard_id[1]) is None else None

    param.weight_loader, param.checkpoint_slice = load, checkpoint_slice


def _attach_down_loader(param: nn.Parameter, num_experts: int, part: Part | None, experts: Part) -> None:
    """``param`` [local experts, rows, cols]: cols run along this rank's ``part`` of the
    intermediate dim (None: cols are not split)."""
    cols = param.shape[2] if part is None else part.full
    param.full_shape = (num_experts, param.shape[1], cols, *param.shape[3:])
    param.shard_ids = tuple(("down", e) for e in range(experts.lo, experts.hi))
    split = part is not None and part.size != part.full

    def load(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # [E, rows, cols]
            if src.shape[0] != experts.size:
                src = src[experts.lo:experts.hi]
            p.data.copy_(src[:, :, part.lo:part.hi] if split and src.shape[2] != part.size else src)
            return
        if _local(experts, shard_id[1]) is not None:
            src = src.reshape(p.shape[1], -1)
            copy_rows(p.data[_local(experts, shard_id[1])], src, [part if part is not None else Part(
                src.shape[1], 0, src.shape[1])], 1, None)

    def checkpoint_slice(shard_id=None) -> tuple[int, int, int] | None:
        if shard_id is None:
            if experts.size != experts.full:
                return 0, experts.lo, experts.hi
            return (2, part.lo, part.hi) if split else None
        if _local(experts, shard_id[1]) is None:
            return 0, 0, 0
        return (1, part.lo, part.hi) if split else None

    param.weight_loader, param.checkpoint_slice = load, checkpoint_slice
