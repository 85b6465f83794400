"""What every tool-call format shares: the request's tools (``FunctionTool``), the parser
interface (``ToolParser``) and the stream that turns a parser's view of the text so far
into OpenAI's deltas (``ToolCallStream``); what a request allows of its tools is
``ToolPlan`` (gateway/tool_parsers/plan.py).

Parsing is one pure function of the text generated so far, ``split(text, final)``: the
content before the first call and each call's name and arguments. It is monotone (what
it reports only grows as text is added: content and each call's arguments by appending,
calls by appending), so a stream sends the difference at each delta and a whole response
is the same function applied once (``ToolPlan.parse``): streamed and non-streamed answers
agree. Content is held back while its end could still turn out to be the start of a
call. A call counts from the moment its name is read; until then nothing of it is sent,
and an answer in which no call was named is all content.

The constraint (``tool_choice`` required or a named function) is an xgrammar structural
tag: ``tags_with_separator`` of one ``tag`` per allowed function, whose ``begin`` is the
call's fixed text up to the arguments (the name included, so a call cannot name another
function), whose content is the function's parameters schema (in the format's own style:
JSON, or Qwen's XML parameters) and whose ``end`` closes the call, inside the fixed text
that opens and closes a list of calls where the format has one; ``stop_after_first``
unless parallel calls are allowed. A format whose arguments no schema style describes
(pythonic calls) has no constraint of its own: required and named calls then use the
JSON form (``JsonCallsToolParser``), as they do with no ``--tool-call-parser`` at all.
"""
from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.structured_outputs import StructuredOutputsParams

# Whitespace between the JSON tokens of tool arguments under a constraint (xgrammar needs
# a positive bound): a small model cannot fill max_tokens with blanks.
_ARGUMENTS_MAX_WHITESPACE = 1
# The arguments key, then the value: ``{"name": "f", "arguments": `` (or "parameters").
_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


@dataclass(frozen=True)
class FunctionTool:
    """One OpenAI function tool, as the request gave it."""

    name: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object
    description: str | None = None
    strict: bool | None = None

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates expect it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """What a stream chunk carries of call ``index``: the first one has the id and the
    name (and possibly arguments), later ones more of the arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message: its text before the calls (None: none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class _Call:
    name: str | None  # None: not known yet, nothing of this call can be sent
    arguments: str  # the arguments' JSON text so far (grows by appending only)


@dataclass
class _Split:
    content: str  # grows by appending only
    calls: list[_Call] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolParser(ABC):
    """A model family's tool-call format: its constraint and its parser."""

    name: str = ""
    # Whether the format's markers are special tokens the detokenizer would drop
    # (Mistral's [TOOL_CALLS]): requests with tools then keep special tokens in the text.
    keeps_special_tokens: bool = False
    # Whether a structural tag can force calls in this format (module docstring).
    has_constraint: bool = True

    _calls_begin: str = ""  # fixed text before the first call (a list's opening)
    _calls_end: str = ""  # and after the last
    _call_end: str = ""
    _separator: str = ""
    _arguments_style: str = "json"  # xgrammar's JSONSchemaFormat.style

    def constraint(self, tools: Sequence[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        """The structural tag that makes the model call one of ``tools`` (at least once;
        once only unless ``parallel``)."""
        tags = [{"type": "tag", "begin": self._call_begin(t.name),
                 "content": {"type": "json_schema", "json_schema": t.parameters, "style": self._arguments_style,
                             "max_whitespace_cnt": _ARGUMENTS_MAX_WHITESPACE},
                 "end": self._call_end} for t in tools]
        calls: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": self._separator,
                                 "at_least_one": True, "stop_after_first": not parallel}
        if self._calls_begin or self._calls_end:
            parts = [{"type": "const_string", "value": s} for s in (self._calls_begin,) if s]
            parts += [calls] + [{"type": "const_string", "value": s} for s in (self._calls_end,) if s]
            calls = {"type": "sequence", "elements": parts}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": calls},
                                                                 ensure_ascii=False))

    def _call_begin(self, name: str) -> str:
        """A call's fixed text up to its arguments value."""
        raise NotImplementedError(f"{self.name} calls are not constrained in their own format")

    @abstractmethod
    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        """Content and calls of ``text`` (module docstring); ``final``: no more text
        comes; ``tools``: the request's tools by name (for formats whose arguments are
        typed by the schema)."""


