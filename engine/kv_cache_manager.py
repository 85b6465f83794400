"""Per-request block tables, one per KV cache group, on one block pool; and the state slots
of linear-attention layers.

The scheduler talks to this class only; ``BlockPool`` internals (free queue, ref counts,
the hash map) stay behind it. The groups (engine/kv_cache_groups.py) share the pool: a
request holds, per group, a table of that group's blocks; a request's need is the sum of
its groups' needs, and it is allocated all or nothing.

Which token ranges of a request are where, at allocation time (each group alike)::

    | computed (KV in cache)      | new this step         | not yet scheduled |
    0                   num_computed_tokens   +num_new_tokens         num_tokens
    | prefix-cache hit | own blocks |

Only full blocks whose every token is computed are hashed and cached, per group (a block
of one group holds other layers' KV than the same tokens' block of another).
"""
from __future__ import annotations

import math
from typing import Sequence

from engine.block_hash import hash_block_tokens
from engine.block_pool import BlockPool, KVBlock
from engine.kv_cache_groups import FULL, SLIDING, KVCacheGroup, KVCacheLayout, build_layout
from engine.kv_offload import HostKVTier
from engine.linear_state_cache import StateSnapshots
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupTables:
    """One group's tables: per request its blocks (and their ids), how many leading ones are
    registered in the prefix cache and how many were released as out of the window."""

    def __init__(self, index: int, group: KVCacheGroup) -> None:
        self.index, self.group = index, group
        self.block_size = group.block_size
        # Keys in the pool: group 0's are the block hashes (what the prefix index publishes);
        # another group's are its own, derived from them.
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_dead_blocks: dict[str, int] = {}

    def key(self, block_hash: int) -> int:
        return block_hash if self.index == 0 else hash((block_hash, self.index))

    def need(self, request: Request, num_tokens: int, num_hits: int) -> int:
        have = len(self.req_blocks.get(request.request_id, ())) + num_hits
        return max(0, cdiv(num_tokens, self.block_size) - have)


