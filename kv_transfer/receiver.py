"""Decode end of a KV pair."""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from kv_transfer.protocol import (DEFAULT_PAIR_NAME, DEFAULT_TIMEOUT_S, KVChannelClosed, KVLayout,
                                  KVTransferError, RECEIVER_RANK, ReceivedKV, SENDER_RANK, TransferStats,
                                  TRAILER_BYTES, WirePlan, _HEADER_QUEUE, _IDLE_WAIT, _OK, _WILDCARD_HOSTS,
                                  decode_runs, decode_trailer, expand_runs, has_repeats, plane_block_bytes,
                                  plane_chunks, state_views)
from kv_transfer import canary
from kv_transfer.pair import _Pair, _hello, _log_pair_up, _remaining, _scatter_blocks, _settle

logger = logging.getLogger(__name__)


class KVReceiver(_Pair):
    """Decode end of one pair. ``recv`` is meant for one thread (the pair's receive loop)."""

    _peer_rank = SENDER_RANK

    def __init__(self, layout: KVLayout, asks: str, timeout: float, device: str | torch.device) -> None:
        super().__init__(layout, asks, timeout, device)
        self.host = ""
        self.port = 0
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._setup_thread: threading.Thread | None = None
        self._recv_lock = threading.Lock()
        self._peer_closed = False
        self._landed: list[torch.cuda.Event | None] = [None, None]  # staged gloo: slot's H2D copy done

    @classmethod
    def listen(cls, host: str, layout: KVLayout, *, port: int = 0, backend: str = "auto",
               device: str | torch.device = "cpu", timeout: float = DEFAULT_TIMEOUT_S,
               pair_name: str = DEFAULT_PAIR_NAME) -> tuple[KVReceiver, int]:
        """Open a TCPStore at host:port (0 = a free port) and return at once with the port to
        hand to the prefill side. The handshake (which settles the backend when ``backend`` is
        "auto") and group setup run in a background thread, bounded by ``timeout``;
        ``wait_connected()`` / ``recv()`` raise its error, if any."""
        self = cls(layout, backend, timeout, device)
        try:
            store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout),
                                  wait_for_workers=False)
        except Exception as e:
            raise KVTransferError(f"cannot open KV store at {host}:{port}: {e}") from e
        self.host, self.port = host, store.port
        self._store = dist.PrefixStore(pair_name, store)
        self._store.set("hello/1", json.dumps(_hello(layout, backend, self.device)))
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
            mine = _hello(self.layout, self.asks, self.device)
            self.backend, self.reason = _settle(theirs, mine)
            bind = self.host if self.host not in _WILDCARD_HOSTS else theirs.get("dialed_host")
            self._build_group(RECEIVER_RANK, deadline, where, bind)
            if self._closed:
                raise KVChannelClosed("KV pair closed during setup")
            _log_pair_up(f"receiving at {self.host}:{self.port}", self.backend, self.reason, theirs, mine)
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

    def recv(self, kv_cache: torch.Tensor, validate: Callable[..., None] | None = None,
             timeout: float | None = None, draft_cache: torch.Tensor | None = None,
             linear_states: Sequence[Any] | None = None) -> ReceivedKV:
        """Receive the next transfer into ``kv_cache``: (request_id, dst_block_ids, stats, meta).

        Waits up to ``timeout`` s (None: until a transfer comes or the pair closes) for the
        header, then calls ``validate(request_id, dst_block_ids)``. If it raises (or a dst id
        is out of range / repeated), the data is drained into scratch memory, ``kv_cache`` is
        not modified and the exception is re-raised; the pair stays usable. Returns once the
        data is in ``kv_cache`` (later work on any stream sees it).

        ``draft_cache``: the draft model's cache, given exactly when the pair's layout has a
        draft; each transfer's same blocks of it land there (``ReceivedKV.stats`` counts both).

        ``linear_states``: a hybrid model's linear-attention state tensors (the engine's
        ``linear_states``), given exactly when the pair's layout has a state: each transfer's
        state lands in the slot its header names, which ``validate`` is given as a third
        argument, ``validate(request_id, dst_block_ids, state_slot)``."""
        self.layout.check_caches(kv_cache, draft_cache)
        self.layout.check_state(linear_states)
        with self._recv_lock:
            self.wait_connected()
            if self.backend == "nccl" and kv_cache.device != self.device:
                raise ValueError(f"backend nccl needs the kv_cache on {self.device}, got {kv_cache.device}")
            header = self._next_header(timeout)
            start = time.perf_counter()
            marks = [("header received", start)]
            try:
                request_id = header["request_id"]
                runs = decode_runs(header["runs"])
                dst_ids = expand_runs(runs, 1)
                plan = WirePlan(pack=bool(header["pack"]), chunk_layers=int(header["chunk_layers"]))
                planes = [(kv_cache, plan)]
                if ("draft" in header) != (draft_cache is not None):
                    raise ValueError("the header and the pair disagree on a draft model's cache")
                if draft_cache is not None:
                    draft = header["draft"]
                    planes.append((draft_cache, WirePlan(pack=bool(draft["pack"]),
                                                         chunk_layers=int(draft["chunk_layers"]))))
                chunks = plane_chunks(planes)  # validates
                state = None  # (the slot it lands in, its bytes)
                if ("state" in header) != (linear_states is not None):
                    raise ValueError("the header and the pair disagree on a linear-attention state")
                if linear_states is not None:
                    slot = int(header["state"]["slot"])
                    nbytes = sum(v.numel() for v in state_views(linear_states, 0))
                    if int(header["state"]["bytes"]) != nbytes:
                        raise ValueError(f"a state of {header['state']['bytes']} bytes, the layout's is {nbytes}")
                    state = (slot, nbytes)
            except Exception as e:  # cannot know which messages follow: out of sync for good
                self._fail("reading a KV header", e)
                raise KVTransferError(f"malformed KV header {header!r}: {e}") from e
            dst = dst_ids.tolist()

            def check() -> None:
                in_range = dst_ids.size == 0 or (dst_ids.min() >= 0 and dst_ids.max() < kv_cache.shape[1])
                if not in_range or has_repeats(dst_ids):
                    err = KVTransferError(f"request {request_id}: dst block ids out of range "
                                          f"[0, {kv_cache.shape[1]}) or repeated: {dst}")
                    err.request_id = request_id
                    raise err
                if state is not None and not 0 <= state[0] < linear_states[0].conv.shape[0]:
                    err = KVTransferError(f"request {request_id}: linear-attention state slot {state[0]} out of "
                                          f"range [0, {linear_states[0].conv.shape[0]})")
                    err.request_id = request_id
                    raise err
                if validate is not None:
                    validate(request_id, list(dst), *((state[0],) if state is not None else ()))
                marks.append(("validated", time.perf_counter()))

            try:
                status, meta, num_messages = self._recv_chunks(
                    request_id, runs, dst_ids, planes, chunks, check, marks,
                    (linear_states, state[0], state[1]) if state is not None else None)
            except KVTransferError as e:
                e.request_id = request_id
                raise
            if status != _OK:
                err = KVTransferError(f"request {request_id}: the prefill side aborted the transfer; "
                                      f"blocks {dst} hold partial data")
                err.request_id = request_id
                raise err
        return ReceivedKV(request_id, list(dst), TransferStats(
            num_blocks=len(dst), num_bytes=len(dst) * plane_block_bytes(planes) + (state[1] if state else 0),
            seconds=time.perf_counter() - start, backend=self.backend,
            num_messages=num_messages, marks=(*marks, ("landed", time.perf_counter()))), meta)

    def _next_header(self, timeout: float | None) -> dict[str, Any]:
        """One blocking pop from the store's header queue. An idle pair waits here, not in the
        process group: an idle posted gloo receive times out, an idle NCCL one cannot be
        cancelled short of aborting the communicator."""
        store = self._store
        if store is None or self._closed:
            raise KVChannelClosed("KV pair is closed")
        if self._peer_closed:
            raise KVChannelClosed("the prefill side closed the KV pair")
        self._check_usable()
        store.set_timeout(_IDLE_WAIT if timeout is None else timedelta(seconds=timeout))
        while True:
            try:
                header = json.loads(store.queue_pop(_HEADER_QUEUE, True))
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

    def _recv_chunks(self, request_id: str, runs: np.ndarray, dst_ids: np.ndarray,
                     planes: list[tuple[torch.Tensor, WirePlan]], chunks: list[tuple[int, int, int]],
                     check: Callable[[], None], marks: list[tuple[str, float]],
                     state: tuple[Sequence[Any], int, int] | None = None) -> tuple[int, dict[str, Any], int]:
        """Post chunk k's receives, then land chunk k - 1, so one chunk is in flight while the
        previous one lands. ``check`` (the destination blocks may be written) runs before
        anything can reach kv_cache: before the first post, or for a packed plan, whose
        messages land in staging first, right after it. If it raises, the rest is drained into
        scratch, kv_cache is not touched, and its exception is raised once the trailer is in.
        Returns (trailer status, the sender's meta, data messages). ``chunks``: (plane, first
        layer, end layer) in wire order, a plane being one of ``planes`` (cache, its plan).
        ``state``: (the linear-attention state tensors, the slot, its bytes): one message before
        the trailer, staged, then copied into the slot once everything has come (not when
        drained)."""
        deadline = time.monotonic() + self.timeout
        what = f"request {request_id}: receiving KV"
        kv_cache, plan = planes[0]
        rejected: Exception | None = None

        def run_check() -> bool:
            nonlocal rejected, what, deadline
            try:
                check()
                return False
            except Exception as e:
                rejected, what = e, what + " (draining a rejected transfer)"
                return True
            finally:  # the check may wait (for the engine): the data's deadline starts after it
                deadline = time.monotonic() + self.timeout

        drain = False if plan.pack else run_check()
        with self._on_stream(after_caller=True):
            marks.append(("after caller's work", time.perf_counter()))
            dst_index = None  # placed after chunk 0 is posted: the first landing needs it
            # kept for the pair's life: transfers on a pair never overlap, and this one is read
            # after everything it posted has completed
            trailer = self._buffer("trailer", 0, TRAILER_BYTES, torch.uint8, self.wire_device)
            works: list[list[Any]] = []
            staged: list[list[torch.Tensor]] = []  # per chunk: its messages' staging views ([] if in place)
            num_messages = 0
            for k in range(len(chunks) + 1):
                if k < len(chunks):
                    cache, chunk_plan = planes[chunks[k][0]]
                    targets, in_staging = self._targets(k, chunks[k][1:], runs, cache, chunk_plan, drain)
                    marks.append((f"chunk {k} targets", time.perf_counter()))
                    num_messages += len(targets)
                    staged.append(list(targets) if in_staging and not drain else [])
                    if k == len(chunks) - 1:
                        if state is not None:
                            state_buf = self._buffer("state", 0, state[2], torch.uint8, self.wire_device)
                            targets.append(state_buf)
                            num_messages += 1
                        targets.append(trailer)
                    works.append(self._post(targets, send=False, what=f"{what} layers {chunks[k][1]}.."))
                    marks.append((f"chunk {k} posted", time.perf_counter()))
                if k == 0 and plan.pack:
                    drain = run_check()
                    if drain:
                        staged[0] = []
                if dst_index is None and not drain and any(p.pack for _, p in planes):
                    dst_index = self._index_on_device(dst_ids, kv_cache.device)
                if k >= 1:
                    plane, l0, l1 = chunks[k - 1]
                    self._land(k - 1, (l0, l1), works[k - 1], staged[k - 1], runs, planes[plane][0],
                               dst_index if planes[plane][1].pack else None, deadline, what)
            if state is not None and not drain:  # every work is over (landed above): the state is in
                self._land_state(state_buf, state[0], state[1])
            # the canary's sums of what landed, queued on this stream: read with the trailer below
            landed = None if drain else self._canary_sums(request_id, dst_ids, planes, state)
            if self.backend == "nccl":
                done = torch.cuda.Event()
                done.record()
                self._wait([w for ws in works for w in ws], deadline, what, done=done)
            elif kv_cache.is_cuda:
                torch.cuda.current_stream().synchronize()
            host = trailer.cpu()
            try:
                status, meta = decode_trailer(host)
            except ValueError as e:
                self._fail("reading a KV trailer", e)
                raise KVTransferError(f"{what}: malformed trailer: {e}") from e
        if rejected is not None:
            raise rejected
        if status == _OK and landed is not None:
            canary.check(request_id, canary.carried_sums(host.numpy()), landed.cpu().numpy(), len(dst_ids),
                         [kv.shape[0] for kv, _ in planes])
        return status, meta, num_messages

    def _canary_sums(self, request_id: str, dst_ids: np.ndarray, planes: list[tuple[torch.Tensor, WirePlan]],
                     state: tuple[Sequence[Any], int, int] | None) -> torch.Tensor:
        """The canary's sums of the landed transfer's sampled blocks (and state windows), as the
        sender computed them of what it sent (canary.py), queued on this pair's stream. The test
        hook (PDSERVE_TEST_CORRUPT_KV_EVERY) corrupts a sampled block first."""
        kv_cache = planes[0][0]
        plan = canary.plan_canary(request_id, dst_ids, [kv.shape[0] for kv, _ in planes])
        views = state_views(state[0], state[1]) if state is not None else None
        if canary.TEST_CORRUPTION.due():
            canary.TEST_CORRUPTION.corrupt(kv_cache, plan.rows[0], views, request_id)
        placed = np.concatenate(plan.rows, axis=1)
        rows = self._index_on_device(placed.reshape(-1), kv_cache.device, kind="canary").view(3, placed.shape[1])
        sums = canary.new_sums(kv_cache.device)
        for (kv, _), plane_rows in zip(planes, rows.split([r.shape[1] for r in plan.rows], dim=1)):
            canary.add_cache_sums(sums, kv, plane_rows, plan.k, 0, kv.shape[0])
        if views is not None:
            canary.add_state_sum(sums, views, request_id)
        return sums

    def _targets(self, k: int, chunk: tuple[int, int], runs: np.ndarray, kv_cache: torch.Tensor,
                 plan: WirePlan, drain: bool) -> tuple[list[torch.Tensor], bool]:
        """Where chunk k's messages land, and whether that is staging slot k % 2 (else straight
        into kv_cache). A slot is free again once chunk k - 2 has landed from it: for NCCL by
        stream order (this receive waits for this stream, which holds that scatter); for gloo
        into a GPU cache, once the slot's copy to the device is done."""
        l0, l1 = chunk
        block_shape, block_numel = kv_cache.shape[2:], kv_cache[0, 0].numel()
        lengths = runs[:, 2].tolist()
        # a head slice of the cache is no message's memory: its runs are staged, then copied in
        in_place = self.wire_device == kv_cache.device and kv_cache.is_contiguous()
        if not plan.pack and not drain and in_place:
            return [kv_cache[layer, d:d + n] for layer in range(l0, l1) for _, d, n in runs.tolist()], False
        if not in_place and self._landed[k % 2] is not None:
            self._landed[k % 2].synchronize()
        if drain and not plan.pack:  # every message into the same scratch: the bytes are thrown away
            scratch = self._buffer("wire", k % 2, max(lengths, default=0) * block_numel, kv_cache.dtype,
                                   self.wire_device)
            return [scratch[:n * block_numel].view(n, *block_shape) for _ in range(l0, l1) for n in lengths], True
        slot = self._buffer("wire", k % 2, (l1 - l0) * sum(lengths) * block_numel, kv_cache.dtype,
                            self.wire_device)
        if plan.pack:
            return [slot.view(l1 - l0, sum(lengths), *block_shape)], True
        views, offset = [], 0  # runs staged through host memory, one view per (layer, run)
        for _ in range(l0, l1):
            for n in lengths:
                views.append(slot[offset:offset + n * block_numel].view(n, *block_shape))
                offset += n * block_numel
        return views, True

    def _land(self, k: int, chunk: tuple[int, int], works: list[Any], staged: list[torch.Tensor],
              runs: np.ndarray, kv_cache: torch.Tensor, dst_index: torch.Tensor | None,
              deadline: float, what: str) -> None:
        """Chunk k was posted: order this stream after it, then move what it staged into
        kv_cache (scatter the packed [layers, blocks, 2, block_size, heads, head_dim] message by
        ``dst_index``, or copy each staged run into place)."""
        l0, l1 = chunk
        if self.backend == "nccl":
            for work in works:
                work.block_current_stream()  # stream-side: the host does not wait here
        else:
            self._wait(works, deadline, what)
        if not staged:
            return
        if dst_index is not None:
            data = staged[0]
            if data.device != kv_cache.device:  # gloo into a GPU cache: through the device
                on_gpu = self._buffer("scatter", k % 2, data.numel(), kv_cache.dtype, kv_cache.device)
                data = on_gpu.view(data.shape).copy_(data, non_blocking=True)
            _scatter_blocks(kv_cache[l0:l1], dst_index, data)
        else:
            views = iter(staged)
            for layer in range(l0, l1):
                for _, d, n in runs.tolist():
                    kv_cache[layer, d:d + n].copy_(next(views), non_blocking=True)
        if staged[0].device != kv_cache.device:
            self._landed[k % 2] = torch.cuda.Event()
            self._landed[k % 2].record()

    def _land_state(self, data: torch.Tensor, states: Sequence[Any], slot: int) -> None:
        """Copy a received state (bytes, in ``state_views`` order) into slot ``slot`` of every
        linear layer, through the states' device when it came through host memory."""
        views = state_views(states, slot)
        if data.device != views[0].device:
            data = self._buffer("state-scatter", 0, data.numel(), torch.uint8, views[0].device).copy_(
                data, non_blocking=True)
        offset = 0
        for v in views:
            v.copy_(data[offset:offset + v.numel()], non_blocking=True)
            offset += v.numel()

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
            self._teardown()
            self._store = None
        finally:
            if locked:
                self._recv_lock.release()
