"""Chained hashes of full KV blocks, shared by the engine's prefix cache and
the gateway's prefix-aware router (both must compute the same values).

hash(block i) = H(hash(block i-1), token ids of block i), with block -1's
hash = ``NONE_HASH``. A block's hash therefore names its whole prefix. H is
SHA-256 truncated to 63 bits: stable across processes and Python versions
(unlike ``hash()`` of strings), and cheap (~1 µs per block).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Container, Sequence

NONE_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    payload = struct.pack(f"<q{len(token_ids)}I", parent_hash, *token_ids)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") >> 1


def hash_request_blocks(token_ids: Sequence[int], block_size: int, start: int = 0,
                        parent_hash: int = NONE_HASH) -> list[int]:
    """Hashes of the full blocks of ``token_ids``, from block index ``start``
    (whose parent hash is ``parent_hash``) to the last full block."""
    hashes: list[int] = []
    for i in range(start, len(token_ids) // block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent_hash)
    return hashes


def leading_run(hashes: Sequence[int], present: Container[int]) -> int:
    """How many leading ``hashes`` are in ``present`` (a prefix hit stops at the first miss)."""
    n = 0
    for h in hashes:
        if h not in present:
            break
        n += 1
    return n
