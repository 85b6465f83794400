"""Per-request sampling parameters (the vLLM shape)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5

# Limits every request is checked against. The integer ones are what the
# int32 / int64 fields of pdserve.v1.SamplingParams hold; the float ones keep
# every intermediate of the sampler finite in float32 (logits are O(10-100)).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_TEMPERATURE = 1000.0
MIN_REPETITION_PENALTY = 1e-3
MAX_REPETITION_PENALTY = 1000.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N = 128  # n and best_of: OpenAI's bound on n (the gateway's --max-n may lower it)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. Stop strings are applied by whoever
    detokenizes (the offline ``LLM`` or the gateway), never inside the step.
    ``n`` sequences are generated from one prompt (``best_of``: that many, of which the ``n``
    with the highest cumulative logprob are returned); choice ``i`` is the request with
    ``choice(i)``'s parameters (seed + i, as vLLM), so a choice equals a single request.
    """

    n: int = 1
    best_of: int | None = None  # vLLM's: sequences generated, the best n returned (None: n)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each sampled position
    # vLLM's prompt_logprobs: for each prompt position after the first, the logprob of that
    # prompt token given the ones before, its rank and the top-N (0: the token's own only).
    # Such a request takes no prefix-cache hits for its prompt (cached positions have no logits).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # What the output must match (JSON schema, regex, choice, grammar; engine/structured_outputs.py)
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before sampling
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these tokens can be sampled (None: every token)
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # the offline API's convenience form
            spec = dict(self.structured_outputs)
            if isinstance(spec.get("json"), (dict, bool)):
                spec["json"] = json.dumps(spec["json"])
            self.structured_outputs = StructuredOutputsParams(**spec)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r:.80}")
            setattr(self, name, list(value or []))
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict) and not self.logit_bias:
            self.logit_bias = None
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.validate()

    @property
    def num_sequences(self) -> int:
        """Sequences generated: ``best_of``, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def choice(self, index: int) -> "SamplingParams":
        """Choice ``index``'s parameters: one sequence, seed + index when seeded (vLLM's rule);
        prompt logprobs only for choice 0 (the prompt's are the same for every choice), and
        the sampled tokens' logprobs for every choice of a ``best_of`` (its ranking)."""
        seed = (self.seed + index) % (INT64_MAX + 1) if self.seed is not None else None
        logprobs = self.logprobs if self.logprobs is not None or self.num_sequences == self.n else 0
        return dataclasses.replace(self, n=1, best_of=None, seed=seed, logprobs=logprobs,
                                   prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    def best(self, scores: Sequence[float]) -> list[int]:
        """Of ``num_sequences`` choices' cumulative logprobs (the sum of each one's sampled
        tokens'), the indices of the ``n`` highest, best first (ties: the lower index), as
        vLLM ranks ``best_of``."""
        return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:self.n]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` with a user-facing message naming the field on
        a bad value: wrong type, not finite, outside its range (the ranges
        fit the int32/float32/int64 fields of pdserve.v1.SamplingParams), a
        string that is not valid Unicode, too many or too long stop strings,
        or, with ``vocab_size``, a stop token id outside the vocabulary.

        Every front end (HTTP, gRPC, the offline ``LLM``) goes through here."""
        _check_int("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1, MAX_N)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and "
                                 f"best_of={self.best_of}")
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, INT32_MAX, what=f"-1 or 0 (disabled) or in [1, {INT32_MAX}]")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                     MAX_REPETITION_PENALTY)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, INT64_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r:.80}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                                 f"got one of {len(s)}")
            check_unicode(s, "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r:.80}")
        high = INT32_MAX if vocab_size is None else vocab_size - 1
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= high:
                raise ValueError(f"stop_token_ids: {t!r} is not a token id in [0, {high}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r:.80}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
            for t, bias in self.logit_bias.items():
                if not _is_int(t) or not 0 <= t <= high:
                    raise ValueError(f"logit_bias: {t!r} is not a token id in [0, {high}]")
                _check_float(f"logit_bias[{t}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            for t in self.allowed_token_ids:
                if not _is_int(t) or not 0 <= t <= high:
                    raise ValueError(f"allowed_token_ids: {t!r} is not a token id in [0, {high}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_logit_controls(self) -> bool:
        """``logit_bias`` or ``allowed_token_ids`` changes the logits before sampling."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def check_priority(priority: object, policy: str | None = None) -> None:
    """ValueError unless ``priority`` is an int32 and, under ``--scheduling-policy fcfs``, 0
    (vLLM's rule: a priority that would be ignored is refused); ``policy`` None: the range only
    (the gateway, which does not know the servers' policy)."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not -INT32_MAX - 1 <= priority <= INT32_MAX:
        raise ValueError(f"priority must be an integer in [{-INT32_MAX - 1}, {INT32_MAX}], got {priority!r:.40}")
    if priority != 0 and policy == "fcfs":
        raise ValueError(f"priority {priority} is set, but this server schedules first come first served: "
                         "start it with --scheduling-policy priority, or leave priority out")


def check_unicode(text: str, field_name: str) -> None:
    """ValueError unless ``text`` is valid Unicode (no lone surrogates, which
    JSON's \\ud800 escapes can smuggle into a Python str)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field_name} is not valid Unicode: {e.reason} at character {e.start}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: int, what: str | None = None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r:.80}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be {what or f'in [{low}, {high}]'}, got {value}")


def _check_float(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r:.80}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if not (low < value if low_open else low <= value) or not value <= high:
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")
