"""Prefill end of a KV pair."""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from kv_transfer.protocol import (DEFAULT_PAIR_NAME, DEFAULT_TIMEOUT_S, KVLayout, KVTransferError,
                                  RECEIVER_RANK, SENDER_RANK, StateMove, TransferStats, WirePlan, _ABORTED,
                                  _HEADER_QUEUE, _OK, encode_runs, encode_trailer, has_repeats, host_staged,
                                  plan_transfer, plane_block_bytes, plane_chunks, run_array, state_views)
from kv_transfer import canary
from kv_transfer.pair import (_Pair, _gather_blocks, _hello, _local_addr_toward, _log_pair_up, _remaining,
                              _settle, _wait_for_listener)

logger = logging.getLogger(__name__)


class KVSender(_Pair):
    """Prefill end of one pair. Thread-safe: transfers are serialized by a lock."""

    _peer_rank = RECEIVER_RANK

    def __init__(self, layout: KVLayout, asks: str, timeout: float, device: str | torch.device) -> None:
        super().__init__(layout, asks, timeout, device)
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, host: str, port: int, layout: KVLayout, *, backend: str = "auto",
                device: str | torch.device = "cpu", timeout: float = DEFAULT_TIMEOUT_S,
                pair_name: str = DEFAULT_PAIR_NAME) -> KVSender:
        """Join the pair a KVReceiver listens for at host:port. ``backend`` "auto" lets the
        handshake decide from the two GPUs' UUIDs. Raises KVTransferError within ``timeout``
        if nobody listens, the layouts or backends disagree, or the group cannot be built."""
        deadline = time.monotonic() + timeout
        self = cls(layout, backend, timeout, device)
        where = f"KV pair setup with decode at {host}:{port}"
        _wait_for_listener(host, port, deadline)
        mine = _hello(layout, backend, self.device, dialed_host=host)
        try:
            store = dist.TCPStore(host, port, None, False, _remaining(deadline, where),
                                  wait_for_workers=False)
            self._store = dist.PrefixStore(pair_name, store)
            self._store.set("hello/0", json.dumps(mine))
            self._store.wait(["hello/1"], _remaining(deadline, where))
            theirs = json.loads(self._store.get("hello/1"))
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"{where}: {e}") from e
        self.backend, self.reason = _settle(mine, theirs)
        self.host_staged = host_staged(self.backend, mine.get("gpu"), theirs.get("gpu"))
        self._build_group(SENDER_RANK, deadline, where, _local_addr_toward(host, port))
        _log_pair_up(f"sending to {host}:{port}", self.backend, self.reason, mine, theirs)
        return self

    def begin(self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              kv_cache: torch.Tensor, meta: dict[str, Any] | None = None,
              plan: WirePlan | None = None, overlap: bool = False,
              draft_cache: torch.Tensor | None = None, state: StateMove | None = None) -> KVSendTransfer:
        """Start one transfer: takes the pair's lock and sends the header. Then call
        ``send_layer(l)`` for l = 0..L-1 in order (e.g. as prefill finishes each layer) and
        ``finish(meta)``; use it as a context manager. Data leaves a chunk at a time, once its
        last layer was given. ``meta`` (small JSON, e.g. the first sampled token) travels in the
        trailer, so it may be given only at ``finish``. ``overlap``: the layers will come one by
        one while prefill runs (the plan then posts chunks of ~64 MiB as their last layer comes).
        ``plan`` overrides the message plan (benchmarks, tests).

        The header always goes first: posting an NCCL batch may block this thread until the
        peer posts its side (NCCL connects channels on first use), and the peer posts only
        once it has the header.

        ``draft_cache``: the draft model's cache, given exactly when the pair's layout has a
        draft: the same blocks of it travel after the target's (posted by ``finish``, so the
        draft's KV must be written by then; on a GPU, queued on the stream before the
        target's last layer).

        ``state``: a hybrid model's linear-attention state, given exactly when the pair's layout
        has one: slot ``state.src_slot`` of every linear layer goes into the receiver's
        ``state.dst_slot``, one message after the last chunk (posted by ``finish``: the state
        must be the one after the prompt's last token by then, its forward pass over)."""
        begun = time.perf_counter()
        self.layout.check_caches(kv_cache, draft_cache)
        self.layout.check_state(state.states if state is not None else None)
        if state is not None and not 0 <= state.src_slot < state.states[0].conv.shape[0]:
            raise ValueError(f"request {request_id}: state slot {state.src_slot} out of range "
                             f"[0, {state.states[0].conv.shape[0]})")
        src, dst = np.asarray(src_block_ids, dtype=np.int64), np.asarray(dst_block_ids, dtype=np.int64)
        runs = run_array(src, dst)
        if src.size and (src.min() < 0 or src.max() >= kv_cache.shape[1]):
            raise ValueError(f"src block ids out of range [0, {kv_cache.shape[1]}): {src.tolist()}")
        if has_repeats(dst):
            raise ValueError(f"duplicate dst block ids: {dst.tolist()}")
        if self.backend == "nccl" and kv_cache.device != self.device:
            raise ValueError(f"backend nccl needs the kv_cache on {self.device}, got {kv_cache.device}")
        layer_block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        given_plan = plan is not None
        plan = plan or plan_transfer(runs, self.layout.num_layers, layer_block_bytes, self.backend,
                                     kv_cache.is_cuda, overlap)
        if not len(runs):
            plan = WirePlan(pack=False, chunk_layers=self.layout.num_layers)
        elif not kv_cache.is_contiguous() and not plan.pack:
            if given_plan:
                raise ValueError("a head slice of the cache is gathered to be sent: the plan must pack")
            plan = WirePlan(pack=True, chunk_layers=plan.chunk_layers)
        elif kv_cache.is_cuda and self.backend != "nccl" and not plan.pack:
            raise ValueError("gloo from a GPU cache stages through host memory: the plan must pack")
        planes = [(kv_cache, plan)]
        fields: dict[str, Any] = {"request_id": request_id, "runs": encode_runs(runs),
                                  "pack": plan.pack, "chunk_layers": plan.chunk_layers}
        if draft_cache is not None:  # its own plan: other layer sizes (sent once prefill is done)
            assert self.layout.draft is not None
            draft_plan = plan_transfer(runs, self.layout.draft.num_layers,
                                       draft_cache[0, 0].numel() * draft_cache.element_size(), self.backend,
                                       draft_cache.is_cuda)
            if not len(runs):
                draft_plan = WirePlan(pack=False, chunk_layers=self.layout.draft.num_layers)
            planes.append((draft_cache, draft_plan))
            fields["draft"] = {"pack": draft_plan.pack, "chunk_layers": draft_plan.chunk_layers}
        views = None
        if state is not None:
            views = state_views(state.states, state.src_slot)
            fields["state"] = {"slot": state.dst_slot, "bytes": sum(v.numel() for v in views)}
        header = json.dumps(fields)
        if not self._lock.acquire(timeout=self.timeout):
            raise KVTransferError(f"request {request_id}: KV pair busy for {self.timeout}s")
        try:
            self._check_usable()
            self._push_header(request_id, header)
            return KVSendTransfer(self, request_id, runs, src, planes, meta, begun, views)
        except Exception:
            self._lock.release()
            raise

    def _staged_trailer(self, trailer: torch.Tensor) -> torch.Tensor:
        """The trailer on the wire's device. From a GPU: through a pinned buffer, copied on the
        pair's stream without waiting (a pageable copy would wait for the chunks already on that
        stream, so the last chunk could not be gathered while the one before it moves). The
        buffer is free again at the next finish(): this one waits for everything it posted."""
        if self.wire_device.type != "cuda":
            return trailer
        staged = self._buffer("trailer", 0, trailer.numel(), trailer.dtype, torch.device("cpu"))
        staged.copy_(trailer)
        with self._on_stream():
            return staged.to(self.wire_device, non_blocking=True)

    def _push_header(self, request_id: str, header: str) -> None:
        try:
            assert self._store is not None
            self._store.queue_push(_HEADER_QUEUE, header)
        except Exception as e:
            self._broken = f"header: {e}"
            raise KVTransferError(f"request {request_id}: sending KV header failed: {e}") from e

    def send(self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             kv_cache: torch.Tensor, meta: dict[str, Any] | None = None,
             plan: WirePlan | None = None, draft_cache: torch.Tensor | None = None,
             state: StateMove | None = None) -> TransferStats:
        """Send kv_cache[:, src_block_ids] (and draft_cache's, and a linear-attention state: see
        ``begin``) into the receiver's dst_block_ids; returns when the data has left this
        process's memory (the blocks may then be freed or rewritten)."""
        with self.begin(request_id, src_block_ids, dst_block_ids, kv_cache, meta, plan,
                        draft_cache=draft_cache, state=state) as transfer:
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
            self._teardown()
            self._store = None
        finally:
            if locked:
                self._lock.release()


