"""What a runner's caches are, on this rank: the KV pages of every group (engine/kv_cache_groups.py)
and the linear-attention state slots. The runner owns the tensors; this says their shapes,
their bytes, and makes them (and the dummy metadata the memory profile and warm-up run on)."""
from __future__ import annotations

import math
import mmap

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.kv_cache_groups import KVCacheLayout
from engine.kv_cache_manager import cdiv
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.linear_state import LinearState, LinearStateShape


@dataclass(frozen=True)
class CacheSpec:
    layout: KVCacheLayout
    block_size: int  # tokens per block of the widest group (a narrower group's blocks hold more)
    kv_heads: int  # this rank's KV heads of the widest group's layers
    head_dim: int
    kv_dtype: torch.dtype
    num_state_slots: int = 0  # one per running sequence
    state_shapes: list[LinearStateShape] = field(default_factory=list)
    num_snapshots: int = 0  # prefix-cache snapshots (engine/linear_state_cache.py)

    @staticmethod
    def of(model: torch.nn.Module, layout: KVCacheLayout, block_size: int, kv_dtype: torch.dtype,
           num_state_slots: int, num_snapshots: int = 0) -> "CacheSpec":
        """The spec of ``model`` (its layout already set) on this rank."""
        heads = {(m.num_kv_heads, m.head_dim) for m in model.modules() if isinstance(m, Attention)}
        kv_heads, head_dim = max(heads, key=lambda hd: hd[0] * hd[1])
        shapes = model.linear_state_shapes()
        return CacheSpec(layout, block_size, kv_heads, head_dim, kv_dtype,
                         num_state_slots if shapes else 0, shapes, num_snapshots if shapes else 0)

    @property
    def num_state_slots_total(self) -> int:
        """Running sequences' slots, the scratch slot (index ``num_state_slots``: padding rows of
        a CUDA graph's batch write it), then the snapshots'."""
        return self.num_state_slots + 1 + self.num_snapshots if self.state_shapes else 0

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.block_size for g in self.layout.groups)

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One slot of one block: [2, block_size, kv_heads, head_dim]."""
        return (2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block on this rank: a page in every slot."""
        return self.layout.num_slots * 2 * self.block_size * self.kv_heads * self.head_dim * self.kv_dtype.itemsize

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots_total * sum(s.bytes for s in self.state_shapes)

    def new_kv_cache(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """[num_slots, num_blocks, 2, block_size, kv_heads, head_dim], zeroed."""
        return zeroed((self.layout.num_slots, num_blocks, *self.page_shape), self.kv_dtype, device)

    def new_linear_states(self, device: torch.device) -> list[LinearState]:
        """Every linear-attention layer's slots (``num_state_slots_total``)."""
        n = self.num_state_slots_total
        return [LinearState(zeroed((n, *s.conv), s.conv_dtype, device), zeroed((n, *s.ssm), s.ssm_dtype, device))
                for s in self.state_shapes]

    def dummy_metadata(self, query_lens: list[int], device: torch.device, written: bool) -> AttentionMetadata:
        """Fresh sequences of ``query_lens`` tokens (``dummy_metadata`` below) for
        every group; written: into blocks numbered from 0 (a scratch cache), else nowhere."""
        meta = dummy_metadata(query_lens, device, self.block_sizes if written else None,
                              num_groups=self.layout.num_groups)
        if self.num_state_slots:  # row b in slot b (rows past the slots share them: a dummy pass only)
            meta.state_slots = (torch.arange(len(query_lens), dtype=torch.int32) % (self.num_state_slots + 1)).to(device)
        return meta


def dummy_metadata(query_lens: Sequence[int], device: torch.device, block_sizes: Sequence[int] | int | None = None,
                   *, num_groups: int = 1) -> AttentionMetadata:
    """Attention metadata of fresh sequences of ``query_lens`` tokens each (every token is
    new: seq_len = query length). ``block_sizes`` (each KV cache group's) None: nothing is
    written (slot -1) and every sequence reads block 0 (``num_groups`` groups alike); else each
    sequence writes its keys into blocks of its own, numbered from 0 in order in every group
    (a scratch cache must hold them)."""
    lens = torch.tensor(list(query_lens), dtype=torch.int32)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=qsl[1:])
    total = int(qsl[-1])
    if isinstance(block_sizes, int):
        block_sizes = (block_sizes,)
    if block_sizes is None:
        slots = torch.full((num_groups, total), -1, dtype=torch.long)
        tables = torch.zeros(num_groups, len(lens), 1, dtype=torch.int32)
    else:
        width = max(cdiv(n, bs) for bs in block_sizes for n in lens.tolist())
        tables = torch.zeros(len(block_sizes), len(lens), width, dtype=torch.int32)
        slots = torch.empty(len(block_sizes), total, dtype=torch.long)
        for g, bs in enumerate(block_sizes):
            first = 0
            for i, n in enumerate(lens.tolist()):
                w = cdiv(n, bs)
                tables[g, i, :w] = torch.arange(first, first + w, dtype=torch.int32)
                slots[g, qsl[i]:qsl[i + 1]] = first * bs + torch.arange(n)
                first += w
    return AttentionMetadata(slot_mapping=slots.to(device), block_tables=tables.to(device),
                             query_start_loc=qsl.to(device), seq_lens=lens.to(device))


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On CPU its memory is an anonymous mapping whose pages the kernel zeroes
    on first touch: a cache is resident only as far as it has been written, so a large KV cache
    costs a single-stream local user the memory of the blocks it uses (``torch.zeros`` would
    write every page; numpy's zeros asks for 2 MiB huge pages, and a block written in each
    layer's part of the cache then makes 2 MiB resident per layer)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
