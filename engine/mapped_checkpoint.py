"""A safetensors file mapped into memory, its tensors as views of the file's pages (CPU weights).

On CPU the loader (``engine.model_loader.iter_safetensors``) maps each checkpoint file private
(copy-on-write) and yields its whole tensors as views of the mapping, as llama.cpp maps a GGUF:

- a parameter that is a checkpoint tensor as stored (same shape, dtype and layout: the
  parameter's loader calls ``fill``) takes the view itself. Its pages are read from the file
  when first used and are the page cache's: every process that maps the file (the prefill and
  decode servers of one machine) shares them, and no anonymous copy of the weights is made.
  A write into such a parameter copies the page it touches (private mapping): the file is
  never changed;
- a tensor the loader copies instead (stacked parts such as q|k|v, another dtype, a
  tensor-parallel shard) is dropped from the mapping once copied: the pages wholly inside it
  are given back (``MADV_DONTNEED``), so a load holds no second copy of it. A view a parameter
  took and a quantized method then converted to another layout (int4 checkpoints) is given back
  the same way once the methods are done (``release_unheld``).

Any dtype or alignment a view cannot take is read as before (``safe_open``'s copy).
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def supported() -> bool:
    """Whether this platform maps files private and gives pages back (Linux, macOS; not Windows)."""
    return all(hasattr(mmap, name) for name in ("MAP_PRIVATE", "PROT_WRITE", "MADV_DONTNEED")) and \
        hasattr(mmap.mmap, "madvise")


class MappedSafetensors:
    """One safetensors file mapped private: ``view(name)`` a tensor over its bytes,
    ``release(view)`` drops the pages wholly inside a view that was copied."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(header_len))
            self.mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.data_start = 8 + header_len
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)  # holds the mapping while views live
        self.taken: list[torch.Tensor] = []

    def view(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` as a view of the mapping, or None where a view cannot hold it."""
        meta = self.header.get(name)
        dtype = _DTYPES.get(meta["dtype"]) if meta else None
        if dtype is None:
            return None
        lo, hi = (self.data_start + o for o in meta["data_offsets"])
        size = dtype.itemsize
        if lo % size or (hi - lo) % size or hi == lo:
            return None
        t = self.bytes[lo:hi].view(dtype).view(meta["shape"])
        t.file_mapped = True
        return t

    def keep(self, t: torch.Tensor) -> None:
        """View ``t`` was taken by a parameter (``fill``): ``release_unheld`` looks at it again."""
        self.taken.append(t)

    def release_unheld(self, tensors: list[torch.Tensor]) -> int:
        """After the model's methods converted their weights: give back the pages of the views
        taken at load that none of ``tensors`` (the model's parameters and buffers) overlaps any
        more (a quantized layer's checkpoint tensors, replaced by their converted layout). The
        number of views given back."""
        held = [_span(t) for t in tensors if t.device.type == "cpu"]
        released = 0
        for v in self.taken:
            lo, hi = _span(v)
            if not any(a < hi and lo < b for a, b in held):
                self.release(v)
                released += 1
        self.taken.clear()
        return released

    def release(self, t: torch.Tensor) -> None:
        """Give back the pages wholly inside view ``t`` (those at its ends may hold a neighbour's bytes)."""
        start = t.data_ptr() - self.bytes.data_ptr()
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (start + t.numel() * t.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [lo, hi) of the bytes ``t`` reads (strides included)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def fill(param: torch.Tensor, src: torch.Tensor) -> None:
    """Give parameter ``param`` (whole) the values of checkpoint tensor ``src``: ``src`` itself
    where it is a view of a mapped file with the parameter's shape, dtype and device (no copy),
    else a copy into the parameter's own memory."""
    if (getattr(src, "file_mapped", False) and isinstance(param, torch.nn.Parameter) and src.device == param.device
            and src.dtype == param.dtype and src.shape == param.shape):
        param.data = src
        src.adopted = True
        return
    param.data.copy_(src)


def adopted(t: torch.Tensor) -> bool:
    """Whether a parameter took view ``t`` (``fill``): its pages must stay."""
    return getattr(t, "adopted", False)