class KVSendTransfer:
    """One request's transfer in flight. Holds the pair's lock until ``finish()``.

    The data goes in chunks, each a few consecutive layers of one cache (a "plane": the
    target's, then a draft model's, if the pair has one). Chunk k of the target
    (``plan.chunk_layers`` layers) is posted once its last layer was given, except the last
    chunk of the transfer, which ``finish()`` posts together with the trailer; the draft's
    chunks go at ``finish()``. With a packed plan, chunk k is gathered into staging slot
    k % 2; that slot is reused by chunk k + 2 only after chunk k has left (a stream-side
    wait for NCCL, a host-side one for gloo). A linear-attention state (``state``: its slot's
    tensors as bytes) is gathered into one message, posted with the last chunk, before the
    trailer."""

    def __init__(self, sender: KVSender, request_id: str, runs: np.ndarray, src: np.ndarray,
                 planes: list[tuple[torch.Tensor, WirePlan]], meta: dict[str, Any] | None = None,
                 begun: float | None = None, state: list[torch.Tensor] | None = None) -> None:
        self.request_id = request_id
        self.meta = meta
        self._state = state
        self._sender = sender
        self._runs = runs
        self._planes = planes
        kv_cache, plan = planes[0]
        self._plan = plan
        self._chunks = plane_chunks(planes)  # (plane, first layer, end layer)
        self._works: list[list[Any]] = []  # per posted chunk
        self._num_waited = 0  # chunks whose works were waited for (a gloo work is waited once)
        self._num_messages = 0
        self._next_layer = 0
        self._start = time.perf_counter()
        self._marks = [("begin", begun or self._start), ("header sent", self._start)]
        self._deadline = time.monotonic() + sender.timeout
        self._stats: TransferStats | None = None
        self._done = False
        self._src_index: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        packs = any(p.pack for _, p in planes)
        # the canary's sampled (layer, block, slot) of each cache, and its sums, on the cache's device
        plan = canary.plan_canary(request_id, src, [kv.shape[0] for kv, _ in planes])
        self._canary_k = plan.k
        with sender._on_stream(after_caller=True):
            if packs:
                self._src_index = sender._index_on_device(src, kv_cache.device)
            placed = np.concatenate(plan.rows, axis=1)
            rows = sender._index_on_device(placed.reshape(-1), kv_cache.device, kind="canary").view(3, placed.shape[1])
            self._canary_rows = list(rows.split([r.shape[1] for r in plan.rows], dim=1))
            self._sums = canary.new_sums(kv_cache.device)
        self._marks.append(("after caller's work" + (", index placed" if packs else ""), time.perf_counter()))

    @property
    def chunk_layers(self) -> int:
        """Layers per posted chunk: giving layers more often than this does nothing sooner."""
        return self._plan.chunk_layers

    def send_layer(self, layer: int, ready: torch.cuda.Event | None = None) -> None:
        """Layer ``layer`` of the cache is ready (in order); posts every chunk it completes,
        except the last one. ``ready``: a CUDA event after which the layer's data is written
        (the work of another thread's stream); the pair's stream waits for it on the device,
        this thread does not."""
        if self._done:
            raise KVTransferError(f"request {self.request_id}: send_layer after finish()")
        if layer != self._next_layer:
            raise ValueError(f"send_layer({layer}) out of order: expected layer {self._next_layer}")
        self._sender._check_usable()
        self._next_layer += 1
        if ready is not None:
            self._ready = ready  # the newest: later layers were written after earlier ones
        k = len(self._works)
        if k < len(self._chunks) - 1 and self._chunks[k][0] == 0 and self._chunks[k][2] == self._next_layer:
            self._post_chunk(k, trailer=None)

    def _post_chunk(self, k: int, trailer: torch.Tensor | None) -> None:
        sender, (plane, l0, l1) = self._sender, self._chunks[k]
        kv, plan = self._planes[plane]
        what = f"request {self.request_id}: sending {'the draft model' if plane else 'KV'} layers {l0}..{l1 - 1}"
        nccl = sender.backend == "nccl"
        with sender._on_stream():
            if self._ready is not None:
                torch.cuda.current_stream().wait_event(self._ready)
                self._ready = None
            if k >= 2:  # chunk k may reuse what chunk k - 2 sent from
                if nccl:
                    for work in self._works[k - 2]:
                        work.block_current_stream()
                elif self._num_waited <= k - 2:
                    sender._wait(self._works[k - 2], self._deadline, what)
                    self._num_waited = k - 1
            # this chunk's sampled blocks, after its layers are written (the stream waited above)
            canary.add_cache_sums(self._sums, kv, self._canary_rows[plane], self._canary_k, l0, l1)
            if plan.pack:
                messages = [self._gather(k, kv, l0, l1)]
                self._marks.append((f"chunk {k} gathered", time.perf_counter()))
            else:
                messages = [kv[layer, s:s + n] for layer in range(l0, l1) for s, _, n in self._runs.tolist()]
            self._num_messages += len(messages)
            if trailer is not None:
                if self._state is not None:
                    canary.add_state_sum(self._sums, self._state, self.request_id)
                    messages.append(self._gather_state())
                    self._num_messages += 1
                # from a GPU over gloo, the gathers above synchronized the stream: this copy waits for nothing
                canary.seal(trailer, self._sums)
                messages.append(trailer)
            self._works.append(sender._post(messages, send=True, what=what))
        self._marks.append((f"chunk {k} posted", time.perf_counter()))

    def _gather(self, k: int, kv: torch.Tensor, l0: int, l1: int) -> torch.Tensor:
        """Chunk k's blocks of ``kv``, [layers, blocks, 2, block_size, heads, head_dim], in staging
        slot k % 2 on the wire: gathered on the cache's device, then copied to pinned host memory
        for gloo."""
        sender = self._sender
        assert self._src_index is not None
        shape = (l1 - l0, len(self._src_index), *kv.shape[2:])
        numel = shape[0] * shape[1] * kv[0, 0].numel()
        wire = sender.wire_device
        if wire.type == kv.device.type:
            out = sender._buffer("wire", k % 2, numel, kv.dtype, wire).view(shape)
            _gather_blocks(kv[l0:l1], self._src_index, out)
            return out
        gathered = sender._buffer("gather", k % 2, numel, kv.dtype, kv.device).view(shape)
        _gather_blocks(kv[l0:l1], self._src_index, gathered)
        host = sender._buffer("wire", k % 2, numel, kv.dtype, wire).view(shape)
        host.copy_(gathered, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # gloo reads host memory now
        return host

    def _gather_state(self) -> torch.Tensor:
        """The request's linear-attention state as one message of bytes on the wire: gathered on
        the state's device, then copied to pinned host memory for gloo from a GPU."""
        sender, views = self._sender, self._state
        assert views is not None
        numel, device, wire = sum(v.numel() for v in views), views[0].device, sender.wire_device
        if wire.type == device.type:
            return torch.cat(views, out=sender._buffer("state", 0, numel, torch.uint8, wire))
        gathered = torch.cat(views, out=sender._buffer("state-gather", 0, numel, torch.uint8, device))
        host = sender._buffer("state", 0, numel, torch.uint8, wire)
        host.copy_(gathered, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # gloo reads host memory now
        return host

    def finish(self, meta: dict[str, Any] | None = None, abort: bool = False) -> TransferStats:
        """Post the last chunk and the trailer (with ``meta``, else the one given to ``begin``),
        wait until everything has left, release the pair, return the stats.

        With ``abort``, or called before every layer was given (the caller failed mid-prefill),
        it sends the remaining layers anyway so the receiver stays in sync, marks the trailer
        "aborted" (the receiver's recv raises) and raises KVTransferError. Leaving the context
        manager by an exception aborts. Idempotent once it succeeded.
        """
        if self._done:
            if self._stats is None:
                raise KVTransferError(f"request {self.request_id}: transfer already finished (failed)")
            return self._stats
        sender, num_layers = self._sender, self._sender.layout.num_layers
        aborted = abort or self._next_layer < num_layers
        what = f"request {self.request_id}: sending KV"
        problem = "aborted by the sender" if abort else "finished before every layer was sent"
        try:
            try:
                trailer = encode_trailer(_ABORTED if aborted else _OK, meta if meta is not None else self.meta)
            except ValueError as e:  # still send an (aborted) trailer: the receiver waits for one
                trailer, aborted, problem = encode_trailer(_ABORTED, None), True, str(e)
            for layer in range(self._next_layer, num_layers):
                self.send_layer(layer)
            for k in range(len(self._works), len(self._chunks) - 1):  # the draft's, but its last
                self._post_chunk(k, trailer=None)
            self._post_chunk(len(self._chunks) - 1, sender._staged_trailer(trailer))
            sender._wait([w for works in self._works[self._num_waited:] for w in works], self._deadline, what)
        finally:
            self._works = []
            self._next_layer = num_layers
            self._done = True
            sender._lock.release()
        if aborted:
            raise KVTransferError(f"{what}: {problem}; the receiver was told the transfer is aborted")
        num_blocks = int(self._runs[:, 2].sum())
        state_bytes = sum(v.numel() for v in self._state) if self._state is not None else 0
        self._stats = TransferStats(
            num_blocks=num_blocks, num_bytes=num_blocks * plane_block_bytes(self._planes) + state_bytes,
            seconds=time.perf_counter() - self._start, backend=sender.backend,
            num_messages=self._num_messages, marks=(*self._marks, ("left", time.perf_counter())),
            host_staged=sender.host_staged)
        return self._stats

    def __enter__(self) -> KVSendTransfer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._done:
            return
        try:
            self.finish(abort=exc_type is not None)
        except KVTransferError:
            if exc_type is None:
                raise
