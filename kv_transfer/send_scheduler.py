"""Scheduler side of a prefill engine's KV sends: for each request, where its KV goes, when
it leaves, and the send reading its blocks, in one place.

One request, as the prefill service drives it (the engine's states in brackets)::

    expect(rid, decode, dst blocks, skip)      before the engine sees the request
    [the engine schedules the prompt's last chunk]
        layer-wise: step_begins (engine thread) starts its send; layers leave as they finish
    [first token sampled, blocks HELD_FOR_SEND]
    first_token(rid, meta) -> send | None      a layer-wise send takes the token and ends;
                                               None: no send began, so (after begin_send)
    send_after_prefill(rid, blocks) -> send    every layer now, on a worker thread
    end(rid) -> send | None                    the RPC is over: the send still reading the
                                               blocks, after which release_after_send

A layer-wise send that failed before its header left, or on a pair that broke because
the decode server restarted, is redone after prefill, and its future ends with the redo.
A request that ends before its first token has its layer-wise send told to the decode
server as aborted; its blocks stay allocated (the engine's ``pending_free``) until the
send is released.

A pair carries one transfer at a time, and each transfer ends with its first token, so
the requests of one step bound for one decode server are spread over up to
``pairs_per_decode`` pairs to it (``--kv-pairs-per-decode``); more than that wait their
turn. A channel in parts (tensor parallelism) is sent after prefill.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from engine.cpu_threads import serial_thread
from engine.llm_engine import LLMEngine
from kv_transfer.channel import OpenChannel
from kv_transfer.layerwise import StepLayers, StreamedSend, stream_send
from kv_transfer.layout import engine_layout
from kv_transfer.protocol import KVTransferError
from kv_transfer.send_worker import KVSendWorker

logger = logging.getLogger(__name__)
_MAX_STREAMS = 32  # layer-wise sends at once (worker threads)
_MAX_AFTER_PREFILL = 8  # sends after prefill at once


@dataclass
class _Send:
    """One request's send: where its KV goes, and the send in flight (owned by the scheduler)."""

    request_id: str
    decode_address: str
    dst_block_ids: list[int]
    skip: int  # leading blocks the decode server has cached: not sent
    may_stream: bool  # the engine may still start a layer-wise send of it
    stream: StreamedSend | None = None  # its layer-wise send, once the engine started it
    meta: dict[str, Any] | None = None  # the first token (and its logprob), once sampled
    future: Future | None = None  # the send reading its blocks, once it has its token
    ended: bool = False  # the RPC is over: nothing more starts
    dst_state_slot: int = -1  # a hybrid model's: where its linear-attention state goes on the decode server
    src_state_slot: int = -1  # and where it is here, once known (the engine thread tells)


