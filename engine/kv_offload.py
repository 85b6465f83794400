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
staging buffer now, written by the disk tier's writer thread), and ``find`` looks past the
host hits into it: the blocks that follow them on disk are read into host blocks on the disk
tier's reader thread, off the step. ``find`` itself returns the host hits only; while those
reads run (``reading(hash)``), the scheduler leaves the request waiting (engine/scheduler.py)
and looks it up again at a later step, when the blocks read are here and load like any host
hit (a block read from disk counts once as a disk hit: ``_from_disk``). A block being read
into is reserved (``_reading``): neither free nor in the LRU, so no eviction, store or other
read takes it, until its read ends and ``poll_reads`` (on the scheduler's thread: every
``find``) makes it an ordinary cached block, or frees it when the read failed (the prefix is
recomputed from there). Nothing else of the tier is touched by the reader: it writes the
reserved block's bytes and reports the end on a queue. A request that ends meanwhile leaves
nothing behind: its blocks read become cached host blocks like any other. At most
``max_reads`` blocks are being read at once. A reader thread that died ends none of its
reads: ``poll_reads`` frees their blocks, reads no more, and the waiting requests recompute.

The host touches its buffer from the CPU only for spills (read a block) and disk reads (write
one), never a block a queued copy of this round reads or writes, and on CUDA only once the
copies of earlier flushes are done (``_sync_host``; a read's reader waits for the flushes
queued before its blocks were reserved).

The prefix index hears of this tier too (rpc/cache_feed.py): ``snapshot`` lists every hash
here and starts recording which hashes enter and leave (``take_events``), in a buffer as
bounded as the block pool's (past it, the feed is marked lost and a new snapshot is exact).
Nothing is recorded before the first snapshot.

Limits: one KV cache group without linear-attention state (the manager refuses more), one
rank (no tensor parallel), no draft model (engine/config.py refuses both).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from engine.block_hash import leading_run
from engine.cache_events import CacheEvents

if TYPE_CHECKING:
    from engine.kv_disk_tier import DiskKVTier

logger = logging.getLogger(__name__)


