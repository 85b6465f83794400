"""Formats whose calls are JSON objects naming the function first: Hermes' tagged blocks,
Llama 3's bare objects, and the JSON list that required and named calls use without a
parser of the model's own (vLLM's form). gpt-oss's harmony calls are here too: they are
parsed from tokens elsewhere, and forced by a structural tag over harmony's messages."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.structured_outputs import StructuredOutputsParams
from gateway.tool_parsers.base import (_ARGUMENTS_MAX_WHITESPACE, FunctionTool, ToolParser, _Split, hold_back,
                                       read_call_object, skip_ws, value_end)


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks; the content is
    the text before the first block."""

    name = "hermes"
    BEGIN, END = "<tool_call>", "</tool_call>"
    _call_end = "}\n</tool_call>"
    _separator = "\n"

    def _call_begin(self, name: str) -> str:
        return f'{self.BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        i = text.find(self.BEGIN)
        if i < 0:
            return _Split(text if final else text[:hold_back(text, self.BEGIN)])
        out = _Split(text[:i].rstrip())
        while i >= 0:
            start = i + len(self.BEGIN)
            j = text.find(self.END, start)
            body = text[start:] if j < 0 else text[start:j]
            call = read_call_object(body, complete=j >= 0 or final)
            if call is not None:
                out.calls.append(call)
            if j < 0:
                break
            i = text.find(self.BEGIN, j + len(self.END))
        if final and not any(c.name is not None for c in out.calls):
            return _Split(text)  # no block is a call: the answer is text
        return out


def _json_objects(text: str, pos: int, final: bool, separator: str, out: _Split) -> int | None:
    """Reads call objects from ``text[pos]`` (a ``{``) on, ``separator`` between them, into
    ``out``; the index after the last complete one (None: the last is incomplete)."""
    while True:
        end, _ = value_end(text, pos)
        call = read_call_object(text[pos:end] if end is not None else text[pos:], complete=end is not None or final)
        if call is not None:
            out.calls.append(call)
        if end is None:
            return None
        pos = skip_ws(text, end)
        if not text.startswith(separator, pos):
            return pos
        nxt = skip_ws(text, pos + 1)
        if not text.startswith("{", nxt):
            return pos
        pos = nxt


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

    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        k = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, k):
            k = skip_ws(text, k + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[k:]):
            return _Split("")  # nothing yet, or the start of the tag
        if k >= len(text):
            return _Split(text if final else "")
        if text[k] != "{":
            return _Split(text)  # a plain answer
        out = _Split("")
        _json_objects(text, k, final, ";", out)
        if final and not any(c.name is not None for c in out.calls):
            return _Split(text)  # JSON that is no call: the answer itself
        return out


class JsonCallsToolParser(ToolParser):
    """The JSON form of forced calls, for a gateway with no ``--tool-call-parser`` or a
    format with no constraint of its own (vLLM's form of ``tool_choice`` required):
    ``[{"name": ..., "parameters": {...}}, ...]``, the whole answer; a named function is
    a list of one call of it. Never parsed for ``auto``."""

    name = "json"
    _calls_begin = "["
    _calls_end = "]"
    _call_end = "}"
    _separator = ", "

    def _call_begin(self, name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '

    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        k = skip_ws(text, 0)
        if k >= len(text):
            return _Split(text if final else "")
        if text[k] != "[":
            return _Split(text)
        k = skip_ws(text, k + 1)
        if k >= len(text):
            return _Split(text if final else "")
        if text[k] != "{":
            return _Split(text)
        out = _Split("")
        _json_objects(text, k, final, ",", out)
        if final and not any(c.name is not None for c in out.calls):
            return _Split(text)
        return out


class HarmonyToolParser(ToolParser):
    """gpt-oss's calls: harmony messages, parsed from the output tokens by the gpt_oss
    reasoning parser (``HarmonyChatStream``), not from text.

    Forced calls (``required``, a named function) are one structural tag over the whole
    output, harmony's control tokens matched as tokens (never spelt out in text): an optional
    analysis message (the reasoning, any tokens but the control ones), then one call
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>``
    of an allowed function, its arguments under the function's schema. A harmony turn holds
    one call (``<|call|>`` ends it), so parallel calls change nothing. The gpt_oss reasoning
    parser starts this grammar at the first output token, not at the final channel."""

    name = "openai"
    CONTROL_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>",
                      "<|return|>")

    def constraint(self, tools: Sequence[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        def token(s: str) -> dict[str, Any]:
            return {"type": "token", "token": s}

        def text(s: str) -> dict[str, Any]:
            return {"type": "const_string", "value": s}

        analysis = [token("<|channel|>"), text("analysis"), token("<|message|>"),
                    {"type": "any_tokens", "exclude_tokens": list(self.CONTROL_TOKENS)},
                    token("<|end|>"), token("<|start|>"), text("assistant")]
        calls = [{"type": "sequence", "elements": [
            token("<|channel|>"), text(f"commentary to=functions.{t.name} "), token("<|constrain|>"), text("json"),
            token("<|message|>"), {"type": "json_schema", "json_schema": t.parameters, "style": "json",
                                   "max_whitespace_cnt": _ARGUMENTS_MAX_WHITESPACE},
            token("<|call|>")]} for t in tools]
        call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        whole = {"type": "sequence", "elements": [
            {"type": "optional", "content": {"type": "sequence", "elements": analysis}}, call]}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": whole},
                                                                 ensure_ascii=False))

    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        return _Split(text)  # (HarmonyChatStream parses the calls)
