"""Prefill end of a KV pair."""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from engine.kv_transfer.protocol import (DEFAULT_PAIR_NAME, DEFAULT_TIMEOUT_S, KVLayout, KVTransferError,
                                         RECEIVER_RANK, SENDER_RANK, TransferStats, _ABORTED, _HEADER_QUEUE,
                                         _OK, _TAG, merge_runs)
from engine.kv_transfer.pair import (_Pair, _check_hello, _hello, _local_addr_toward, _make_group,
                                     _remaining, _shutdown, _wait_for_listener)

logger = logging.getLogger(__name__)


class KVSender(_Pair):
    """Prefill end of one pair. Thread-safe: transfers are serialized by a lock."""

    def __init__(self, layout: KVLayout, backend: str, timeout: float, device: str | torch.device) -> None:
        super().__init__(layout, backend, timeout, device)
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, host: str, port: int, layout: KVLayout, *, backend: str = "gloo",
                device: str | torch.device = "cpu", timeout: float = DEFAULT_TIMEOUT_S,
                pair_name: str = DEFAULT_PAIR_NAME) -> KVSender:
        """Join the pair a KVReceiver listens for at host:port. Raises KVTransferError within
        ``timeout`` if nobody listens, the layouts differ, or the group cannot be built."""
        deadline = time.monotonic() + timeout
        self = cls(layout, backend, timeout, device)
        where = f"KV pair setup with decode at {host}:{port}"
        _wait_for_listener(host, port, deadline)
        try:
            store = dist.TCPStore(host, port, None, False, _remaining(deadline, where),
                                  wait_for_workers=False)
            self._store = dist.PrefixStore(pair_name, store)
            self._store.set("hello/0", _hello(layout, backend, dialed_host=host))
            self._store.wait(["hello/1"], _remaining(deadline, where))
            theirs = json.loads(self._store.get("hello/1"))
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"{where}: {e}") from e
        _check_hello(json.loads(_hello(layout, backend)), theirs)
        try:
            self._group = _make_group(self._store, SENDER_RANK, backend, _remaining(deadline, where),
                                      _local_addr_toward(host, port))
            ping = torch.ones(1, device=self.wire_device)
            self._wait([self._group.send([ping], RECEIVER_RANK, _TAG)], deadline, where)
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"{where}: {e}") from e
        logger.info("KV pair up: sending to %s:%d over %s", host, port, backend)
        return self

    def begin(self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              kv_cache: torch.Tensor, meta: dict[str, Any] | None = None) -> KVSendTransfer:
        """Start one transfer: takes the pair's lock and sends the header. Then call
        ``send_layer(l)`` for l = 0..L-1 in order (e.g. as prefill finishes each layer)
        and ``finish()``; use it as a context manager."""
        self.layout.check_cache(kv_cache)
        src, dst = [int(b) for b in src_block_ids], [int(b) for b in dst_block_ids]
        runs = merge_runs(src, dst)
        if any(not 0 <= b < kv_cache.shape[1] for b in src):
            raise ValueError(f"src block ids out of range [0, {kv_cache.shape[1]}): {src}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"duplicate dst block ids: {dst}")
        if self.backend == "nccl" and kv_cache.device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA kv_cache")
        if not self._lock.acquire(timeout=self.timeout):
            raise KVTransferError(f"request {request_id}: KV pair busy for {self.timeout}s")
        try:
            self._check_usable()
            assert self._store is not None
            self._store.queue_push(_HEADER_QUEUE, json.dumps(
                {"request_id": request_id, "src": src, "dst": dst, "meta": meta or {}}))
        except Exception as e:
            self._lock.release()
            if isinstance(e, KVTransferError):
                raise
            self._broken = f"header: {e}"
            raise KVTransferError(f"request {request_id}: sending KV header failed: {e}") from e
        return KVSendTransfer(self, request_id, runs, kv_cache)

    def send(self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             kv_cache: torch.Tensor, meta: dict[str, Any] | None = None) -> TransferStats:
        """Send kv_cache[:, src_block_ids] into the receiver's dst_block_ids; returns when
        the data has left this process's memory (the blocks may then be freed)."""
        with self.begin(request_id, src_block_ids, dst_block_ids, kv_cache, meta) as transfer:
            for layer in range(self.layout.num_layers):
                transfer.send_layer(layer)
        return transfer.finish()

    def close(self) -> None:
        """Tell the receiver we are gone (its recv raises KVChannelClosed) and drop the group."""
        if self._closed:
            return
        locked = self._lock.acquire(timeout=self.timeout)
        try:
            if self._store is not None and not self._broken:
                try:
                    self._store.queue_push(_HEADER_QUEUE, json.dumps({"closed": True}))
                except Exception as e:  # receiver already gone
                    logger.debug("KV sender close: %s", e)
            self._closed = True
            _shutdown(self._group)
            self._group = self._store = None
        finally:
            if locked:
                self._lock.release()


class KVSendTransfer:
    """One request's transfer in flight. Holds the pair's lock until ``finish()``."""

    def __init__(self, sender: KVSender, request_id: str, runs: list[tuple[int, int, int]],
                 kv_cache: torch.Tensor) -> None:
        self.request_id = request_id
        self._sender = sender
        self._runs = runs
        self._kv_cache = kv_cache
        self._next_layer = 0
        self._inflight: list[dist.Work] = []
        self._start = time.perf_counter()
        self._deadline = time.monotonic() + sender.timeout
        self._stats: TransferStats | None = None
        self._done = False

    def send_layer(self, layer: int) -> None:
        """Post layer ``layer``'s runs, then wait for the previous layer's (two layers in flight)."""
        sender, kv = self._sender, self._kv_cache
        if self._done:
            raise KVTransferError(f"request {self.request_id}: send_layer after finish()")
        if layer != self._next_layer:
            raise ValueError(f"send_layer({layer}) out of order: expected layer {self._next_layer}")
        group = sender._check_usable()
        what = f"request {self.request_id}: sending KV layer {layer}"
        if sender._is_staged(kv):
            # Slot layer % 2 was last used by layer - 2, whose sends finished during layer - 1.
            views = sender._staging_views(layer % 2, kv, [n for _, _, n in self._runs])
            for view, (s, _, n) in zip(views, self._runs):
                view.copy_(kv[layer, s:s + n], non_blocking=True)
            torch.cuda.current_stream(kv.device).synchronize()
        else:
            views = [kv[layer, s:s + n] for s, _, n in self._runs]  # contiguous views, no copy
        try:
            works = [group.send([v], RECEIVER_RANK, _TAG) for v in views]
        except Exception as e:
            sender._broken = f"{what}: {e}"
            raise KVTransferError(f"{what} failed: {e}") from e
        sender._wait(self._inflight, self._deadline, what)
        self._inflight = works
        self._next_layer += 1

    def finish(self) -> TransferStats:
        """Send the trailer, wait for everything, release the pair, return the stats.

        Called before every layer was sent (the caller failed mid-prefill), it sends the
        remaining layers anyway so the receiver stays in sync, marks the trailer "aborted"
        (the receiver's recv raises) and raises KVTransferError. Idempotent once it succeeded.
        """
        if self._done:
            if self._stats is None:
                raise KVTransferError(f"request {self.request_id}: transfer already finished (failed)")
            return self._stats
        sender, num_layers = self._sender, self._sender.layout.num_layers
        aborted = self._next_layer < num_layers
        what = f"request {self.request_id}: sending KV"
        try:
            for layer in range(self._next_layer, num_layers):
                self.send_layer(layer)
            trailer = torch.tensor([_ABORTED if aborted else _OK], dtype=torch.int64,
                                   device=sender.wire_device)
            try:
                self._inflight.append(sender._check_usable().send([trailer], RECEIVER_RANK, _TAG))
            except KVTransferError:
                raise
            except Exception as e:
                sender._broken = f"{what}: {e}"
                raise KVTransferError(f"{what} failed: {e}") from e
            sender._wait(self._inflight, self._deadline, what)
        finally:
            self._inflight = []
            self._next_layer = num_layers
            self._done = True
            sender._lock.release()
        if aborted:
            raise KVTransferError(f"{what}: finished before every layer was sent; "
                                  "the receiver was told the transfer is aborted")
        num_blocks = sum(n for _, _, n in self._runs)
        block_bytes = self._kv_cache[0, 0].numel() * self._kv_cache.element_size()
        self._stats = TransferStats(
            num_blocks=num_blocks, num_bytes=num_blocks * block_bytes * num_layers,
            seconds=time.perf_counter() - self._start, backend=sender.backend,
            num_messages=len(self._runs) * num_layers)
        return self._stats

    def __enter__(self) -> KVSendTransfer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._done:
            return
        try:
            self.finish()
        except KVTransferError:
            if exc_type is None:
                raise
