"""The block pool: owner of every KV block's ref count, hash and free-list
position.

Invariants:
- a block is in the free queue iff its ref_cnt == 0;
- a block with a hash is in ``cached`` (hash -> block) until it is evicted,
  which happens only when it is popped from the free queue for reuse;
- the free queue is in eviction order (LRU): freed blocks go to the tail,
  allocation pops the head. Never-used blocks start in id order.
"""
from __future__ import annotations

from typing import Callable, Iterable

from engine.cache_events import CacheEvents


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "indexed", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.indexed = True  # its hash is published to the prefix index (cache groups: group 0's)
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks. A deque cannot remove from the
    middle in O(1), which a prefix-cache hit on a free block needs."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        ids, b = [], self._head.next_free
        while b is not None and b is not self._tail:
            ids.append(b.block_id)
            b = b.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        # The prefix index feed: hashes stored/evicted since the last take_events()
        # (engine/cache_events.py; nothing until someone subscribes or snapshots).
        self.events = CacheEvents()
        # Called with (hash, block id) just before a cached block is reused for a new
        # allocation, while its KV is still there (the host tier's write-back: engine/kv_offload.py).
        self.on_evict: Callable[[int, int], object] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests (idle prefix-cache blocks are free)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if self.on_evict is not None and b.block_hash is not None and self.cached.get(b.block_hash) is b:
                self.on_evict(b.block_hash, b.block_id)
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if block.indexed:
                    self.events.record(False, block.block_hash)
            block.block_hash = None

    def cache_block(self, block: KVBlock, block_hash: int, indexed: bool = True) -> None:
        """Register a full, computed block under its chained hash. If another
        block already holds that hash, this one stays unhashed (a duplicate).
        ``indexed``: publish it to the prefix index's feed (events, snapshot)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash, block.indexed = block_hash, indexed
        self.cached[block_hash] = block
        if indexed:
            self.events.record(True, block_hash)

    def publish(self, block_hash: int) -> None:
        """Publish the cached block of ``block_hash``, registered unpublished
        (``cache_block(indexed=False)``) or withdrawn, to the prefix index's feed, from now until
        it is evicted or withdrawn. Nothing when no block holds that hash."""
        block = self.cached.get(block_hash)
        if block is None or block.indexed:
            return
        block.indexed = True
        self.events.record(True, block_hash)

    def unpublish(self, block_hash: int) -> None:
        """Withdraw the cached block of ``block_hash`` from the prefix index's feed (a dropped
        event); it stays cached. Nothing when no block holds that hash or it is not published."""
        block = self.cached.get(block_hash)
        if block is None or not block.indexed:
            return
        block.indexed = False
        self.events.record(False, block_hash)

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue
        tail in the given order (pass a request's blocks tail-first so its
        prefix is evicted last)."""
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None or not self.enable_caching:
                    b.block_hash = None
                self.free_queue.append(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_used_blocks:
            return False
        for b in self.blocks:
            self._evict(b)
        return True

    @property
    def is_recording(self) -> bool:
        return self.events.is_recording

    def subscribe_events(self, max_events: int | None = None) -> None:
        """Start recording stored/evicted hashes for ``take_events``."""
        self.events.restart(max_events)

    def take_events(self) -> tuple[list[tuple[bool, int]], bool]:
        """((stored?, hash) in order since the last call, lost): lost when the buffer
        overflowed since then (a new ``snapshot`` is exact). Empty until subscribed."""
        return self.events.take()

    def snapshot(self) -> list[int]:
        """Every hash cached now, recording from here on (subscribed now if not yet): what
        was buffered and the lost mark are dropped, ``take_events`` continues from this."""
        self.events.restart()
        return [h for h, b in self.cached.items() if b.indexed]
