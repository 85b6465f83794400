"""Tool calls in the model's own words: the parsers that find them in generated text,
and the structured-output constraint that makes the model write them.

    parser         the model writes a call as                                   several calls
    hermes         <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>   one block each, "\\n" between
                   (Hermes 2 Pro, Qwen2.5, Qwen3; deploy/chat_templates/hermes_tools.jinja)
    llama3_json    {"name": NAME, "parameters": {...}}, after an optional          separated by "; "
                   <|python_tag|> (Llama 3.1 / 3.2 / 3.3 JSON tool calling)
    openai         harmony commentary messages to functions.NAME (gpt-oss, with     one message each
                   --reasoning-parser gpt_oss, which parses them from the tokens:
                   gateway/reasoning_parsers.py; tool_choice auto only)

With a ``--reasoning-parser``, calls are parsed from the answer's content, after the
reasoning, never from the reasoning itself (gateway/reasoning_parsers.py).

A request's ``ToolPlan`` says what it allows (``tool_choice``):

    auto       the model writes freely; calls are parsed out of the text afterwards (no constraint)
    required   the engine's grammar forces at least one call of any of the tools, each call's
               arguments matching that tool's ``parameters`` schema (one call only without
               ``parallel_tool_calls``)
    function   (a named function) the grammar forces exactly one call of that function

The constraint is an xgrammar structural tag (``StructuredOutputsParams.structural_tag``):
``tags_with_separator`` of one ``tag`` per allowed function, whose ``begin`` is the call's
fixed text up to the arguments (the name included, so a call cannot name another
function), whose content is the function's parameters schema and whose ``end`` closes
the call; ``stop_after_first`` unless parallel calls are allowed. After each call the
grammar may end, and the engine lets the model choose there between the separator (one
more call) and its stop token.

Parsing (``ToolCallStream``) is one pure function of the text generated so far,
``split(text, final)``: the content before the first call and each call's name and
arguments. It is monotone (what it reports only grows as text is added), so a stream
sends the difference at each delta and a whole response is the same function applied
once (``ToolPlan.parse``): streamed and non-streamed answers agree. Content is held back
while its end could still turn out to be the start of a call. A call's ``arguments`` is
the model's own JSON text of the value (when the object names the function first, as
both formats do), so it streams in pieces and equals the non-streamed text. Text after
the first call that is not a call, and blocks that are not JSON call objects, are not
part of the answer; an answer with no call at all is all content.
"""
from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
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

    def constraint(self, tools: Sequence[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        """The structural tag that makes the model call one of ``tools`` (at least once;
        once only unless ``parallel``)."""
        tags = [{"type": "tag", "begin": self._call_begin(t.name),
                 "content": {"type": "json_schema", "json_schema": t.parameters,
                             "max_whitespace_cnt": _ARGUMENTS_MAX_WHITESPACE},
                 "end": self._call_end} for t in tools]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self._separator,
                 "at_least_one": True, "stop_after_first": not parallel}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": calls},
                                                                 ensure_ascii=False))

    _call_end: str = ""
    _separator: str = ""

    @abstractmethod
    def _call_begin(self, name: str) -> str:
        """A call's fixed text up to its arguments value."""

    @abstractmethod
    def split(self, text: str, final: bool) -> _Split:
        """Content and calls of ``text`` (module docstring); ``final``: no more text comes."""


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks; the content is
    the text before the first block."""

    name = "hermes"
    BEGIN, END = "<tool_call>", "</tool_call>"
    _call_end = "}\n</tool_call>"
    _separator = "\n"

    def _call_begin(self, name: str) -> str:
        return f'{self.BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def split(self, text: str, final: bool) -> _Split:
        i = text.find(self.BEGIN)
        if i < 0:
            return _Split(text if final else text[:_hold_back(text, self.BEGIN)])
        out = _Split(text[:i].rstrip())
        while i >= 0:
            start = i + len(self.BEGIN)
            j = text.find(self.END, start)
            body = text[start:] if j < 0 else text[start:j]
            call = _read_call(body, complete=j >= 0 or final)
            if call is not None:
                out.calls.append(call)
            if j < 0:
                break
            i = text.find(self.BEGIN, j + len(self.END))
        if final and not any(c.name is not None for c in out.calls):
            return _Split(text)  # no block is a call: the answer is text
        return out


class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON tool calls: the whole answer is ``{"name": ..., "parameters": ...}``
    objects separated by ``;`` (after ``<|python_tag|>`` when the tokenizer's special tokens
    are kept); an answer that does not start with ``{`` is content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    _call_end = "}"
    _separator = "; "

    def _call_begin(self, name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '

    def split(self, text: str, final: bool) -> _Split:
        k = _skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, k):
            k = _skip_ws(text, k + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[k:]):
            return _Split("")  # nothing yet, or the start of the tag
        if k >= len(text):
            return _Split(text if final else "")
        if text[k] != "{":
            return _Split(text)  # a plain answer
        out, pos = _Split(""), k
        while True:
            end, _ = _value_end(text, pos)
            call = _read_call(text[pos:end] if end is not None else text[pos:], complete=end is not None or final)
            if call is not None:
                out.calls.append(call)
            if end is None:
                break
            pos = _skip_ws(text, end)
            if not text.startswith(";", pos):
                break
            pos = _skip_ws(text, pos + 1)
            if not text.startswith("{", pos):
                break
        if final and not any(c.name is not None for c in out.calls):
            return _Split(text)  # JSON that is no call: the answer itself
        return out


class HarmonyToolParser(ToolParser):
    """gpt-oss's calls: harmony messages, parsed from the output tokens by the gpt_oss
    reasoning parser (``HarmonyChatStream``), not from text; no constraint forces them."""

    name = "openai"

    def constraint(self, tools: Sequence[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        raise ValueError("tool_choice required or a named function is not supported for gpt-oss (harmony) "
                         'tool calls; send tool_choice "auto" or "none"')

    def _call_begin(self, name: str) -> str:  # pragma: no cover - no constraint
        raise NotImplementedError

    def split(self, text: str, final: bool) -> _Split:
        return _Split(text)  # (HarmonyChatStream parses the calls)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser,
                                                            HarmonyToolParser)}


def get_parser(name: str) -> ToolParser:
    """The parser named by ``--tool-call-parser``; ValueError listing the known ones."""
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools and what it allows of them: ``choice`` "auto", "required",
    or "function" (exactly one call of ``function``)."""

    tools: tuple[FunctionTool, ...]
    choice: str
    parallel: bool
    parser: ToolParser
    function: str | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint that enforces ``required`` or a named function (None for auto)."""
        if self.choice == "auto":
            return None
        if self.choice == "required":
            return self.parser.constraint(self.tools, self.parallel)
        return self.parser.constraint([t for t in self.tools if t.name == self.function], parallel=False)

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.template_dict() for t in self.tools]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.parser, self.parallel and self.choice != "function")

    def parse(self, text: str) -> ParsedMessage:
        """The whole answer's content and calls (what a stream of it sends, assembled)."""
        stream = self.stream()
        content, deltas = stream.feed(text, final=True)
        calls: list[ToolCall] = []
        for d in deltas:
            if d.id is not None:
                calls.append(ToolCall(d.id, d.name or "", d.arguments))
            else:
                last = calls[d.index]
                calls[d.index] = ToolCall(last.id, last.name, last.arguments + d.arguments)
        return ParsedMessage(content or None, calls)


