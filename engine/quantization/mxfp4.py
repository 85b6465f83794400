"""MXFP4 experts (gpt-oss): weight-only, 4-bit e2m1 values with one e8m0 scale per 32, kept
packed in memory and dequantized by the fused MoE kernel tile by tile (``ops.fused_moe`` with
uint8 weights: Triton on CUDA, its reference on CPU). Only the experts of mixture-of-experts
blocks are MXFP4; every other layer (attention, router, embeddings, LM head) stays 16-bit.

Checkpoint tensors of a block's experts (kernels/mxfp4_reference.py has the format), in
pdserve's order: gate rows, then up rows (gpt-oss stores them interleaved, row 2j gate j and
2j + 1 up j; the model reorders the rows before it calls these loaders)::

    experts.gate_up_proj_blocks  [E, 2I, H/32, 16] uint8   gate_up_proj_scales  [E, 2I, H/32] uint8
    experts.down_proj_blocks     [E, H, I/32, 16] uint8    down_proj_scales     [E, H, I/32] uint8
    experts.gate_up_proj_bias    [E, 2I], experts.down_proj_bias [E, H]   (16-bit; FusedMoE's own)

W13[e, r, 32 g + i] = e2m1(code i of gate_up_proj_blocks[e, r, g]) * 2^(gate_up_proj_scales[e, r, g] - 127),
the same orientation as pdserve's gate_up_proj [E, 2I, H] (transformers dequantizes to [E, 2I, H]
and transposes to its own [E, H, 2I]); likewise down_proj [E, H, I].

Loading is stacked only (shard id None: every expert in one tensor, as gpt-oss ships them).
Tensor parallelism splits I: each rank takes its rows of the gate and of the up half, and its
column blocks of the down projection, so I / 32 blocks must split evenly over the ranks
(gpt-oss-20b and -120b, I = 2880 = 90 blocks: 1 or 2 ranks; refused otherwise). Expert
parallelism takes whole experts. After loading the blocks are viewed as the kernel's
[E, rows, K/2] bytes (no copy). Random (dummy) weights arrive as floats and become random
codes with the scale 2^-7 (weights of about the 16-bit dummies' 0.02).
"""
from __future__ import annotations

from types import ModuleType

import torch

from engine.layers.moe import FusedMoE, MoEMethod
from kernels.mxfp4_reference import BLOCK

DUMMY_SCALE = 127 - 7  # e8m0 of random (dummy) expert weights: 2^-7


class Mxfp4MoEMethod(MoEMethod):
    """The experts of a FusedMoE layer in MXFP4 (module docstring). ``online``: random (dummy)
    weights, which arrive as floats and are turned into codes by the loaders."""

    def __init__(self, *, online: bool, ops: ModuleType, prefix: str = "") -> None:
        self.online, self.ops, self.prefix = online, ops, prefix

    def create_weights(self, layer: FusedMoE) -> None:
        e, h, part = layer.num_local_experts, layer.hidden_size, layer.part
        if h % BLOCK:
            raise ValueError(f"{self.prefix}: MXFP4 experts need the hidden size ({h}) to be a multiple of {BLOCK}")
        if part.full % BLOCK:
            raise ValueError(f"{self.prefix}: MXFP4 experts need the intermediate size ({part.full}) to be a "
                             f"multiple of {BLOCK}")
        if part.lo % BLOCK or part.hi % BLOCK:
            raise ValueError(f"{self.prefix}: MXFP4 experts split the intermediate size over tensor-parallel ranks "
                             f"in whole blocks of {BLOCK}: {part.full // BLOCK} blocks do not split evenly (this rank "
                             f"would hold rows [{part.lo}, {part.hi})); choose another --tensor-parallel-size or "
                             "--enable-expert-parallel")
        i = part.size
        u8 = torch.uint8
        params = [
            layer.add_expert_param("gate_up_proj_blocks", torch.zeros(e, 2 * i, h // BLOCK, BLOCK // 2, dtype=u8),
                                   "gate_up"),
            layer.add_expert_param("gate_up_proj_scales", torch.zeros(e, 2 * i, h // BLOCK, dtype=u8), "gate_up"),
            layer.add_expert_param("down_proj_blocks", torch.zeros(e, h, i // BLOCK, BLOCK // 2, dtype=u8), "down",
                                   div=BLOCK),
            layer.add_expert_param("down_proj_scales", torch.zeros(e, h, i // BLOCK, dtype=u8), "down", div=BLOCK),
        ]
        for name, p in zip(("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"),
                           params):
            self._guard_loader(p, f"{self.prefix}.{name}", scales=name.endswith("_scales"))

    def _guard_loader(self, param: torch.nn.Parameter, where: str, scales: bool) -> None:
        """Checks what reaches the layer's loader: uint8 of the stacked shape (the whole or this
        rank's experts), or random floats (dummy weights) turned into codes."""
        inner = param.weight_loader
        full = tuple(param.full_shape)
        local_experts = (param.shape[0], *full[1:])

        def weight_loader(p: torch.nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
            if shard_id is not None:
                raise ValueError(f"{where}: MXFP4 experts load stacked tensors only (all experts in one), got "
                                 f"shard {shard_id}")
            if src.is_floating_point() and self.online:
                src = _dummy_codes(src, scales)
            if src.dtype != torch.uint8:
                raise ValueError(f"{where}: expected the checkpoint's uint8 MXFP4 {'scales' if scales else 'blocks'}, "
                                 f"got {src.dtype} (is quantization_config right?)")
            if tuple(src.shape) not in (full, local_experts):
                raise ValueError(f"{where}: checkpoint tensor of shape {tuple(src.shape)} where {list(full)} is "
                                 "expected (gate rows then up rows, blocks of 32 along the reduced dim)")
            inner(p, src, None)

        param.weight_loader = weight_loader
        param.shard_ids = (None,)
        slice_of = param.checkpoint_slice
        param.checkpoint_slice = lambda shard_id=None: _experts_only(slice_of(shard_id))

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Nothing to convert: the kernel reads the blocks as [E, rows, K/2] bytes (a view)."""

    def kernel_weights(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
        ex = layer.experts
        return ex.gate_up_proj_blocks.flatten(-2), ex.down_proj_blocks.flatten(-2)

    def kernel_args(self, layer: FusedMoE) -> dict:
        return dict(w13_scale=layer.experts.gate_up_proj_scales, w2_scale=layer.experts.down_proj_scales)

    def tuned_tiles(self, layer: FusedMoE, device: torch.device) -> dict | None:
        from engine.moe_configs import moe_kernel_config

        return moe_kernel_config(layer.num_local_experts, layer.hidden_size, layer.part.size, layer.top_k,
                                 torch.uint8, device, x_dtype=layer.gate.weight.dtype)


def _experts_only(slice_: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """The file reader may narrow a stacked tensor to this rank's experts (dim 0) before the loader;
    other narrowing (the intermediate dim) is left to the loader, which checks the full shape."""
    return slice_ if slice_ is None or slice_[0] == 0 else None


def _dummy_codes(src: torch.Tensor, scales: bool) -> torch.Tensor:
    """Random (dummy) floats -> uint8: random bytes of codes (from the draw, so every TP size
    gets the same model), or the scale 2^-7."""
    if scales:
        return torch.full(src.shape, DUMMY_SCALE, dtype=torch.uint8, device=src.device)
    out = torch.empty(src.shape, dtype=torch.uint8, device=src.device)
    for e in range(src.shape[0]):  # an expert at a time: the int32 working copy of a whole layer's would not fit
        out[e] = ((src[e].float() * 4096).round().to(torch.int32) & 0xFF).to(torch.uint8)
    return out
