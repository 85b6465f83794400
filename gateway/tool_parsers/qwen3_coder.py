"""Qwen3-Coder's XML calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags, less one newline on each side, typed
by the tool's JSON schema: ``integer``, ``number``, ``boolean`` and ``null`` from their
text, ``object`` and ``array`` from JSON (or a Python literal, which the model's chat
template writes for them), ``string`` as written; a value that does not read as its
type, or a parameter the schema does not name, is the string. Several types (a list,
``anyOf``) are tried with ``string`` last. The arguments stream a parameter at a time
(each is sent once its closing tag is read), as JSON. ``<tool_call>`` may be left out
(the model sometimes starts at ``<function=``); a parameter with no ``</parameter>`` ends
at the next parameter or at ``</function>``. The content is the text before the first
call. The constraint is xgrammar's ``qwen_xml`` style of the parameters' schema.
"""
from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from typing import Any

from gateway.tool_parsers.base import FunctionTool, ToolParser, _Call, _Split, hold_back, object_text

_NOT_READ = object()


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    TOOL_CALL, FUNCTION, PARAMETER = "<tool_call>", "<function=", "<parameter="
    END_FUNCTION, END_PARAMETER = "</function>", "</parameter>"
    _call_end = "</function>\n</tool_call>"
    _separator = "\n"
    _arguments_style = "qwen_xml"

    def _call_begin(self, name: str) -> str:
        return f"{self.TOOL_CALL}\n{self.FUNCTION}{name}>\n"

    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        starts = [j for j in (text.find(self.TOOL_CALL), text.find(self.FUNCTION)) if j >= 0]
        if not starts:
            return _Split(text if final else text[:hold_back(text, self.TOOL_CALL, self.FUNCTION)])
        out = _Split(text[:min(starts)].rstrip())
        i = text.find(self.FUNCTION, min(starts))
        while i >= 0:
            k = i + len(self.FUNCTION)
            gt = text.find(">", k)
            if gt < 0 or "\n" in text[k:gt] or gt == k:
                if gt < 0 and "\n" not in text[k:] and not final:
                    out.calls.append(_Call(None, ""))
                break
            name = text[k:gt]
            schema = _properties(tools, name)
            end = text.find(self.END_FUNCTION, gt)
            body = text[gt + 1:] if end < 0 else text[gt + 1:end]
            members = [f"{json.dumps(p, ensure_ascii=False)}: {json.dumps(_typed(v, schema.get(p)), ensure_ascii=False)}"
                       for p, v in self._parameters(body, closed=end >= 0)]
            out.calls.append(_Call(name, object_text(members, closed=end >= 0)))
            if end < 0:
                break
            i = text.find(self.FUNCTION, end)
        if final and not any(c.name is not None for c in out.calls):
            return _Split(text)
        return out

    def _parameters(self, body: str, closed: bool) -> list[tuple[str, str]]:
        """(name, value text) of each complete parameter in a function's ``body``."""
        out = []
        i = body.find(self.PARAMETER)
        while i >= 0:
            k = i + len(self.PARAMETER)
            gt = body.find(">", k)
            if gt < 0:
                break
            nxt = body.find(self.PARAMETER, gt)
            end = body.find(self.END_PARAMETER, gt)
            if end < 0 or (0 <= nxt < end):
                if nxt < 0 and not closed:
                    break  # not complete yet
                end = nxt if nxt >= 0 else len(body)
                after = end
            else:
                after = end + len(self.END_PARAMETER)
            value = body[gt + 1:end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            out.append((body[k:gt], value))
            i = body.find(self.PARAMETER, after)
        return out


def _properties(tools: Mapping[str, FunctionTool] | None, name: str) -> dict[str, Any]:
    tool = (tools or {}).get(name)
    properties = tool.parameters.get("properties") if tool is not None else None
    return properties if isinstance(properties, dict) else {}


def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    types = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types += _types(sub)
    if not types and "enum" in schema:
        types = ["string"]
    return types


def _typed(value: str, schema: Any) -> Any:
    """``value`` as its schema's type (module docstring)."""
    types = _types(schema)
    for t in sorted(dict.fromkeys(types), key=lambda t: t == "string"):
        read = _read(value, t)
        if read is not _NOT_READ:
            return read
    return value


def _read(value: str, type_: str) -> Any:
    text = value.strip()
    if type_ == "string":
        return value
    if type_ == "null":
        return None if text == "null" else _NOT_READ
    if type_ == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NOT_READ)
    if type_ == "integer":
        try:
            return int(text)
        except ValueError:
            return _NOT_READ
    if type_ == "number":
        try:
            number = float(text)
        except ValueError:
            return _NOT_READ
        if not math.isfinite(number):
            return _NOT_READ
        return int(number) if number.is_integer() and not any(c in text for c in ".eE") else number
    if type_ in ("object", "array"):
        want = dict if type_ == "object" else list
        try:
            parsed = json.loads(text)
        except ValueError:
            try:
                parsed = ast.literal_eval(text)
                json.dumps(parsed)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return _NOT_READ
        return parsed if isinstance(parsed, want) else _NOT_READ
    return _NOT_READ
