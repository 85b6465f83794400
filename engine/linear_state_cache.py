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
which snapshot slot holds what.
"""
from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, first_slot: int, num_snapshots: int, interval: int) -> None:
        """Snapshot slots ``first_slot .. first_slot + num_snapshots - 1``; boundaries every
        ``interval`` tokens."""
        if interval < 1:
            raise ValueError("the state snapshot interval must be at least 1 token")
        self.interval = interval
        self.free = list(range(first_slot + num_snapshots - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recent first

    @property
    def enabled(self) -> bool:
        return bool(self.free or self.by_hash)

    def find(self, block_hash: int) -> int | None:
        slot = self.by_hash.get(block_hash)
        if slot is not None:
            self.by_hash.move_to_end(block_hash)
        return slot

    def take(self, block_hash: int) -> int | None:
        """A slot for a new snapshot under ``block_hash`` (the oldest evicted when none is free);
        None when it is already kept."""
        if block_hash in self.by_hash:
            self.by_hash.move_to_end(block_hash)
            return None
        if self.free:
            slot = self.free.pop()
        elif self.by_hash:
            _, slot = self.by_hash.popitem(last=False)
        else:
            return None
        self.by_hash[block_hash] = slot
        return slot

    def chunk_end(self, start: int, num_new: int, prompt_len: int) -> int:
        """How many of ``num_new`` tokens from ``start`` to compute so that the chunk ends on a
        boundary where it crosses one: the last boundary it reaches, and within the prompt, its
        last boundary before the final token (a prefix hit always leaves one token to compute)."""
        end = start + num_new
        if start >= prompt_len:  # decoding: snapshots are of prompts
            return num_new
        last = (min(end, prompt_len - 1) // self.interval) * self.interval
        return last - start if last > start else num_new
