"""What the offline API returns (the vLLM shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    logprobs: list | None = None  # per token: Logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float | None] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then a Logprobs for each
    # following one (the logprob of that token given those before it)
    prompt_logprobs: list | None = None


@dataclass
class Logprobs:
    """Log-probabilities (of the raw logits) at one sampled position."""

    token_id: int
    logprob: float
    rank: int  # of the sampled token; 1 = most likely
    top: list[tuple[int, float]]  # top-N (token_id, logprob), most likely first
