"""The transfer canary: a checksum over a sample of each transfer's blocks, computed by the
sender where the data is, carried in the trailer, recomputed by the receiver once the blocks
have landed. A mismatch fails the request's transfer (``KVChecksumError``) like any other
transfer failure; the decode server counts it (``pdserve:kv_transfer_checksum_mismatches``).

It is a canary, not an integrity check of every byte: it catches what corrupts transfers
wholesale (a wrong plan, a scatter into the wrong blocks or heads, a torn staging slot, a
bad link) at a cost that does not grow with the prompt.

The sample (``sample_positions``): per layer of each cache (the target's, then a draft
model's), ``SAMPLES_PER_LAYER`` of the transfer's blocks, at positions that rotate with the
layer and start at a hash of the request id, so that a long prompt's blocks are all visited
over the layers and both sides pick the same ones knowing only the request id and the
number of blocks:

    k = min(SAMPLES_PER_LAYER, n)            n: the transfer's blocks (after the skipped prefix)
    position(layer, j) = (crc32(request_id) + layer + j * (n // k)) mod n     j < k

A hybrid model's linear-attention state adds one window of ``STATE_WINDOW_BYTES`` of each
linear layer's conv and of its ssm tensor (the window's index rotates with the tensor).

Cost, per transfer and per side, whatever the prompt's length: ``SAMPLES_PER_LAYER`` blocks'
worth of bytes of each cache (one block is layers x 2 x block_size x KV heads x head size:
2 MiB for an 8B Llama at blocks of 16 in bfloat16, so 4 MiB read) plus 8 KiB per linear
layer; a handful of kernel launches per chunk of layers on the sender (on the pair's stream,
after the chunk's layers are written: no host sync), one batch on the receiver after
everything landed (read back with the trailer, which the receiver reads anyway).

The checksum (``weighted_sums``): the bytes as 16-bit words, each times its position's weight
(``i mod 65521 + 1``), summed in int64 per sampled (layer, block). Exact integer arithmetic:
the same on CPU and GPU, in any order of summation, and any change of a single word changes
it. The sums of the layers of a cache go into ``CANARY_SLOTS - 1`` slots (layer index modulo),
the state's into the last one; the slots are the trailer's last ``CANARY_BYTES``.

Test hook: ``PDSERVE_TEST_CORRUPT_KV_EVERY=N`` (read once, at start, by
engine/runtime_config.py; tests only) makes a receiving process corrupt one sampled block of
every N-th transfer it receives, after it landed and before the check: the path from a
corrupted block to the client's error or recomputation can be tested with real servers.
Unset (0), it costs one integer test per transfer.
"""
from __future__ import annotations

import itertools
import threading
import zlib
from typing import NamedTuple, Sequence

import numpy as np
import torch

from engine.runtime_config import kv_corruption_test_hook
from kv_transfer.protocol import _TRAILER_CANARY_BYTES, KVTransferError

SAMPLES_PER_LAYER = 2
CANARY_SLOTS = 128  # int64 sums at the trailer's end: slot l % 127 for layer l, 127 for the state
CANARY_BYTES = CANARY_SLOTS * 8
assert CANARY_BYTES == _TRAILER_CANARY_BYTES  # the room encode_trailer leaves
_STATE_SLOT = CANARY_SLOTS - 1
STATE_WINDOW_BYTES = 4096
_MODULUS = 65521  # the weights' period (a prime below 2**16): word x weight < 2**32


class KVChecksumError(KVTransferError):
    """The blocks that landed do not have the sender's checksum."""


