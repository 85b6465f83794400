"""The KV pairs of a tensor-parallel worker on the sending side, driven by rank 0.

When a tensor-parallel engine hands a request's KV to another engine, every rank sends
its own share of the KV heads (``engine.parallel.kv_transfer_parts``) over a pair of its
own, from its own cache: nothing is gathered on one rank. Rank 0 opens the pairs and
starts the sends; a worker rank does its part through these handlers, called over
``engine.rank_calls``.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import torch

from engine.kv_transfer.protocol import KVLayout, KVTransferError
from engine.kv_transfer.sender import KVSender


class RankSenders:
    """This rank's pairs, by the key rank 0 gave them, each with the heads it sends."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self._pairs: dict[str, tuple[KVSender, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {"kv_connect": self.connect, "kv_send": self.send, "kv_close": self.close}

    def connect(self, key: str, host: str, port: int, layout: dict, heads: list[int], backend: str,
                timeout: float) -> str:
        """Join the pair a receiver listens for at host:port; the backend's reason."""
        self.close(key)
        sender = KVSender.connect(host, port, KVLayout.from_dict(layout), backend=backend,
                                  device=self.kv_cache.device, timeout=timeout)
        with self._lock:
            self._pairs[key] = (sender, (heads[0], heads[1]))
        return sender.reason

    def send(self, key: str, request_id: str, src: list[int], dst: list[int], meta: dict) -> dict:
        """Send this rank's heads of blocks ``src`` into the receiver's ``dst``; the stats."""
        with self._lock:
            pair = self._pairs.get(key)
        if pair is None:
            raise KVTransferError(f"no KV pair {key} on this rank")
        sender, (lo, hi) = pair
        if not sender.is_usable:
            raise KVTransferError(f"KV pair {key} is broken")
        stats = sender.send(request_id, src, dst, self.kv_cache[..., lo:hi, :], meta=meta)
        return {k: v for k, v in dataclasses.asdict(stats).items() if k not in ("marks", "parts")}

    def close(self, key: str) -> None:
        with self._lock:
            pair = self._pairs.pop(key, None)
        if pair is not None:
            pair[0].close()
