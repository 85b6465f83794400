"""Grammars of structured outputs on one engine: compiled off the engine loop, cached,
and one matcher per constrained request (xgrammar does the compiling and matching).

    register(req)      the request's grammar starts compiling (a worker thread; the
                       compiled-grammar cache is keyed by the spec's hash, LRU, bounded)
    poll(req)          a GrammarState (engine/structured_outputs.py): WAIT (compiling) |
                       READY | DONE (the grammar is complete: the request has its whole
                       output) | ERROR (message): first brings the matcher up to the
                       request's output tokens, accepting each once
    fill(rows)         the next-token bitmask of each row ([ceil(V / 32)] int32, bit v of
                       word v // 32 set: token v allowed), from its matcher
    free(request_id)   the request ended

The matcher follows the request's own tokens: ``num_accepted`` of them are in it, and
``poll`` accepts the rest. So a token sampled elsewhere (the decode tier receives the
first token from the prefill tier) is accepted when the decode tier first polls, a
token is never accepted twice, and a request recomputed after preemption keeps its
matcher (its output tokens did not change).

Ending: where the grammar may end, its mask allows the model's stop tokens beside any
continuation, so the model decides (``[a-z]+`` runs as long as the model writes
letters); the request is DONE when the matcher took a stop token, or as soon as the
mask allows nothing but stop tokens (the output is whole: a closed JSON object, the
last choice's last token), without spending a step on the stop token. ``poll`` computes
the next mask to see that, and keeps it for ``fill``.

Reasoning (``StructuredOutputsParams.reasoning_end_token_ids``, a thinking model): the
grammar constrains the answer after the reasoning, as vLLM's reasoning parsers have it.
Until the output contains that token sequence the request is READY with a mask that
allows every token (the model reasons freely, and may stop); the output tokens up to the
sequence's end never reach the matcher, which takes the tokens after it. A request whose
prompt already ended the reasoning (``enable_thinking: false``) comes without the
sequence: the gateway decides, it sees the prompt.

Compilation is bounded by ``max_compile_seconds`` from the request's arrival (or from
when the compiler became ready, the first time: it loads the tokenizer): past that
the request fails (ERROR: the servers answer INVALID_ARGUMENT), the worker
finishing in the background (a compile cannot be interrupted) and its result cached.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine.request import Request
from engine.structured_outputs import MAX_WHITESPACE, GrammarState, StructuredOutputsParams

logger = logging.getLogger(__name__)
_MAX_CACHED = 256  # compiled grammars kept (LRU)
# Masks of this many rows or more are filled on xgrammar's threads, fewer one by one: on the
# H200 machine one by one was faster at 32 rows, the threads at 64 (docs/benchmarks.md).
_BATCH_FILL_ROWS, _BATCH_FILL_THREADS = 64, "auto"


@dataclass
class _RequestGrammar:
    future: Future
    started: float  # time.monotonic() of register
    matcher: Any = None
    num_accepted: int = 0
    error: str | None = None
    mask: torch.Tensor | None = None  # [ceil(V / 32)] int32: the next token's, after num_accepted tokens
    only_stop: bool = False  # the mask allows stop tokens and nothing else (set with mask)
    # Output index where the constrained answer starts: after the reasoning's end sequence
    # (None: still reasoning; 0 without reasoning). num_accepted counts from the output's start.
    content_start: int | None = 0
    num_searched: int = 0  # output tokens searched for the reasoning's end so far


@dataclass
class GrammarManager:
    """Owns the compiler, the compiled-grammar cache and every live request's matcher.

    Cheap to create (the engine makes one at start and hands it to the scheduler): the
    tokenizer and xgrammar load at the first compile, in a compile thread, so an engine
    that serves no constrained request never loads them."""

    tokenizer_path: Path
    vocab_size: int  # the model's logits width (the bitmask covers it)
    stop_token_ids: Sequence[int]
    max_compile_seconds: float = 10.0
    _requests: dict[str, _RequestGrammar] = field(default_factory=dict)
    _cache: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _compiler: Any = None
    _compiler_ready_at: float | None = None  # time.monotonic(): the tokenizer is loaded, compiling can start
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile"))
    # Called (in a compile thread) when a compile ends: whoever drives the engine may be idle
    # waiting for work, and a request can run now.
    on_compiled: Callable[[], None] | None = None
    _stop_words: np.ndarray | None = None  # [ceil(V / 32)] int32: the stop tokens' bits
    _batch_matcher: Any = None  # xgrammar's BatchGrammarMatcher: masks of many rows on threads
    _has_tokenizer: bool = False  # check_tokenizer found one (looked for until then)
    _full_mask: torch.Tensor | None = None  # [ceil(V / 32)] int32, every bit set: no constraint

    def check_tokenizer(self) -> None:
        """ValueError when ``tokenizer_path`` has no tokenizer to compile against: a
        constrained request is refused at admission rather than failing to compile."""
        if self._has_tokenizer:
            return
        path = self.tokenizer_path
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise ValueError(f"structured outputs need the model's tokenizer, and {path} has none "
                             "(pass --tokenizer DIR)")
        self._has_tokenizer = True

    # ---- compiling ------------------------------------------------------------------------------
    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_path))
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.stop_token_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
                self._compiler_ready_at = time.monotonic()
                logger.info("structured outputs: grammar compiler ready (tokenizer %s, %d tokens)",
                            self.tokenizer_path, self.vocab_size)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind, ws = params.kind, params.any_whitespace
        json_kw = dict(any_whitespace=ws, max_whitespace_cnt=MAX_WHITESPACE if ws else None)
        if kind == "json":
            return compiler.compile_json_schema(params.json, **json_kw)
        if kind == "json_object":
            return compiler.compile_json_schema(json.dumps({"type": "object"}), **json_kw)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            import xgrammar as xgr

            return compiler.compile_grammar(xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)))
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_structural_tag(params.structural_tag)

    def _compiled(self, params: StructuredOutputsParams) -> Future:
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, params)
            future.add_done_callback(self._compile_ended)
            self._cache[key] = future
            while len(self._cache) > _MAX_CACHED:
                self._cache.popitem(last=False)
            return future

    # ---- requests -------------------------------------------------------------------------------
    def register(self, req: Request) -> None:
        """Start compiling ``req``'s grammar (once; a cached grammar is ready at once)."""
        params = req.sampling_params.structured_outputs
        if params is None or req.request_id in self._requests:
            return
        content_start = None if params.reasoning_end_token_ids else 0
        self._requests[req.request_id] = _RequestGrammar(self._compiled(params), time.monotonic(),
                                                         content_start=content_start)

    def poll(self, req: Request) -> tuple[GrammarState, str]:
        """Where ``req``'s grammar stands (module docstring); the message explains ERROR."""
        g = self._requests.get(req.request_id)
        if g is None:
            self.register(req)
            g = self._requests[req.request_id]
        if g.error is not None:
            return GrammarState.ERROR, g.error
        if g.matcher is None:
            if not g.future.done():
                # Counted from when compiling could start: loading the tokenizer (once) is not the
                # constraint's doing.
                ready = self._compiler_ready_at
                if ready is None or time.monotonic() - max(g.started, ready) <= self.max_compile_seconds:
                    return GrammarState.WAIT, ""
                g.error = (f"compiling the {req.sampling_params.structured_outputs.kind} constraint took longer "
                           f"than --max-grammar-compile-seconds {self.max_compile_seconds:g}")
                return GrammarState.ERROR, g.error
            exc = g.future.exception()
            if exc is not None:
                g.error = f"invalid {req.sampling_params.structured_outputs.kind}: {_first_line(exc)}"
                return GrammarState.ERROR, g.error
            import xgrammar as xgr

            g.matcher = xgr.GrammarMatcher(g.future.result())
        out = req.generated_token_ids
        if g.content_start is None and not self._find_reasoning_end(g, req):
            g.mask, g.only_stop = self._all_tokens(), False  # still reasoning: unconstrained
            return GrammarState.READY, ""
        while g.num_accepted < len(out):
            token = out[g.num_accepted]
            if g.matcher.is_terminated() or not g.matcher.accept_token(token):
                g.error = f"token {token} at output position {g.num_accepted} does not match the constraint"
                return GrammarState.ERROR, g.error
            g.num_accepted += 1
            g.mask = None
        if g.matcher.is_terminated():
            return GrammarState.DONE, ""
        if g.mask is None:
            self._set_masks([g])
        return (GrammarState.DONE, "") if g.only_stop else (GrammarState.READY, "")

    def _find_reasoning_end(self, g: _RequestGrammar, req: Request) -> bool:
        """Whether ``req``'s output has ended its reasoning (its end sequence is in the
        output); when it has, the matcher starts after the sequence's first occurrence."""
        end = list(req.sampling_params.structured_outputs.reasoning_end_token_ids)
        out = req.generated_token_ids
        for i in range(max(0, g.num_searched - len(end) + 1), len(out) - len(end) + 1):
            if out[i] == end[0] and list(out[i:i + len(end)]) == end:
                g.content_start = g.num_accepted = i + len(end)
                g.mask = None
                return True
        g.num_searched = len(out)
        return False

    def _all_tokens(self) -> torch.Tensor:
        """The mask that allows every token (a request still reasoning)."""
        if self._full_mask is None:
            import xgrammar as xgr

            self._full_mask = xgr.allocate_token_bitmask(1, self.vocab_size)[0].fill_(-1)
        return self._full_mask

    def _set_masks(self, grammars: list[_RequestGrammar]) -> None:
        """Each one's next mask (one batched fill on xgrammar's threads) and whether it
        allows nothing but stop tokens."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        if len(grammars) >= _BATCH_FILL_ROWS:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=_BATCH_FILL_THREADS)
            self._batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
        else:
            for i, g in enumerate(grammars):
                g.matcher.fill_next_token_bitmask(bitmask, i)
        only_stop = self._only_stop_tokens(bitmask).tolist()
        for g, mask, only in zip(grammars, bitmask, only_stop):
            g.mask, g.only_stop = mask, only

    def _only_stop_tokens(self, masks: torch.Tensor) -> torch.Tensor:
        """[N] bool: each mask ([N, W]) allows one or more stop tokens and nothing else (a
        mask allowing nothing at all is not whole output: it goes to the sampler, which
        fails the row)."""
        if self._stop_words is None:
            words = np.zeros(masks.shape[1], dtype=np.uint32)
            for t in self.stop_token_ids:
                if 0 <= t < self.vocab_size:
                    words[t // 32] |= np.uint32(1 << (t % 32))
            self._stop_words = words.view(np.int32)  # bit 31 is the sign bit, as in the masks
        m, stop = masks.numpy(), self._stop_words  # numpy: no intra-op threads for a few kB
        return torch.from_numpy(((m & stop) != 0).any(axis=1) & ((m & ~stop) == 0).all(axis=1))

    def prefetch(self, pairs: Sequence[tuple[Request, int]]) -> None:
        """Before a step's tokens are taken one by one (``poll``): accept each request's new
        ``token`` into its matcher and fill all their next masks in one batch. A token the
        matcher refuses is left for ``poll`` to report."""
        ready = []
        for req, token in pairs:
            g = self._requests.get(req.request_id)
            if g is None or g.matcher is None or g.error is not None or g.content_start is None:
                continue  # (still reasoning: poll looks for the reasoning's end)
            if g.num_accepted != req.num_generated_tokens or g.matcher.is_terminated():
                continue  # behind (poll catches it up), or ended
            if not g.matcher.accept_token(token):
                continue
            g.num_accepted += 1
            g.mask = None
            if not g.matcher.is_terminated():
                ready.append(g)
        if ready:
            self._set_masks(ready)

    def fill(self, requests: Sequence[Request]) -> torch.Tensor:
        """[len(requests), ceil(V / 32)] int32 next-token bitmasks (each request polled READY
        since its last token: the mask ``poll`` computed)."""
        return torch.stack([self._requests[req.request_id].mask for req in requests])

    def _compile_ended(self, _: Future) -> None:
        if self.on_compiled is not None:
            self.on_compiled()

    def wait(self, timeout: float) -> None:
        """Block until one of the live requests' compiles ends, or ``timeout`` seconds (an
        engine with nothing else to do, instead of stepping in a loop meanwhile)."""
        pending = [g.future for g in self._requests.values() if not g.future.done()]
        if pending:
            futures_wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location and check-failure prefixes."""
    text = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    text = _LOCATION.sub("", text)
    return _CHECK_FAILED.sub("", text).strip()


_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")  # "[22:32:00] /project/cpp/x.cc:94: "
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")
