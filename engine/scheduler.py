"""Continuous batching with token accounting, and the owner of every
request's state on its tier.

Each step the scheduler hands out a token budget (``max_num_batched_tokens``):
first one token to every running request that is decoding, then prefill
chunks of running requests, then new or preempted requests from the waiting
queue. A request simply gets ``num_tokens - num_computed_tokens`` tokens (or
what is left of the budget); there is no prefill or decode phase. When blocks
run out, the newest running request is preempted: its blocks are freed and it
is recomputed later (its prefix-cache blocks usually survive).

``--scheduling-policy priority`` (vLLM's): the waiting queues are served by
priority (lower first), then arrival, and preemption takes the lowest priority,
newest first (the request asking for blocks itself, when it is that one). The
running requests are kept in the same order, so a step's budget goes to higher
priorities first (decode rows still before prefill chunks, and a row given its
tokens this step is not preempted later in the same step: on a colocated server a
lower-priority decode row can keep its blocks for that step while a
higher-priority chunk waits; on the prefill and decode tiers every row is of one
kind). Starvation is bounded: a request that has waited
``priority_starvation_timeout`` seconds since it arrived goes ahead of every
request that has not, whatever their priorities (in arrival order).

The two tiers add states around that batch (see ``RequestStatus``)::

    decode:  reserve ──▶ WAITING_FOR_BLOCKS ──(blocks free, FIFO)──▶ WAITING_FOR_KV
             ──begin_kv_receive──▶ RECEIVING_KV ──kv_received──▶ RUNNING ──▶ FINISHED_*
                                                ──kv_failed────▶ FINISHED_ABORTED
    prefill: add_request(hold) ──▶ WAITING ──▶ RUNNING ──first token──▶ HELD_FOR_SEND
             ──begin_send … release_held──▶ FINISHED_*
             (layer-wise: ``begin_streamed_send`` as the last prompt chunk is scheduled,
             RUNNING, then held already sending ──release_held──▶ FINISHED_*)

A prefix hit on blocks of the disk KV tier (``--kv-offloading-path``) is read off the
step, as vLLM's asynchronous KV connector loads are (WAITING_FOR_REMOTE_KVS): the lookup
(``KVCacheManager.get_computed_blocks`` -> ``HostKVTier.find``) starts reading the blocks
that follow the device and host hits into the host tier on the disk tier's reader thread,
and the request stays in its queue, passed over (``WAITING_FOR_DISK_KV``; a reservation
stays WAITING_FOR_BLOCKS), while the block right after its hit is being read; the requests
behind it are admitted and the steps run meanwhile. A later step looks it up again and
takes the blocks read as host hits. It waits for reads at most ``max_read_wait_s`` in all,
and not for a second read of a block whose first read it waited for (read, then evicted
before it came back): past either, it is admitted with the hit it has and computes the rest.

Every non-final state has a deadline (``expire``): the caller's, and for the
hand-off states their own bound, so nothing waits for ever. ``finish_request``
is the one exit. A request finished while a transfer still reads or writes
its blocks (RECEIVING_KV, or a prefill request with a send running) is reported
finished at once but keeps its blocks in ``pending_free`` until that transfer
ends (``kv_received`` / ``kv_failed`` / ``release_held``): never freed under
a transfer.

The scheduler owns the queues, every request's status and
``num_computed_tokens``; the KV cache manager owns the blocks. Its collaborators
come through the constructor and stay for its life: the speculator
(engine/speculative.py), the structured-output grammars (engine/grammar.py), the
LoRA limit and the waiting-queue bound (the one value set later, by
``limit_waiting``: servers bound the queue, the offline API does not).
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_groups import KVCacheLayout
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestError, RequestStatus
from engine.speculative import Speculator
from engine.structured_outputs import GrammarState


@dataclass
class SpecStats:
    """Speculative decoding's counts (vLLM's metric names): rows that verified proposals,
    the proposals, the accepted ones, and acceptances by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1


class Grammars(Protocol):
    """The engine's structured-output grammars (engine/grammar.py), as the scheduler asks them:
    ``poll(req)`` -> (state, message); ``prefetch`` takes a step's new tokens in one batch
    before they are polled one by one; ``num_requests``: constrained requests live (none:
    nothing to prefetch)."""

    def poll(self, req: Request) -> tuple[GrammarState, str]: ...

    def prefetch(self, pairs: Sequence[tuple[Request, int]]) -> None: ...

    def free(self, request_id: str) -> None: ...

    @property
    def num_requests(self) -> int: ...

S = RequestStatus
# A reservation whose prefill has not started, for a caller that set no
# deadline, waits at most this many KV transfer timeouts.
_UNSTARTED_KV_WAIT_FACTOR = 10
# Extra time a transfer's own deadline gets before the engine gives up on it.
_TRANSFER_GRACE_S = 5.0


