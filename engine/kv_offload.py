"""The host tier of the KV cache (``--kv-offloading-size``): KV blocks the device cache evicts,
kept in host memory (pinned on CUDA, a plain tensor on CPU), and loaded back on a prefix hit.

Ownership: ``HostKVTier`` alone decides what is in the host tier. It holds the host buffer
(``[host blocks, slots, 2, block_size, kv_heads, head_dim]``: one block's page of every KV
cache slot, i.e. every layer, contiguous), its own LRU of block hash -> host block, its own
bound (``num_blocks``, from the size and the bytes of a block), and the copies still to run.
The device side tells it two things, both from the KV cache manager while a step is scheduled:

- ``offload(hash, device block)``: a cached device block is about to be reused for a new
  allocation (``BlockPool.get_new_blocks``). Write-back: its KV is copied to the host before
  the device block is overwritten (if the hash is here already, it is only touched).
- ``load(host block, device block)``: a prefix hit continued past the device hits into the
  host tier (``KVCacheManager.get_computed_blocks``); the device block is a new one of the
  request, registered as an ordinary cached device block once its step ran.

Both are queued in the order they happen (a store into a host block whose old contents a
load of the same round still reads comes after that load), and ``flush`` runs them on the
KV cache tensor right after the scheduler returns, before the step's forward pass (or a
KV receive) writes the new blocks. On CUDA they go on a side stream, non-blocking from and
to pinned memory, and the compute stream waits for them (so they are ordered before any
overwrite, without the host waiting). Loading layer by layer, overlapped with the forward
pass, is a later optimisation; the whole block is copied before the step now.

The disk tier (``--kv-offloading-path``, engine/kv_disk_tier.py) is this tier's next level,
reached only through it: a host block dropped to make room is spilled there (copied to a
staging buffer now, written by the disk tier's thread), and ``find`` continues a prefix
lookup past the host hits into it, reading those files into host blocks that then load like
any host hit. The host touches its buffer from the CPU only for those two (a spill reads a
block, a disk read writes one), never a block a queued copy of this round reads or writes,
and on CUDA only once the copies of earlier flushes are done (``_sync_host``).

Limits: one KV cache group without linear-attention state (the manager refuses more), one
rank (no tensor parallel), no draft model (engine/config.py refuses both).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import torch

from engine.block_hash import leading_run

if TYPE_CHECKING:
    from engine.kv_disk_tier import DiskKVTier


class HostKVTier:
    def __init__(self, num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        """``block_shape``: one block of the device cache, every slot (``kv_cache[:, b].shape``)."""
        if num_blocks < 1:
            raise ValueError("the host KV tier needs at least one block: raise --kv-offloading-size")
        self.num_blocks = num_blocks
        self.device = device
        cuda = device.type == "cuda"
        self.buffer = torch.zeros((num_blocks, *block_shape), dtype=dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> host block, least recently used first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self._pinned: set[int] = set()  # host blocks a load of the allocation in progress reads
        self._copies: list[tuple[bool, int, int]] = []  # (store?, device block, host block), in order
        self._pending: set[int] = set()  # host blocks the queued copies read or write
        self._pending_stores: set[int] = set()  # of those, the ones written (not holding their KV yet)
        self._flushed: torch.cuda.Event | None = None  # CUDA: the last flush's copies, until waited for
        self.disk: DiskKVTier | None = None  # the next tier (--kv-offloading-path), if any
        self.stored_blocks_total = 0  # device -> host copies
        self.loaded_blocks_total = 0  # host -> device copies (prefix hits in this tier)
        self.dropped_blocks_total = 0  # host blocks whose hash made room for another (LRU)

    @classmethod
    def of_size(cls, size_gib: float, kv_cache: torch.Tensor) -> "HostKVTier":
        """A tier of ``size_gib`` GiB for blocks of ``kv_cache`` ([slots, blocks, ...])."""
        block = kv_cache[:, 0]
        block_bytes = block.numel() * block.element_size()
        n = int(size_gib * 2**30) // block_bytes
        if n < 1:
            raise ValueError(f"--kv-offloading-size {size_gib} GiB holds no KV block (one is "
                             f"{block_bytes / 2**20:.2f} MiB)")
        return cls(n, tuple(block.shape), kv_cache.dtype, kv_cache.device)

    # ---- what is here (the scheduler's side) ------------------------------
    @property
    def num_used_blocks(self) -> int:
        return len(self._lru)

    @property
    def block_bytes(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are here (changes nothing)."""
        return leading_run(hashes, self._lru)

    def acquire(self, hashes: Sequence[int]) -> list[int]:
        """The host blocks of ``hashes`` (all here: ``lookup``), made most recently used and
        pinned until ``release``: no store of the same allocation takes them."""
        slots = []
        for h in hashes:
            slot = self._lru[h]
            self._lru.move_to_end(h)
            self._pinned.add(slot)
            slots.append(slot)
        return slots

    def release(self, slots: Sequence[int]) -> None:
        self._pinned.difference_update(slots)

    def attach_disk(self, disk: DiskKVTier) -> None:
        """Spill the blocks this tier drops to ``disk`` and continue ``find`` into it."""
        self.disk = disk

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def find(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are here, after reading those that follow the host hits
        from the disk tier into host blocks (as far as they verify and fit beside the host hits,
        which they never displace). Unlike ``lookup``, it changes what is here."""
        n = self.lookup(hashes)
        if self.disk is None or n == len(hashes) or hashes[n] not in self.disk:
            return n
        want = self.disk.lookup(hashes[n:])
        protect = {self._lru[h] for h in hashes[:n]} - self._pinned  # (the host hits: not victims)
        self._pinned |= protect
        read = 0
        try:
            for h in hashes[n:n + want]:
                if h in self._lru:  # here too (stored again after an earlier spill): a host hit, not a read
                    slot = self._lru[h]
                    self._lru.move_to_end(h)
                    self._pinned.add(slot)
                    protect.add(slot)
                    read += 1
                    continue
                slot = self._take_slot(cpu_write=True)
                if slot is None:
                    break
                self._sync_host()
                if not self.disk.read(h, self.buffer[slot]):  # refused or gone: recomputed from here
                    self._free.append(slot)
                    break
                self._lru[h] = slot
                self._pinned.add(slot)
                protect.add(slot)
                read += 1
        finally:
            self._pinned -= protect
        return n + read

    def _take_slot(self, cpu_write: bool = False) -> int | None:
        """A host block for new contents: a free one, else the least recently used that is not
        pinned (nor, for a write by the CPU, read or written by a queued copy), whose KV is
        spilled to the disk tier first. None when there is none."""
        if self._free:
            return self._free.pop()
        busy = self._pinned | self._pending if cpu_write else self._pinned
        victim = next((h for h, s in self._lru.items() if s not in busy), None)
        if victim is None:
            return None
        slot = self._lru.pop(victim)
        self.dropped_blocks_total += 1
        if self.disk is not None and slot not in self._pending_stores:  # (else its KV is not here yet)
            self._sync_host()
            self.disk.spill(victim, self.buffer[slot])
        return slot

    def _sync_host(self) -> None:
        """Before the CPU reads or writes the buffer: the copies of earlier flushes are done."""
        if self._flushed is not None:
            self._flushed.synchronize()
            self._flushed = None

    def offload(self, block_hash: int, device_block: int) -> bool:
        """A cached device block is about to be reused: keep its KV here (queued copy), or
        only touch it when its hash is here already. False when every host block is pinned
        (the block is dropped, as without this tier)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        slot = self._take_slot()
        if slot is None:
            return False
        self._lru[block_hash] = slot
        self._copies.append((True, device_block, slot))
        self._pending.add(slot)
        self._pending_stores.add(slot)
        self.stored_blocks_total += 1
        return True

    def load(self, slot: int, device_block: int) -> None:
        """Queue the copy of host block ``slot`` into ``device_block`` (a prefix hit here)."""
        self._copies.append((False, device_block, slot))
        self._pending.add(slot)
        self.loaded_blocks_total += 1

    @property
    def num_pending_copies(self) -> int:
        return len(self._copies)

    def check(self) -> None:
        """Assert the accounting: every host block is either free or holds one hash."""
        used = list(self._lru.values())
        assert len(used) == len(set(used)), "a host block holds two hashes"
        assert not set(used) & set(self._free), "a host block is both free and used"
        assert len(used) + len(self._free) == self.num_blocks, "host blocks lost"
        assert len(used) <= self.num_blocks

    # ---- the copies (the runner's side) ---------------------------------
    def flush(self, kv_cache: torch.Tensor, wait: bool = False) -> int:
        """Run the queued copies, in order, on ``kv_cache`` ([slots, blocks, ...]). On CUDA: on
        a side stream that first waits for the compute stream, which then waits for it (the
        host does not, unless ``wait``). Returns how many ran."""
        copies, self._copies = self._copies, []
        self._pending.clear()
        self._pending_stores.clear()
        if not copies:
            return 0
        if self._stream is None:
            for store, block, slot in copies:
                if store:
                    self.buffer[slot].copy_(kv_cache[:, block])
                else:
                    kv_cache[:, block].copy_(self.buffer[slot])
            return len(copies)
        compute = torch.cuda.current_stream(kv_cache.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for store, block, slot in copies:
                if store:
                    self.buffer[slot].copy_(kv_cache[:, block], non_blocking=True)
                else:
                    kv_cache[:, block].copy_(self.buffer[slot], non_blocking=True)
        compute.wait_stream(self._stream)
        if wait:
            self._stream.synchronize()
            self._flushed = None
        elif self.disk is not None:  # (the CPU touches the buffer only with a disk tier)
            self._flushed = torch.cuda.Event()
            self._flushed.record(self._stream)
        return len(copies)


__all__ = ["HostKVTier"]
