"""Layer-wise KV send, the moving part: a request's KV leaves for its decode server layer
by layer while prefill computes the next layers, so that little of the transfer is left
when the first token is sampled. Which requests send this way, and when, is the
scheduler side's (``KVSendScheduler``); this module moves their layers.

The engine (``LLMEngine.layerwise_sink``) tells the scheduler side, as a step begins,
which held-for-send requests finish their prompt in it; then, from the engine thread, as
layers finish (``StepLayers``). A worker thread per request (``stream_send``) opens the
transfer (the header goes while layer 0 runs) and posts chunks of layers (~64 MiB each)
as their last layer's CUDA event passes, on the pair's own stream, so neither thread
waits for the GPU; the engine thread records an event and wakes the worker only at a
chunk's last layer. The first token, known after sampling, rides in the transfer's
trailer; a request that ends before it is told to its decode server as an aborted
transfer (``StreamedSend.cancel``).
"""
from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.protocol import KVTransferError, TransferStats
from kv_transfer.send_worker import KVSendWorker, check_block_counts

logger = logging.getLogger(__name__)
_END = "end"  # the step is over: no more layers
# TESTS ONLY (the prefill server's hidden flag --test-pause-kv-send LAYER:SECONDS): every
# layer-wise send stops for SECONDS once it has given layer LAYER, its transfer begun on the
# decode server, so a test can kill the prefill server mid-send. None: one test per layer.
TEST_PAUSE_AFTER_LAYER: tuple[int, float] | None = None


@dataclass
class StreamedSend:
    """One request's layer-wise send, from the step that finishes its prompt to its end."""

    request_id: str
    decode_address: str
    dst_block_ids: list[int]
    skip: int  # leading blocks the decode server has cached: not sent
    slot: int = 0  # which of the pairs to its decode server carries it
    layers: "queue.SimpleQueue[tuple[int, torch.cuda.Event | None] | str]" = field(default_factory=queue.SimpleQueue)
    wake_every: int = 1  # its plan's layers per chunk, once begun: wake the worker only that often
    meta: "queue.SimpleQueue[dict[str, Any] | None]" = field(default_factory=queue.SimpleQueue)
    future: Future | None = None  # the worker thread's send
    src_block_ids: list[int] = field(default_factory=list)  # what it sends (the request's blocks after skip)
    may_redo: bool = False  # it failed where sending again after prefill can work
    state_slots: tuple[int, int] = (-1, -1)  # a hybrid model's linear-attention state: (slot here, there)

    def cancel(self) -> None:
        """The request ended before its first token: the transfer ends aborted."""
        self.layers.put(_END)
        self.meta.put(None)


def stream_send(worker: KVSendWorker, s: StreamedSend, block_ids: list[int], num_layers: int) -> TransferStats:
    """The worker thread of one layer-wise send: begin the transfer on its pair, post the
    layers as the engine reports them, finish with the first token. On a KVTransferError,
    ``s.may_redo`` says whether a send after prefill can still work: the decode server never
    heard of this transfer, or the pair broke in a way a new pair mends
    (``KVSendWorker.settle_failure``)."""
    deadline = time.monotonic() + worker.timeout
    src = s.src_block_ids = block_ids[s.skip:]
    check_block_counts(s.request_id, src, s.dst_block_ids)
    state = worker.state_move(s.request_id, s.state_slots)
    reused = worker.has_pair(s.decode_address, s.slot)
    sender = worker.pair(s.decode_address, slot=s.slot)
    header_sent = False
    try:
        # a linear-attention state leaves at finish(), with the first token: after the step's forward pass
        transfer = sender.begin(s.request_id, src, s.dst_block_ids, worker.kv_cache, overlap=True,
                                draft_cache=worker.draft_cache, state=state)
        header_sent = True
        s.wake_every = transfer.chunk_layers
        return _stream(s, transfer, num_layers, deadline)
    except KVTransferError:
        mendable = worker.settle_failure(s.decode_address, sender, reused, s.slot)
        s.may_redo = mendable or not header_sent
        raise


def _stream(s: StreamedSend, transfer, num_layers: int, deadline: float) -> TransferStats:
    with transfer:  # leaving early (an exception) sends the rest marked aborted
        next_layer = 0
        while next_layer < num_layers:
            item = _get(s.layers, deadline, f"request {s.request_id}: layer {next_layer} never came")
            if item == _END:
                raise KVTransferError(f"request {s.request_id}: prefill ended before layer {next_layer}")
            done, ready = item  # layers up to ``done`` are written once ``ready`` has passed
            for layer in range(next_layer, done + 1):
                transfer.send_layer(layer, ready if layer == done else None)
                if TEST_PAUSE_AFTER_LAYER is not None and layer == TEST_PAUSE_AFTER_LAYER[0]:
                    _test_pause(s.request_id, *TEST_PAUSE_AFTER_LAYER)
            next_layer = done + 1
        meta = _get(s.meta, deadline, f"request {s.request_id}: no first token")
        if meta is None:
            raise KVTransferError(f"request {s.request_id}: ended before its first token")
        return transfer.finish(meta)


class StepLayers:
    """One step's signal to the sends it started (the engine's ``LayerSignal``)."""

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


def _test_pause(request_id: str, layer: int, seconds: float) -> None:
    logger.warning("test hook: the layer-wise KV send of request %s pauses after layer %d for %g s",
                   request_id, layer, seconds)
    time.sleep(seconds)


def _get(q: queue.SimpleQueue, deadline: float, what: str) -> Any:
    try:
        return q.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise KVTransferError(f"{what} within the KV transfer timeout") from None
