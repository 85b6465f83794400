"""Decode end of a KV pair."""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.kv_transfer.protocol import (DEFAULT_PAIR_NAME, DEFAULT_TIMEOUT_S, KVChannelClosed, KVLayout,
                                         KVTransferError, RECEIVER_RANK, ReceivedKV, SENDER_RANK,
                                         TransferStats, _HEADER_QUEUE, _IDLE_WAIT, _OK, _TAG,
                                         _WILDCARD_HOSTS, merge_runs)
from engine.kv_transfer.pair import _Pair, _check_hello, _hello, _make_group, _remaining, _shutdown

logger = logging.getLogger(__name__)


class KVReceiver(_Pair):
    """Decode end of one pair. ``recv`` is meant for one thread (the pair's receive loop)."""

    def __init__(self, layout: KVLayout, backend: str, timeout: float, device: str | torch.device) -> None:
        super().__init__(layout, backend, timeout, device)
        self.host = ""
        self.port = 0
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._setup_thread: threading.Thread | None = None
        self._recv_lock = threading.Lock()
        self._peer_closed = False

    @classmethod
    def listen(cls, host: str, layout: KVLayout, *, port: int = 0, backend: str = "gloo",
               device: str | torch.device = "cpu", timeout: float = DEFAULT_TIMEOUT_S,
               pair_name: str = DEFAULT_PAIR_NAME) -> tuple[KVReceiver, int]:
        """Open a TCPStore at host:port (0 = a free port) and return at once with the port to
        hand to the prefill side. The handshake and group setup run in a background thread,
        bounded by ``timeout``; ``wait_connected()`` / ``recv()`` raise its error, if any."""
        self = cls(layout, backend, timeout, device)
        try:
            store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout),
                                  wait_for_workers=False)
        except Exception as e:
            raise KVTransferError(f"cannot open KV store at {host}:{port}: {e}") from e
        self.host, self.port = host, store.port
        self._store = dist.PrefixStore(pair_name, store)
        self._store.set("hello/1", _hello(layout, backend))
        self._setup_thread = threading.Thread(target=self._setup, name=f"kv-listen-{self.port}",
                                              daemon=True)
        self._setup_thread.start()
        return self, self.port

    def _setup(self) -> None:
        deadline = time.monotonic() + self.timeout
        where = f"KV pair setup at {self.host}:{self.port}"
        try:
            assert self._store is not None
            try:
                self._store.wait(["hello/0"], _remaining(deadline, where))
            except KVTransferError:
                raise
            except Exception as e:
                raise KVTransferError(f"{where}: no prefill server connected within "
                                      f"{self.timeout}s") from e
            theirs = json.loads(self._store.get("hello/0"))
            _check_hello(theirs, json.loads(_hello(self.layout, self.backend)))
            bind = self.host if self.host not in _WILDCARD_HOSTS else theirs.get("dialed_host")
            try:
                self._group = _make_group(self._store, RECEIVER_RANK, self.backend,
                                          _remaining(deadline, where), bind)
                ping = torch.zeros(1, device=self.wire_device)
                self._wait([self._group.recv([ping], SENDER_RANK, _TAG)], deadline, where)
            except KVTransferError:
                raise
            except Exception as e:
                raise KVTransferError(f"{where}: {e}") from e
            if self._closed:
                raise KVChannelClosed("KV pair closed during setup")
            logger.info("KV pair up: receiving at %s:%d over %s", self.host, self.port, self.backend)
        except BaseException as e:
            self._setup_error = e
            if not isinstance(e, KVChannelClosed):
                logger.warning("%s", e)
        finally:
            self._ready.set()

    @property
    def is_connected(self) -> bool:
        return self._ready.is_set() and self._setup_error is None

    def wait_connected(self, timeout: float | None = None) -> None:
        """Block until setup is done (at most the listen timeout); raise its error if it failed."""
        if not self._ready.wait(self.timeout + 5.0 if timeout is None else timeout):
            raise KVTransferError(f"KV pair at {self.host}:{self.port} not connected yet")
        if self._setup_error is not None:
            raise self._setup_error

    def recv(self, kv_cache: torch.Tensor, validate: Callable[[str, list[int]], None] | None = None,
             timeout: float | None = None) -> ReceivedKV:
        """Receive the next transfer into ``kv_cache``: (request_id, dst_block_ids, stats).

        Waits up to ``timeout`` s (None: until a transfer comes or the pair closes) for the
        header, then calls ``validate(request_id, dst_block_ids)``. If it raises (or a dst id
        is out of range / repeated), the data is drained into scratch memory, ``kv_cache`` is
        not modified and the exception is re-raised; the pair stays usable."""
        self.layout.check_cache(kv_cache)
        if self.backend == "nccl" and kv_cache.device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA kv_cache")
        with self._recv_lock:
            self.wait_connected()
            header = self._next_header(timeout)
            start = time.perf_counter()
            request_id, src, dst = header["request_id"], header["src"], header["dst"]
            runs = merge_runs(src, dst)
            try:
                bad = [b for b in dst if not 0 <= b < kv_cache.shape[1]]
                if bad or len(set(dst)) != len(dst):
                    raise KVTransferError(f"request {request_id}: dst block ids out of range "
                                          f"[0, {kv_cache.shape[1]}) or repeated: {dst}")
                if validate is not None:
                    validate(request_id, list(dst))
            except Exception:
                self._recv_layers(request_id, runs, kv_cache, drain=True)
                raise
            try:
                status = self._recv_layers(request_id, runs, kv_cache, drain=False)
            except KVTransferError as e:
                e.request_id = request_id
                raise
            if status != _OK:
                err = KVTransferError(f"request {request_id}: the prefill side aborted the transfer; "
                                      f"blocks {dst} hold partial data")
                err.request_id = request_id
                raise err
        block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        return ReceivedKV(request_id, list(dst), TransferStats(
            num_blocks=len(dst), num_bytes=len(dst) * block_bytes * self.layout.num_layers,
            seconds=time.perf_counter() - start, backend=self.backend,
            num_messages=len(runs) * self.layout.num_layers), header.get("meta") or {})

    def _next_header(self, timeout: float | None) -> dict[str, Any]:
        store = self._store
        if store is None or self._closed:
            raise KVChannelClosed("KV pair is closed")
        if self._peer_closed:
            raise KVChannelClosed("the prefill side closed the KV pair")
        self._check_usable()
        while True:
            try:
                store.wait([_HEADER_QUEUE], _IDLE_WAIT if timeout is None else timedelta(seconds=timeout))
                header = json.loads(store.queue_pop(_HEADER_QUEUE, False))
                break
            except Exception as e:
                if self._closed:
                    raise KVChannelClosed("KV pair is closed") from e
                if timeout is not None:
                    raise KVTransferError(f"no KV transfer arrived within {timeout}s: {e}") from e
        if self._closed or header.get("closed"):
            self._peer_closed = self._peer_closed or not self._closed
            raise KVChannelClosed("KV pair is closed" if self._closed
                                  else "the prefill side closed the KV pair")
        return header

    def _recv_layers(self, request_id: str, runs: list[tuple[int, int, int]],
                     kv_cache: torch.Tensor, drain: bool) -> int:
        """Layer by layer, two in flight, straight into kv_cache[l, d:d+n] unless staged or
        drained; then the trailer, whose value (_OK or _ABORTED) is returned."""
        group = self._check_usable()
        deadline = time.monotonic() + self.timeout
        what = f"request {request_id}: receiving KV" + (" (draining a rejected transfer)" if drain else "")
        staged = self._is_staged(kv_cache) and not drain
        lengths = [n for _, _, n in runs]
        scratch, offsets = None, [sum(lengths[:i]) for i in range(len(lengths))] if drain else []
        if drain:  # [2 slots, blocks in the transfer, 2, block_size, heads, head_dim]
            scratch = torch.empty((2, sum(lengths), *kv_cache.shape[2:]), dtype=kv_cache.dtype,
                                  device=self.wire_device)
        events: list[Any] = [None, None]
        prev: tuple[int, list[dist.Work], list[torch.Tensor]] | None = None
        for layer in range(self.layout.num_layers + 1):
            current = None
            if layer < self.layout.num_layers:
                if scratch is not None:
                    views = [scratch[layer % 2, o:o + n] for o, n in zip(offsets, lengths)]
                elif staged:
                    if events[layer % 2] is not None:  # H2D copy of layer - 2 out of this slot
                        events[layer % 2].synchronize()
                    views = self._staging_views(layer % 2, kv_cache, lengths)
                else:
                    views = [kv_cache[layer, d:d + n] for _, d, n in runs]
                try:
                    current = (layer, [group.recv([v], SENDER_RANK, _TAG) for v in views], views)
                except Exception as e:
                    self._broken = f"{what}: {e}"
                    raise KVTransferError(f"{what} failed: {e}") from e
            if prev is not None:
                done_layer, works, views = prev
                self._wait(works, deadline, f"{what} layer {done_layer}")
                if staged:
                    for view, (_, d, n) in zip(views, runs):
                        kv_cache[done_layer, d:d + n].copy_(view, non_blocking=True)
                    events[done_layer % 2] = torch.cuda.Event()
                    events[done_layer % 2].record(torch.cuda.current_stream(kv_cache.device))
            prev = current
        trailer = torch.empty(1, dtype=torch.int64, device=self.wire_device)
        try:
            work = group.recv([trailer], SENDER_RANK, _TAG)
        except Exception as e:
            self._broken = f"{what}: {e}"
            raise KVTransferError(f"{what} failed: {e}") from e
        self._wait([work], deadline, what)
        if staged:
            torch.cuda.current_stream(kv_cache.device).synchronize()
        return int(trailer.item())

    def close(self) -> None:
        """Stop receiving: a blocked ``recv`` raises KVChannelClosed; the port is released."""
        if self._closed:
            return
        self._closed = True
        if self._store is not None:
            try:  # wake a recv blocked on the header queue, or the setup thread on hello/0
                waker = self._store.clone()
                waker.queue_push(_HEADER_QUEUE, json.dumps({"closed": True}))
                if not self._ready.is_set():
                    waker.set("hello/0", json.dumps({"closed": True}))
            except Exception as e:
                logger.debug("KV receiver close: %s", e)
        if self._setup_thread is not None:
            self._setup_thread.join(self.timeout)
        locked = self._recv_lock.acquire(timeout=self.timeout)
        try:
            _shutdown(self._group)
            self._group = self._store = None
        finally:
            if locked:
                self._recv_lock.release()
