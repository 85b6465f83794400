"""Bridge between an engine thread and a server's asyncio event loop.

The engine runs in an ``EngineLoop`` thread. A server opens a stream per
request (an asyncio queue), calls the engine's named operations with
``run``/``submit``, and receives ``Delta``s: after every engine step the
bridge turns the step's output, in the engine thread, into one delta per
event (tokens since the last delta, "reserved", "started") and posts them to
the event loop. The engine owns every request's state; the bridge keeps only
the streams (who listens) and how many tokens each was already sent.

Bounds: a stream holds at most one pending "tokens" delta (a new one is
merged into it while the server has not taken it: a slow reader costs its
own tokens, never one queue entry per step), plus the one-off "reserved" and
"started" events. Awaited engine calls (``run``) share the engine loop's
bounded command queue and fail with OverflowError when it is full.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from engine.engine_loop import EngineLoop, EngineThread
from engine.llm_engine import LLMEngine, StepOutput
from engine.request import Request, RequestError, RequestStatus, RequestTimes
from rpc.engine_metrics import EngineMetrics
from pdserve.v1 import common_pb2
from rpc.convert import lora_to_proto

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Delta:
    """One event of a request, engine thread -> event loop.

    ``event``: "tokens" (new output tokens; ``finish_reason`` on the last),
    "reserved" (decode tier: ``block_ids`` reserved) or "started" (prefill
    tier: the engine began computing it)."""

    request_id: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # "reserved", and tokens of a held request
    event: str = "tokens"
    error: RequestError | None = None  # set when the request ended by a failure or a deadline
    is_held: bool = False  # prefill tier: HELD_FOR_SEND, blocks in block_ids
    times: RequestTimes | None = None  # the request's milestones (written by the engine thread only)
    kv_transfer: dict | None = None  # decode tier: the figures of the KV transfer it came with
    spec: tuple[int, int] = (0, 0)  # speculative decoding so far: (tokens proposed, accepted)
    state_slot: int = -1  # "reserved": a hybrid model's linear-attention state slot reserved (-1: none)
    # SamplingParams.prompt_logprobs, where this server computed the prompt: on the first delta
    # with tokens, the Logprobs of prompt tokens 1, 2, ... (engine/request.py)
    prompt_logprobs: list = field(default_factory=list)


class _DeltaQueue(asyncio.Queue):
    """An asyncio queue of one request's deltas that merges a "tokens" delta
    into a pending one (the reader gets the same tokens, fewer messages)."""

    def _put(self, item: Delta) -> None:
        tail = self._queue[-1] if self._queue else None  # type: ignore[attr-defined]
        if (tail is not None and tail.event == item.event == "tokens" and tail.finish_reason is None
                and tail.error is None and not tail.is_held):
            item.token_ids = tail.token_ids + item.token_ids
            item.logprobs = tail.logprobs + item.logprobs
            item.prompt_logprobs = tail.prompt_logprobs or item.prompt_logprobs
            self._queue[-1] = item  # type: ignore[attr-defined]
            return
        self._queue.append(item)  # type: ignore[attr-defined]


class EngineBridge:
    def __init__(self, engine: LLMEngine, role: str, address: str, metrics: EngineMetrics | None = None,
                 post_started: bool = False, thread: EngineThread | None = None) -> None:
        """``thread``: the thread that built the engine, to run its loop (else one of its own)."""
        self.engine = engine
        self.role, self.address, self.metrics = role, address, metrics
        self.post_started = post_started
        self._streams: dict[str, asyncio.Queue[Delta]] = {}
        self._sent: dict[str, int] = {}  # engine thread: output tokens already posted
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.num_finished = 0  # engine thread writes, others read
        self.after_step: Callable[[LLMEngine], None] | None = None  # engine thread, after each reported step
        self.instance_id = self.cache_namespace = ""
        self.loop = EngineLoop(engine, self._on_step, thread=thread)
        # A server's waiting queue is bounded like the decode tier's reservations (offline: unbounded).
        engine.limit_waiting(engine.config.scheduler.max_queued_requests)

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` in the engine thread and await its result."""
        return await asyncio.wrap_future(self.loop.submit(fn, bounded=True))

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire and forget (safe from a cancelled coroutine's finally)."""
        self.loop.submit(fn)

    # ---- streams ---------------------------------------------------------
    def open_stream(self, request_id: str) -> "asyncio.Queue[Delta]":
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        q: asyncio.Queue[Delta] = _DeltaQueue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def abort(self, request_id: str) -> None:
        """Abort in every state; the stream gets a final "abort" delta."""
        self.submit(lambda e: e.abort_request(request_id))

    # ---- engine thread ---------------------------------------------------
    def _post(self, delta: Delta) -> None:
        q = self._streams.get(delta.request_id)
        if q is not None and self._aloop is not None:
            self._aloop.call_soon_threadsafe(q.put_nowait, delta)

    def _snapshot(self, req: Request) -> Delta:
        """What ``req`` gained since its last delta."""
        start = self._sent.get(req.request_id, 0)
        self._sent[req.request_id] = req.num_output_tokens
        if req.is_finished:
            self._sent.pop(req.request_id, None)
            if req.status != RequestStatus.FINISHED_ABORTED:  # LoadInfo: completed, not aborted
                self.num_finished += 1
        lps = req.logprobs[start:] if req.sampling_params.logprobs is not None else []
        if self.metrics is not None:
            if start == 0 and req.num_output_tokens:
                self.metrics.prompt_tokens.inc(req.num_prompt_tokens)
            self.metrics.generation_tokens.inc(req.num_output_tokens - start)
        held = req.status == RequestStatus.HELD_FOR_SEND
        first = start == 0 and req.num_output_tokens > 0  # the prompt's logprobs go with the first token
        return Delta(req.request_id, req.output_token_ids[start:], lps, req.finish_reason,
                     req.num_cached_tokens, req.num_prompt_tokens, req.num_output_tokens,
                     block_ids=self.engine.get_block_ids(req.request_id) if held else [],
                     error=req.error, is_held=held, times=req.times, kv_transfer=req.kv_transfer,
                     spec=(req.num_draft_tokens, req.num_accepted_draft_tokens),
                     prompt_logprobs=list(req.prompt_logprobs) if first and req.prompt_logprobs else [])

    def _on_step(self, out: StepOutput) -> None:
        for req in out.reserved:
            self._post(Delta(req.request_id, [], num_cached_tokens=req.num_cached_tokens,
                             block_ids=self.engine.get_block_ids(req.request_id), event="reserved",
                             state_slot=self.engine.state_slot(req.request_id)))
        if self.post_started:
            for req in out.started:
                self._post(Delta(req.request_id, [], event="started"))
        for req in out.updated:
            self._post(self._snapshot(req))
        if self.after_step is not None:
            self.after_step(self.engine)

    # ---- load ------------------------------------------------------------
    def load_info(self) -> common_pb2.LoadInfo:
        """Engine counters (plain reads, racy but consistent enough)."""
        s, cfg = self.engine.stats(), self.engine.config
        return common_pb2.LoadInfo(
            role=self.role, address=self.address, metrics_url=self.metrics.url if self.metrics else "",
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
            model=cfg.model.served_model_name, block_size=cfg.cache.block_size,
            max_model_len=cfg.scheduler.max_model_len, num_requests_finished=self.num_finished,
            cache_namespace=self.cache_namespace, instance_id=self.instance_id,
            lora_adapters=self._lora_adapters(), max_loras=cfg.lora.max_loras if cfg.lora is not None else 0,
            draft_model=self.engine.drafter.model_name if self.engine.drafter is not None else "")

    def _lora_adapters(self) -> list[common_pb2.LoRAAdapter]:
        lora = self.engine.lora
        if lora is None:
            return []
        held = set(lora.held())
        return [lora_to_proto(i, i.name in held) for i in lora.list()]
