"""Per-request block tables on top of the block pool.

The scheduler talks to this class only; ``BlockPool`` internals (free queue,
ref counts, the hash map) stay behind it.

Which token ranges of a request are where, at allocation time::

    | computed (KV in cache)      | new this step         | not yet scheduled |
    0                   num_computed_tokens   +num_new_tokens         num_tokens
    | prefix-cache hit | own blocks |

Only full blocks whose every token is computed are hashed and cached.
"""
from __future__ import annotations

from typing import Sequence

from engine.block_hash import hash_block_tokens
from engine.block_pool import BlockPool, KVBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Every layer attends within this many keys: leading blocks that have left the
        # window are released as a request advances (free_dead_blocks). None: keep all.
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same tables as ids, kept alongside
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's full blocks so far
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already registered in the pool
        self.num_dead_blocks: dict[str, int] = {}  # leading blocks released as out of the window

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests (idle prefix-cache blocks count as free)."""
        return self.pool.num_used_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs, tokens = self.block_size, request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.cache_root
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, as blocks and a token count.
        At least one token is always left to compute (its logits are needed).
        Does not take references: ``allocate_slots`` does."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for h in self._block_hashes(request, max_blocks):
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def _num_new_blocks(self, request: Request, num_new_tokens: int,
                        new_computed_blocks: Sequence[KVBlock]) -> int | None:
        have = len(self.req_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = max(0, self.blocks_needed(num_computed + num_new_tokens) - have)
        # Cache hits sitting in the free queue stop being free once touched.
        hits_in_free_queue = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return need if need <= self.pool.num_free_blocks - hits_in_free_queue else None

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> list[KVBlock] | None:
        """Take the prefix-cache hits and enough new blocks for
        ``num_new_tokens`` more tokens. Returns the new blocks, or None (and
        changes nothing) when there are not enough free blocks."""
        need = self._num_new_blocks(request, num_new_tokens, new_computed_blocks)
        if need is None:
            return None
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        ids = self.req_block_ids.setdefault(rid, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            ids.extend(b.block_id for b in new_computed_blocks)
            self.num_cached_blocks[rid] = len(blocks)
        new = self.pool.get_new_blocks(need) if need else []
        if new:
            blocks.extend(new)
            ids.extend(b.block_id for b in new)
        return new

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's newly full and computed blocks."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[rid] = num_full

    def free_dead_blocks(self, request: Request) -> int:
        """Release the request's leading blocks that no query of it reads again: with every
        layer windowed, the next query (position ``num_computed_tokens``) and every later
        one see only keys at or past ``num_computed_tokens - sliding_window + 1``::

            | dead: released        | window of the next query | next
            0                 dead * block_size          num_computed_tokens

        A released block keeps its id in the request's table (the kernels never read it)
        and, once registered, its hash: it stays a prefix-cache hit until evicted. Blocks
        not yet registered are kept. Requests whose KV will be sent (``hold_kv_on_finish``)
        keep every block: the send reads them all. Returns how many were released."""
        if self.sliding_window is None or request.hold_kv_on_finish:
            return 0
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return 0
        dead = (request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        dead = min(dead, len(blocks) - 1)
        if self.enable_caching:
            dead = min(dead, self.num_cached_blocks.get(rid, 0))
        start = self.num_dead_blocks.get(rid, 0)
        if dead <= start:
            return 0
        self.pool.free_blocks(reversed(blocks[start:dead]))
        self.num_dead_blocks[rid] = dead
        return dead - start

    def trim(self, request: Request, num_tokens: int) -> int:
        """Release the request's trailing blocks past the first ``num_tokens`` tokens: blocks
        a speculative step took for proposals that were rejected (never registered; their
        KV is never read, the next steps write over the positions). Returns how many."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return 0
        keep = max(self.blocks_needed(num_tokens), self.num_cached_blocks.get(rid, 0))
        extra = blocks[keep:]
        if not extra:
            return 0
        del blocks[keep:]
        del self.req_block_ids[rid][keep:]
        self.pool.free_blocks(reversed(extra))
        return len(extra)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference to (its table less the released ones)."""
        return len(self.req_blocks.get(request_id, ())) - self.num_dead_blocks.get(request_id, 0)

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.req_block_ids.get(request_id, ()))  # a copy: the kept list grows

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its prefix is evicted
        last). Hashes are kept: a preempted request recomputes the same ones."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        dead = self.num_dead_blocks.pop(request.request_id, 0)  # released already
        self.pool.free_blocks(reversed(blocks[dead:]))

    def forget(self, request: Request) -> None:
        """Drop all per-request state of a finished request."""
        self.free(request)
        self.req_hashes.pop(request.request_id, None)

    # ---- the prefix index feed (the pool's events) ----------------------
    def cache_snapshot(self) -> list[int]:
        """Every full-block hash cached now; prefix-cache events are recorded from here on
        (``take_cache_events``)."""
        return self.pool.snapshot()

    def take_cache_events(self) -> tuple[list[tuple[bool, int]], bool]:
        """((stored?, hash) in order, lost) since the last call or snapshot; lost: the
        buffer overflowed and only a new snapshot is exact."""
        return self.pool.take_events()
