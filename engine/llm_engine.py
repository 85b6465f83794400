"""The engine: a scheduler and a model runner, driven one step at a time.

    out = scheduler.schedule()          # which tokens of which requests
    sampled = runner.execute(out)       # one forward pass + sampling
    scheduler.update_from_output(...)   # advance token counts, finish

Not thread-safe: one thread owns an engine (the servers run it in a
dedicated loop thread and talk to it through queues).
"""
from __future__ import annotations

import logging
from typing import Sequence

from engine.config import EngineArgs, EngineConfig
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        logger.info("engine config: %s", config.describe())
        self.config = config
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks)
        mc, sc = config.model, config.scheduler
        capacity = self.runner.num_blocks * config.cache.block_size
        logger.info("KV cache blocks: %d (%d tokens, %.1f MiB)", self.runner.num_blocks, capacity,
                    self.runner.num_blocks * self.runner.block_bytes / 2**20)
        if capacity < sc.max_model_len:
            logger.warning("the KV cache holds %d tokens, less than --max-model-len %d", capacity,
                           sc.max_model_len)
        self.eos_token_ids = mc.eos_token_ids

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     arrival_time: float | None = None) -> Request:
        """Validate and build a request (not yet queued)."""
        max_len = self.config.scheduler.max_model_len
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens. However, the "
                             f"prompt has {n} tokens; at least one token must remain for generation.")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for vocabulary size {vocab}")
        params.validate()
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids, max_len, arrival_time)
        self.scheduler.check_fits(req)
        return req

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None) -> Request:
        req = self.make_request(request_id, prompt_token_ids, params, arrival_time)
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        return self.scheduler.finish_request(request_id, status)

    def step(self) -> list[Request]:
        """One engine step. Returns the requests that got a token or finished."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return out.finished
        sampled, logprobs = self.runner.execute(out)
        return out.finished + self.scheduler.update_from_output(out, sampled, logprobs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()
