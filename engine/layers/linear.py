"""Linear layers with their tensor-parallel split and a method hook.

A layer holds this rank's shard of its weight and asks its ``LinearMethod``
to create, finish and apply it: the plain method (a dense weight in the model
dtype) is below; a quantized method (engine/quantization/: FP8, int4) plugs
in there instead of into every model.

    ReplicatedLinear        every rank holds all of it (MoE routers)
    ColumnParallelLinear    output rows split; one or more *parts* stacked in one
                            weight (q|k|v, gate|up), each part split on its own
    RowParallelLinear       input columns split; the partial sums are all-reduced

A method creates its tensors with ``layer.add_param``, naming the dims that
follow the layer's output rows and input columns; the layer knows how it is
split and gives each parameter what the checkpoint loader
(``engine/models/base.py``) needs, so no model or method repeats slicing code:

    param.full_shape                    the unsharded shape (dummy weights draw it whole)
    param.shard_ids                     the checkpoint parts it is stacked from ((None,): one);
                                        consecutive parts that one checkpoint tensor holds
                                        share an id (``part_span``)
    param.weight_loader(param, t, sid)  copy checkpoint tensor ``t`` (part ``sid``, or the
                                        whole stacked tensor when sid is None) into the shard
                                        (a whole parameter takes a file-mapped ``t`` itself:
                                        ``engine.mapped_checkpoint.fill``)
    param.checkpoint_slice(sid)         (dim, start, stop) of this rank's range of that
                                        checkpoint tensor, or None (read it whole)

A dim that packs or groups ``div`` rows per entry (int4 words, FP8 block
scales) is split at ``row // div``: a rank's range must start and end on a
multiple of ``div`` (or at the end of a part). After every tensor is loaded
the model calls ``method.process_weights_after_loading(layer)`` once (a
quantized method converts to the layout its kernel reads there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from engine.mapped_checkpoint import fill
from engine.parallel import TPGroup
from kernels import cpu_gemm


def split_range(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share [start, stop) of ``n`` rows split ``size`` ways."""
    if n % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {what} ({n})")
    per = n // size
    return rank * per, (rank + 1) * per


def tp_rank_size(tp: TPGroup | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.size)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

    def packed(self, div: int, what: str) -> Part:
        """The same range counted in entries of ``div`` rows each (the last may be short)."""
        if div == 1:
            return self
        if self.lo % div or (self.hi % div and self.hi != self.full):
            raise ValueError(f"{what}: this rank's rows [{self.lo}, {self.hi}) of {self.full} are not aligned to "
                             f"the {div} rows one stored entry covers (choose another --tensor-parallel-size)")
        return Part(cdiv(self.full, div), self.lo // div, cdiv(self.hi, div))


def part_span(shard_ids: Sequence, shard_id) -> slice:
    """The stacked parts checkpoint tensor ``shard_id`` holds: one part, or several
    consecutive parts that share an id (Qwen3.5's ``in_proj_qkv`` is q, k and v)."""
    ids = list(shard_ids)
    first = ids.index(shard_id)
    stop = first + ids.count(shard_id)
    if ids[first:stop] != [shard_id] * (stop - first):
        raise ValueError(f"the parts of {shard_id!r} are not consecutive in {ids}")
    return slice(first, stop)


def copy_rows(dst: torch.Tensor, src: torch.Tensor, parts: Sequence[Part], dim: int,
              which: int | slice | None) -> None:
    """Copy checkpoint rows (along ``dim``) into a stacked shard. ``which``: the part (or the
    slice of consecutive parts) ``src`` holds, None = every part. ``src`` holds those parts
    whole, stacked as stored, or already just this rank's rows of them."""
    span = slice(None) if which is None else slice(which, which + 1) if isinstance(which, int) else which
    first = range(len(parts))[span].start
    dst_lo = sum(q.size for q in parts[:first])
    held = parts[span]
    rows = sum(p.size for p in held)
    if src.shape[dim] == rows:  # this rank's rows already (every part whole, unsplit)
        dst.narrow(dim, dst_lo, rows).copy_(src)
        return
    src_lo = 0
    for p in held:
        dst.narrow(dim, dst_lo, p.size).copy_(src.narrow(dim, src_lo + p.lo, p.size))
        src_lo, dst_lo = src_lo + p.full, dst_lo + p.size


def _check_shape(src: torch.Tensor, p: torch.Tensor) -> None:
    if tuple(src.shape) != tuple(p.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} for a parameter of shape {tuple(p.shape)}")


def attach_loader(param: nn.Parameter, full_shape: tuple[int, ...], parts: Sequence[Part] | None, dim: int,
                  shard_ids: Sequence = (None,)) -> nn.Parameter:
    """Give ``param`` the loader attributes for rows split along ``dim`` into ``parts``
    (None: not split, every rank holds all of it; a stacked layer's parts then all load
    the same tensor, and must agree)."""
    param.full_shape = full_shape
    param.shard_ids = tuple(shard_ids)

    def weight_loader(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        if parts is None:
            _check_shape(src, p)
            loaded = p.__dict__.setdefault("_loaded_parts", set())
            if loaded and not torch.equal(p.data, src.to(p.dtype)):
                raise ValueError(f"the stacked parts {sorted(map(str, loaded))} and {shard_id} of one layer hold "
                                 "different values for a tensor they must share")
            if not loaded:  # a later part holds the same values: nothing to take
                fill(p, src)
            loaded.add(shard_id)
            return
        which = None if shard_id is None else part_span(shard_ids, shard_id)
        held = parts if which is None else parts[which]
        rows = {sum(q.full for q in held), sum(q.size for q in held)}
        if src.dim() != p.dim() or src.shape[dim] not in rows or any(
                src.shape[d] != p.shape[d] for d in range(p.dim()) if d != dim):
            want = [str(n) for n in p.shape]
            want[dim] = " or ".join(map(str, sorted(rows)))
            raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} where [{', '.join(want)}] is expected"
                             + ("" if shard_id is None else f" (part {shard_id})"))
        if which is None and tuple(src.shape) == tuple(p.shape):  # every part whole, stacked as stored
            fill(p, src)
            return
        copy_rows(p.data, src, parts, dim, which)

    def checkpoint_slice(shard_id=None) -> tuple[int, int, int] | None:
        if parts is None or all(p.size == p.full for p in parts):
            return None
        held = parts if shard_id is None else parts[part_span(shard_ids, shard_id)]
        return (dim, held[0].lo, held[0].hi) if len(held) == 1 else None

    param.weight_loader = weight_loader
    param.checkpoint_slice = checkpoint_slice
    return param


