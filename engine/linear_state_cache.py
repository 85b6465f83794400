"""Prefix caching of linear-attention state: snapshots of a request's state slot at chosen
token boundaries, kept under the hash of the block that ends there.

A hybrid model's prefix hit must restore the recurrent state after the prefix's last token:
the KV blocks of its attention layers are not enough. The scheduler cuts a prompt's chunks so
that they end on a boundary (every ``interval`` tokens, and the prompt's last one before its
end), and each chunk that ends on one copies the request's slot into a snapshot slot right
after the step's forward pass. A later request whose prompt starts with that prefix takes the
longest prefix whose attention blocks are cached *and* whose boundary has a snapshot; its first
step copies the snapshot into its own slot before the forward pass. The rest is recomputed.

Memory: ``num_snapshots`` slots beside the running ones (each one state of every linear layer:
``CacheSpec.state_bytes`` counts them), evicted least recently used. Only this class decides
which snapshot slot holds what, and so which blocks a kept snapshot covers: a block is worth a
hit (and published to the prefix index) while the prefix of some kept snapshot holds it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Sequence


class Taken(NamedTuple):
    """What ``StateSnapshots.take`` did: the new snapshot's slot (None: that boundary was kept
    already), the block hashes a kept snapshot now covers that none did, and those none covers
    any more (the evicted snapshot's that no other kept one holds)."""

    slot: int | None
    covered: list[int]
    uncovered: list[int]


class StateSnapshots:
    def __init__(self, first_slot: int, num_snapshots: int, interval: int) -> None:
        """Snapshot slots ``first_slot .. first_slot + num_snapshots - 1``; boundaries every
        ``interval`` tokens."""
        if interval < 1:
            raise ValueError("the state snapshot interval must be at least 1 token")
        self.interval = interval
        self.free = list(range(first_slot + num_snapshots - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recent first
        self._prefixes: dict[int, tuple[int, ...]] = {}  # boundary hash -> its prefix's block hashes
        self._holders: dict[int, int] = {}  # block hash -> how many kept snapshots' prefixes hold it

    @property
    def enabled(self) -> bool:
        return bool(self.free or self.by_hash)

    def find(self, block_hash: int) -> int | None:
        slot = self.by_hash.get(block_hash)
        if slot is not None:
            self.by_hash.move_to_end(block_hash)
        return slot

    def covers(self, block_hash: int) -> bool:
        """Whether the prefix of a kept snapshot holds the block."""
        return block_hash in self._holders

    def take(self, prefix: Sequence[int]) -> Taken:
        """A slot for a new snapshot at the end of ``prefix`` (the block hashes of the tokens up to
        the boundary, in order: its last is the boundary's, the snapshot's key), the oldest
        evicted when none is free; no slot when that boundary is kept already."""
        block_hash = prefix[-1]
        if block_hash in self.by_hash:
            self.by_hash.move_to_end(block_hash)
            return Taken(None, [], [])
        evicted: tuple[int, ...] = ()
        if self.free:
            slot = self.free.pop()
        elif self.by_hash:
            old, slot = self.by_hash.popitem(last=False)
            evicted = self._prefixes.pop(old)
        else:
            return Taken(None, [], [])
        self.by_hash[block_hash] = slot
        self._prefixes[block_hash] = tuple(prefix)
        covered = [h for h in prefix if self._hold(h, 1)]  # before the eviction: a shared block stays held
        uncovered = [h for h in evicted if self._hold(h, -1)]
        return Taken(slot, covered, uncovered)

    def _hold(self, block_hash: int, delta: int) -> bool:
        """Count a kept prefix more (1) or less (-1) as holding the block; True where that made it
        held (or no longer held)."""
        n = self._holders.get(block_hash, 0) + delta
        if n:
            self._holders[block_hash] = n
        else:
            del self._holders[block_hash]
        return n == (1 if delta > 0 else 0)

    def chunk_end(self, start: int, num_new: int, prompt_len: int) -> int:
        """How many of ``num_new`` tokens from ``start`` to compute so that the chunk ends on a
        boundary where it crosses one: the last boundary it reaches, and within the prompt, its
        last boundary before the final token (a prefix hit always leaves one token to compute)."""
        end = start + num_new
        if start >= prompt_len:  # decoding: snapshots are of prompts
            return num_new
        last = (min(end, prompt_len - 1) // self.interval) * self.interval
        return last - start if last > start else num_new
