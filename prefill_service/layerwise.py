"""Layer-wise KV send: a request's KV leaves for its decode server layer by
layer while prefill computes the next layers, so that little of the transfer
is left when the first token is sampled.

The engine (``LLMEngine.layerwise_sink``) tells us, as a step begins, which
held-for-send requests finish their prompt in it; then, from the engine
thread, as layers finish. A worker thread per request opens the transfer (the
header goes while layer 0 runs) and posts chunks of layers (~64 MiB each) as
their last layer's CUDA event passes, on the pair's own stream, so neither
thread waits for the GPU; the engine thread records an event and wakes the
worker only at a chunk's last layer. The first token, known after sampling,
rides in the transfer's trailer.

    Prefill RPC:  expect(rid, decode, dst blocks)   before the engine sees the request
    engine:       step_begins (the scheduler marks the request sending)
                  -> layer_done(0..L-1) -> step_ended
    Prefill RPC:  held -> take(rid) -> first token to the worker -> await the result
                  -> release_after_send (no begin_send: it has been sending since step_begins)
                  (a send that failed before its header left, or on a pair that broke
                  because the decode server restarted, is redone after prefill)

A pair carries one transfer at a time, and each transfer ends with its first
token, so the requests of one step bound for one decode server are spread
over up to ``pairs_per_decode`` pairs to it (``--kv-pairs-per-decode``); more
than that wait their turn.
A request that ends before its token (aborted, expired) is told to its
decode server as an aborted transfer; its blocks stay allocated (the engine's
``pending_free``) until the send is released.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer import KVTransferError, TransferStats
from prefill_service.flags import PAIRS_PER_DECODE
from prefill_service.kv_sender import KVSenders, check_block_counts

logger = logging.getLogger(__name__)
_END = "end"  # the step is over: no more layers
_MAX_WORKERS = 32


@dataclass
class StreamedSend:
    """One request's layer-wise send."""

    request_id: str
    decode_address: str
    dst_block_ids: list[int]
    skip: int  # leading blocks the decode server has cached: not sent
    layers: "queue.SimpleQueue[tuple[int, torch.cuda.Event | None] | str]" = field(default_factory=queue.SimpleQueue)
    wake_every: int = 1  # its plan's layers per chunk, once begun: wake the worker only that often
    meta: "queue.SimpleQueue[dict[str, Any] | None]" = field(default_factory=queue.SimpleQueue)
    future: Future | None = None  # set once the engine scheduled its last prompt chunk
    slot: int = 0  # which of the pairs to its decode server carries it
    src_block_ids: list[int] = field(default_factory=list)  # what it sends (the request's blocks after skip)
    may_redo: bool = False  # it failed where sending again after prefill can work

    def cancel(self) -> None:
        """The request ended before its first token: the transfer ends aborted."""
        self.layers.put(_END)
        self.meta.put(None)


