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

from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()  # decode tier: blocks reserved, KV transfer in flight
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.time()) of a request's milestones."""

    arrival: float = field(default_factory=time.time)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Request:
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                 eos_token_ids: Sequence[int] = (), max_model_len: int | None = None,
                 arrival_time: float | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output, appended in place
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first schedule)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.hold_kv_on_finish = False  # prefill tier: keep blocks after finishing until the KV is sent
        self.logprobs: list = []  # per output token, when sampling_params.logprobs is set
        self.times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.time())
        budget = (max_model_len - len(self.prompt_token_ids)) if max_model_len else None
        limits = [x for x in (sampling_params.max_tokens, budget) if x is not None]
        self.max_tokens: int = min(limits) if limits else 1 << 30

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
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """After a token was appended: set a finished status if a stop
        condition holds (eos, stop token, max_tokens / max_model_len)."""
        last = self.output_token_ids[-1]
        p = self.sampling_params
        if self.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in p.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
