"""Anthropic Messages API response bodies and stream events, built from the
GenerationDeltas of a chat request (gateway/anthropic_protocol.py translated it).

The answer is split as the chat endpoint splits it (``ChatStream``: reasoning, content,
tool calls) and shaped as Anthropic's content blocks: ``thinking`` (with a
``--reasoning-parser``; ``signature`` empty), ``text``, then one ``tool_use`` per call
(``id`` toolu_..., ``input`` the parsed arguments; ``{}`` where they are not a JSON
object, e.g. cut short by max_tokens). No output at all is ``content: []``.

    finish          stop_reason                               stop_sequence
    stop            tool_use (a call was made), stop_sequence   the stop string that matched
                    (a stop_sequences string ended it), else end_turn
    length          max_tokens
    abort, error    abort, error (pdserve's own, as on the OpenAI endpoints)

``usage``: ``input_tokens`` are the prompt tokens not read from a prefix cache,
``cache_read_input_tokens`` those that were (Anthropic's accounting: their sum is the
prompt), ``output_tokens`` the generated ones.

Streamed, every event is ``event: <type>`` + ``data: <json>``: ``message_start`` (usage
with the prompt's token count), ``ping``, then per block ``content_block_start``,
``content_block_delta`` (``thinking_delta`` / ``text_delta`` / ``input_json_delta``, the
arguments' JSON text in the pieces the model writes) and ``content_block_stop``, then
``message_delta`` (stop_reason, stop_sequence, the final usage) and ``message_stop``; no
``[DONE]``. An error after the stream began is an ``error`` event, and the stream ends.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.anthropic_protocol import error_body
from gateway.errors import ErrorKind
from gateway.openai_responses import ResponseFormatter, TokenText
from gateway.output_processor import GenerationDelta, Usage
from gateway.reasoning_parsers import ChatStream
from gateway.sse import sse_event
from gateway.tool_parsers import ToolCall


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens}


def stop_reason(d: GenerationDelta, num_calls: int) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of the last delta (module docstring)."""
    if d.finish_reason == "stop":
        if num_calls:
            return "tool_use", None
        return ("stop_sequence", d.stop_string) if d.stop_string is not None else ("end_turn", None)
    if d.finish_reason == "length":
        return "max_tokens", None
    return d.finish_reason, None


def openai_error_to_anthropic(error: dict[str, Any]) -> dict[str, Any]:
    """``{"message", "type", ...}`` (OpenAI's error object) in Anthropic's shape."""
    kind = next((k for k in ErrorKind if k.openai_type == error.get("type")), ErrorKind.INTERNAL)
    return error_body(kind.http_status, str(error.get("message", "")))


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` form of a parsed call's id."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesFormatter(ResponseFormatter):
    """One /v1/messages request's body or events; ``answer``: how the chat path splits it."""

    def __init__(self, response_id: str, model: str, token_text: TokenText, answer: ChatStream,
                 num_prompt_tokens: int) -> None:
        super().__init__(response_id, model, token_text, include_usage=False, want_logprobs=False)
        self._answer = answer
        self._num_prompt_tokens = num_prompt_tokens
        self._num_blocks = 0
        self._open: str | None = None  # the type of the block being streamed

    def _message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.response_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    def response(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]:
        last = deltas[-1]
        answer = self._answer.whole([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas))
        content: list[dict[str, Any]] = []
        if answer.reasoning:
            content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.content:
            content.append({"type": "text", "text": answer.content})
        content += [self._tool_use(c, tool_input(c.arguments)) for c in answer.tool_calls]
        reason, sequence = stop_reason(last, len(answer.tool_calls))
        usage = usage_json(last.usage) if last.usage is not None else {"input_tokens": self._num_prompt_tokens,
                                                                      "output_tokens": 0}
        return self._message(content, reason, sequence, usage)

    @staticmethod
    def _tool_use(call: ToolCall, arguments: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": arguments}

    def stream_start(self) -> list[dict[str, Any]]:
        usage = {"input_tokens": self._num_prompt_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": self._message([], None, None, usage)}, {"type": "ping"}]

    def stream_delta(self, d: GenerationDelta) -> list[dict[str, Any]]:
        new = self._answer.feed(d.token_ids, d.text, final=bool(d.finish_reason))
        events: list[dict[str, Any]] = []
        if new.reasoning:
            events += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": new.reasoning}))
        if new.content:
            events += self._block("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": new.content}))
        for call in new.tool_calls:
            if call.id is not None:  # a new call
                events += self._block("tool_use", self._tool_use(ToolCall(call.id, call.name or "", ""), {}),
                                      new=True)
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        if d.finish_reason:
            events += self._close()
            reason, sequence = stop_reason(d, self._answer.num_calls)
            usage = usage_json(d.usage) if d.usage is not None else {"output_tokens": 0}
            events += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage}, {"type": "message_stop"}]
        return events

    def _block(self, kind: str, start: dict[str, Any], new: bool = False) -> list[dict[str, Any]]:
        """Events that make a block of ``kind`` the open one (``new``: a fresh one even if
        one of that kind is open)."""
        if self._open == kind and not new:
            return []
        events = self._close()
        events.append({"type": "content_block_start", "index": self._num_blocks, "content_block": start})
        self._num_blocks += 1
        self._open = kind
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._num_blocks - 1, "delta": delta}

    def sse_event(self, chunk: dict[str, Any]) -> bytes:
        """A named event (its ``type``); the OpenAI error object of a failure after the
        stream began becomes Anthropic's ``error`` event."""
        if "type" not in chunk and isinstance(chunk.get("error"), dict):
            chunk = openai_error_to_anthropic(chunk["error"])
        return b"event: " + str(chunk["type"]).encode() + b"\n" + sse_event(chunk)

    def sse_done(self) -> bytes:
        return b""  # the stream ends after message_stop (or an error event)

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._num_blocks - 1}]
