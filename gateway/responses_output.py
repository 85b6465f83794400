"""OpenAI's Responses API response object and stream events, built from a chat answer's
deltas (the request ran as a chat request: gateway/responses_protocol.py).

One formatter per request. Its answer (``ChatStream``: reasoning, content and tool calls,
as chat completions split them) becomes output items in the order they begin:

    reasoning (a --reasoning-parser's)  {type: reasoning, id: rs_..., summary: [],
                                         content: [{type: reasoning_text, text}]}
    content                             {type: message, id: msg_..., role: assistant,
                                         content: [{type: output_text, text, annotations: []}]}
    each tool call                      {type: function_call, id: fc_..., call_id, name, arguments}

An answer with neither content nor calls still has an (empty) message. Streamed, each item
is ``response.output_item.added``, its deltas (``response.content_part.added`` then
``response.output_text.delta`` or ``response.reasoning_text.delta``;
``response.function_call_arguments.delta``), its ``.done`` events and
``response.output_item.done``, closed when the next item begins or the answer ends; the
stream opens with ``response.created`` and ``response.in_progress`` and ends with
``response.completed``, ``response.incomplete`` (max_output_tokens reached) or
``response.failed`` (no token met the request's constraint, or the request was aborted),
each carrying the whole response. Every event has a ``sequence_number`` counting from 0;
SSE events are named by their type, and no ``[DONE]`` follows (as OpenAI sends them). The
non-streamed body is the final response of the same events, so both carry the same output.

Usage: ``input_tokens`` (``input_tokens_details.cached_tokens``; ``cache_write_tokens`` 0:
there is no explicit prompt cache), ``output_tokens``, ``total_tokens``;
``output_tokens_details.reasoning_tokens`` counts the output tokens of the deltas that
carried reasoning text (a thinking model's ``</think>`` token, which carries none, is not).
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.openai_responses import ResponseFormatter
from gateway.output_processor import GenerationDelta, Usage
from gateway.reasoning_parsers import ChatStream
from gateway.sse import sse_event
from gateway.tool_parsers import ToolCallDelta

# finish_reason -> (the response's status, its last event)
_ENDS = {"stop": ("completed", "response.completed"), "length": ("incomplete", "response.incomplete"),
         "abort": ("cancelled", "response.failed"), "error": ("failed", "response.failed")}


def response_id(request_id: str) -> str:
    """``resp_...`` from the gateway's request id (``resp-<hex>``, or the client's own)."""
    return "resp_" + request_id.removeprefix("resp-")


@dataclass
class _Item:
    """One output item being written: its index in ``output`` and the JSON it will have."""

    index: int
    json: dict[str, Any]
    text: list[str] = field(default_factory=list)  # a message's or a reasoning's text so far

    @property
    def id(self) -> str:
        return self.json["id"]

    @property
    def type(self) -> str:
        return self.json["type"]


class ResponsesFormatter(ResponseFormatter):
    """/v1/responses: ``response`` objects and their stream events (module docstring)."""

    object_name = "response"

    def __init__(self, request_id: str, model: str, echo: dict[str, Any], answer: ChatStream) -> None:
        """``echo``: the request's fields the response repeats (``ResponsesRequest.echo``)."""
        super().__init__(response_id(request_id), model, lambda _: "", include_usage=False, want_logprobs=False)
        self._echo = echo
        self._answer = answer
        self._sequence_number = 0
        self._output: list[dict[str, Any]] = []  # items done
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # by the answer's tool-call index
        self._reasoning_tokens = 0
        self._status = "in_progress"
        self._incomplete: dict[str, Any] | None = None
        self._error: dict[str, Any] | None = None

    # ---- the formatter interface (gateway/http_api.py) ----

    def stream_start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._body()),
                self._event("response.in_progress", response=self._body())]

    def stream_delta(self, d: GenerationDelta) -> list[dict[str, Any]]:
        new = self._answer.feed(d.token_ids, d.text, final=bool(d.finish_reason))
        events: list[dict[str, Any]] = []
        if new.reasoning:
            self._reasoning_tokens += len(d.token_ids)
            events += self._text("reasoning", new.reasoning)
        if new.content:
            events += self._text("message", new.content)
        for call in new.tool_calls:
            events += self._call(call)
        if d.finish_reason:
            events += self._finish(d)
        return events

    def response(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]:
        for d in deltas:
            self.stream_delta(d)
        return self._body()

    def stream_end(self) -> list[dict[str, Any]]:
        return []

    def sse_event(self, chunk: dict[str, Any]) -> bytes:
        return f"event: {chunk.get('type', 'error')}\n".encode() + sse_event(chunk)

    def sse_done(self) -> bytes:
        return b""

    # ---- events ----

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def _begin(self, item: dict[str, Any]) -> tuple[_Item, list[dict[str, Any]]]:
        events = self._close()
        self._open = _Item(len(self._output), item)
        return self._open, events + [self._event("response.output_item.added", output_index=self._open.index,
                                                 item=dict(item))]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """``text`` added to the open message or reasoning item (one begun if need be)."""
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item.type != kind:
            item, events = self._begin_text(kind)
        item.text.append(text)
        if kind == "message":
            return events + [self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                         content_index=0, delta=text, logprobs=[])]
        return events + [self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                     content_index=0, delta=text)]

    def _begin_text(self, kind: str) -> tuple[_Item, list[dict[str, Any]]]:
        item, events = self._begin(_new_item(kind))
        return item, events + [self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                           content_index=0, part=_part(kind, ""))]

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if call.id is not None:
            item, events = self._begin({"id": "fc_" + secrets.token_hex(12), "type": "function_call",
                                        "status": "in_progress", "call_id": call.id, "name": call.name or "",
                                        "arguments": ""})
            self._calls[call.index] = item
        item = self._calls[call.index]
        if not call.arguments:
            return events
        item.json["arguments"] += call.arguments
        return events + [self._event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=item.index, delta=call.arguments)]

    def _close(self) -> list[dict[str, Any]]:
        """The open item's ``.done`` events; it joins ``output``."""
        item, self._open = self._open, None
        if item is None:
            return []
        status = "incomplete" if self._status == "incomplete" else "completed"
        events = []
        if item.type == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                      output_index=item.index, name=item.json["name"],
                                      arguments=item.json["arguments"]))
        else:
            text = "".join(item.text)
            done = "response.output_text.done" if item.type == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item.type == "message" else {}
            events += [self._event(done, item_id=item.id, output_index=item.index, content_index=0, text=text,
                                   **extra),
                       self._event("response.content_part.done", item_id=item.id, output_index=item.index,
                                   content_index=0, part=_part(item.type, text))]
            item.json["content"] = [_part(item.type, text)]
        item.json["status"] = status
        self._output.append(item.json)
        return events + [self._event("response.output_item.done", output_index=item.index, item=dict(item.json))]

    def _finish(self, d: GenerationDelta) -> list[dict[str, Any]]:
        self._status, last_event = _ENDS.get(d.finish_reason or "", ("completed", "response.completed"))
        if d.finish_reason == "length":
            self._incomplete = {"reason": "max_output_tokens"}
        elif d.finish_reason in ("error", "abort"):
            message = d.finish_message or "the request was aborted"
            self._error = {"code": "server_error", "message": message}
        self._usage = d.usage
        events = self._close()
        if not any(item["type"] in ("message", "function_call") for item in self._output):
            events += self._begin_text("message")[1] + self._close()  # an empty message
        return events + [self._event(last_event, response=self._body())]

    # ---- the response object ----

    def _body(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": "response", "created_at": self.created, "status": self._status,
                "background": False, "error": self._error, "incomplete_details": self._incomplete,
                "model": self.model, "output": list(self._output), "previous_response_id": None, "store": False,
                "truncation": "disabled", **self._echo,
                "usage": _usage_json(self._usage, self._reasoning_tokens) if self._usage is not None else None}


def _new_item(kind: str) -> dict[str, Any]:
    if kind == "message":
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
    return {"id": "rs_" + secrets.token_hex(12), "type": "reasoning", "summary": [], "content": [],
            "status": "in_progress"}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _usage_json(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    # cache_write_tokens: those written to an explicit prompt cache (OpenAI's prompt_cache_options),
    # which pdserve does not have; its prefix cache is implicit, read as cached_tokens.
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens}
