"""Continuous batching with token accounting.

Each step the scheduler hands out a token budget (``max_num_batched_tokens``):
first one token to every running request that is decoding, then prefill
chunks of running requests, then new or preempted requests from the waiting
queue. A request simply gets ``num_tokens - num_computed_tokens`` tokens (or
what is left of the budget); there is no prefill or decode phase. When blocks
run out, the newest running request is preempted: its blocks are freed and it
is recomputed later (its prefix-cache blocks usually survive).

The scheduler owns the waiting/running queues and every request's status and
``num_computed_tokens``; the KV cache manager owns the blocks.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table after allocation

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its
        last position's logits give the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended while scheduling (cache too small)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_blocks: int) -> None:
        self.config = sched
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}  # decode tier: blocks held while KV arrives
        self.held: dict[str, Request] = {}  # prefill tier: finished, blocks held for the KV send
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.prefix_queries_total = 0  # tokens looked up in the prefix cache
        self.prefix_hits_total = 0  # tokens found there

    # ---- admission -------------------------------------------------------
    def check_fits(self, request: Request) -> None:
        """Raise ValueError when the request can never run on this cache."""
        need = self.kv.blocks_needed(request.num_prompt_tokens + 1)
        if need > self.kv.num_blocks:
            raise ValueError(f"the prompt needs {need} KV blocks but the cache has only "
                             f"{self.kv.num_blocks}; use a shorter prompt or a larger --kv-cache-memory")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.check_fits(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request) -> list[int] | None:
        """Decode tier: allocate blocks for a prompt whose KV will arrive by
        transfer, reusing this cache's prefix hits (``num_cached_tokens``:
        the sender may skip those leading blocks). None when the blocks or a
        sequence slot are not free now."""
        self.check_fits(request)
        if len(self.running) + len(self.reserved) >= self.config.max_num_seqs:
            return None
        hits, num_hit = self.kv.get_computed_blocks(request)
        if self.kv.allocate_slots(request, request.num_prompt_tokens - num_hit, hits) is None:
            return None
        request.num_cached_tokens = num_hit
        self.prefix_queries_total += request.num_prompt_tokens
        self.prefix_hits_total += num_hit
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return self.kv.get_block_ids(request.request_id)

    def kv_arrived(self, request_id: str, first_token: int, logprob=None) -> Request:
        """Decode tier: the prompt's KV is in the reserved blocks and the
        prefill tier sampled ``first_token``; the request joins the batch."""
        req = self.reserved.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        req.times.first_scheduled = req.times.first_scheduled or time.time()
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._append_token(req, first_token, logprob)
        return req

    # ---- the step --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decode-first: stable sort puts requests with one token to compute first.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._allocate_or_preempt(req, num_new, out):
                out.scheduled.append(ScheduledRequest(req, num_new, self.kv.get_block_ids(req.request_id)))
                budget -= num_new
        if not out.preempted:
            budget = self._schedule_waiting(budget, out)
        return out

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        scheduled = {s.request.request_id for s in out.scheduled}
        while self.kv.allocate_slots(req, num_new) is None:
            victims = [r for r in self.running if r.request_id not in scheduled and r is not req]
            if not victims:
                if not scheduled:  # alone and still too big: the cache cannot hold it
                    req.status = RequestStatus.FINISHED_LENGTH
                    self._finish(req)
                    out.finished.append(req)
                    return False
                self._preempt(req)
                out.preempted.append(req)
                return False
            victim = victims[-1]
            self._preempt(victim)
            out.preempted.append(victim)
        return True

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) + len(self.reserved) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            if req.times.first_scheduled is None:  # first admission, not a resume
                req.times.first_scheduled = time.time()
                req.num_cached_tokens = num_hit
                self.prefix_queries_total += req.num_prompt_tokens
                self.prefix_hits_total += num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv.get_block_ids(req.request_id)))
            budget -= num_new
        return budget

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None],
                           logprobs: list | None = None) -> list[Request]:
        """Advance token counts after the model ran ``out``; ``sampled[i]``
        is the new token of ``out.scheduled[i]`` or None for a partial chunk.
        Returns the requests that got a token (finished ones included)."""
        updated = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            if req.is_finished:  # aborted or stopped since the schedule
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)
            tok = sampled[i]
            if tok is None:
                continue
            self._append_token(req, tok, logprobs[i] if logprobs else None)
            updated.append(req)
        return updated

    def _append_token(self, req: Request, token: int, logprob) -> None:
        req.append_output_token(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        if req.times.first_token is None:
            req.times.first_token = time.time()
        if req.check_stop():
            self._finish(req)

    # ---- leaving ---------------------------------------------------------
    def _finish(self, req: Request) -> None:
        req.times.finished = time.time()
        if req in self.running:
            self.running.remove(req)
        if req.hold_kv_on_finish and req.status != RequestStatus.FINISHED_ABORTED:
            self.held[req.request_id] = req  # released by release_held() after the KV send
            return
        self.kv.forget(req)
        self.requests.pop(req.request_id, None)

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """The one exit for requests stopped from outside the step (abort,
        client gone, stop string, deadline). Frees blocks on every path."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.request_id in self.held:
            return self.release_held(request_id)
        if not req.is_finished:
            if req in self.waiting:
                self.waiting.remove(req)
            self.reserved.pop(request_id, None)
            req.status = status
            self._finish(req)
        return req

    def release_held(self, request_id: str) -> Request | None:
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.forget(req)
            self.requests.pop(request_id, None)
        return req

    # ---- introspection ---------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.reserved)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)
