"""Linear layers with their tensor-parallel split and a method hook.

A layer holds this rank's shard of its weight and asks its ``LinearMethod``
to create and apply it: the plain method is below; a quantized method (FP8,
int4) or an adapter plugs in there instead of into every model.

    ReplicatedLinear        every rank holds all of it (MoE routers)
    ColumnParallelLinear    output rows split; one or more *parts* stacked in one
                            weight (q|k|v, gate|up), each part split on its own
    RowParallelLinear       input columns split; the partial sums are all-reduced

Every parameter carries what the checkpoint loader (``engine/models/base.py``)
needs, so no model repeats slicing code:

    param.full_shape                    the unsharded shape (dummy weights draw it whole)
    param.shard_ids                     the checkpoint parts it is stacked from ((None,): one)
    param.weight_loader(param, t, sid)  copy checkpoint tensor ``t`` (part ``sid``, or the
                                        whole stacked tensor when sid is None) into the shard
    param.checkpoint_slice(sid)         (dim, start, stop) of this rank's range of that
                                        checkpoint tensor, or None (read it whole)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import TPGroup


def split_range(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share [start, stop) of ``n`` rows split ``size`` ways."""
    if n % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {what} ({n})")
    per = n // size
    return rank * per, (rank + 1) * per


def tp_rank_size(tp: TPGroup | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.size)


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor stacked into a column-parallel weight: ``full`` rows, of which
    this rank holds [lo, hi)."""

    full: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def copy_rows(dst: torch.Tensor, src: torch.Tensor, parts: Sequence[Part], dim: int,
              which: int | None) -> None:
    """Copy checkpoint rows (along ``dim``) into a stacked shard. ``which`` = one part
    (``src`` holds that part whole, or already just this rank's rows); None = ``src`` holds
    every part stacked in full."""
    if which is not None:
        p = parts[which]
        dst_lo = sum(q.size for q in parts[:which])
        if src.shape[dim] != p.size:
            src = src.narrow(dim, p.lo, p.size)
        dst.narrow(dim, dst_lo, p.size).copy_(src)
        return
    if len(parts) == 1 and src.shape[dim] == parts[0].size:  # the file reader took this rank's rows
        dst.copy_(src)
        return
    src_lo = dst_lo = 0
    for p in parts:
        dst.narrow(dim, dst_lo, p.size).copy_(src.narrow(dim, src_lo + p.lo, p.size))
        src_lo, dst_lo = src_lo + p.full, dst_lo + p.size


def attach_loader(param: nn.Parameter, full_shape: tuple[int, ...], parts: Sequence[Part] | None, dim: int,
                  shard_ids: Sequence = (None,)) -> nn.Parameter:
    """Give ``param`` the loader attributes for rows split along ``dim`` into ``parts``
    (None: not split, every rank holds all of it)."""
    param.full_shape = full_shape
    param.shard_ids = tuple(shard_ids)
    ids = list(shard_ids)

    def weight_loader(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        if parts is None:
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} for a parameter of "
                                 f"shape {tuple(p.shape)}")
            p.data.copy_(src)
            return
        copy_rows(p.data, src, parts, dim, None if shard_id is None else ids.index(shard_id))

    def checkpoint_slice(shard_id=None) -> tuple[int, int, int] | None:
        if parts is None or all(p.size == p.full for p in parts):
            return None
        if shard_id is None:
            return (dim, parts[0].lo, parts[0].hi) if len(parts) == 1 else None
        p = parts[ids.index(shard_id)]
        return dim, p.lo, p.hi

    param.weight_loader = weight_loader
    param.checkpoint_slice = checkpoint_slice
    return param


class LinearMethod:
    """How a linear layer keeps and applies its weight. The plain method: a dense
    ``weight [out, in]`` in the model dtype. Quantized methods subclass this."""

    def create_weights(self, layer: nn.Module, in_size: int, out_size: int) -> nn.Parameter:
        layer.weight = nn.Parameter(torch.empty(out_size, in_size))
        return layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class _Linear(nn.Module):
    def __init__(self, in_local: int, out_local: int, bias: bool, method: LinearMethod | None) -> None:
        super().__init__()
        self.method = method or LinearMethod()
        self.method.create_weights(self, in_local, out_local)
        self.bias = nn.Parameter(torch.zeros(out_local)) if bias else None


class ReplicatedLinear(_Linear):
    def __init__(self, in_size: int, out_size: int, bias: bool = False, method: LinearMethod | None = None) -> None:
        super().__init__(in_size, out_size, bias, method)
        attach_loader(self.weight, (out_size, in_size), None, 0)
        if self.bias is not None:
            attach_loader(self.bias, (out_size,), None, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ColumnParallelLinear(_Linear):
    """y = x W^T with W's rows stacked from ``parts`` (one per checkpoint tensor, named by
    ``shard_ids``), each split across the ranks. No communication: the output stays split."""

    def __init__(self, in_size: int, parts: Sequence[Part], bias: bool = False, shard_ids: Sequence = (None,),
                 method: LinearMethod | None = None) -> None:
        self.parts = tuple(parts)
        out_local = sum(p.size for p in self.parts)
        super().__init__(in_size, out_local, bias, method)
        full = sum(p.full for p in self.parts)
        attach_loader(self.weight, (full, in_size), self.parts, 0, shard_ids)
        if self.bias is not None:
            attach_loader(self.bias, (full,), self.parts, 0, shard_ids)

    @property
    def output_sizes(self) -> list[int]:
        """Each part's local width, in order (to split the output)."""
        return [p.size for p in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


def column_parts(sizes: Sequence[int], tp: TPGroup | None, what: str) -> list[Part]:
    """Parts of ``sizes`` rows each, every one split evenly across the ranks."""
    rank, size = tp_rank_size(tp)
    return [Part(n, *split_range(n, rank, size, what)) for n in sizes]


class RowParallelLinear(_Linear):
    """y = all_reduce(x_local W_local^T) + b: the input's columns are split across ranks
    (x arrives split, as a column-parallel layer leaves it). The bias is added once, after
    the reduction."""

    def __init__(self, in_size: int, out_size: int, tp: TPGroup | None, what: str, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        rank, size = tp_rank_size(tp)
        lo, hi = split_range(in_size, rank, size, what)
        super().__init__(hi - lo, out_size, bias, method)
        self.tp = tp
        attach_loader(self.weight, (out_size, in_size), [Part(in_size, lo, hi)], 1)
        if self.bias is not None:
            attach_loader(self.bias, (out_size,), None, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.method.apply(self, x, self.bias)
        out = self.tp.all_reduce(self.method.apply(self, x, None))
        return out if self.bias is None else out + self.bias
