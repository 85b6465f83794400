"""Turn a growing list of output token ids into streamable text, and apply
stop strings.

Two things are held back while streaming, so nothing emitted ever has to be
taken back:

* bytes of a character that is not complete yet (byte-level BPE and byte
  fallback split multi-byte UTF-8 characters across tokens; decoding such a
  tail yields "\\ufffd"), and
* the longest tail of the text that is a proper prefix of some stop string
  (at most ``len(longest stop) - 1`` characters), so a stop string never
  leaks into the stream.

Guarantee: the concatenation of everything returned by ``add_tokens`` and
``finish`` equals the final ``output_text``, which is
``tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)``
truncated at the first stop string (see ``IncrementalDetokenizer``). Only the
output ids are decoded, never the prompt, so the text matches that decode
exactly (sentencepiece tokenizers drop the leading space of the first decoded
token; decoding with prompt context would keep it). One caveat: tokenizers
with ``clean_up_tokenization_spaces=True`` rewrite " ." to "." etc., which an
incremental decoder cannot undo across an emitted boundary.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.sampling_params import SamplingParams

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one request's output, a few tokens at a time.

    Token ids are decoded in a small window, vLLM-style:

        ids:   [0, prefix_offset)  [prefix_offset, read_offset)  [read_offset, len)
               in self._text       decoded again as context      not in self._text yet
                                   (= the last emitted window)    (maybe an incomplete char)

    The text of the new ids is ``decode(ids[prefix:]) - decode(ids[prefix:read])``;
    decoding a window that starts one step back keeps tokenizers that treat
    the first token of a decode specially (leading-space stripping) correct.

        self._text: [0, _num_emitted)   returned to the caller
                    [_num_emitted, len)  held back: might start a stop string

    A stop string matches when the text contains it. If several match, the
    one that is complete first (earliest end; ties: earliest start) wins, so
    the result does not depend on how the text was split into tokens.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        # prompt_token_ids is accepted for interface symmetry but not used as
        # decode context: see the module docstring.
        del prompt_token_ids
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]  # an empty stop would match at once
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._num_emitted = 0
        self._stop_reason: str | None = None
        self._is_finished = False

    @property
    def output_text(self) -> str:
        """Text emitted so far (held-back characters excluded). After a stop
        or ``finish()`` this is the final output text."""
        return self._text[:self._num_emitted]

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, if any."""
        return self._stop_reason

    @property
    def is_stopped(self) -> bool:
        """A stop string matched: the caller must finish the request with
        finish_reason "stop". Later tokens are ignored."""
        return self._stop_reason is not None

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Take newly generated ids; return the text that is now safe to emit."""
        if self._is_finished:
            raise RuntimeError("add_tokens() called after finish()")
        if self.is_stopped or not token_ids:
            return ""
        self._token_ids.extend(token_ids)
        return self._append(self._decode_new(flush=False), flush=False)

    def finish(self) -> str:
        """Flush everything held back (the request ended for another reason
        than a stop string). The flushed text is still checked for stop
        strings, so ``is_stopped`` may become true here. Idempotent."""
        if self._is_finished or self.is_stopped:
            self._is_finished = True
            return ""
        self._is_finished = True
        return self._append(self._decode_new(flush=True), flush=True)

    def _decode(self, token_ids: list[int]) -> str:
        text: str = self._tokenizer.decode(
            token_ids, skip_special_tokens=self._skip_special_tokens)
        return text

    def _decode_new(self, flush: bool) -> str:
        """Text of ids[read_offset:], or "" while it ends in an incomplete
        character (unless flushing). Advances the window when it returns text."""
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. only skipped special tokens so far
        if full_text.endswith(_INCOMPLETE) and not flush:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full_text[len(prefix_text):]

    def _append(self, new_text: str, flush: bool) -> str:
        """Add decoded text, look for stop strings, return what may be emitted."""
        # Every match ending before the new text was found on an earlier call.
        search_from = max(0, len(self._text) - self._max_stop_len + 1)
        self._text += new_text
        match = self._find_stop(search_from)
        if match is not None:
            start, stop = match
            self._text = self._text[:start + len(stop) if self._include_stop else start]
            self._stop_reason = stop
            flush = True
        held = 0 if flush else self._num_held_back()
        end = max(self._num_emitted, len(self._text) - held)
        delta = self._text[self._num_emitted:end]
        self._num_emitted = end
        return delta

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = self._text.find(stop, search_from)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_held_back(self) -> int:
        """Length of the longest tail of the text that could start a stop string."""
        text = self._text
        for n in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0