class StateSlots:
    """The linear-attention state slots: one per request that has begun computing, taken at
    its first allocation and given back when its blocks are (preemption recomputes it)."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self.slot_of: dict[str, int] = {}

    def take(self, request_id: str) -> None:
        if request_id not in self.slot_of:
            self.slot_of[request_id] = self.free.pop()

    def give_back(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, layout: KVCacheLayout | None = None,
                 num_state_slots: int = 0, num_state_snapshots: int = 0, snapshot_interval: int = 256) -> None:
        """``layout``: the model's cache groups (None: one group of every layer, windowed when
        ``sliding_window`` is set); ``num_state_slots``: linear-attention state slots (one per
        running sequence); ``num_state_snapshots`` more hold prefix-cache snapshots of them every
        ``snapshot_interval`` tokens (engine/linear_state_cache.py; 0: hybrid prompts are
        computed whole)."""
        if layout is None:
            kind = "sliding_attention" if sliding_window is not None else "full_attention"
            layout = build_layout([kind], [sliding_window], block_size)
        self.layout = layout
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = [GroupTables(i, g) for i, g in enumerate(layout.groups)]
        # A prefix hit is a whole number of every group's blocks.
        self.hit_unit = math.lcm(*(g.block_size for g in layout.groups))
        # A hybrid model's prefix hit restores the linear state from a snapshot: without any,
        # its prompts are computed whole.
        self.snapshots: StateSnapshots | None = None
        if layout.has_linear and enable_caching and num_state_snapshots > 0:
            if snapshot_interval % self.hit_unit:
                raise ValueError(f"the state snapshot interval {snapshot_interval} is not a multiple of the "
                                 f"blocks' {self.hit_unit} tokens")
            # slots: running ones, the scratch slot, then the snapshots'
            self.snapshots = StateSnapshots(num_state_slots + 1, num_state_snapshots, snapshot_interval)
        self.enable_caching = enable_caching and (not layout.has_linear or self.snapshots is not None)
        self.restore_from: dict[str, int] = {}  # request -> the snapshot slot its prefix hit restores
        # Prefill tier: request -> its prompt's first tokens whose KV the receiving decode server
        # holds already; a send leaves out each group's blocks of them (``send_block_ids``).
        self.send_skip: dict[str, int] = {}
        self.states = StateSlots(num_state_slots) if layout.has_linear else None
        if layout.has_linear and num_state_slots < 1:
            raise ValueError("a model with linear-attention layers needs state slots")
        self.req_hashes: dict[str, dict[int, list[int]]] = {}  # request -> block size -> hashes so far
        # The host tier (--kv-offloading-size; engine/kv_offload.py), and per request the hashes
        # of its last lookup's hits there (taken by the allocation that follows it).
        self.host: HostKVTier | None = None
        self._host_hits: dict[str, list[int]] = {}

    def attach_host_tier(self, tier: HostKVTier) -> None:
        """Keep the blocks this cache evicts in ``tier`` and continue prefix hits into it. One
        cache group without linear-attention state only."""
        if self.layout.has_linear:
            raise ValueError("--kv-offloading-size is not supported for models with linear-attention layers "
                             "yet (their recurrent state is not in KV blocks); serve without it")
        if len(self.groups) > 1:
            raise ValueError(f"--kv-offloading-size supports one KV cache group only, this model has "
                             f"{len(self.groups)} ({self.layout.describe()}); serve without it, or with "
                             "--disable-hybrid-kv-cache-manager where the model allows one group")
        if not self.enable_caching:
            raise ValueError("--kv-offloading-size needs prefix caching (drop --no-enable-prefix-caching)")
        self.host = tier
        self.pool.on_evict = tier.offload

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests (idle prefix-cache blocks count as free)."""
        return self.pool.num_used_blocks

    def blocks_needed(self, num_tokens: int, chunk: int | None = None) -> int:
        """Blocks of every group that ``num_tokens`` tokens take at most at once: every block,
        or with ``chunk`` (computed ``chunk`` tokens a step at most, blocks behind the window
        released) a windowed group's window, the chunk and the block in progress."""
        total = 0
        for g in self.groups:
            n = g.group.blocks_needed(num_tokens)
            if chunk is not None and g.group.kind == SLIDING:
                n = min(n, cdiv(g.group.sliding_window - 1 + chunk, g.block_size) + 1)
            total += n
        return total

    def _block_hashes(self, request: Request, num_full_blocks: int, block_size: int | None = None) -> list[int]:
        bs = block_size or self.block_size
        hashes = self.req_hashes.setdefault(request.request_id, {}).setdefault(bs, [])
        tokens = request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.cache_root
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request, with_state: bool = True) -> tuple[list[list[KVBlock]], int]:
        """Longest cached prefix of the request in every group, as each group's blocks and a
        token count. At least one token is always left to compute (its logits are needed).
        Does not take references: ``allocate_slots`` does.

        ``with_state`` False: the request's linear-attention state will not be restored from a
        snapshot (a decode tier's reservation: the state after the whole prompt arrives with
        its KV), so a hybrid model's hit is its attention groups' blocks alone, at any boundary
        of them, and no snapshot is noted for ``take_restore``."""
        none: list[list[KVBlock]] = [[] for _ in self.groups]
        if not self.enable_caching:
            return none, 0
        num_tokens = (request.num_tokens - 1) // self.hit_unit * self.hit_unit
        limit = num_tokens
        found: list[list[KVBlock]] = []
        for g in self.groups:
            blocks: list[KVBlock] = []
            for h in self._block_hashes(request, num_tokens // g.block_size, g.block_size):
                b = self.pool.get_cached_block(g.key(h))
                if b is None:
                    break
                blocks.append(b)
            num_tokens = min(num_tokens, len(blocks) * g.block_size // self.hit_unit * self.hit_unit)
            found.append(blocks)
        if self.host is not None:  # past the device hits, the host tier's (one group)
            num_tokens += self._host_lookup(request, len(found[0]), limit // self.block_size)
        if self.snapshots is not None and with_state:  # and the linear state at that boundary, or an earlier one
            num_tokens = self._snapshot_boundary(request, num_tokens)
        if num_tokens == 0:
            return none, 0
        return [blocks[:num_tokens // g.block_size] for g, blocks in zip(self.groups, found)], num_tokens

    def _host_lookup(self, request: Request, start: int, end: int) -> int:
        """Tokens of blocks ``start``.. (up to ``end``) found in the host tier, in order; their
        hashes are noted for the allocation that follows."""
        assert self.host is not None
        self._host_hits.pop(request.request_id, None)
        if start >= end:
            return 0
        hashes = self._block_hashes(request, end)[start:end]
        n = self.host.find(hashes)  # (blocks on disk after these: being read into the host tier, off the step)
        if n:
            self._host_hits[request.request_id] = hashes[:n]
        return n * self.block_size

    def _boundary_hash(self, request: Request, num_tokens: int) -> int:
        bs = self.groups[0].block_size
        return self._block_hashes(request, num_tokens // bs, bs)[num_tokens // bs - 1]  # (the list may be longer)

    def _snapshot_boundary(self, request: Request, num_tokens: int) -> int:
        """The longest boundary within ``num_tokens`` that has a state snapshot (0: none); the
        snapshot is noted for ``take_restore``."""
        assert self.snapshots is not None
        self.restore_from.pop(request.request_id, None)
        b = num_tokens // self.snapshots.interval * self.snapshots.interval
        while b > 0:
            slot = self.snapshots.find(self._boundary_hash(request, b))
            if slot is not None:
                self.restore_from[request.request_id] = slot
                return b
            b -= self.snapshots.interval
        return 0

    # ---- linear-attention state: chunks, snapshots, restores ----------------
    def chunk_len(self, request: Request, start: int, num_new: int) -> int:
        """Tokens of a chunk from ``start`` to compute this step: ``num_new``, cut to end on a
        state snapshot boundary where it crosses one (engine/linear_state_cache.py)."""
        if self.snapshots is None or num_new <= 1:
            return num_new
        return self.snapshots.chunk_end(start, num_new, request.num_prompt_tokens)

    def snapshot_after(self, request: Request, end: int) -> tuple[int, int] | None:
        """(the request's slot, a snapshot slot) to copy once a step computed its tokens up to
        ``end``, where that is a boundary without a snapshot yet; else None.

        The prefix index hears of a hybrid model's blocks while a kept snapshot covers them
        (``StateSnapshots.covers``: what a hit there restores): the blocks up to this boundary
        now, those only an evicted snapshot covered no more. Blocks not registered yet are
        published by ``cache_blocks`` once their step ran."""
        if self.snapshots is None or end % self.snapshots.interval or end > request.num_tokens or end == 0:
            return None
        bs = self.groups[0].block_size
        taken = self.snapshots.take(self._block_hashes(request, end // bs, bs)[:end // bs])
        for h in taken.uncovered:
            self.pool.unpublish(h)
        for h in taken.covered:
            self.pool.publish(h)
        return None if taken.slot is None else (self.state_slot(request.request_id), taken.slot)

    def take_restore(self, request: Request) -> tuple[int, int] | None:
        """(snapshot slot, the request's slot) to copy before its first step after a prefix hit."""
        src = self.restore_from.pop(request.request_id, None)
        return None if src is None else (src, self.state_slot(request.request_id))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[KVBlock]] = ()) -> list[KVBlock] | None:
        """Take the prefix-cache hits (per group, from ``get_computed_blocks``) and enough new
        blocks in every group for ``num_new_tokens`` more tokens, and a state slot on its first
        call. Returns the new blocks, or None (and changes nothing) when they do not fit."""
        hits = list(new_computed_blocks) or [[] for _ in self.groups]
        rid = request.request_id
        # The host tier's hits of the lookup that gave ``new_computed_blocks``: new device blocks,
        # loaded from the host (the first ones this call takes).
        host_hits = self._host_hits.pop(rid, []) if new_computed_blocks else []
        num_hit_tokens = (len(hits[0]) + len(host_hits)) * self.groups[0].block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        needs = [g.need(request, total, len(h)) for g, h in zip(self.groups, hits)]
        # Cache hits sitting in the free queue stop being free once touched.
        hits_in_free_queue = sum(1 for h in hits for b in h if b.ref_cnt == 0)
        if sum(needs) > self.pool.num_free_blocks - hits_in_free_queue:
            return None
        if self.states is not None and rid not in self.states.slot_of:
            if not self.states.free:
                return None
            self.states.take(rid)
        # Every group's hits first: a hit still in the free queue must not be handed out as
        # another group's new block.
        for g, h in zip(self.groups, hits):
            blocks = g.req_blocks.setdefault(rid, [])
            if h:
                self.pool.touch(h)
                blocks.extend(h)
                g.req_block_ids.setdefault(rid, []).extend(b.block_id for b in h)
                g.num_cached_blocks[rid] = len(blocks)
        # (pinned: the evictions below store into the host tier but never over these)
        host_slots = self.host.acquire(host_hits) if host_hits and self.host is not None else []
        new_all: list[KVBlock] = []
        for g, need in zip(self.groups, needs):
            blocks = g.req_blocks[rid]
            ids = g.req_block_ids.setdefault(rid, [])
            new = self.pool.get_new_blocks(need) if need else []
            blocks.extend(new)
            ids.extend(b.block_id for b in new)
            new_all.extend(new)
        if host_slots:
            assert self.host is not None and len(new_all) >= len(host_slots)
            for slot, block in zip(host_slots, new_all):
                self.host.load(slot, block.block_id)  # registered by cache_blocks once its step ran
            self.host.release(host_slots)
        return new_all

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's newly full and computed blocks, in every group."""
        if not self.enable_caching:
            return
        rid = request.request_id
        for g in self.groups:
            blocks = g.req_blocks.get(rid, [])
            num_full = min(num_computed_tokens // g.block_size, len(blocks))
            start = g.num_cached_blocks.get(rid, 0)
            if num_full <= start:
                continue
            hashes = self._block_hashes(request, num_full, g.block_size)
            for i in range(start, num_full):
                # published: group 0's, and a hybrid model's only under a kept state snapshot
                indexed = g.index == 0 and (self.snapshots is None or self.snapshots.covers(hashes[i]))
                self.pool.cache_block(blocks[i], g.key(hashes[i]), indexed=indexed)
            g.num_cached_blocks[rid] = num_full

    def free_dead_blocks(self, request: Request) -> int:
        """Release the request's leading blocks that no query of it reads again, in each
        windowed group: the next query (position ``num_computed_tokens``) and every later one
        see only keys at or past ``num_computed_tokens - sliding_window + 1``::

            | dead: released        | window of the next query | next
            0                 dead * block_size          num_computed_tokens

        A released block keeps its id in the request's table (the kernels never read it)
        and, once registered, its hash: it stays a prefix-cache hit until evicted. Blocks
        not yet registered are kept. Requests whose KV will be sent (``hold_kv_on_finish``)
        keep every block: the send reads them all. Full-attention groups keep theirs.
        Returns how many were released."""
        if request.hold_kv_on_finish:
            return 0
        rid, released = request.request_id, 0
        for g in self.groups:
            if g.group.kind != SLIDING:
                continue
            blocks = g.req_blocks.get(rid)
            if not blocks:
                continue
            dead = (request.num_computed_tokens - g.group.sliding_window + 1) // g.block_size
            dead = min(dead, len(blocks) - 1)
            if self.enable_caching:
                dead = min(dead, g.num_cached_blocks.get(rid, 0))
            start = g.num_dead_blocks.get(rid, 0)
            if dead <= start:
                continue
            self.pool.free_blocks(reversed(blocks[start:dead]))
            g.num_dead_blocks[rid] = dead
            released += dead - start
        return released

    def trim(self, request: Request, num_tokens: int) -> int:
        """Release the request's trailing blocks past the first ``num_tokens`` tokens: blocks
        a speculative step took for proposals that were rejected (never registered; their
        KV is never read, the next steps write over the positions). Returns how many."""
        rid, released = request.request_id, 0
        for g in self.groups:
            blocks = g.req_blocks.get(rid)
            if not blocks:
                continue
            keep = max(cdiv(num_tokens, g.block_size), g.num_cached_blocks.get(rid, 0))
            extra = blocks[keep:]
            if not extra:
                continue
            del blocks[keep:]
            del g.req_block_ids[rid][keep:]
            self.pool.free_blocks(reversed(extra))
            released += len(extra)
        return released

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference to (its tables less the released ones)."""
        return sum(len(g.req_blocks.get(request_id, ())) - g.num_dead_blocks.get(request_id, 0)
                   for g in self.groups)

    def get_block_table(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (copies: the kept lists grow)."""
        return tuple(list(g.req_block_ids.get(request_id, ())) for g in self.groups)

    def get_block_ids(self, request_id: str, skip_tokens: int = 0) -> list[int]:
        """The request's block ids, every group's table in group order (one group: its table);
        past its first ``skip_tokens`` tokens (a whole number of every group's blocks): each
        group's table less its blocks of them."""
        return [b for g in self.groups for b in g.req_block_ids.get(request_id, ())[skip_tokens // g.block_size:]]

    def skipped_tokens(self, request_id: str, block_ids: Sequence[int]) -> int | None:
        """The prefix whose blocks ``block_ids`` leaves out of the request's tables, in tokens:
        the n for which they are ``get_block_ids(request_id, n)`` (each group less its blocks of
        the same n tokens); None when they are no such list."""
        per_unit = sum(self.hit_unit // g.block_size for g in self.groups)  # blocks of hit_unit tokens
        missing = sum(len(g.req_block_ids.get(request_id, ())) for g in self.groups) - len(block_ids)
        if missing < 0 or missing % per_unit:
            return None
        n = missing // per_unit * self.hit_unit
        return n if self.get_block_ids(request_id, n) == list(block_ids) else None

    # ---- prefill tier: what a send leaves out -------------------------------
    def skip_on_send(self, request: Request, num_tokens: int) -> None:
        """The request's KV goes to a decode server that holds its prompt's first ``num_tokens``
        tokens already (its prefix-cache hit): ``send_block_ids`` leaves out each group's blocks
        of them. ValueError unless that is a whole number of every group's blocks, fewer than
        the prompt's tokens."""
        try:
            self.layout.check_prefix(num_tokens, request.num_prompt_tokens)
        except ValueError as exc:
            raise ValueError(f"request {request.request_id}: the decode server's cached prefix: {exc}") from None
        if num_tokens:
            self.send_skip[request.request_id] = num_tokens
        else:
            self.send_skip.pop(request.request_id, None)

    def send_block_ids(self, request_id: str) -> list[int]:
        """The blocks a send of the request's KV reads: every group's table in group order, less
        each group's blocks of the prefix the receiver holds (``skip_on_send``)."""
        return self.get_block_ids(request_id, self.send_skip.get(request_id, 0))

    def state_slot(self, request_id: str) -> int:
        """The request's linear-attention state slot (-1: none)."""
        return -1 if self.states is None else self.states.slot_of.get(request_id, -1)

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its prefix is evicted last) and its
        state slot. Hashes are kept: a preempted request recomputes the same ones."""
        rid = request.request_id
        for g in self.groups:
            blocks = g.req_blocks.pop(rid, [])
            g.req_block_ids.pop(rid, None)
            g.num_cached_blocks.pop(rid, None)
            dead = g.num_dead_blocks.pop(rid, 0)  # released already
            self.pool.free_blocks(reversed(blocks[dead:]))
        if self.states is not None:
            self.states.give_back(rid)
        self.restore_from.pop(rid, None)
        self._host_hits.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drop all per-request state of a finished request."""
        self.free(request)
        self.req_hashes.pop(request.request_id, None)
        self.send_skip.pop(request.request_id, None)

    # ---- the prefix index feed (the pool's events) ----------------------
    def cache_snapshot(self) -> list[int]:
        """Every group-0 block hash cached now; prefix-cache events are recorded from here on
        (``take_cache_events``)."""
        return self.pool.snapshot()

    def take_cache_events(self) -> tuple[list[tuple[bool, int]], bool]:
        """((stored?, hash) in order, lost) since the last call or snapshot; lost: the
        buffer overflowed and only a new snapshot is exact."""
        return self.pool.take_events()


__all__ = ["KVCacheManager", "cdiv", "FULL", "SLIDING"]
