"""Scheduler side of a decode engine's KV receives: admission, and each request's receive
progress, in one place.

A transfer names its request and destination blocks in its header. Before any byte lands
(``admit``), the engine checks in its own thread that those blocks are reserved for that
request (``LLMEngine.begin_kv_receive``); once the receive is over the engine hears how
it ended, once (``kv_received`` or ``kv_failed``). The request's state is the engine's;
what is here is the receive's: how many parts it comes in, which of them are landing,
how it went.

A request's KV comes in one part, or, from a tensor-parallel prefill engine (or into a
tensor-parallel decode engine), in one part per (sender rank, receiver rank) pair
(``tp_parts.kv_transfer_parts``), each through its own pair, possibly on a worker rank
(which asks here over ``engine.rank_calls``: ``handlers``). The first part to arrive asks
the engine; the others wait for its answer. The engine hears once every part has ended
(so no part still lands in blocks the engine freed), or when a part has not come within
the transfer timeout and none is landing.

    admit(part)  ─▶ ReceiveProgress (first part: engine.begin_kv_receive)
    ended(part) / refused ─▶ progress.num_ended ─▶ all ended, or failed and none landing:
                                                   engine.kv_received | engine.kv_failed (once)
    timeout after the first part ─▶ failed ("only k of n KV parts came"); one more ─▶ forgotten
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.outputs import Logprobs
from kv_transfer.protocol import KVTransferError

logger = logging.getLogger(__name__)


class ReceiveProgress:
    """One request's receive: its parts, which are landing, how it went. Owned by the
    ``KVReceiveScheduler`` (read and written under its lock)."""

    def __init__(self, num_parts: int, dst_block_ids: list[int]) -> None:
        self.num_parts, self.dst_block_ids = num_parts, dst_block_ids
        self.begun: Future = Future()  # the engine's answer to begin_kv_receive
        self.landing: set[str] = set()  # parts admitted and not ended: they may still write into the blocks
        self.num_ended = 0  # parts over: ended after admission, or refused before it
        self.failed: str | None = None
        self.reported = False  # the engine has heard
        self.meta: dict = {}  # the sender's (the first token), from the parts that landed
        self.figures: dict | None = None  # bytes, seconds, backend, parts: for the trace
        self.timer: threading.Timer | None = None

    @property
    def is_complete(self) -> bool:
        return self.num_ended == self.num_parts

    def take_report(self) -> bool:
        """Whether the engine is to hear now: once, when no part can still land and every
        part has ended, or one failed."""
        if self.reported or self.landing or not (self.is_complete or self.failed is not None):
            return False
        self.reported = True
        return True


class KVReceiveScheduler:
    """The receives in flight to one decode engine, by request, and what the engine hears
    of each. Thread-safe: parts end on their pairs' threads (or on worker ranks)."""

    def __init__(self, loop: EngineLoop, timeout: float,
                 on_checksum_mismatch: Callable[[], None] | None = None) -> None:
        """``loop``: the engine's thread, where its operations run; ``timeout``: the KV
        transfer timeout (``--kv-transfer-timeout``); ``on_checksum_mismatch``: told of each
        part whose blocks landed other than sent (the canary, canary.py: metrics)."""
        self.loop, self.timeout = loop, timeout
        self.on_checksum_mismatch = on_checksum_mismatch
        self.num_checksum_mismatches = 0  # parts that failed the canary, on any rank
        self._receives: dict[str, ReceiveProgress] = {}
        # Parts whose end came before their admission (a worker rank gave up waiting for the
        # answer and ended its part; the calls may cross): the admission, when it comes, is
        # refused, so that nothing counts the part as landing (part -> when). Kept apart from
        # the receives: the request may have none (no part of it admitted yet).
        self._ended_unadmitted: dict[str, float] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """What worker ranks call on rank 0 for the parts they receive (``engine.rank_calls``)."""
        return {"kv_admit": self.admit, "kv_ended": self.ended, "kv_refused": self.refused}

    @property
    def num_receiving(self) -> int:
        """Requests with a receive in progress (or failed and not yet forgotten)."""
        return len(self._receives)

    def admit(self, request_id: str, dst_block_ids: list[int], num_parts: int, part: str,
              state_slot: int = -1) -> None:
        """A part's header came: may it land in ``dst_block_ids`` (and its linear-attention
        state in ``state_slot``; -1: none)? The request's first part asks the engine
        (begin_kv_receive); the others wait for that answer. Raises if not. Every admitted part
        is ``ended`` later, whatever happens."""
        with self._lock:
            if self._ended_unadmitted.pop(part, None) is not None:
                raise KVTransferError(f"request {request_id}: a KV part's admission came after it ended")
            progress = self._receives.get(request_id)
            first = progress is None
            if progress is None:
                progress = self._receives[request_id] = ReceiveProgress(num_parts, dst_block_ids)
                self._arm(request_id, progress, forget=False)
            progress.landing.add(part)
            if progress.failed is not None:
                raise KVTransferError(f"request {request_id}: {progress.failed}")
            if (progress.num_parts, progress.dst_block_ids) != (num_parts, dst_block_ids):
                raise KVTransferError(f"request {request_id}: parts disagree on the destination blocks")
        if first:
            try:
                self.loop.submit(lambda e: e.begin_kv_receive(request_id, dst_block_ids, state_slot)
                                 ).result(self.timeout)
            except BaseException as exc:
                progress.begun.set_exception(exc)
                raise
            progress.begun.set_result(None)
        else:
            progress.begun.result(self.timeout)  # the first part's answer (raises its error)

    def ended(self, request_id: str, error: str | None, part: str, meta: dict | None = None,
              figures: dict | None = None, checksum_mismatch: bool = False) -> None:
        """An admitted part ended: landed (error None) or not (``checksum_mismatch``: it landed,
        but not as sent; counted). A part whose admission has not been taken yet (its caller
        gave up waiting for the answer) ends as refused, and its admission is refused when it
        comes."""
        if checksum_mismatch:
            with self._lock:
                self.num_checksum_mismatches += 1
            if self.on_checksum_mismatch is not None:
                self.on_checksum_mismatch()
        with self._lock:
            progress = self._receives.get(request_id)
            early = progress is None or part not in progress.landing
            if early:
                now = time.monotonic()
                self._ended_unadmitted = {p: t for p, t in self._ended_unadmitted.items()
                                          if now - t < 10 * self.timeout}
                self._ended_unadmitted[part] = now
            else:
                assert progress is not None
                progress.landing.discard(part)
                if error is None:
                    progress.meta.update(meta or {})
                    progress.figures = _merged(progress.figures, figures or {})
                tell = self._part_over(request_id, progress, error)
        if early:
            self.refused(request_id, error or "the KV part ended before its admission")
            return
        self._report(request_id, progress, tell)

    def refused(self, request_id: str, error: str) -> None:
        """A part of the request failed before it was admitted (nothing of it landed)."""
        with self._lock:
            progress = self._receives.get(request_id)
            tell = progress is not None and self._part_over(request_id, progress, error)
        if progress is None:  # no part of it admitted: nothing can land, the engine hears now
            self.loop.submit(lambda e: e.kv_failed(request_id, error))
            return
        self._report(request_id, progress, tell)

    def _expire(self, request_id: str, forget: bool = False) -> None:
        """The transfer timeout passed since the first part: the parts not here yet fail it.
        One more timeout later (``forget``), the request's entry goes once no part of it is
        landing: a part later still is taken for a new transfer, which the engine refuses."""
        with self._lock:
            progress = self._receives.get(request_id)
            if progress is None:
                return
            tell = False
            if forget and not progress.landing:
                del self._receives[request_id]
                return
            if not forget:
                progress.failed = progress.failed or (
                    f"only {progress.num_ended + len(progress.landing)} of {progress.num_parts} KV parts came "
                    f"within {self.timeout:g}s")
                tell = progress.take_report()
            self._arm(request_id, progress, forget=True)
        self._report(request_id, progress, tell)

    def _arm(self, request_id: str, progress: ReceiveProgress, forget: bool) -> None:
        """``_expire`` (with ``forget``) one transfer timeout from now."""
        progress.timer = threading.Timer(self.timeout, self._expire, (request_id, forget))
        progress.timer.daemon = True
        progress.timer.start()

    def _part_over(self, request_id: str, progress: ReceiveProgress, error: str | None) -> bool:
        """One more part of the request has ended (lock held; ``error`` None: it landed). The
        entry goes with its last part; True when the engine is to hear now."""
        progress.num_ended += 1
        if error is not None and progress.failed is None:
            progress.failed = error
        if progress.is_complete:
            del self._receives[request_id]
            if progress.timer is not None:
                progress.timer.cancel()
        return progress.take_report()

    def _report(self, request_id: str, progress: ReceiveProgress, tell: bool) -> None:
        if not tell:
            return
        if progress.failed is not None:
            message = progress.failed
            self.loop.submit(lambda e: e.kv_failed(request_id, message))
        else:
            meta, figures = progress.meta, progress.figures or {}
            self.loop.submit(lambda e: _arrived(e, request_id, meta, figures))


def _merged(total: dict | None, part: dict) -> dict:
    """Figures of a request's transfer from its parts': bytes add up, the slowest part's time,
    and each part as (receiving rank, start, end (time.time()), bytes) for the trace."""
    end = part.pop("end", None)
    rank = part.pop("rank", 0)
    this = [(rank, end - part["seconds"], end, part["num_bytes"])] if end is not None else []
    if total is None:
        return dict(part, parts=this)
    return dict(total, num_bytes=total["num_bytes"] + part["num_bytes"],
                seconds=max(total["seconds"], part["seconds"]), parts=total["parts"] + this)


def _arrived(engine: LLMEngine, request_id: str, meta: dict, figures: dict) -> None:
    lp = meta.get("logprob")
    logprob = Logprobs(lp["token_id"], lp["logprob"], lp["rank"], [tuple(t) for t in lp["top"]]) if lp else None
    engine.kv_received(request_id, int(meta["first_token"]), logprob, figures)