class ToolCallStream:
    """One request's streamed answer: text deltas in, content and call deltas out."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self._parser = parser
        self._parallel = parallel
        self._text = ""
        self._num_content = 0  # characters of content sent
        self._sent: list[tuple[str, int]] = []  # per call sent: its id, characters of arguments sent

    @property
    def num_calls(self) -> int:
        return len(self._sent)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(new content, new call deltas) after ``text``; ``final`` on the last delta."""
        self._text += text
        split = self._parser.split(self._text, final)
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


def _read_call(body: str, complete: bool) -> _Call | None:
    """The call in ``body`` (a call object, possibly cut short). None: ``body`` is complete
    and is no call object."""
    m = _NAME_FIRST.match(body)
    name = _json_string(m.group(1)) if m is not None else None
    if m is not None and name is not None:
        start = m.end()
        end, in_string = _value_end(body, start)
        if end is not None:
            arguments = body[start:end]
        else:  # cut short: whitespace outside a string may be no part of the value
            arguments = body[start:] if in_string else body[start:].rstrip()
        return _Call(name, arguments)
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


def _json_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:  # a bad escape
        return None


def _value_end(s: str, i: int) -> tuple[int | None, bool]:
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


def _hold_back(text: str, marker: str) -> int:
    """How much of ``text`` is content for sure: all but a trailing start of ``marker``
    and the whitespace before it (which would not be content if the marker follows)."""
    n = len(text)
    for k in range(min(len(marker) - 1, n), 0, -1):
        if text.endswith(marker[:k]):
            n -= k
            break
    return len(text[:n].rstrip())


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