@dataclass
class _DiskWait:
    """A request waiting for its prefix's blocks to be read from the disk tier: since when
    (time.monotonic()), and the block (hash) and read (the host tier's read id) it waits for."""

    since: float
    block: int
    read: int


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: tuple[list[int], ...]  # the request's whole block table after allocation, per KV cache group
    # A row scheduled a step ahead (Scheduler.schedule_ahead): the step still in flight
    # computes ``computed_ahead`` positions of the request before this row's (their KV is
    # being written) and samples ``lookahead`` tokens the host has not read yet (0 or 1; a
    # row with one takes it as its input, from the device). Both are zeroed once that step's
    # outcome is taken (``landed``), when the request's own counts include them.
    lookahead: int = 0
    computed_ahead: int = 0
    # A constrained row that samples: its next-token bitmask ([ceil(V / 32)] int32, set by the
    # engine before sampling; see engine/grammar.py).
    bitmask: Any = None
    # A speculating decode row: tokens proposed after its pending one, verified this step
    # (num_new_tokens = 1 + len; engine/speculative.py).
    draft_token_ids: list[int] = field(default_factory=list)
    state_slot: int = -1  # the request's linear-attention state slot (-1: the model has none)

    @property
    def start(self) -> int:
        """The first position this row computes."""
        return self.request.num_computed_tokens + self.computed_ahead

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its
        last position's logits give the next token (a speculating row: every position's)."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens + self.lookahead

    def landed(self) -> None:
        """The step in flight before this row's was taken: the request's counts include it."""
        self.lookahead = self.computed_ahead = 0

    @property
    def prompt_logprob_positions(self) -> range:
        """The positions of this row whose logits give prompt logprobs still to record
        (``SamplingParams.prompt_logprobs``): the runner computes their logits too."""
        return self.request.prompt_logprob_positions(self.start, self.start + self.num_new_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended while scheduling (cache too small)
    reserved: list[Request] = field(default_factory=list)  # decode tier: blocks reserved this step
    started: list[Request] = field(default_factory=list)  # scheduled for the first time this step
    # Linear-attention state copies (src slot, dst slot; engine/linear_state_cache.py): prefix
    # hits' snapshots into their rows' slots before the forward pass, and the slots of chunks
    # that ended on a snapshot boundary into snapshot slots after it.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_blocks: int, *,
                 speculator: Speculator | None = None, grammars: Grammars | None = None,
                 max_loras: int | None = None, max_waiting: int | None = None,
                 layout: KVCacheLayout | None = None, num_state_slots: int = 0,
                 num_state_snapshots: int = 0) -> None:
        """``speculator``: proposals for decoding rows (None: no speculative decoding);
        ``grammars``: what holds requests to their structured-output constraints (None:
        nothing does; the engine always gives its manager, which loads nothing until used);
        ``max_loras``: distinct adapters in one step (None: no LoRA); ``max_waiting``: the
        bound of the waiting queue for ``add_request`` (None: unbounded); ``layout``: the
        model's KV cache groups (None: one group) and ``num_state_slots`` its linear-attention
        state slots, ``num_state_snapshots`` their prefix-cache snapshots (engine/kv_cache_manager.py)."""
        if max_loras is not None and max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.config = sched
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.sliding_window,
                                 layout=layout, num_state_slots=num_state_slots,
                                 num_state_snapshots=num_state_snapshots,
                                 snapshot_interval=cache.linear_state_snapshot_interval)
        self.waiting: deque[Request] = deque()  # WAITING, PREEMPTED
        self.running: list[Request] = []  # RUNNING
        self.block_waiting: deque[Request] = deque()  # WAITING_FOR_BLOCKS, first come first served
        self.reserved: dict[str, Request] = {}  # WAITING_FOR_KV, RECEIVING_KV
        self.held: dict[str, Request] = {}  # HELD_FOR_SEND
        self.pending_free: dict[str, Request] = {}  # finished; a transfer still uses their blocks
        self.requests: dict[str, Request] = {}  # every request that holds a queue slot or blocks
        self._disk_waits: dict[str, _DiskWait] = {}  # queued requests that waited for disk reads, until admitted
        self._max_waiting: int | None = None
        self.limit_waiting(max_waiting)
        self._grammars = grammars
        self._speculator = speculator
        # (the speculator's two kinds apart: the step reads them for every decoding row)
        self._propose = speculator.propose if speculator is not None else None
        self._propose_batch = speculator.propose_batch if speculator is not None else None
        self._max_loras = max_loras
        self.spec = SpecStats()
        self.num_preemptions_total = 0
        self.prefix_queries_total = 0  # tokens looked up in the prefix cache
        self.prefix_hits_total = 0  # tokens found there
        # Of those, by where they were: the device cache, the host tier, the disk tier (read into the
        # host tier by the lookup). vLLM's cache hit sources (vllm:prompt_tokens_cached_by_source).
        self.prefix_hits_by_source = {"device": 0, "host": 0, "disk": 0}

    # ---- collaborators and limits (read-only: given at construction) ----
    @property
    def speculator(self) -> Speculator | None:
        return self._speculator

    @property
    def num_speculative_tokens(self) -> int:
        """k: the most proposals a row verifies in a step (0 without a speculator)."""
        return self._speculator.num_speculative_tokens if self._speculator is not None else 0

    @property
    def grammars(self) -> Grammars | None:
        return self._grammars

    @property
    def max_loras(self) -> int | None:
        """Distinct adapters in one step (``--max-loras``); None without LoRA."""
        return self._max_loras

    @property
    def max_waiting(self) -> int | None:
        """The bound of the waiting queue for ``add_request``; None: unbounded."""
        return self._max_waiting

    def limit_waiting(self, max_waiting: int | None) -> None:
        """Bound the waiting queue (a server's ``--max-queued-requests``, known once the
        engine is built; past it ``add_request`` raises OverflowError). None: unbounded."""
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"the waiting-queue bound must be at least 0, got {max_waiting}")
        self._max_waiting = max_waiting

    # ---- admission -------------------------------------------------------
    def check_fits(self, request: Request, whole: bool = False) -> None:
        """Raise ValueError when the request can never run on this cache. ``whole``: its prompt's
        blocks are taken at once (a reservation for a received prompt)."""
        # a windowed group holds its window and a step's chunk, unless the KV is held for a send
        # or arrives whole
        chunk = None if whole or request.hold_kv_on_finish else self.config.max_num_batched_tokens
        need = self.kv.blocks_needed(request.num_prompt_tokens + 1, chunk)
        if need > self.kv.num_blocks:
            raise ValueError(f"the prompt needs {need} KV blocks but the cache has only "
                             f"{self.kv.num_blocks}; use a shorter prompt or a larger --kv-cache-memory")

    def _admit(self, request: Request, whole: bool = False) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.check_fits(request, whole)
        self.requests[request.request_id] = request

    def add_request(self, request: Request) -> None:
        """Queue a request to be computed here (WAITING). Raises
        OverflowError when ``max_waiting`` requests already wait."""
        if self._max_waiting is not None and len(self.waiting) >= self._max_waiting:
            raise OverflowError(f"the waiting queue is full ({self._max_waiting} requests waiting to run)")
        self._admit(request)
        self.waiting.append(request)

    def add_reservation(self, request: Request) -> None:
        """Decode tier: queue a request whose prompt KV will arrive by
        transfer (WAITING_FOR_BLOCKS). Its blocks are reserved in FIFO order
        by ``schedule()``, which reports them in ``SchedulerOutput.reserved``.
        Raises OverflowError when ``max_queued_requests`` already wait."""
        if len(self.block_waiting) >= self.config.max_queued_requests:
            raise OverflowError(f"decode queue is full ({self.config.max_queued_requests} requests "
                                "waiting for KV blocks)")
        self._admit(request, whole=True)
        request.status = S.WAITING_FOR_BLOCKS
        self.block_waiting.append(request)

    def _reserve_waiting(self, out: SchedulerOutput) -> None:
        """Reserve blocks for queued reservations, in order, while they fit,
        reusing this cache's prefix hits (``num_cached_tokens``: the sender
        skips those leading blocks)."""
        deferred: list[Request] = []  # prefixes being read from disk: they keep their place
        try:
            while self.block_waiting and len(self.running) + len(self.reserved) < self.config.max_num_seqs:
                req = self.block_waiting[0]
                # The sender leaves out each group's blocks of the prefix this cache has. A hybrid
                # model's linear state arrives whole (after the last prompt token) with the KV: the
                # hit is the attention groups' blocks, with or without a state snapshot.
                hits, num_hit = self.kv.get_computed_blocks(req, with_state=False)
                if self._waits_for_disk(req, num_hit, queued=False):
                    deferred.append(self.block_waiting.popleft())
                    continue
                tiers = self._tier_hits()
                if self.kv.allocate_slots(req, req.num_prompt_tokens - num_hit, hits) is None:
                    return
                self.block_waiting.popleft()
                self._disk_waits.pop(req.request_id, None)
                self._count_prefix_hit(req, num_hit, tiers)
                req.status = S.WAITING_FOR_KV
                req.times.reserved = time.time()
                req.state_deadline = time.monotonic() + _UNSTARTED_KV_WAIT_FACTOR * self.config.kv_transfer_timeout
                self.reserved[req.request_id] = req
                out.reserved.append(req)
        finally:
            self.block_waiting.extendleft(reversed(deferred))

    # ---- KV hand-off, decode tier ----------------------------------------
    def prefill_started(self, request_id: str) -> bool:
        """The prefill server began computing the request: its KV is due
        within one transfer timeout from now."""
        req = self.reserved.get(request_id)
        if req is None or req.status != S.WAITING_FOR_KV:
            return False
        req.times.prefill_started = time.time()
        req.state_deadline = time.monotonic() + self.config.kv_transfer_timeout
        return True

    def begin_kv_receive(self, request_id: str, dst_block_ids: list[int]) -> None:
        """Check that ``dst_block_ids`` are this request's reserved blocks
        (past the ones this cache already had) and mark it RECEIVING_KV.
        Raises ValueError otherwise: no byte may land in them."""
        req = self.reserved.get(request_id)
        if req is None or req.status != S.WAITING_FOR_KV:
            state = req.status.name if req is not None else "unknown or finished"
            raise ValueError(f"request {request_id} is not waiting for KV here ({state})")
        have = self.kv.get_block_ids(request_id)
        # the leading tokens whose blocks (in every group) this cache already had: prefix hits
        skipped = self.kv.skipped_tokens(request_id, dst_block_ids)
        if skipped is None or skipped > req.num_cached_tokens:
            raise ValueError(f"request {request_id}: KV sent to blocks {dst_block_ids}, reserved {have} "
                             f"({req.num_cached_tokens} tokens cached here)")
        req.status = S.RECEIVING_KV
        req.kv_skipped_blocks = len(have) - len(dst_block_ids)
        req.times.kv_recv_start = time.time()
        req.state_deadline = time.monotonic() + self.config.kv_transfer_timeout + _TRANSFER_GRACE_S

    def kv_received(self, request_id: str, first_token: int, logprob=None,
                    transfer: dict | None = None) -> Request | None:
        """The prompt's KV is in the reserved blocks and the prefill tier
        sampled ``first_token``: the request joins the batch. Returns the
        request if it is live, None if it had already finished (its blocks
        are freed now)."""
        if self._end_transfer(request_id):
            return None
        req = self.reserved.get(request_id)
        if req is None or req.status != S.RECEIVING_KV:
            raise ValueError(f"request {request_id}: KV arrived but no receive was begun for it")
        del self.reserved[request_id]
        req.times.kv_recv_end = time.time()
        req.kv_transfer = transfer
        if transfer and transfer.get("draft") and req.kv_skipped_blocks == 0:
            req.num_draft_computed = req.num_prompt_tokens  # the draft's KV of the prompt came too
        req.num_computed_tokens = req.num_prompt_tokens
        req.times.first_scheduled = req.times.first_scheduled or time.time()
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.status = S.RUNNING
        req.state_deadline = None
        self._start_running(req)
        self._append_token(req, first_token, logprob)
        return req

    def kv_failed(self, request_id: str, message: str) -> Request | None:
        """A transfer into the request's blocks failed or was refused: it
        ends (FINISHED_ABORTED with a kv_transfer error) if it was waiting
        for or receiving KV. Returns it then, else None."""
        if self._end_transfer(request_id):
            return None
        req = self.reserved.get(request_id)
        if req is None:
            return None
        if req.status == S.RECEIVING_KV:
            req.times.kv_recv_end = time.time()
        self._finish(req, S.FINISHED_ABORTED, RequestError("kv_transfer", message), transfer_over=True)
        return req

    # ---- KV hand-off, prefill tier ---------------------------------------
    def begin_send(self, request_id: str) -> list[int]:
        """A send of the held request's blocks starts; returns the block ids it reads (less each
        group's blocks of a prefix the receiver holds: ``KVCacheManager.skip_on_send``).
        Raises ValueError if it is not held (aborted or expired meanwhile)."""
        req = self.held.get(request_id)
        if req is None or req.is_sending:
            raise ValueError(f"request {request_id} has no KV held for a send here")
        req.is_sending = True
        req.times.kv_send_start = time.time()
        req.state_deadline = time.monotonic() + self.config.kv_transfer_timeout + _TRANSFER_GRACE_S
        return self.kv.send_block_ids(request_id)

    def begin_streamed_send(self, request_id: str) -> None:
        """A send reads the running request's blocks from now on, layer by layer as its last
        prompt chunk computes them; it is held, still sending, once its first token is sampled."""
        req = self.requests[request_id]
        if req.status != S.RUNNING or not req.hold_kv_on_finish or req.is_sending:
            raise ValueError(f"request {request_id} cannot start a layer-wise send ({req.status.name})")
        req.is_sending = True
        req.times.kv_send_start = time.time()

    def release_held(self, request_id: str) -> Request | None:
        """The send ended (or will never start): the held blocks go back to
        the pool (they stay in the prefix cache until evicted)."""
        if self._end_transfer(request_id):
            return None
        req = self.held.get(request_id)
        if req is None:
            return None
        if req.is_sending:
            req.times.kv_send_end = time.time()
        req.is_sending = False
        self._finish(req, req.held_status or S.FINISHED_LENGTH, transfer_over=True)
        return req

    # ---- the step --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._order_queues()
        self._reserve_waiting(out)
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()  # ids in out.scheduled, kept alongside it (no rebuild per request)
        loras: set[str] = set()  # the step's adapters (at most max_loras)
        drafted = self._batch_proposals(budget) if self._propose_batch is not None else {}
        # Decode-first: stable sort puts requests with one token to compute first.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status != S.RUNNING:  # preempted earlier in this loop
                continue
            if self._held_by_constraint(req, out) or not self._lora_fits(req, loras):
                continue
            num_new = self.kv.chunk_len(req, req.num_computed_tokens,
                                        min(req.num_tokens - req.num_computed_tokens, budget))
            drafts = self._proposals(req, budget, drafted) if num_new == 1 else []
            if drafts and self.kv.allocate_slots(req, num_new + len(drafts)) is None:
                drafts = []  # no room for the proposals: a plain step (proposals never preempt)
            if drafts or self._allocate_or_preempt(req, num_new, out, scheduled):
                num_new += len(drafts)
                out.scheduled.append(self._row(req, num_new, out, draft_token_ids=drafts))
                scheduled.add(req.request_id)
                budget -= num_new
        if not out.preempted:
            self._schedule_waiting(budget, out, loras)
        return out

    def _row(self, req: Request, num_new: int, out: SchedulerOutput, **fields) -> ScheduledRequest:
        """The step's row of ``req``: its block tables and state slot as allocated now (and the
        snapshot of that slot after the step, where its chunk ends on a boundary)."""
        rid = req.request_id
        row = ScheduledRequest(req, num_new, self.kv.get_block_table(rid), state_slot=self.kv.state_slot(rid),
                               **fields)
        snapshot = self.kv.snapshot_after(req, row.start + num_new)
        if snapshot is not None:
            out.state_snapshots.append(snapshot)
        return row

    def _grammar_ready(self, req: Request) -> bool:
        """An unconstrained request, or one whose grammar has its next mask (not compiling,
        not complete: those wait for ``schedule``)."""
        if req.sampling_params.structured_outputs is None:
            return True
        return self._grammars is not None and self._grammars.poll(req)[0] is GrammarState.READY

    def _lora_fits(self, req: Request, loras: set[str]) -> bool:
        """Whether ``req``'s adapter can join the step's (``loras``, added to when it can): a
        step runs at most ``max_loras`` adapters; a request under another waits its turn."""
        if req.lora is None or self._max_loras is None or req.lora.name in loras:
            return True
        if len(loras) >= self._max_loras:
            return False
        loras.add(req.lora.name)
        return True

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """The next step, scheduled while ``in_flight`` (a step whose sampled tokens the host
        has not read yet) still runs: the step ``schedule()`` would make once they are read,
        if none of them ends its request. Each row of ``in_flight`` that samples decodes once
        more, a step ahead, taking as input the token in flight (these rows lead the batch, in
        ``in_flight``'s order); then, decode rows first within the budget, each other running
        request, a prefill chunk of ``in_flight`` going on past the positions in flight, and
        waiting requests where there is room. Tokens of a request that the step in flight
        finishes are computed and discarded. None, with nothing scheduled, where the schedule
        could differ from the one ``schedule()`` makes after reading the tokens: a row of
        ``in_flight`` no longer running, held for a KV send, or sampling with penalties (they
        read the tokens), a constrained request not in flight (or a chunk of one) whose
        grammar is not ready, speculation, more adapters than a step takes, a budget smaller
        than the rows in flight that sample, or blocks that would take a preemption. A
        constrained row in flight may go ahead: its next mask follows from the token in
        flight, which the engine takes before the step ahead samples
        (``LLMEngine._step_ahead``). (Blocks taken for the rows before a None are kept: their
        requests need them the step after.)"""
        loras: set[str] = set()
        if self.ahead_blocked_by(in_flight, loras) is not None:
            return None
        self._order_queues()
        rows = in_flight.scheduled
        leading = [s for s in rows if s.samples]
        in_flight_chunk = {s.request.request_id: s.num_new_tokens for s in rows if not s.samples}
        lead_ids = {s.request.request_id for s in leading}
        rest = [r for r in self.running if r.request_id not in lead_ids]
        budget = self.config.max_num_batched_tokens - len(leading)
        # (request, tokens, positions in flight before them, tokens in flight it takes as input)
        plan = [(s.request, 1, s.num_new_tokens, 1) for s in leading]
        # Decode-first, as schedule(): a stable sort over the running order.
        left = {r.request_id: r.num_tokens - r.num_computed_tokens - in_flight_chunk.get(r.request_id, 0)
                for r in rest}
        for req in sorted(rest, key=lambda r: left[r.request_id] > 1):
            if budget == 0:
                break
            if left[req.request_id] <= 0:
                continue
            done = in_flight_chunk.get(req.request_id, 0)
            num_new = self.kv.chunk_len(req, req.num_computed_tokens + done, min(left[req.request_id], budget))
            plan.append((req, num_new, done, 0))
            budget -= num_new
        out = SchedulerOutput()
        for req, num_new, done, lookahead in plan:
            if self.kv.allocate_slots(req, done + num_new) is None:
                return None
            out.scheduled.append(self._row(req, num_new, out, lookahead=lookahead, computed_ahead=done))
        self._schedule_waiting(budget, out, loras)  # (arrivals do not depend on the tokens in flight)
        self._reserve_waiting(out)  # after the rows' blocks: a None above must not drop a reservation
        return out

    def ahead_blocked_by(self, in_flight: SchedulerOutput, loras: set[str] | None = None) -> str | None:
        """Why the step after ``in_flight`` cannot be scheduled before its tokens are read, or
        None when it can (``schedule_ahead``; blocks are checked as it allocates them).
        ``loras`` collects the running requests' adapters. Whether a step so scheduled is
        queued ahead is the step planner's (engine/planner.py)."""
        loras = set() if loras is None else loras
        if not all(self._lora_fits(r, loras) for r in self.running):
            return "more adapters than one step takes"
        if self._may_speculate(self.running):
            return "proposals (a step with them is scheduled after the tokens are read)"
        for s in in_flight.scheduled:
            if s.request.status != S.RUNNING:
                return "a row in flight no longer runs"
            if s.request.hold_kv_on_finish:
                return "a row in flight is held for a KV send"
            if s.draft_token_ids:
                return "a row in flight verifies proposals"
            if s.samples and s.request.sampling_params.has_penalties:
                return "a row in flight samples with penalties (they read its tokens)"
        lead_ids = {s.request.request_id for s in in_flight.scheduled if s.samples}
        if not all(self._grammar_ready(r) for r in self.running if r.request_id not in lead_ids):
            return "a constraint not in flight is not compiled yet"
        if len(lead_ids) > self.config.max_num_batched_tokens:
            return "more rows in flight than the token budget"
        return None

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput,
                             scheduled: set[str]) -> bool:
        """Allocate ``num_new`` tokens' blocks for ``req``, preempting the
        newest running requests not in ``scheduled`` (ids already scheduled
        this step; under priority, the lowest priority first) until they fit.
        False when ``req`` itself had to go."""
        while self.kv.allocate_slots(req, num_new) is None:
            victim = self._newest_unscheduled(req, scheduled)
            if victim is req:  # priority: the lowest of those that could go
                self._preempt(req)
                out.preempted.append(req)
                return False
            if victim is None:
                # Alone and still too big: the cache cannot hold it, unless blocks held for a KV
                # transfer (sends pending, KV arriving) will come back; then it waits for them.
                if not scheduled and not (self.held or self.pending_free or self.reserved):
                    self._finish(req, S.FINISHED_LENGTH)
                    out.finished.append(req)
                    return False
                self._preempt(req)
                out.preempted.append(req)
                return False
            self._preempt(victim)
            out.preempted.append(victim)
        return True

    def _newest_unscheduled(self, req: Request, scheduled: set[str]) -> Request | None:
        """The request to preempt for ``req``'s blocks, never one scheduled this step: the newest
        other one (fcfs); under priority the last in ``running``'s order (the lowest priority,
        newest), which is ``req`` itself when no other comes after it."""
        by_priority = self.config.scheduling_policy == "priority"
        for r in reversed(self.running):
            if r is req and by_priority:
                return r
            if r is not req and r.request_id not in scheduled:
                return r
        return None

    def _queue_key(self, now: float):
        """Under ``--scheduling-policy priority``, the order of every queue: priority (lower
        first), then arrival; a request that has waited ``priority_starvation_timeout`` seconds
        since it arrived goes ahead of all that have not, in arrival order (the starvation bound)."""
        limit = self.config.priority_starvation_timeout
        return lambda r: (0, 0, r.times.arrival) if now - r.times.arrival >= limit else (1, r.priority, r.times.arrival)

    def _order_queues(self) -> None:
        """Priority policy: both waiting queues in ``_queue_key`` order (fcfs: arrival order,
        as they were queued; preempted requests at the front)."""
        if self.config.scheduling_policy != "priority":
            return
        key = self._queue_key(time.time())
        if len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=key))
        if len(self.block_waiting) > 1:
            self.block_waiting = deque(sorted(self.block_waiting, key=key))

    def _start_running(self, req: Request) -> None:
        """``req`` joins ``running``: at the end (fcfs, arrival order), or under priority in
        (priority, arrival) order, so the stable decode-first sorts of a step serve higher
        priorities first and preemption takes the lowest."""
        if self.config.scheduling_policy != "priority":
            self.running.append(req)
            return
        bisect.insort(self.running, req, key=lambda r: (r.priority, r.times.arrival))

    def _speculates(self, req: Request) -> bool:
        """Whether a decoding request may get proposals: not rows whose outputs cannot be
        verified position by position (a constraint's mask, logprobs), nor rows that never
        decode here (held for a KV send)."""
        p = req.sampling_params
        return not (req.hold_kv_on_finish or p.structured_outputs is not None or p.logprobs is not None)

    def _proposals(self, req: Request, budget: int, drafted: dict[str, list[int]]) -> list[int]:
        """Tokens to verify after a decoding request's pending one (none without a
        speculator), never past max_tokens or the step's budget."""
        if self._speculator is None or not self._speculates(req):
            return []
        k = self._proposal_len(req, budget)
        if k <= 0:
            return []
        if self._propose is None:  # proposed per step (_batch_proposals)
            return drafted.get(req.request_id, [])[:k]
        return self._propose(req, k)[:k]

    def _proposal_len(self, req: Request, budget: int) -> int:
        """How many proposals to ask for: the request's current k, never past max_tokens or
        the step's budget. k starts at ``num_speculative_tokens`` and follows the acceptance:
        after a verify step it is one more than the proposals accepted (capped), so a row whose
        proposals keep failing asks for one (a draft model then runs no extra steps for it, and
        its verify row is 2 tokens), and one whose proposals all pass grows back a token a step."""
        if self.speculation_off:
            return 0
        k = self.num_speculative_tokens if req.spec_k is None else req.spec_k
        return min(k, budget - 1, req.max_tokens - req.num_output_tokens - 1)

    @property
    def speculation_off(self) -> bool:
        """More requests run than ``disable_by_batch_size``: no proposals this step."""
        above = self._speculator.disable_by_batch_size if self._speculator is not None else None
        return above is not None and len(self.running) > above

    def _may_speculate(self, reqs: list[Request]) -> bool:
        """Whether some of ``reqs`` would get proposals next step: any that may, with a draft
        model; with n-gram, any whose known tokens give a proposal now (the next token is
        still in flight: a guess, which only decides whether the step waits for it)."""
        if self.speculation_off:
            return False
        if self._propose_batch is not None:
            return any(self._speculates(r) for r in reqs)
        if self._propose is None:
            return False
        k = self.num_speculative_tokens
        return any(self._speculates(r) and r.max_tokens - r.num_output_tokens > 2 and self._propose(r, k)
                   for r in reqs)

    def _batch_proposals(self, budget: int) -> dict[str, list[int]]:
        """The batch speculator's proposals for the running rows that decode this step (their
        blocks for the proposals taken first: a draft model writes its KV there); a row with
        no room for them gets none."""
        batch = []
        for req in self.running:
            if req.status != S.RUNNING or req.num_tokens - req.num_computed_tokens != 1 or not self._speculates(req):
                continue
            k = self._proposal_len(req, budget)
            if k > 0 and self.kv.allocate_slots(req, 1 + k) is not None:
                batch.append((req, k, self.kv.get_block_table(req.request_id)[0]))
        assert self._propose_batch is not None
        return self._propose_batch(batch) if batch else {}

    def _schedule_waiting(self, budget: int, out: SchedulerOutput, loras: set[str]) -> None:
        deferred: list[Request] = []  # constraints still compiling, adapters past max_loras: they keep their place
        while self.waiting and budget > 0 and len(self.running) + len(self.reserved) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._lora_fits(req, loras):
                deferred.append(self.waiting.popleft())
                continue
            if self._held_by_constraint(req, out):
                if self.waiting and self.waiting[0] is req:  # still waiting (not failed)
                    deferred.append(self.waiting.popleft())
                continue
            # A request that wants its prompt's logprobs computes every position of it: a cached
            # position has no logits (as in vLLM). Once they are recorded (a preempted request
            # coming back) it takes hits as any other.
            looked_up = not req.needs_prompt_logprobs
            hits, num_hit = self.kv.get_computed_blocks(req) if looked_up else ((), 0)
            if looked_up and self._waits_for_disk(req, num_hit):  # its next blocks come from disk: later
                deferred.append(self.waiting.popleft())
                continue
            num_new = self.kv.chunk_len(req, num_hit, min(req.num_tokens - num_hit, budget))
            tiers = self._tier_hits()
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            restore = self.kv.take_restore(req)  # a hybrid model's hit: its state from the snapshot
            if restore is not None:
                out.state_restores.append(restore)
            self.waiting.popleft()
            self._disk_waits.pop(req.request_id, None)
            if req.times.first_scheduled is None:  # first admission, not a resume
                req.times.first_scheduled = time.time()
                self._count_prefix_hit(req, num_hit, tiers)
                out.started.append(req)
            req.num_computed_tokens = num_hit
            req.status = S.RUNNING
            self._start_running(req)
            out.scheduled.append(self._row(req, num_new, out))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))

    def _waits_for_disk(self, req: Request, num_hit: int, queued: bool = True) -> bool:
        """After ``req``'s lookup found ``num_hit`` tokens: True while the block right after them
        is being read from the disk tier (the lookup started the read, or an earlier one did),
        so the request waits; ``queued``: it is in the waiting queue, WAITING_FOR_DISK_KV while
        it waits (a reservation stays WAITING_FOR_BLOCKS). False, and the request goes on with
        the hit it has, when nothing it needs is being read, when it has waited
        ``max_read_wait_s`` in all since its first wait, or when the block is read a second
        time after the read it waited for (read, then evicted before this lookup)."""
        host = self.kv.host
        if host is None or host.disk is None:
            return False
        rid, bs = req.request_id, self.kv.block_size
        hashes = self.kv.req_hashes.get(rid, {}).get(bs, ())
        i = num_hit // bs
        block = hashes[i] if i < min(len(hashes), (req.num_tokens - 1) // bs) else None
        read = host.reading(block) if block is not None else None
        wait = self._disk_waits.get(rid)
        now = time.monotonic()
        if read is not None and wait is not None and (
                now - wait.since >= host.max_read_wait_s or (wait.block == block and wait.read != read)):
            read = None
        if read is None:
            if queued and req.status == S.WAITING_FOR_DISK_KV:
                req.status = S.PREEMPTED if req.num_preemptions else S.WAITING
            return False
        assert block is not None
        if wait is None:
            self._disk_waits[rid] = _DiskWait(now, block, read)
        else:
            wait.block, wait.read = block, read
        if queued:
            req.status = S.WAITING_FOR_DISK_KV
        return True

    def _held_by_constraint(self, req: Request, out: SchedulerOutput) -> bool:
        """A request with a structured-output constraint runs only once its grammar is
        compiled and has taken the request's tokens: True while it compiles (the request
        waits), or when it ends here (the constraint failed to compile, or is complete:
        ``out.finished``)."""
        if self._grammars is None or req.sampling_params.structured_outputs is None:
            return False
        state, message = self._grammars.poll(req)
        if state is GrammarState.READY:
            return False
        if state is GrammarState.ERROR:
            self._finish(req, S.FINISHED_ABORTED, RequestError("invalid_constraint", f"request {req.request_id}: "
                                                                                      f"{message}"))
            out.finished.append(req)
        elif state is GrammarState.DONE:
            req.stop_reason = "constraint"
            self._finish(req, S.FINISHED_STOPPED)
            out.finished.append(req)
        return True

    def _tier_hits(self) -> tuple[int, int]:
        """The host tier's prefix hits taken so far, in blocks: (in host memory, read from disk)."""
        host = self.kv.host
        return host.hit_blocks if host is not None else (0, 0)

    def _count_prefix_hit(self, req: Request, num_hit: int, tiers_before: tuple[int, int]) -> None:
        """A request's first admission: its prompt tokens found in the prefix cache, and of
        those, by source (``tiers_before``: ``_tier_hits()`` before its allocation took them)."""
        req.num_cached_tokens = num_hit
        self.prefix_queries_total += req.num_prompt_tokens
        self.prefix_hits_total += num_hit
        host, disk = ((now - before) * self.kv.block_size for now, before in zip(self._tier_hits(), tiers_before))
        self.prefix_hits_by_source["device"] += num_hit - host - disk
        self.prefix_hits_by_source["host"] += host
        self.prefix_hits_by_source["disk"] += disk

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = S.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None],
                           logprobs: list | None = None, prompt_logprobs: list | None = None) -> list[Request]:
        """Advance token counts after the model ran ``out``; ``sampled[i]``
        is the new token of ``out.scheduled[i]`` or None for a partial chunk;
        ``prompt_logprobs[i]`` (when any row computed some): None, or (first, [Logprobs]) for
        prompt tokens ``first``, ``first + 1``, ... Returns the requests that got a token
        (finished ones included)."""
        updated = []
        if self._grammars is not None and self._grammars.num_requests:  # constrained rows' next masks, in one batch
            self._grammars.prefetch([(s.request, tok) for s, tok in zip(out.scheduled, sampled)
                                    if isinstance(tok, int) and tok >= 0 and s.request.status == S.RUNNING
                                    and s.request.sampling_params.structured_outputs is not None])
        for i, s in enumerate(out.scheduled):
            req = s.request
            if req.status != S.RUNNING:  # aborted or expired since the schedule
                continue
            tok = sampled[i]
            if prompt_logprobs is not None and prompt_logprobs[i] is not None:
                req.record_prompt_logprobs(*prompt_logprobs[i])
            if s.draft_token_ids:  # the accepted proposals, then the target's token
                tokens = list(tok)
                self.spec.record(len(s.draft_token_ids), len(tokens) - 1)
                req.spec_k = min(self.num_speculative_tokens, len(tokens))  # accepted + 1
                req.num_draft_tokens += len(s.draft_token_ids)
                req.num_accepted_draft_tokens += len(tokens) - 1
                req.num_computed_tokens += len(tokens)  # the pending token and the accepted ones have KV
                tok = tokens.pop()
                for t in tokens:
                    self._append_token(req, t, None)
                    if req.status != S.RUNNING:
                        break
                self.kv.trim(req, req.num_computed_tokens + 1)  # blocks only rejected positions took
            else:
                req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)
            self.kv.free_dead_blocks(req)
            if tok is None:
                continue
            if req.status != S.RUNNING:  # finished inside its accepted proposals
                updated.append(req)
                continue
            if tok < 0:  # the sampler's guard (SAMPLE_FAILED): this request alone fails
                if req.sampling_params.structured_outputs is not None:
                    self._finish(req, S.FINISHED_ERROR, RequestError(
                        "constraint", f"request {req.request_id}: no token meets the structured-output "
                                      f"constraint at output position {req.num_output_tokens}"))
                else:
                    self._finish(req, S.FINISHED_ABORTED, RequestError(
                        "sampling", f"request {req.request_id}: no token could be sampled (the distribution "
                                    "was not finite: NaN or infinite logits after penalties and temperature)"))
                updated.append(req)
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
        status = req.check_stop()
        if status is None and self._grammars is not None and req.sampling_params.structured_outputs is not None:
            state, message = self._grammars.poll(req)  # WAIT: still compiling, the token is taken later
            if state is GrammarState.DONE:
                status, req.stop_reason = S.FINISHED_STOPPED, "constraint"
            elif state is GrammarState.ERROR:
                status = S.FINISHED_ERROR
                req.error = RequestError("constraint", f"request {req.request_id}: {message}")
        if status is None:
            return
        if req.hold_kv_on_finish:  # prefill tier: keep the blocks until the KV is sent
            self.running.remove(req)
            req.status, req.held_status = S.HELD_FOR_SEND, status
            req.times.held = time.time()
            req.state_deadline = time.monotonic() + self.config.kv_transfer_timeout + (
                _TRANSFER_GRACE_S if req.is_sending else 0.0)
            self.held[req.request_id] = req
            return
        self._finish(req, status)

    # ---- leaving ---------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus = S.FINISHED_ABORTED,
                       error: RequestError | None = None) -> Request | None:
        """The one exit for requests stopped from outside the step (abort,
        client gone, stop string, deadline), in any state. Frees blocks, or
        defers the free while a transfer uses them. Returns the request if it
        was live here, None if unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, status, error)
        return req

    def _finish(self, req: Request, status: RequestStatus, error: RequestError | None = None,
                transfer_over: bool = False) -> None:
        rid = req.request_id
        busy = not transfer_over and (req.status == S.RECEIVING_KV or req.is_sending)
        if req.status in (S.WAITING, S.PREEMPTED, S.WAITING_FOR_DISK_KV):
            self.waiting.remove(req)
        elif req.status == S.WAITING_FOR_BLOCKS:
            self.block_waiting.remove(req)
        elif req.status in (S.WAITING_FOR_KV, S.RECEIVING_KV):
            del self.reserved[rid]
        elif req.status == S.RUNNING:
            self.running.remove(req)
        elif req.status == S.HELD_FOR_SEND:
            del self.held[rid]
        req.status, req.error, req.state_deadline = status, error or req.error, None
        req.times.finished = time.time()
        self._disk_waits.pop(rid, None)
        if self._grammars is not None:
            self._grammars.free(rid)
        if busy:
            self.pending_free[rid] = req
            return
        self.kv.forget(req)
        del self.requests[rid]

    def _end_transfer(self, request_id: str) -> bool:
        """A transfer of a request finished earlier has ended: free its blocks now."""
        req = self.pending_free.pop(request_id, None)
        if req is None:
            return False
        req.is_sending = False
        self.kv.forget(req)
        del self.requests[request_id]
        return True

    def expire(self, now: float) -> list[Request]:
        """Finish (FINISHED_ABORTED, a deadline error) every request whose
        own or current state's deadline (time.monotonic()) has passed."""
        expired = []
        for req in list(self.requests.values()):
            if req.is_finished:
                continue
            bounds = [d for d in (req.deadline, req.state_deadline) if d is not None]
            if not bounds or now < min(bounds):
                continue
            own = req.deadline is not None and now >= req.deadline
            self._finish(req, S.FINISHED_ABORTED, RequestError("deadline", _expiry_message(req, own, self.config)))
            expired.append(req)
        return expired

    # ---- introspection ---------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting to run, for blocks, or for their KV."""
        return len(self.waiting) + len(self.block_waiting) + len(self.reserved)

    def has_unfinished_requests(self) -> bool:
        """Anything a step could advance or expire (transfers in flight included)."""
        return bool(self.requests)


def _expiry_message(req: Request, own_deadline: bool, config: SchedulerConfig) -> str:
    rid, t = req.request_id, config.kv_transfer_timeout
    if own_deadline:
        return f"request {rid} ran past its deadline while {req.status.name}"
    if req.status == S.WAITING_FOR_KV and req.times.prefill_started is not None:
        return f"request {rid}: no KV arrived from the prefill tier within {t:g}s of its prefill start"
    if req.status == S.WAITING_FOR_KV:
        return (f"request {rid}: the prefill tier did not start on it within "
                f"{_UNSTARTED_KV_WAIT_FACTOR * t:g}s of the reservation")
    if req.status == S.RECEIVING_KV:
        return f"request {rid}: the KV receive did not end within {t:g}s"
    if req.status == S.HELD_FOR_SEND:
        return f"request {rid}: the KV send did not {'end' if req.is_sending else 'start'} within {t:g}s"
    return f"request {rid} expired while {req.status.name}"