class LayerwiseSends:
    """The prefill server's ``LayerwiseSink``: one ``StreamedSend`` per expected request."""

    def __init__(self, senders: KVSenders, num_layers: int, pairs_per_decode: int = PAIRS_PER_DECODE) -> None:
        if pairs_per_decode < 1:
            raise ValueError(f"--kv-pairs-per-decode must be at least 1, got {pairs_per_decode}")
        self.senders = senders
        self.num_layers = num_layers
        self.pairs_per_decode = pairs_per_decode
        self.device = senders.kv_cache.device
        self._pool = ThreadPoolExecutor(max_workers=_MAX_WORKERS, thread_name_prefix="kv-layerwise")
        self._sends: dict[str, StreamedSend] = {}
        self._lock = threading.Lock()

    def expect(self, request_id: str, decode_address: str, dst_block_ids: list[int], skip: int) -> None:
        if self.senders.sends_in_parts(decode_address):  # several pairs: sent after prefill
            return
        with self._lock:
            self._sends[request_id] = StreamedSend(request_id, decode_address, dst_block_ids, skip)

    def take(self, request_id: str) -> StreamedSend | None:
        """The request's send if the engine started it (then the caller owns it), else None."""
        with self._lock:
            s = self._sends.pop(request_id, None)
        return s if s is not None and s.future is not None else None

    def forget(self, request_id: str) -> StreamedSend | None:
        """The RPC is over: a started send it never took ends aborted; returns it (its
        blocks are free to go once its future is done)."""
        with self._lock:
            s = self._sends.pop(request_id, None)
        if s is None or s.future is None:
            return None
        s.cancel()
        return s

    def close(self) -> None:
        with self._lock:
            sends, self._sends = list(self._sends.values()), {}
        for s in sends:
            s.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread ----------------------------------------------------
    def step_begins(self, finishing: list[tuple[str, list[int]]]) -> _StepLayers | None:
        started: list[StreamedSend] = []
        per_decode: dict[str, int] = {}
        with self._lock:
            for request_id, block_ids in finishing:
                s = self._sends.get(request_id)
                if s is None or s.future is not None:
                    continue
                # A pair carries one transfer at a time: spread this step's sends to one decode
                # server over its pairs, so that they overlap the forward pass together.
                n = per_decode.get(s.decode_address, 0)
                per_decode[s.decode_address] = n + 1
                s.slot = n % self.pairs_per_decode
                s.future = self._pool.submit(self._run, s, block_ids)
                started.append(s)
        return _StepLayers(started, self.device, self.num_layers) if started else None

    # ---- worker thread ----------------------------------------------------
    def _run(self, s: StreamedSend, block_ids: list[int]) -> TransferStats:
        deadline = time.monotonic() + self.senders.timeout
        src = s.src_block_ids = block_ids[s.skip:]
        check_block_counts(s.request_id, src, s.dst_block_ids)
        reused = self.senders.has_pair(s.decode_address, s.slot)
        sender = self.senders.pair(s.decode_address, slot=s.slot)
        header_sent = False
        try:
            transfer = sender.begin(s.request_id, src, s.dst_block_ids, self.senders.kv_cache, overlap=True,
                                    draft_cache=self.senders.draft_cache)
            header_sent = True
            s.wake_every = transfer.chunk_layers
            return self._stream(s, transfer, deadline)
        except KVTransferError:
            # Redo after prefill if the decode server never heard of this transfer, or if the
            # pair broke in a way a new pair can mend (see KVSenders.settle_failure).
            mendable = self.senders.settle_failure(s.decode_address, sender, reused, s.slot)
            s.may_redo = mendable or not header_sent
            raise

    def _stream(self, s: StreamedSend, transfer, deadline: float) -> TransferStats:
        with transfer:  # leaving early (an exception) sends the rest marked aborted
            next_layer = 0
            while next_layer < self.num_layers:
                item = _get(s.layers, deadline, f"request {s.request_id}: layer {next_layer} never came")
                if item == _END:
                    raise KVTransferError(f"request {s.request_id}: prefill ended before layer {next_layer}")
                done, ready = item  # layers up to ``done`` are written once ``ready`` has passed
                for layer in range(next_layer, done + 1):
                    transfer.send_layer(layer, ready if layer == done else None)
                next_layer = done + 1
            meta = _get(s.meta, deadline, f"request {s.request_id}: no first token")
            if meta is None:
                raise KVTransferError(f"request {s.request_id}: ended before its first token")
            return transfer.finish(meta)


class _StepLayers:
    """One step's signal to the sends it started."""

    def __init__(self, sends: list[StreamedSend], device: torch.device, num_layers: int) -> None:
        self.sends = sends
        self.request_ids = [s.request_id for s in sends]
        self.cuda = device.type == "cuda"
        self.last = num_layers - 1

    def layer_done(self, layer: int) -> None:
        """Wakes a send's worker only where its plan ends a chunk: each wake-up takes the GIL
        from this (the engine's) thread."""
        wake = [s for s in self.sends if (layer + 1) % s.wake_every == 0 or layer == self.last]
        if not wake:
            return
        ready = None
        if self.cuda:  # on CPU the layer's writes are done when the call returns
            ready = torch.cuda.Event()
            ready.record()
        for s in wake:
            s.layers.put((layer, ready))

    def step_ended(self) -> None:
        for s in self.sends:
            s.layers.put(_END)  # read only by a send that is still short of layers


def _get(q: queue.SimpleQueue, deadline: float, what: str) -> Any:
    try:
        return q.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise KVTransferError(f"{what} within the KV transfer timeout") from None
