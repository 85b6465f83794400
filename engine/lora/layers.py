"""LoRA beside the model's linear layers: per layer, ``--max-loras`` slots of A and
B in device memory, and the step's rows mapped to slots (``LoRABatch``, one object
every layer reads).

    column-parallel (q|k|v, gate|up)   A [slots, P*R, in]   B [slots, out_local, R]
        part p's A rows at [p*R, p*R + r); B's rows are the layer's output columns,
        this rank's range of each part (A is whole on every rank)
    row-parallel (o, down)             A [slots, R, in_local]   B [slots, out, R]
        A's columns are this rank's range of the input; the product is added to the
        partial sum before the all-reduce, which sums the ranks' shares of x A^T

R is ``--max-lora-rank``; an adapter of lower rank leaves the rest zero, which adds
nothing. The shrink (x A^T, float32) and the expand (adds t B^T into the layer's
output) are ``ops.lora_shrink`` / ``ops.lora_expand`` (kernels/lora.py, or the
references on CPU); a row whose slot is -1 gets nothing.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from torch import nn

from engine.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from engine.lora.adapter import LoRAAdapter, ModuleShape


class LoRABatch:
    """The step's token -> slot map (-1: no adapter), grouped by slot once for every layer."""

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device, ops: ModuleType) -> None:
        self.num_slots, self.ops, self.device = num_slots, ops, device
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.sorted_ids: torch.Tensor | None = None
        self.slot_starts: torch.Tensor | None = None
        self.active = False  # some row of this step has an adapter
        self.num_tokens = 0

    def set(self, token_slots: np.ndarray | None) -> None:
        """An eager step's slots per token (None or all -1: no LoRA work in this step)."""
        if token_slots is None or not (token_slots >= 0).any():
            self.active = False
            return
        self.upload(token_slots)
        self.begin(len(token_slots))

    def upload(self, token_slots: np.ndarray) -> None:
        """Queue the copy of the step's slots into the device buffer (stream-ordered, no host wait)."""
        host = torch.from_numpy(np.ascontiguousarray(token_slots, dtype=np.int32))
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.token_slots[:len(token_slots)].copy_(host, non_blocking=True)

    def set_device(self, token_slots: torch.Tensor) -> None:
        """An eager step's slots already on the device (tensor parallelism, ranks > 0: as rank
        0 sent them; all -1: no LoRA work)."""
        n = token_slots.shape[0]
        self.token_slots[:n].copy_(token_slots)
        self.active = bool((token_slots >= 0).any())
        if self.active:
            self.begin(n)

    def begin(self, n: int) -> None:
        """The step's first n rows read their slots from the buffer: grouped here, on the device
        (a decode graph captures this with the layers, and replays it over each step's slots)."""
        self.sorted_ids, self.slot_starts = self.ops.lora_group(self.token_slots[:n], self.num_slots)
        self.num_tokens, self.active = n, True


