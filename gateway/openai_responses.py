"""OpenAI response bodies and streaming chunks, built from GenerationDeltas.

One formatter per request: ``stream_start()`` / ``stream_delta()`` give the
chunk objects of a streamed response (``stream_end()`` the trailing usage
chunk when ``stream_options.include_usage``), ``response()`` the body of a
non-streamed one. Token strings in logprobs are the single-token decode.

A chat request with tools (``ToolPlan``) has its text parsed for tool calls: the
message carries ``tool_calls`` (``content`` is the text before them, or null) and a
natural end is ``finish_reason: "tool_calls"``; streamed, ``delta.tool_calls`` carries
each call's ``index``, then ``id``, ``type`` and ``function.name`` on its first chunk and
``function.arguments`` in pieces. A request that ends with ``finish_reason: "error"``
(no token met its constraint) has the reason in the choice's ``stop_reason``.

With a ``--reasoning-parser`` (gateway/reasoning_parsers.py) the message's reasoning is
``reasoning_content`` (and ``reasoning``, vLLM's newer name for it; null when there was
none) apart from ``content`` (null when empty); streamed, ``delta.reasoning_content`` (and
``delta.reasoning``) carry it as it comes, before the content's deltas.

The prompt (``PromptView``; gateway/openai_protocol.py): a completion's ``echo`` puts the
prompt's text before the choice's text and, with ``logprobs``, the prompt's tokens before
the generated ones (the first prompt token with a null logprob and top_logprobs); vLLM's
``prompt_logprobs`` is a list, null for the first prompt token and then for each a map from
token id to ``{"logprob", "rank", "decoded_token"}`` (the token's own entry, then the top-N),
in the choice of a completion and at the top of a chat completion, as vLLM places them.
Streamed, they come with the first chunk (a chat's echoed text in a chunk of its own after
the role's, as vLLM sends it).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.output_processor import GenerationDelta, Usage
from gateway.reasoning_parsers import ChatStream, plain_chat_stream
from gateway.sse import SSE_DONE, sse_event
from gateway.tool_parsers import ToolPlan
from gateway.tool_parsers import finish_reason as tool_finish_reason
from pdserve.v1 import common_pb2

TokenText = Callable[[int], str]


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


@dataclass(frozen=True)
class PromptView:
    """What a response shows of the prompt: its ``token_ids``; ``echo_text``, the text the
    answer starts with (None: no echo); ``echo_top``, the top-N each echoed prompt token
    shows in the logprobs (the request's ``logprobs``); ``prompt_logprobs``, the top-N of
    vLLM's ``prompt_logprobs`` field (None: not asked for)."""

    token_ids: Sequence[int] = ()
    echo_text: str | None = None
    echo_top: int = 0
    prompt_logprobs: int | None = None


class ResponseFormatter:
    """Shared by both endpoints: envelope, usage chunk, usage-null convention."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, token_text: TokenText, include_usage: bool,
                 want_logprobs: bool, prompt: PromptView | None = None, n: int = 1) -> None:
        """``n``: the choices (deltas carry their ``index``; gateway/choices.py)."""
        self.response_id = response_id
        self.n = n
        self.model = model
        self.created = int(time.time())
        self._token_text = token_text
        self._include_usage = include_usage
        self._want_logprobs = want_logprobs
        self._usage: Usage | None = None
        self._prompt = prompt if prompt is not None else PromptView()
        self._prompt_shown: set[int] = set()  # streamed: the choices whose first chunk carried the prompt
        self._prompt_lps: list[common_pb2.TokenLogprob] = []  # as they came with choice 0's first delta

    def _prompt_lps_of(self, d: GenerationDelta) -> list[common_pb2.TokenLogprob]:
        """The prompt's logprobs (computed once, for choice 0; every choice shows them)."""
        if d.prompt_logprobs:
            self._prompt_lps = list(d.prompt_logprobs)
        return self._prompt_lps

    def _prompt_logprobs_json(self, lps: Sequence[common_pb2.TokenLogprob]) -> list[Any] | None:
        """vLLM's ``prompt_logprobs`` (None: not asked for)."""
        n = self._prompt.prompt_logprobs
        if n is None:
            return None
        out: list[Any] = [None]
        for lp in lps:
            entry = {str(lp.token_id): self._logprob_entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, t in enumerate(lp.top[:n], start=1):
                entry.setdefault(str(t.token_id), self._logprob_entry(t.token_id, t.logprob, rank))
            out.append(entry)
        return out

    def _logprob_entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(token_id)}

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def stream_start(self) -> list[dict[str, Any]]:
        """Chunks to send before the first delta."""
        return []

    def stream_delta(self, d: GenerationDelta) -> list[dict[str, Any]]:
        """Chunks for one delta (none when it carries nothing to show)."""
        raise NotImplementedError

    def response(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]:
        """The non-streamed body from every delta of a finished request."""
        raise NotImplementedError

    def sse_event(self, chunk: dict[str, Any]) -> bytes:
        """One chunk (or an error object) framed as an SSE event."""
        return sse_event(chunk)

    def sse_done(self) -> bytes:
        """What ends the stream."""
        return SSE_DONE

    def stream_end(self) -> list[dict[str, Any]]:
        """The usage-only chunk (``choices: []``) when the client asked for it."""
        if not self._include_usage or self._usage is None:
            return []
        chunk = self._envelope(self.chunk_object_name, [])
        chunk["usage"] = usage_json(self._usage)
        return [chunk]

    def _with_usage_field(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self._include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk


def by_choice(deltas: Sequence[GenerationDelta]) -> list[tuple[int, list[GenerationDelta]]]:
    """The deltas of each choice, by index (one choice: all of them)."""
    groups: dict[int, list[GenerationDelta]] = {}
    for d in deltas:
        groups.setdefault(d.index, []).append(d)
    return sorted(groups.items())


def last_usage(deltas: Sequence[GenerationDelta]) -> dict[str, Any] | None:
    """The request's usage: the last delta's that has one (with ``n`` > 1 the last finished
    choice's, which counts them all)."""
    usage = next((d.usage for d in reversed(deltas) if d.usage is not None), None)
    return usage_json(usage) if usage is not None else None


def _finish_fields(choice: dict[str, Any], d: GenerationDelta, finish_reason: str | None) -> dict[str, Any]:
    """The choice's ``finish_reason``, and with "error" its reason in ``stop_reason``."""
    choice["finish_reason"] = finish_reason
    if d.finish_reason == "error":
        choice["stop_reason"] = d.finish_message
    return choice


class CompletionFormatter(ResponseFormatter):
    """/v1/completions: ``text_completion`` objects."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text_offsets = [0] * self.n  # per choice

    def _logprobs(self, lps: Sequence[common_pb2.TokenLogprob],
                  echoed: Sequence[common_pb2.TokenLogprob] | None = None, index: int = 0) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs of ``lps``; ``echoed``: echo's prompt logprobs, whose tokens
        come first (the first prompt token's logprob and top_logprobs null)."""
        if not self._want_logprobs:
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []

        def add(token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
            tokens.append(self._token_text(token_id))
            values.append(logprob)
            tops.append(top)
            offsets.append(self._text_offsets[index])
            self._text_offsets[index] += len(tokens[-1])

        if echoed is not None:
            ids, n = self._prompt.token_ids, self._prompt.echo_top
            by_token = dict(enumerate(echoed, start=1))  # prompt token i's
            for i, token_id in enumerate(ids):
                lp = by_token.get(i)
                add(token_id, lp.logprob if lp is not None else None,
                    {self._token_text(t.token_id): t.logprob for t in lp.top[:n]} if lp is not None else None)
        for lp in lps:
            add(lp.token_id, lp.logprob, {self._token_text(t.token_id): t.logprob for t in lp.top})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, text: str, lps: Sequence[common_pb2.TokenLogprob],
                prompt_lps: Sequence[common_pb2.TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        """Choice ``index``'s text and logprobs; ``prompt_lps``: the prompt's logprobs where the
        prompt is shown (echo, vLLM's prompt_logprobs), None where it is not."""
        echo = self._prompt.echo_text if prompt_lps is not None else None
        choice: dict[str, Any] = {"index": index, "text": text if echo is None else echo + text,
                                  "logprobs": self._logprobs(lps, prompt_lps if echo is not None else None, index)}
        if prompt_lps is not None and self._prompt.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs_json(prompt_lps)
        return choice

    def stream_delta(self, d: GenerationDelta) -> list[dict[str, Any]]:
        if d.usage is not None:
            self._usage = d.usage
        prompt_lps = self._prompt_lps_of(d)
        shows_prompt = d.index not in self._prompt_shown and (self._prompt.echo_text is not None
                                                              or self._prompt.prompt_logprobs is not None)
        if not d.text and not d.finish_reason and not (self._want_logprobs and d.logprobs) and not shows_prompt:
            return []
        self._prompt_shown.add(d.index)
        choice = _finish_fields(self._choice(d.text, d.logprobs, prompt_lps if shows_prompt else None, d.index), d,
                                d.finish_reason)
        return [self._with_usage_field(self._envelope(self.chunk_object_name, [choice]))]

    def response(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]:
        prompt_lps = [lp for d in deltas for lp in d.prompt_logprobs]
        choices = []
        for index, ds in by_choice(deltas):
            last = ds[-1]
            lps = [lp for d in ds for lp in d.logprobs]
            choices.append(_finish_fields(self._choice("".join(d.text for d in ds), lps, prompt_lps, index), last,
                                          last.finish_reason))
        body = self._envelope(self.object_name, choices)
        body["usage"] = last_usage(deltas)
        return body


class ChatFormatter(ResponseFormatter):
    """/v1/chat/completions: ``chat.completion`` and ``chat.completion.chunk`` objects."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolPlan | None = None,
                 answer: ChatStream | Sequence[ChatStream] | None = None, reasoning: bool = False,
                 **kwargs: Any) -> None:
        """``answer``: how the answer splits (reasoning, content, tool calls; default: the
        ``tools``' calls, if any, from the text), one per choice with ``n`` > 1;
        ``reasoning``: the gateway has a reasoning parser (the message carries
        ``reasoning_content``)."""
        super().__init__(*args, **kwargs)
        answers = [answer] if answer is None or isinstance(answer, ChatStream) else list(answer)
        self._answers = [a if a is not None else plain_chat_stream(tools) for a in answers]
        self._parsed = self._answers[0].parses  # content null when empty, as vLLM
        self._reasoning = reasoning

    def _token_json(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, lps: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        content = []
        for lp in lps:
            entry = self._token_json(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._token_json(t.token_id, t.logprob) for t in lp.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _chunk(self, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               finish_reason: str | None, d: GenerationDelta | None = None, index: int = 0) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if d is not None:
            _finish_fields(choice, d, finish_reason)
        return self._with_usage_field(self._envelope(self.chunk_object_name, [choice]))

    def stream_start(self) -> list[dict[str, Any]]:
        chunks = []
        for index in range(self.n):
            chunks.append(self._chunk({"role": "assistant", "content": ""}, None, None, index=index))
            if self._prompt.echo_text:  # vLLM's echo: the continued message's text, in a chunk of its own
                chunks.append(self._chunk({"content": self._prompt.echo_text}, None, None, index=index))
        return chunks

    def stream_delta(self, d: GenerationDelta) -> list[dict[str, Any]]:
        if d.usage is not None:
            self._usage = d.usage
        answer = self._answers[d.index]
        new = answer.feed(d.token_ids, d.text, final=bool(d.finish_reason))
        shows_prompt = not self._prompt_shown and self._prompt.prompt_logprobs is not None
        if (not new.reasoning and not new.content and not new.tool_calls and not d.finish_reason
                and not (self._want_logprobs and d.logprobs) and not shows_prompt):
            return []
        self._prompt_shown.add(d.index)
        delta: dict[str, Any] = {}
        if new.reasoning:  # before the content, as vLLM
            delta["reasoning_content"] = delta["reasoning"] = new.reasoning
        if new.content:
            delta["content"] = new.content
        if new.tool_calls:
            delta["tool_calls"] = [c.to_json() for c in new.tool_calls]
        finish_reason = tool_finish_reason(d.finish_reason, answer.num_calls)
        chunk = self._chunk(delta, self._logprobs(d.logprobs), finish_reason, d, d.index)
        if shows_prompt:
            chunk["prompt_logprobs"] = self._prompt_logprobs_json(d.prompt_logprobs)
        return [chunk]

    def response(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]:
        choices = []
        for index, ds in by_choice(deltas):
            last = ds[-1]
            text = "".join(d.text for d in ds)
            answer = self._answers[index].whole([t for d in ds for t in d.token_ids], text)
            message: dict[str, Any] = {"role": "assistant", "content": answer.content if self._parsed else text}
            if self._prompt.echo_text:  # vLLM's echo: the continued message's text first
                message["content"] = self._prompt.echo_text + (message["content"] or "")
            if self._reasoning:
                message["reasoning_content"] = message["reasoning"] = answer.reasoning
            if answer.tool_calls:
                message["tool_calls"] = [c.to_json() for c in answer.tool_calls]
            finish_reason = tool_finish_reason(last.finish_reason, len(answer.tool_calls))
            choices.append(_finish_fields({"index": index, "message": message,
                                           "logprobs": self._logprobs([lp for d in ds for lp in d.logprobs])},
                                          last, finish_reason))
        body = self._envelope(self.object_name, choices)
        if self._prompt.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_json([lp for d in deltas for lp in d.prompt_logprobs])
        body["usage"] = last_usage(deltas)
        return body