def seed_of(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


def sample_positions(request_id: str, num_blocks: int, num_layers: int) -> np.ndarray:
    """[num_layers, k] positions in the transfer's block list (k = min(SAMPLES_PER_LAYER,
    num_blocks)): the blocks the canary reads in each layer. See the module's docstring."""
    k = min(SAMPLES_PER_LAYER, num_blocks)
    if k == 0:
        return np.zeros((num_layers, 0), dtype=np.int64)
    base = (seed_of(request_id) + np.arange(num_layers, dtype=np.int64)) % num_blocks
    return (base[:, None] + np.arange(k, dtype=np.int64)[None, :] * (num_blocks // k)) % num_blocks


class CanaryPlan(NamedTuple):
    """Where the canary reads in each cache of a transfer: per cache, [3, layers x k] int64
    rows (layer, block id on this side, trailer slot), layer-major; ``k``: samples a layer."""

    rows: list[np.ndarray]
    k: int


def plan_canary(request_id: str, block_ids: np.ndarray, layer_counts: Sequence[int]) -> CanaryPlan:
    """The canary's (layer, block id, slot) of each cache (``layer_counts``: each cache's
    layers, the target's first), for a transfer of ``block_ids`` (this side's ids, in the
    transfer's order)."""
    rows, first = [], 0
    k = min(SAMPLES_PER_LAYER, len(block_ids))
    for num_layers in layer_counts:
        pos = sample_positions(request_id, len(block_ids), num_layers)
        layers = np.repeat(np.arange(num_layers, dtype=np.int64), k)
        slots = (first + layers) % _STATE_SLOT
        rows.append(np.stack([layers, np.asarray(block_ids, dtype=np.int64)[pos.reshape(-1)], slots]))
        first += num_layers
    return CanaryPlan(rows, k)


def _weights(n: int, device: torch.device) -> torch.Tensor:
    # made on the current stream at each use: a cached one made on another pair's stream could
    # be read on this one before it is written
    return torch.arange(n, dtype=torch.int64, device=device) % _MODULUS + 1


def _words(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as int16 words, [rows, words] (bytes when a row is odd)."""
    raw = x.reshape(x.shape[0], -1).view(torch.uint8)
    return raw.view(torch.int16) if raw.shape[1] % 2 == 0 else raw


def weighted_sums(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row of ``x`` (contiguous, [rows, ...]) as 16-bit words, weighted by
    position and summed. Exact: rows of up to 2**31 words cannot overflow."""
    words = _words(x).to(torch.int64)
    return (words * _weights(words.shape[1], words.device)).sum(dim=1)


def add_cache_sums(acc: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, k: int, l0: int, l1: int) -> None:
    """acc[slot] += the checksum of the sampled blocks of ``kv``'s layers l0..l1-1 (``rows``:
    this cache's plan on kv's device). Queued on the current stream; no host sync."""
    if k == 0 or l1 <= l0:
        return
    part = rows[:, l0 * k:l1 * k]
    if kv.element_size() == 1:  # FP8: bytes (not every device's index kernel has float8)
        kv = kv.view(torch.uint8)
    sampled = kv[part[0], part[1]]  # [layers x k, 2, block_size, heads, head_dim]: a copy
    acc.index_add_(0, part[2], weighted_sums(sampled))


def state_windows(views: Sequence[torch.Tensor], request_id: str) -> torch.Tensor:
    """The sampled windows of a linear-attention state (its flat byte views, in wire order),
    concatenated: one window of each tensor, the window's index rotating with the tensor."""
    seed = seed_of(request_id)
    parts = []
    for i, v in enumerate(views):
        w = min(STATE_WINDOW_BYTES, v.numel())
        start = ((seed + i) % max(1, v.numel() // w)) * w if w else 0
        parts.append(v[start:start + w])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def add_state_sum(acc: torch.Tensor, views: Sequence[torch.Tensor], request_id: str) -> None:
    """acc[last slot] += the checksum of the state's sampled windows."""
    windows = state_windows(views, request_id)
    if windows.numel():
        acc[_STATE_SLOT:] += weighted_sums(windows.view(1, -1))


def new_sums(device: torch.device) -> torch.Tensor:
    return torch.zeros(CANARY_SLOTS, dtype=torch.int64, device=device)


def seal(trailer: torch.Tensor, acc: torch.Tensor) -> None:
    """Write the sums into the trailer's last CANARY_BYTES (on the current stream; from a GPU
    into a host trailer, a copy that waits for the stream)."""
    trailer[-CANARY_BYTES:].copy_(acc.view(torch.uint8), non_blocking=trailer.device == acc.device)


def carried_sums(trailer: np.ndarray) -> np.ndarray:
    """The sender's sums from a received trailer (host bytes)."""
    return np.frombuffer(trailer[-CANARY_BYTES:].tobytes(), dtype=np.int64)


def check(request_id: str, sent: np.ndarray, landed: np.ndarray, num_blocks: int, layer_counts: Sequence[int]
          ) -> None:
    """Raise KVChecksumError unless the landed blocks' sums are the sender's, naming the slots
    (layers, or the state) that differ."""
    bad = np.flatnonzero(sent != landed)
    if not bad.size:
        return
    total = sum(layer_counts)
    where = [("the linear-attention state" if s == _STATE_SLOT else
              "layers " + ",".join(str(layer) for layer in range(s, total, _STATE_SLOT))) for s in bad[:4].tolist()]
    err = KVChecksumError(f"request {request_id}: KV checksum mismatch in {'; '.join(where)} (the canary's sampled "
                          f"blocks of {num_blocks}): the blocks that landed are not the ones sent")
    err.request_id = request_id
    raise err


class _CorruptionHook:
    """Tests only: corrupts a sampled block of every ``every``-th transfer this process receives."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._count = itertools.count(1)
        self._lock = threading.Lock()

    def due(self) -> bool:
        if not self.every:
            return False
        with self._lock:
            return next(self._count) % self.every == 0

    @staticmethod
    def corrupt(kv: torch.Tensor, rows: np.ndarray, state_views: Sequence[torch.Tensor] | None,
                request_id: str) -> None:
        """Flip the first byte of the first sampled block of ``kv`` (on the current stream), or,
        without blocks, of the state's first sampled window."""
        if rows.shape[1]:
            layer, block = int(rows[0, 0]), int(rows[1, 0])
            kv[layer, block, 0, 0, 0].view(torch.uint8)[:1].bitwise_xor_(0xFF)
        elif state_views:
            v = state_views[0]
            w = min(STATE_WINDOW_BYTES, v.numel())
            start = (seed_of(request_id) % max(1, v.numel() // w)) * w if w else 0
            v[start:start + 1].bitwise_xor_(0xFF)


TEST_CORRUPTION = _CorruptionHook(kv_corruption_test_hook())