class LoRALayer:
    """The slots of one linear layer and the checkpoint modules they come from."""

    def __init__(self, layer: LinearBase, modules: list[str], fused: str | None, batch: LoRABatch,
                 max_rank: int) -> None:
        self.layer, self.batch, self.rank = layer, batch, max_rank
        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.modules, self.fused = modules, fused  # per part's checkpoint name; the stacked name, if any
        p = weight_device_dtype(layer)
        slots = batch.num_slots
        num_parts = 1 if self.row_parallel else len(layer.out_parts)
        self.a = torch.zeros(slots, num_parts * max_rank, layer.in_size, dtype=p.dtype, device=p.device)
        self.b = torch.zeros(slots, layer.out_size, max_rank, dtype=p.dtype, device=p.device)
        sizes = [layer.out_size] if self.row_parallel else layer.output_sizes
        self.part_offsets = tuple(int(x) for x in np.cumsum([0, *sizes]))

    def shapes(self) -> dict[str, ModuleShape]:
        """The checkpoint modules an adapter may hold for this layer, with their full widths."""
        layer = self.layer
        if self.row_parallel:
            return {self.modules[0]: ModuleShape(layer.full_in_size, layer.full_out_size)}
        out = {m: ModuleShape(layer.full_in_size, p.full) for m, p in zip(self.modules, layer.out_parts)}
        if self.fused is not None:
            out[self.fused] = ModuleShape(layer.full_in_size, layer.full_out_size)
        return out

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Copy this layer's weights of ``adapter`` into ``slot`` (zeros where it has none)."""
        a, b, R = self.a[slot], self.b[slot], self.rank
        a.zero_()
        b.zero_()
        if adapter is None:
            return
        layer = self.layer
        if self.row_parallel:
            w = adapter.weights.get(self.modules[0])
            if w is not None:
                wa, wb = w
                lo, hi = (layer.in_part.lo, layer.in_part.hi) if layer.in_part is not None else (0, layer.in_size)
                a[:wa.shape[0]].copy_(wa[:, lo:hi], non_blocking=True)
                b[:, :wb.shape[1]].copy_(wb, non_blocking=True)
            return
        fused = adapter.weights.get(self.fused) if self.fused is not None else None
        row, full_row = 0, 0
        for k, (module, part) in enumerate(zip(self.modules, layer.out_parts)):
            w = adapter.weights.get(module)
            if w is not None:
                wa, wb = w[0], w[1][part.lo:part.hi]
            elif fused is not None:  # the stacked layer adapted as one: its A feeds every part
                wa, wb = fused[0], fused[1][full_row + part.lo:full_row + part.hi]
            else:
                wa = None
            if wa is not None:
                a[k * R:k * R + wa.shape[0]].copy_(wa, non_blocking=True)
                b[row:row + part.size, :wb.shape[1]].copy_(wb, non_blocking=True)
            row, full_row = row + part.size, full_row + part.full

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the layer's output for ``x``) plus each row's adapter, in place."""
        batch = self.batch
        if not batch.active:
            return out
        n = x.shape[0]
        if n != batch.num_tokens:
            raise RuntimeError(f"LoRA: a step of {batch.num_tokens} tokens ran a layer on {n} rows")
        ops, slots = batch.ops, batch.token_slots[:n]
        t = ops.lora_shrink(x, self.a, slots, batch.sorted_ids, batch.slot_starts)
        ops.lora_expand(out, t, self.b, slots, batch.sorted_ids, batch.slot_starts, self.part_offsets)
        return out


def weight_device_dtype(layer: LinearBase) -> torch.Tensor:
    """A tensor of the layer's device and activation dtype (a quantized layer's weight is not)."""
    for name in ("weight", "weight_scale", "scales", "bias"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() >= 2:
            return t
    return next(t for t in layer.parameters())


def attach_lora(model: nn.Module, batch: LoRABatch, max_rank: int, dtype: torch.dtype) -> dict[str, LoRALayer]:
    """A LoRALayer on every column- and row-parallel layer of ``model`` (set as ``layer.lora``),
    by the layer's name; the checkpoint names of a stacked layer's parts come from the
    model's ``stacked_params``."""
    stacked = getattr(model, "stacked_params", ())
    out: dict[str, LoRALayer] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            continue
        dotted = name + "."
        modules, fused = [name], None
        if isinstance(layer, ColumnParallelLinear) and layer.shard_ids != (None,):
            parts = {sid: dotted.replace(fused_part, part)[:-1]
                     for part, fused_part, sid in stacked if fused_part in dotted}
            if set(parts) >= set(layer.shard_ids):
                modules, fused = [parts[sid] for sid in layer.shard_ids], name
        lora = LoRALayer(layer, modules, fused, batch, max_rank)
        lora.a, lora.b = lora.a.to(dtype), lora.b.to(dtype)
        layer.lora = lora
        out[name] = lora
    return out
