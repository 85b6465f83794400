"""Bridge between an engine thread and a server's asyncio event loop.

The engine runs in an ``EngineLoop`` thread. A server opens a stream per
request (an asyncio queue), submits work with ``run``, and receives
``Delta``s: after every engine step the bridge snapshots, in the engine
thread, what each request gained since its last delta and posts it to the
event loop. Both tiers use it: prefill and decode servers differ only in
what they do with the deltas.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.request import Request
from rpc.engine_metrics import EngineMetrics
from pdserve.v1 import common_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Delta:
    request_id: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # filled for held (prefill) requests


class EngineBridge:
    def __init__(self, engine: LLMEngine, role: str, address: str, metrics: EngineMetrics | None = None,
                 on_step: Callable[[list[Request]], None] | None = None,
                 idle_hook: Callable[[], bool] | None = None) -> None:
        self.engine = engine
        self.role, self.address, self.metrics = role, address, metrics
        self._extra_on_step = on_step
        self._streams: dict[str, asyncio.Queue[Delta]] = {}
        self._sent: dict[str, int] = {}  # engine thread: output tokens already posted
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.num_finished = 0  # engine thread writes, others read
        self.loop = EngineLoop(engine, self._on_step, idle_hook)

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` in the engine thread and await its result."""
        return await asyncio.wrap_future(self.loop.submit(fn))

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire and forget (safe from a cancelled coroutine's finally)."""
        self.loop.submit(fn)

    # ---- streams ---------------------------------------------------------
    def open_stream(self, request_id: str) -> "asyncio.Queue[Delta]":
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        q: asyncio.Queue[Delta] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def abort(self, request_id: str) -> None:
        """Abort in every state (queued, running, reserved, held); frees its
        blocks and ends a stream still open on it with finish_reason abort."""
        self.submit(lambda e: self.abort_in_engine(e, request_id))

    def abort_in_engine(self, engine: LLMEngine, request_id: str) -> None:
        """Engine thread half of ``abort``."""
        if engine.abort_request(request_id) is not None:
            self.post(Delta(request_id, [], finish_reason="abort"))

    def post(self, delta: Delta) -> None:
        """Engine thread -> event loop."""
        q = self._streams.get(delta.request_id)
        if q is not None and self._aloop is not None:
            self._aloop.call_soon_threadsafe(q.put_nowait, delta)

    def snapshot(self, req: Request) -> Delta:
        """Engine thread: what ``req`` gained since its last delta."""
        start = self._sent.get(req.request_id, 0)
        self._sent[req.request_id] = req.num_output_tokens
        if req.is_finished:
            self._sent.pop(req.request_id, None)
            self.num_finished += 1
        lps = req.logprobs[start:] if req.sampling_params.logprobs is not None else []
        if self.metrics is not None:
            if start == 0 and req.num_output_tokens:
                self.metrics.prompt_tokens.inc(req.num_prompt_tokens)
            self.metrics.generation_tokens.inc(req.num_output_tokens - start)
        return Delta(req.request_id, req.output_token_ids[start:], lps, req.finish_reason,
                     req.num_cached_tokens, req.num_prompt_tokens, req.num_output_tokens)

    def _on_step(self, updated: list[Request]) -> None:
        if self._extra_on_step is not None:
            self._extra_on_step(updated)
            return
        for req in updated:
            self.post(self.snapshot(req))

    # ---- load ------------------------------------------------------------
    def load_info(self) -> common_pb2.LoadInfo:
        """Racy but consistent-enough reads of engine counters (ints under the GIL)."""
        e = self.engine
        s, cfg = e.scheduler, e.config
        return common_pb2.LoadInfo(
            role=self.role, address=self.address, metrics_url=self.metrics.url if self.metrics else "",
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_blocks_used=s.kv.pool.num_used_blocks, kv_blocks_total=s.kv.num_blocks,
            model=cfg.model.served_model_name, block_size=cfg.cache.block_size,
            max_model_len=cfg.scheduler.max_model_len, num_requests_finished=self.num_finished)