class ToolCallStream:
    """One request's streamed answer: text deltas in, content and call deltas out."""

    def __init__(self, parser: ToolParser, parallel: bool = True,
                 tools: Mapping[str, FunctionTool] | None = None) -> None:
        self._parser = parser
        self._parallel = parallel
        self._tools = tools
        self._text = ""
        self._num_content = 0  # characters of content sent
        self._sent: list[tuple[str, int]] = []  # per call sent: its id, characters of arguments sent

    @property
    def num_calls(self) -> int:
        return len(self._sent)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(new content, new call deltas) after ``text``; ``final`` on the last delta."""
        self._text += text
        split = self._parser.split(self._text, final, self._tools)
        content = split.content[self._num_content:]
        self._num_content = max(self._num_content, len(split.content))
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(split.calls):
            if call.name is None or (index >= 1 and not self._parallel):
                break
            if index == len(self._sent):
                self._sent.append((new_call_id(), len(call.arguments)))
                deltas.append(ToolCallDelta(index, call.arguments, self._sent[index][0], call.name))
                continue
            call_id, num_sent = self._sent[index]
            if len(call.arguments) > num_sent:
                deltas.append(ToolCallDelta(index, call.arguments[num_sent:]))
                self._sent[index] = (call_id, len(call.arguments))
        return content, deltas


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """A natural end after a call is OpenAI's "tool_calls"."""
    return "tool_calls" if reason == "stop" and num_calls else reason


def read_call_object(body: str, complete: bool) -> _Call | None:
    """The call in ``body``, a ``{"name": ..., "arguments" (or "parameters"): ...}``
    object, possibly cut short; its arguments are the model's own JSON text when the
    name comes first. None: ``body`` is complete and is no call object."""
    m = _NAME_FIRST.match(body)
    name = _json_string(m.group(1)) if m is not None else None
    if m is not None and name is not None:
        return _Call(name, json_value_prefix(body, m.end())[0])
    if not complete:
        return _Call(None, "")
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return _Call(obj["name"], json.dumps(arguments, ensure_ascii=False))


def json_value_prefix(s: str, start: int) -> tuple[str, int | None]:
    """(the JSON value starting at ``s[start]`` as far as it is written, the index after
    it or None while it is incomplete). Of an incomplete value, trailing whitespace
    outside a string is left out: it may be no part of the value."""
    end, in_string = value_end(s, start)
    if end is not None:
        return s[start:end], end
    return (s[start:] if in_string else s[start:].rstrip()), None


def _json_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:  # a bad escape
        return None


def value_end(s: str, i: int) -> tuple[int | None, bool]:
    """(index after the JSON value starting at ``s[i]``, or None while it is incomplete;
    whether ``s`` ends inside a string). Brackets are counted, not matched: the JSON is
    the model's, the client parses it."""
    if i >= len(s):
        return None, False
    if s[i] not in '{["':
        m = _SCALAR.match(s, i)
        return (m.end(), False) if m is not None and m.end() < len(s) else (None, False)
    depth, in_string, escaped = 0, False, False
    for k in range(i, len(s)):
        ch = s[k]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return k + 1, False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return k + 1, False
    return None, in_string


def hold_back(text: str, *markers: str) -> int:
    """How much of ``text`` is content for sure: all but a trailing start of any of
    ``markers`` and the whitespace before it (which would not be content if the marker
    follows)."""
    n = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                n = min(n, len(text) - k)
                break
    return len(text[:n].rstrip())


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def object_text(members: Sequence[str], closed: bool) -> str:
    """A JSON object's text built member by member (``"key": value`` each): it only grows
    as members are added and when it closes, so it streams like the model's own JSON."""
    return "{" + ", ".join(members) + ("}" if closed else "")