def _attach_per_part_loader(param: nn.Parameter, shard_ids: Sequence) -> nn.Parameter:
    """``param`` [num_parts, *shape]: one tensor of ``shape`` per stacked part (a per-tensor
    scale of q, k and v each). A checkpoint tensor that covers several parts (shard id None:
    all of them) gives one tensor for each of them, stacked, or one that they share."""
    param.full_shape = tuple(param.shape)
    param.shard_ids = tuple(shard_ids)

    def weight_loader(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        rows = p.data if shard_id is None else p.data[part_span(shard_ids, shard_id)]
        if tuple(src.shape) == tuple(rows.shape):  # one tensor for each part, stacked
            rows.copy_(src)
            return
        src = src.reshape(rows.shape[1:]) if src.numel() == rows[0].numel() else src
        _check_shape(src, rows[0])  # one tensor for all the parts it covers
        rows.copy_(src.expand_as(rows))

    param.weight_loader = weight_loader
    param.checkpoint_slice = lambda shard_id=None: None
    return param


class LinearMethod:
    """How a linear layer keeps and applies its weight. The plain method: a dense
    ``weight [out, in]`` in the model dtype. Quantized methods subclass this."""

    def create_weights(self, layer: LinearBase) -> None:
        layer.add_param("weight", torch.empty(layer.out_size, layer.in_size), out_dim=0, in_dim=1)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Called once, after every checkpoint tensor is in place (or dummy weights drawn)."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemm.linear(x, layer.weight, bias)  # F.linear; oneDNN's for float32 on CPU

    def direct(self, layer: LinearBase) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``apply(layer, x, None)`` for x [T, in] contiguous in the model dtype as one direct kernel
        call, the same one ``apply`` makes (engine/models/llama_cpu.py); None where there is none
        (here: a method that applies its weight its own way and says nothing of a direct call)."""
        if type(self).apply is not LinearMethod.apply:
            return None
        return cpu_gemm.linear_call(layer.weight)

    def warm_up_key(self, layer: LinearBase) -> tuple | None:
        """What decides the kernels ``apply`` compiles (layers with the same key share one
        ``warm_up``); None: nothing to compile (torch's own GEMMs)."""
        return None

    def warm_up(self, layer: LinearBase, max_tokens: int, dtype: torch.dtype) -> None:
        """Compile every kernel variant ``apply`` can meet for 1..max_tokens rows (CUDA)."""


class LinearMethods(Protocol):
    """Where a model's layers get their methods (engine/quantization/methods.py): by the
    layer's checkpoint names, ``prefix.module`` stacked from ``prefix.<part>`` tensors."""

    def linear(self, prefix: str, module: str, parts: Sequence[str] = ()) -> LinearMethod | None: ...


def method_for(methods: LinearMethods | None, prefix: str, module: str, parts: Sequence[str] = ()
               ) -> LinearMethod | None:
    """The method of layer ``prefix.module`` (None: the plain one)."""
    return None if methods is None else methods.linear(prefix, module, parts)


class LinearBase(nn.Module):
    """What a method sees of a layer: this rank's widths (``in_size``, ``out_size``), the
    unsplit ones (``full_in_size``, ``full_out_size``), the stacked parts' local widths
    (``output_sizes``) and ``add_param``. Subclasses say how the layer is split."""

    def __init__(self, in_local: int, out_local: int, full_in: int, out_parts: Sequence[Part] | None,
                 in_part: Part | None, bias: bool, method: LinearMethod | None, shard_ids: Sequence = (None,)) -> None:
        super().__init__()
        self.in_size, self.out_size, self.full_in_size = in_local, out_local, full_in
        self.out_parts = tuple(out_parts) if out_parts is not None else (Part(out_local, 0, out_local),)
        self.full_out_size = sum(p.full for p in self.out_parts)
        self.split_out, self.in_part = out_parts is not None, in_part
        self.shard_ids = tuple(shard_ids)
        self.method = method or LinearMethod()
        self.method.create_weights(self)
        self.bias = None
        if bias:
            self.bias = self.add_param("bias", torch.zeros(out_local), out_dim=0)
        # engine/lora/layers.py: adds each row's adapter to the output (None: no LoRA)
        self.lora = None

    @property
    def output_sizes(self) -> list[int]:
        """Each part's local width, in order (to split the output)."""
        return [p.size for p in self.out_parts]

    def add_param(self, name: str, tensor: torch.Tensor, *, out_dim: int | None = None, in_dim: int | None = None,
                  out_div: int = 1, in_div: int = 1, per_part: bool = False, keep_dtype: bool = False
                  ) -> nn.Parameter:
        """Register ``tensor`` (this rank's shape) as parameter ``name`` with its loader.

        out_dim / in_dim: the dims that run along the output rows / input columns (None:
        neither), each entry covering ``out_div`` / ``in_div`` of them. ``per_part``: one
        ``tensor`` per stacked part ([num_parts, *shape]: per-tensor scales). ``keep_dtype``:
        not cast to the model dtype (the loader casts float32 parameters otherwise)."""
        if per_part:
            param = nn.Parameter(tensor.new_zeros((len(self.out_parts), *tensor.shape)), requires_grad=False)
            _attach_per_part_loader(param, self.shard_ids)
        else:
            param = nn.Parameter(tensor, requires_grad=False)
            full = list(tensor.shape)
            where = f"{type(self).__name__}.{name}"
            if out_dim is not None and self.split_out:
                parts = [p.packed(out_div, where) for p in self.out_parts]
                full[out_dim] = sum(p.full for p in parts)
                attach_loader(param, tuple(full), parts, out_dim, self.shard_ids)
            elif in_dim is not None and self.in_part is not None:
                part = self.in_part.packed(in_div, where)
                full[in_dim] = part.full
                attach_loader(param, tuple(full), [part], in_dim, self.shard_ids)
            else:
                attach_loader(param, tuple(full), None, 0, self.shard_ids)
        param.keep_dtype = keep_dtype
        setattr(self, name, param)
        return param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.add(x, out)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_size: int, out_size: int, bias: bool = False, method: LinearMethod | None = None) -> None:
        super().__init__(in_size, out_size, in_size, None, None, bias, method)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows stacked from ``parts`` (one per checkpoint tensor, named by
    ``shard_ids``), each split across the ranks. No communication: the output stays split."""

    def __init__(self, in_size: int, parts: Sequence[Part], bias: bool = False, shard_ids: Sequence = (None,),
                 method: LinearMethod | None = None) -> None:
        parts = tuple(parts)
        super().__init__(in_size, sum(p.size for p in parts), in_size, parts, None, bias, method, shard_ids)


def column_parts(sizes: Sequence[int], tp: TPGroup | None, what: str) -> list[Part]:
    """Parts of ``sizes`` rows each, every one split evenly across the ranks."""
    rank, size = tp_rank_size(tp)
    return [Part(n, *split_range(n, rank, size, what)) for n in sizes]


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_local W_local^T) + b: the input's columns are split across ranks
    (x arrives split, as a column-parallel layer leaves it). The bias is added once, after
    the reduction."""

    def __init__(self, in_size: int, out_size: int, tp: TPGroup | None, what: str, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        rank, size = tp_rank_size(tp)
        lo, hi = split_range(in_size, rank, size, what)
        self.tp = tp
        super().__init__(hi - lo, out_size, in_size, None, Part(in_size, lo, hi), bias, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        out = self.method.apply(self, x, None)
        if self.lora is not None:  # this rank's share of x A^T, summed with the rest below
            out = self.lora.add(x, out)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias
