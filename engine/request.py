"""A request as the engine sees it: token ids and how many of them have KV.

Token accounting (no prefill/decode phases): ``num_tokens`` = prompt + output
tokens known so far; ``num_computed_tokens`` = how many of them have KV in the
cache. A prefix-cache hit, a prefill chunk and a received KV transfer all just
advance ``num_computed_tokens``. The request owns these counts; the scheduler
is the only one that mutates them.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Sequence

from engine.block_hash import NONE_HASH
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is on its tier. Every non-final state has a deadline
    (``Scheduler.expire``); the scheduler is the only writer.

    local / offline:  WAITING -> RUNNING <-> PREEMPTED -> FINISHED_*
    prefill tier:     WAITING -> RUNNING -> HELD_FOR_SEND -> FINISHED_*
    decode tier:      WAITING_FOR_BLOCKS -> WAITING_FOR_KV -> RECEIVING_KV -> RUNNING -> FINISHED_*

    A waiting (or preempted) request whose prefix's next blocks are being read from the
    disk KV tier is WAITING_FOR_DISK_KV until they are in (or it stops waiting for them),
    then WAITING (PREEMPTED) again; it keeps its place in the waiting queue meanwhile.
    """

    WAITING = enum.auto()  # in the waiting queue (not yet scheduled)
    WAITING_FOR_BLOCKS = enum.auto()  # decode tier: in the FIFO reservation queue
    WAITING_FOR_KV = enum.auto()  # decode tier: blocks reserved, waiting for the prefill tier's KV
    RECEIVING_KV = enum.auto()  # decode tier: a transfer is writing into the reserved blocks
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_DISK_KV = enum.auto()  # in the waiting queue, its prefix's blocks being read from disk
    HELD_FOR_SEND = enum.auto()  # prefill tier: first token sampled, blocks kept for the KV send
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # ended by a failure of its own output (a constraint no token meets)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class RequestError:
    """Why a request ended without the caller asking: ``kind`` is
    "deadline" (a state or the caller's deadline passed), "kv_transfer"
    (the KV hand-off failed), "invalid_constraint" (its structured-output
    constraint does not compile, in time or at all), "constraint" (no token
    meets its constraint: FINISHED_ERROR), "sampling" (no valid token could be sampled
    from its logits) or "lora" (its adapter's files changed since the adapter was loaded)."""

    kind: str
    message: str


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.time()) of a request's milestones, kept by
    the scheduler; servers build their trace spans from them afterwards."""

    arrival: float = field(default_factory=time.time)
    reserved: float | None = None  # decode tier: blocks reserved
    prefill_started: float | None = None  # decode tier: the prefill server began on it
    kv_recv_start: float | None = None  # decode tier
    kv_recv_end: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    held: float | None = None  # prefill tier: blocks held for the send
    kv_send_start: float | None = None  # prefill tier
    kv_send_end: float | None = None
    finished: float | None = None


class Request:
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                 eos_token_ids: Sequence[int] = (), max_model_len: int | None = None,
                 arrival_time: float | None = None, resume_output_token_ids: Sequence[int] = (),
                 priority: int = 0) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.request_id = request_id
        # A resumed request (migrated from a server that died mid-stream): the tokens it had
        # already generated there. They are computed as part of the prompt here (KV, prefix
        # cache, transfer: ``prompt_token_ids`` holds them) but count as output for sampling
        # (the seeded step k, penalties), structured-output replay, min/max_tokens and stops:
        # ``sampling_prompt_token_ids`` / ``generated_token_ids``.
        self.resumed_token_ids: list[int] = list(resume_output_token_ids)
        self.sampling_prompt_token_ids: list[int] = list(prompt_token_ids)  # the client's prompt
        self.prompt_token_ids: list[int] = list(prompt_token_ids) + self.resumed_token_ids
        self.output_token_ids: list[int] = []  # generated here
        # resumed + output (the same list as output_token_ids when nothing was resumed)
        self.generated_token_ids: list[int] = (list(self.resumed_token_ids) if self.resumed_token_ids
                                               else self.output_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + output, appended in place
        self.sampling_params = sampling_params
        self.priority = priority  # --scheduling-policy priority: lower is served first
        self.eos_token_ids = frozenset(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first schedule)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: RequestError | None = None  # set when it was aborted by a failure, not by the caller
        self.held_status: RequestStatus | None = None  # prefill tier: the finish status once the send ends
        self.hold_kv_on_finish = False  # prefill tier: HELD_FOR_SEND instead of finishing
        self.deadline: float | None = None  # time.monotonic(); the caller's deadline, if any
        self.state_deadline: float | None = None  # time.monotonic(); the current state's own bound
        self.is_sending = False  # prefill tier: a KV send reads the held blocks now
        self.kv_transfer: dict | None = None  # decode tier: figures of the transfer that brought its KV
        self.logprobs: list = []  # per output token, when sampling_params.logprobs is set
        # sampling_params.prompt_logprobs: the Logprobs of prompt tokens 1, 2, ... (token 0 has
        # none), recorded as the chunks that compute them run; None: not computed here (not
        # asked for, or the decode tier, whose prompt the prefill tier computes)
        self.prompt_logprobs: list | None = [] if sampling_params.prompt_logprobs is not None else None
        self.lora = None  # engine.lora.config.LoRAInfo: the adapter it runs under (None: the base model)
        self.num_draft_computed = 0  # draft_model: positions whose draft-model KV is valid (engine/draft_model.py)
        self.kv_skipped_blocks = 0  # decode tier: leading blocks of the prompt cached here, not received
        self.num_draft_tokens = 0  # speculative decoding: tokens proposed for it, and accepted
        self.num_accepted_draft_tokens = 0
        # speculative decoding: proposals to ask for next (None: num_speculative_tokens); it
        # follows the acceptance (engine/scheduler.py, ``_proposal_len``)
        self.spec_k: int | None = None
        self.times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.time())
        budget = (max_model_len - len(self.prompt_token_ids)) if max_model_len else None
        wanted = sampling_params.max_tokens
        if wanted is not None and self.resumed_token_ids:
            wanted -= len(self.resumed_token_ids)  # what remains of it
            if wanted < 1:
                raise ValueError(f"the request resumes after {len(self.resumed_token_ids)} generated tokens, "
                                 f"which is already its max_tokens {sampling_params.max_tokens}")
        limits = [x for x in (wanted, budget) if x is not None]
        self.max_tokens: int = min(limits) if limits else 1 << 30  # output tokens to generate here

    @property
    def cache_root(self) -> int:
        """The parent hash of its first KV block: the base model's, or its adapter's own."""
        return self.lora.root_hash if self.lora is not None else NONE_HASH

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens counting the resumed ones: the sampler's step k."""
        return len(self.generated_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some of its prompt logprobs are still to compute (the client's prompt only: a
        resumed request's earlier output is not part of it)."""
        return self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < len(self.sampling_prompt_token_ids) - 1

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Of the positions ``start`` .. ``end - 1`` a step computes, those whose logits give a
        prompt logprob not recorded yet: position p's give prompt token p + 1's."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, len(self.sampling_prompt_token_ids) - 1))

    def record_prompt_logprobs(self, first: int, logprobs: Sequence) -> None:
        """The logprobs of prompt tokens ``first``, ``first + 1``, ...: those not recorded yet
        are kept (a chunk recomputed after a preemption adds nothing twice)."""
        assert self.prompt_logprobs is not None and first <= len(self.prompt_logprobs) + 1
        self.prompt_logprobs.extend(logprobs[len(self.prompt_logprobs) + 1 - first:])

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.generated_token_ids is not self.output_token_ids:
            self.generated_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """After a token was appended: the finished status a stop condition
        gives (eos, stop token, max_tokens / max_model_len), or None. Sets
        ``stop_reason``; the status itself is the scheduler's to set."""
        last = self.output_token_ids[-1]
        p = self.sampling_params
        if self.num_generated_tokens >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in p.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