class HostKVTier:
    def __init__(self, num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device, max_reads: int | None = None) -> None:
        """``block_shape``: one block of the device cache, every slot (``kv_cache[:, b].shape``);
        ``max_reads``: blocks being read from the disk tier at once, at most (default: half the
        tier, at most 256)."""
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
        # Prefix hits taken here (``acquire``: host blocks a request's allocation loads), by where the
        # block was found: in host memory already, or read from the disk tier by that lookup (``find``).
        self.host_hit_blocks_total = 0
        self.disk_hit_blocks_total = 0
        self._from_disk: set[int] = set()  # hashes read from disk and not taken by a hit since (all here)
        # Reads from the disk tier in flight: hash -> (host block reserved for it, read id). The
        # reader reports each end on ``_read_ends`` (hash, read id, loaded?); ``poll_reads`` takes them.
        self._reading: dict[int, tuple[int, int]] = {}
        self._read_ids = itertools.count(1)
        self._read_ends: queue.SimpleQueue[tuple[int, int, bool]] = queue.SimpleQueue()
        self._read_ended = threading.Event()  # set by the reader after each run of reads
        self.max_reads = max_reads if max_reads is not None else max(1, min(256, num_blocks // 2))
        self._reads_off = False  # the reader thread died: no more reads
        # Called from the reader thread once a run of reads ended (the engine wakes its loop).
        self.on_read_done: Callable[[], None] | None = None
        # How long a request may wait for its prefix's reads, in all (the scheduler's bound).
        self.max_read_wait_s = 10.0
        # The prefix index feed: (stored?, hash) since the last take_events (engine/cache_events.py).
        self.events = CacheEvents()

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
            if h in self._from_disk:
                self._from_disk.discard(h)
                self.disk_hit_blocks_total += 1
            else:
                self.host_hit_blocks_total += 1
        return slots

    @property
    def hit_blocks(self) -> tuple[int, int]:
        """Prefix hits taken so far, in blocks: (found in host memory, read from the disk tier)."""
        return self.host_hit_blocks_total, self.disk_hit_blocks_total

    def release(self, slots: Sequence[int]) -> None:
        self._pinned.difference_update(slots)

    def attach_disk(self, disk: DiskKVTier) -> None:
        """Spill the blocks this tier drops to ``disk`` and continue ``find`` into it."""
        self.disk = disk

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def find(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are here (after taking the reads that ended:
        ``poll_reads``); and where the blocks that follow them have files in the disk tier,
        start reading those (as far as they fit beside the host hits, which they never
        displace, and under ``max_reads``) into host blocks reserved for them, on the disk
        tier's reader thread. Those are here once read: ``reading`` says which are in flight.
        Unlike ``lookup``, it changes what is here."""
        self.poll_reads()
        n = self.lookup(hashes)
        if self.disk is None or self._reads_off or n == len(hashes) or hashes[n] not in self.disk:
            return n
        want = self.disk.lookup(hashes[n:])
        protect = {self._lru[h] for h in hashes[:n]} - self._pinned  # (the host hits: not victims)
        self._pinned |= protect
        run: list[tuple[int, int]] = []  # (hash, host block) to read, in order
        try:
            for h in hashes[n:n + want]:
                if h in self._reading:  # (being read for an earlier lookup)
                    continue
                if h in self._lru:  # here too (stored again after an earlier spill): a host hit, not a read
                    slot = self._lru[h]
                    self._lru.move_to_end(h)
                    if slot not in self._pinned:
                        self._pinned.add(slot)
                        protect.add(slot)
                    continue
                if len(self._reading) >= self.max_reads:
                    break
                slot = self._take_slot(cpu_write=True)
                if slot is None:
                    break
                self._reading[h] = (slot, next(self._read_ids))
                run.append((h, slot))
        finally:
            self._pinned -= protect
        if run:
            flushed = self._flushed  # (CUDA: copies of earlier flushes may still read or write these blocks)
            ids = {h: self._reading[h][1] for h, _ in run}
            last = run[-1][0]
            self.disk.read_async([(h, self.buffer[slot]) for h, slot in run],
                                 lambda h, ok: self._read_done(h, ids[h], ok, h == last),
                                 after=flushed.synchronize if flushed is not None else None)
        return n

    def reading(self, block_hash: int) -> int | None:
        """The id of the read in flight of ``block_hash`` from the disk tier (another read of
        the same block later has another id), or None when none is."""
        entry = self._reading.get(block_hash)
        return None if entry is None else entry[1]

    @property
    def num_reads_in_flight(self) -> int:
        return len(self._reading)

    def _read_done(self, block_hash: int, read_id: int, ok: bool, wake: bool) -> None:
        """(The reader thread.) A read ended; ``wake``: the last of its run (every block of a run
        is reported, read or not), so whoever waits for reads (the engine between steps) looks again."""
        self._read_ends.put((block_hash, read_id, ok))
        if wake:
            self._read_ended.set()
            callback = self.on_read_done
            if callback is not None:
                callback()

    def poll_reads(self) -> None:
        """Take the reads from the disk tier that ended: a block read is here (most recently
        used), one that failed is free again. Where the reader thread died with reads in
        flight, their blocks are freed (nothing writes them any more) and no read starts again."""
        while True:
            try:
                h, read_id, ok = self._read_ends.get_nowait()
            except queue.Empty:
                break
            entry = self._reading.get(h)
            if entry is None or entry[1] != read_id:
                continue  # (a read already given up)
            slot = self._reading.pop(h)[0]
            if ok and h not in self._lru:
                self._lru[h] = slot
                self._from_disk.add(h)
                self.events.record(True, h)
            else:  # failed, or the hash was stored here meanwhile (an eviction from the device)
                self._free.append(slot)
        if self._reading and self.disk is not None and not self.disk.reader_alive:
            logger.error("the KV disk tier's reader thread died: %d block reads dropped, their prefixes are "
                         "recomputed, and no more blocks are read from disk", len(self._reading))
            self._free.extend(slot for slot, _ in self._reading.values())
            self._reading.clear()
            self._reads_off = True

    def wait_reads(self, timeout: float) -> None:
        """Block until a run of reads ends (at most ``timeout`` s); at once when none is in flight."""
        if not self._reading:
            return
        self._read_ended.clear()
        if not self._read_ends.empty():
            return
        self._read_ended.wait(timeout)

    def drain_reads(self, timeout: float = 30.0) -> None:
        """Wait until no read is in flight and take them all (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        self.poll_reads()
        while self._reading and time.monotonic() < deadline:
            self.wait_reads(0.01)
            self.poll_reads()

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
        self._from_disk.discard(victim)
        self.events.record(False, victim)
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
        self.events.record(True, block_hash)
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
        """Assert the accounting: every host block is either free, holds one hash, or is being
        read into for one."""
        used = list(self._lru.values())
        reading = [slot for slot, _ in self._reading.values()]
        assert len(used) == len(set(used)), "a host block holds two hashes"
        assert len(reading) == len(set(reading)), "a host block is read into for two hashes"
        assert not set(used) & set(self._free), "a host block is both free and used"
        assert not set(reading) & (set(used) | set(self._free)), "a host block read into is also free or used"
        assert len(used) + len(reading) + len(self._free) == self.num_blocks, "host blocks lost"
        assert len(used) <= self.num_blocks and len(reading) <= self.max_reads
        assert self._from_disk <= self._lru.keys(), "a hash read from disk is noted but not here"

    # ---- the prefix index feed --------------------------------------------
    def snapshot(self) -> list[int]:
        """Every hash here now, least recently used first; ``take_events`` continues from this
        (recording starts with the first call)."""
        self.events.restart()
        return list(self._lru)

    def take_events(self) -> tuple[list[tuple[bool, int]], bool]:
        """((stored?, hash) in order since the last call or snapshot, lost): lost when the
        buffer overflowed meanwhile (only a new ``snapshot`` is exact). Empty until a snapshot."""
        return self.events.take()

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
