"""Token chunks in, client-ready deltas out: incremental detokenization,
stop strings, usage and the gateway's latency metrics.

The decode server enforces max_tokens, eos, stop_token_ids and min_tokens;
stop *strings* are matched here on the detokenized text. When one matches,
the output ends with finish_reason "stop" at the token that completed it,
and closing the chunk stream cancels the decode call.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from gateway.errors import ErrorKind, GatewayError
from gateway.metrics import GatewayMetrics
from gateway.request_flow import PreparedRequest, TokenChunk
from pdserve.v1 import common_pb2


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_proto(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                                cached_tokens=self.cached_tokens)


@dataclass
class GenerationDelta:
    """What is new since the previous delta. The last one has
    ``finish_reason`` ("stop" | "length" | "abort" | "error") and ``usage``;
    with "error", ``finish_message`` says why (no token met the constraint);
    ``stop_string`` is the stop string that ended the output, if one did."""

    token_ids: list[int]
    text: str
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    finish_message: str = ""
    stop_string: str | None = None
    # SamplingParams.prompt_logprobs: on the first delta, prompt tokens 1, 2, ...'s (token 0 has none)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    index: int = 0  # the choice's (n > 1: gateway/choices.py)


class OutputProcessor:
    """Owns one request's detokenizer and output counts."""

    def __init__(self, tokenizer: Any, req: PreparedRequest, metrics: GatewayMetrics) -> None:
        self._req = req
        self._metrics = metrics
        self._detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.sampling)
        # With stop strings, feed tokens one at a time so the output ends exactly
        # at the token that completed the match.
        self._per_token = bool(req.sampling.stop)
        self._num_output_tokens = 0
        self._num_cached_tokens = 0
        self._prompt_logprobs: list[common_pb2.TokenLogprob] = []  # not yet passed on
        self.spec = (0, 0)  # speculative decoding: (tokens proposed, accepted), as the decode server counts
        self.first_token_time: float | None = None  # time.monotonic()
        self.last_token_time: float | None = None

    async def process(self, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[GenerationDelta]:
        """Deltas until the one with a finish_reason; closes ``chunks`` when done."""
        async with aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                self._num_cached_tokens = max(self._num_cached_tokens, chunk.num_cached_tokens)
                self.spec = max(self.spec, chunk.spec)
                ids, lps, text = self._detokenize(chunk)
                self._observe(len(ids))
                self._prompt_logprobs += getattr(chunk, "prompt_logprobs", ())  # (TokenChunk's, on the first)
                if self._detok.is_stopped:
                    yield self._with_prompt(self._final(ids, lps, text, "stop"))
                    return
                if chunk.finish_reason:
                    text += self._detok.finish()
                    reason = "stop" if self._detok.is_stopped else chunk.finish_reason
                    yield self._with_prompt(self._final(ids, lps, text, reason,
                                                        chunk.finish_message if reason == "error" else ""))
                    return
                if ids or text:
                    yield self._with_prompt(GenerationDelta(ids, text, lps))
        raise GatewayError(ErrorKind.INTERNAL, f"request {self._req.request_id}: the token stream ended "
                           "without a finish reason")

    def _with_prompt(self, delta: GenerationDelta) -> GenerationDelta:
        """``delta`` with the prompt logprobs that came in the chunks so far (the first one)."""
        delta.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, []
        return delta

    def _detokenize(self, chunk: TokenChunk) -> tuple[list[int], list[common_pb2.TokenLogprob], str]:
        """(ids kept, their logprobs, new text); ids past a stop-string match are dropped."""
        ids, lps = chunk.token_ids, chunk.logprobs
        if not self._per_token:
            return ids, lps, self._detok.add_tokens(ids)
        text = ""
        for i, token_id in enumerate(ids):
            text += self._detok.add_tokens([token_id])
            if self._detok.is_stopped:
                return ids[:i + 1], lps[:i + 1], text
        return ids, lps, text

    def _observe(self, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.first_token_time = now
            self._metrics.on_first_token(now - self._req.arrival)
            self._metrics.on_tokens(num_tokens, None)
            self._req.trace.on_first_token(now - self._req.arrival)
        else:
            self._metrics.on_tokens(num_tokens, now - self.last_token_time)
        self.last_token_time = now
        self._num_output_tokens += num_tokens

    def _final(self, ids: list[int], lps: list[common_pb2.TokenLogprob], text: str,
               reason: str, message: str = "") -> GenerationDelta:
        usage = Usage(len(self._req.prompt_token_ids), self._num_output_tokens, self._num_cached_tokens)
        self._metrics.on_finished(reason, usage.prompt_tokens, time.monotonic() - self._req.arrival)
        return GenerationDelta(ids, text, lps, reason, usage, message, self._detok.stop_reason)

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached_tokens