class KVSendScheduler:
    """The sends of one prefill engine, by request; the engine's ``LayerwiseSink`` when its
    sends are layer-wise. Thread-safe (RPC threads, the engine thread, send threads)."""

    def __init__(self, worker: KVSendWorker, num_layers: int, pairs_per_decode: int, layerwise: bool = True,
                 state_slot: Callable[[str], int] | None = None) -> None:
        """``state_slot``: a request's linear-attention state slot in the engine (its
        ``state_slot``, called on the engine thread), for a hybrid model's sends."""
        if pairs_per_decode < 1:
            raise ValueError(f"--kv-pairs-per-decode must be at least 1, got {pairs_per_decode}")
        self.worker = worker
        self.num_layers = num_layers
        self.pairs_per_decode = pairs_per_decode
        self.layerwise = layerwise
        self.device = worker.kv_cache.device
        self.state_slot = state_slot
        self._streams = ThreadPoolExecutor(max_workers=_MAX_STREAMS, thread_name_prefix="kv-layerwise",
                                          initializer=serial_thread)
        self._after_prefill = ThreadPoolExecutor(max_workers=_MAX_AFTER_PREFILL, thread_name_prefix="kv-send",
                                                initializer=serial_thread)
        self._sends: dict[str, _Send] = {}
        self._lock = threading.Lock()

    @classmethod
    def attach(cls, engine: LLMEngine, my_address: str, open_channel: OpenChannel, layerwise: bool,
               pairs_per_decode: int) -> KVSendScheduler:
        """The sends of ``engine`` (a prefill server at ``my_address``), with their worker side;
        layer-wise (the engine's ``layerwise_sink``) where asked and the engine has one rank."""
        tp = engine.config.tensor_parallel_size
        if tp > 1 and layerwise:
            logger.info("--tensor-parallel-size %d: the KV is sent after prefill (each rank its own heads); "
                        "layer-wise sending needs one rank", tp)
            layerwise = False
        # The model's layout (every KV head): a tensor-parallel engine's ranks each hold a share.
        layout = engine_layout(engine)
        worker = KVSendWorker(engine.kv_cache, layout, my_address, engine.config.scheduler.kv_transfer_timeout,
                              open_channel, engine.tp, engine.draft_kv_cache,
                              engine.linear_states if layout.linear_state else None)
        sends = cls(worker, layout.num_layers, pairs_per_decode, layerwise, engine.state_slot)
        if layerwise:
            engine.layerwise_sink = sends
        return sends

    # ---- RPC threads ------------------------------------------------------
    def expect(self, request_id: str, decode_address: str, dst_block_ids: list[int], skip: int,
               dst_state_slot: int = -1) -> None:
        """Where the request's KV goes: ``dst_block_ids`` on ``decode_address``, which has its
        first ``skip`` blocks cached, and a hybrid model's linear-attention state: its slot
        ``dst_state_slot`` there. Before the engine sees the request."""
        may_stream = self.layerwise and skip >= 0 and not self.worker.sends_in_parts(decode_address)
        with self._lock:
            self._sends[request_id] = _Send(request_id, decode_address, dst_block_ids, skip, may_stream,
                                            dst_state_slot=dst_state_slot)

    def first_token(self, request_id: str, meta: dict[str, Any]) -> Future | None:
        """The first token is sampled (``meta``: it and its logprob, for the decode server) and
        the blocks are held. A layer-wise send the engine began takes it and is returned (it
        ends with the transfer, or with a send after prefill that mends a failure of it).
        None: no send began; the caller begins one (``begin_send``, ``send_after_prefill``)."""
        with self._lock:
            s = self._sends.get(request_id)
            if s is None:
                return None
            s.meta, s.may_stream = meta, False  # too late for the engine to start one now
            stream = s.stream
            if stream is None:
                return None
        future = s.future = self._or_redo(s, stream)
        stream.meta.put(meta)
        return future

    def send_after_prefill(self, request_id: str, src_block_ids: list[int], src_state_slot: int = -1) -> Future:
        """Send ``src_block_ids`` (every layer; and a hybrid model's linear-attention state,
        slot ``src_state_slot`` here) on a worker thread; the request's ``first_token`` was
        given. The future holds the TransferStats, or raises KVTransferError."""
        with self._lock:
            s = self._sends[request_id]
            s.src_state_slot = src_state_slot
            s.future = self._send_after_prefill(s, src_block_ids)
            return s.future

    def end(self, request_id: str) -> Future | None:
        """The request's RPC is over. A layer-wise send that never got its first token ends
        aborted (the decode server hears of it). Returns the send still reading the request's
        blocks, if any: release them (``release_after_send``) once it is done."""
        with self._lock:
            s = self._sends.pop(request_id, None)
            if s is None:
                return None
            s.ended = True
            untaken = s.stream if s.stream is not None and s.future is None else None
        if untaken is not None:
            untaken.cancel()
            return untaken.future
        return s.future

    def close(self) -> None:
        with self._lock:
            sends, self._sends = list(self._sends.values()), {}
        for s in sends:
            if s.stream is not None:
                s.stream.cancel()
        self._streams.shutdown(wait=False, cancel_futures=True)
        self._after_prefill.shutdown(wait=False, cancel_futures=True)
        self.worker.close()

    # ---- engine thread ----------------------------------------------------
    def step_begins(self, finishing: list[tuple[str, list[int]]]) -> StepLayers | None:
        """``LayerwiseSink``: the requests that finish their prompt in this step (request id, block
        ids); starts the layer-wise send of each one expected here."""
        started: list[StreamedSend] = []
        per_decode: dict[str, int] = {}
        with self._lock:
            for request_id, block_ids in finishing:
                s = self._sends.get(request_id)
                if s is None or not s.may_stream:
                    continue
                s.may_stream = False
                # A pair carries one transfer at a time: spread this step's sends to one decode
                # server over its pairs, so that they overlap the forward pass together.
                n = per_decode.get(s.decode_address, 0)
                per_decode[s.decode_address] = n + 1
                if self.worker.linear_states is not None and self.state_slot is not None:
                    s.src_state_slot = self.state_slot(request_id)  # (its slot now is its slot to the end)
                stream = s.stream = StreamedSend(request_id, s.decode_address, s.dst_block_ids, s.skip,
                                                 slot=n % self.pairs_per_decode,
                                                 state_slots=(s.src_state_slot, s.dst_state_slot))
                stream.future = self._streams.submit(stream_send, self.worker, stream, block_ids, self.num_layers)
                started.append(stream)
        return StepLayers(started, self.device, self.num_layers) if started else None

    # ---- send threads -----------------------------------------------------
    def _send_after_prefill(self, s: _Send, src_block_ids: list[int]) -> Future:
        return self._after_prefill.submit(self.worker.send, s.decode_address, s.request_id, src_block_ids,
                                          s.dst_block_ids, s.meta or {}, (s.src_state_slot, s.dst_state_slot))

    def _or_redo(self, s: _Send, stream: StreamedSend) -> Future:
        """The layer-wise send's outcome; where it failed in a way a send after prefill can
        mend (``StreamedSend.may_redo``) and the RPC goes on, that send's."""
        out: Future = Future()
        assert stream.future is not None

        def settle(done: Future) -> None:
            try:
                out.set_result(done.result())
                return
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the send
                error = exc
            with self._lock:
                redo = isinstance(error, KVTransferError) and stream.may_redo and not s.ended
            if not redo:
                out.set_exception(error)
                return
            logger.info("request %s: layer-wise KV send did not start (%s); sending after prefill",
                        s.request_id, error)
            try:
                _chain(self._send_after_prefill(s, stream.src_block_ids), out)
            except BaseException as exc:  # noqa: BLE001 - e.g. the pool is closed
                out.set_exception(exc)

        stream.future.add_done_callback(settle)
        return out


def _chain(source: Future, target: Future) -> None:
    """``target`` ends as ``source`` does."""
    def copy(done: Future) -> None:
        try:
            target.set_result(done.result())
        except BaseException as exc:  # noqa: BLE001 - handed on
            target.set_exception(exc)
    source.add_done_callback(copy)
