"""Speculative decoding's configuration (``--speculative-config``, vLLM's JSON), what the
scheduler is given to speculate with (``Speculator``) and the n-gram proposer. Torch-free:
the gateway, the config and the scheduler read it.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}

``disable_by_batch_size`` (vLLM's key): no proposals in a step while more than that many
requests run; default 64, from the H200 measurement (docs/benchmarks.md, "Speculative
decoding"): verify steps of up to 64 rows replay CUDA graphs, and above that a verify step
of the 8B shape cost 3.1x a plain one, paying only above ~76% acceptance per position;
null: never.

A decode row that speculates computes, in one step, its pending token and up to k
proposed ones (``num_speculative_tokens``); the target's logits at each of those
positions verify the proposals (engine/sampler.py, ``verify``): greedy rows keep the
proposals the target would have picked itself and then the target's own next token,
so the output is token for token what plain decoding gives; sampled rows accept a
proposal d with probability p(d) (the proposers here are deterministic: q is one-hot)
and otherwise draw from p with d removed, which keeps the target's distribution.

n-gram (prompt lookup): the longest suffix of the request's tokens, of
``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, that occurred earlier in
them (the latest such occurrence) proposes the tokens that followed it there. Free,
and good wherever the output copies its input (quoting, editing code).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from engine.request import Request

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: Path | None = None  # draft_model: a directory sharing the target's tokenizer
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE  # None: never

    def __post_init__(self) -> None:
        n = self.disable_by_batch_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"--speculative-config: disable_by_batch_size must be a positive integer or null, "
                             f"got {n!r}")
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("--speculative-config: a draft_model needs \"model\" (a directory), ngram takes none")

    @staticmethod
    def parse(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From the flag's JSON (or a dict, as YAML config files give it); None: off."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r:.80}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                 "disable_by_batch_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown} (known: {sorted(known)})")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("--speculative-config needs \"method\" and \"num_speculative_tokens\"")
        model = value.get("model")
        return SpeculativeConfig(method=value["method"], num_speculative_tokens=value["num_speculative_tokens"],
                                 prompt_lookup_min=value.get("prompt_lookup_min", 1),
                                 prompt_lookup_max=value.get("prompt_lookup_max", 4),
                                 model=Path(model) if model is not None else None,
                                 disable_by_batch_size=value.get("disable_by_batch_size",
                                                                 DEFAULT_DISABLE_BY_BATCH_SIZE))

    def describe(self) -> str:
        what = (f"n-gram lookup of {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens" if self.method == "ngram"
                else f"draft model {self.model}")
        off = (f", none above {self.disable_by_batch_size} running requests" if self.disable_by_batch_size
               else "")
        return f"{self.method} ({what}), {self.num_speculative_tokens} tokens ahead{off}"

    def record(self) -> str:
        """What a KV pair's two sides must agree on (the decode tier verifies with it)."""
        return json.dumps({"method": self.method, "k": self.num_speculative_tokens,
                           "model": str(self.model) if self.model else None}, sort_keys=True)


# A decoding request's proposals: (request, at most k) -> tokens (the n-gram lookup).
Propose = Callable[["Request", int], list[int]]
# A step's rows at once, for a proposer that runs a model (a draft): [(request, k, its block
# table)] -> {request id: tokens}; the scheduler takes the blocks for the k positions first.
ProposeBatch = Callable[[list[tuple["Request", int, list[int]]]], dict[str, list[int]]]


@dataclass(frozen=True)
class Speculator:
    """What the scheduler is given to speculate with: one proposer, per request
    (``propose``) or per step (``propose_batch``), k, and the batch size above which no
    step carries proposals (None: any)."""

    num_speculative_tokens: int
    propose: Propose | None = None
    propose_batch: ProposeBatch | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if (self.propose is None) == (self.propose_batch is None):
            raise ValueError("a Speculator proposes per request or per step: give exactly one of propose, "
                             "propose_batch")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, propose_batch: ProposeBatch | None = None) -> Speculator:
        """``--speculative-config``'s: the n-gram lookup of the request's own tokens, or, for a
        draft model, its ``propose_batch``."""
        if config.method == "draft_model":
            if propose_batch is None:
                raise ValueError("a draft_model speculator needs the draft's propose_batch")
            return cls(config.num_speculative_tokens, propose_batch=propose_batch,
                       disable_by_batch_size=config.disable_by_batch_size)
        if propose_batch is not None:
            raise ValueError("the ngram speculator proposes from each request's own tokens: no propose_batch")
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        return cls(config.num_speculative_tokens, propose=lambda req, k: ngram_propose(req.all_token_ids, k, lo, hi),
                   disable_by_batch_size=config.disable_by_batch_size)


def ngram_propose(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``lookup_max`` down to ``lookup_min`` tokens long); [] when no
    suffix occurred before."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    arr = np.asarray(tokens, dtype=np.int64)
    n = arr.shape[0]
    for size in range(min(lookup_max, n - 1), lookup_min - 1, -1):
        # windows starting at 0 .. n - size - 1: every occurrence before the suffix itself
        windows = sliding_window_view(arr[:n - 1], size)
        hits = np.flatnonzero((windows == arr[n - size:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + size
            return arr[start:start + k].tolist()
    return []
