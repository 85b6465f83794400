"""Kernel warm-up before a runner serves.

Triton compiles a kernel variant the first time a launch needs it, stalling that step about
a second (and every abort and deadline queued behind it). ``warm_up_kernels`` compiles what
an eager step can meet: one mixed step (a 3-token prefill chunk beside a decode row; slot -1
writes nowhere, block 0 is read), every split variant of paged attention for each sliding
window, each quantized linear layer's kernels, the adapters' shrink and expand, the fused
MoE. Decode graphs compile theirs at capture.

On CPU, the compiled CPU attention the attention layers call is built or loaded here (well
under a second when built, about a minute to build): done lazily, inside the first step, it
held that step for as long as the build took.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.layers.attention import Attention
from engine.layers.linear import LinearBase

if TYPE_CHECKING:
    from engine.runner_parts import RunnerParts


@torch.inference_mode()
def warm_up_kernels(runner: RunnerParts) -> None:
    if runner.device.type == "cpu" and runner.ops.__name__ in ("kernels.reference", "kernels.cpu_ops"):
        from kernels import cpu_attention

        cpu_attention.extension(runner.runtime.cpu_attention_build_timeout)  # None where it cannot build
        return
    if runner.device.type != "cuda" or runner.ops.__name__ != "kernels":
        return
    mc, dev, model = runner.config.model, runner.device, runner.model
    budget = runner.config.scheduler.max_num_batched_tokens
    meta = runner.cache_spec.dummy_metadata([3, 1], dev, written=False)
    hidden = model(torch.zeros(4, dtype=torch.long, device=dev), torch.tensor([0, 1, 2, 0], device=dev),
                   runner.kv_cache, meta)
    model.compute_logits(hidden[[2, 3]])
    from kernels.paged_attention import warm_up

    # each attention shape the model has: heads, head size, window, its group's block size, sinks
    shapes = {(m.num_heads, m.num_kv_heads, m.head_dim, m.sliding_window,
               runner.layout.groups[m.kv_group].block_size, m.sinks is not None)
              for m in model.modules() if isinstance(m, Attention)}
    for heads, kv_heads, head_dim, window, block_size, sinks in sorted(shapes, key=lambda x: (x[3] or 0, x[2], x[4])):
        warm_up(mc.torch_dtype, heads, kv_heads, head_dim, block_size, dev, sliding_window=window,
                kv_dtype=runner.kv_dtype, sinks=sinks)
    warmed = set()  # quantized linear layers: one warm-up per kernel variant set
    for layer in model.modules():
        key = layer.method.warm_up_key(layer) if isinstance(layer, LinearBase) else None
        if key is not None and key not in warmed:
            warmed.add(key)
            layer.method.warm_up(layer, budget, mc.torch_dtype)
    if runner.lora is not None:  # the adapters' shrink and expand, once per layer shape
        from kernels.lora import warm_up as lora_warm_up

        shapes = set()
        for lora in runner.lora.layers.values():
            key = (tuple(lora.a.shape), tuple(lora.b.shape), lora.part_offsets)
            if key not in shapes:
                shapes.add(key)
                lora_warm_up(lora.a, lora.b, lora.part_offsets, budget)
    moe = model.moe_layers()
    if moe:  # every MoE layer has the same shape and config: one warm-up serves all
        moe[0].method.warm_up(moe[0], budget, mc.torch_dtype)
    torch.cuda.synchronize(dev)
