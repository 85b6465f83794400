"""Pythonic calls (Llama 3.2 / 4 with their pythonic templates, ToolACE, Gemma-style
prompts): a Python list of calls with keyword arguments,

    [get_weather(city="Paris", days=3), get_time(tz='UTC')]

optionally inside ``<|python_start|>`` ... ``<|python_end|>`` (Llama 4) or after
``<|python_tag|>``. Each call is read with Python's ``ast`` (never evaluated): the
function is a name (dotted names allowed), every argument a keyword whose value is a
literal (strings, numbers, True/False/None, and JSON's true/false/null, lists, dicts,
tuples); its arguments are that dict as JSON. A call is sent whole when its closing
parenthesis arrives, so a stream sends each call as one delta. The content is the text
before the list; text after it is no part of the answer. A list whose first call is not
such a call is content.

No schema style describes keyword arguments, so ``tool_choice`` required and named
calls use the JSON form (gateway/tool_parsers/json_formats.py) under this parser.
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.tool_parsers.base import FunctionTool, ToolParser, _Call, _Split, hold_back, skip_ws

_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
# What may still become a list's start at the end of the text.
_PARTIAL_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")
_CALL_NAME = re.compile(r"[A-Za-z_][\w.]*")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_MARKERS = ("<|python_start|>", "<|python_tag|>")


class PythonicToolParser(ToolParser):
    name = "pythonic"
    has_constraint = False

    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        start, body = _list_start(text)
        if start is None:
            if final:
                return _Split(text)
            return _Split(text[:_held(text)])
        out = _Split(text[:start].rstrip())
        k = skip_ws(text, body + 1)  # after "["
        while True:
            m = _CALL_NAME.match(text, k)
            if m is None:
                break
            close = _closing_paren(text, skip_ws(text, m.end()))
            if close is None:
                break  # not complete yet (or never)
            arguments = _call_arguments(text[k:close + 1])
            if arguments is None:
                break  # not a call of literals: it and what follows are not calls
            out.calls.append(_Call(m.group(0), arguments))
            k = skip_ws(text, close + 1)
            if not text.startswith(",", k):
                break
            k = skip_ws(text, k + 1)
        if not out.calls:
            return _Split(text) if final else _Split(out.content)
        return out


def _list_start(text: str) -> tuple[int | None, int]:
    """(where the calls begin, markers included: None if nowhere; the index of the list's ``[``)."""
    m = _START.search(text)
    if m is None:
        return None, 0
    start = m.start()
    before = text[:start].rstrip()
    for marker in _MARKERS:
        if before.endswith(marker):
            return len(before) - len(marker), m.start()
    return start, m.start()


def _held(text: str) -> int:
    """How much of ``text`` (with no list start in it) is content for sure: not a
    trailing start of a list or of a marker, nor a marker with only blanks after it."""
    m = _PARTIAL_START.search(text)
    head = (text[:m.start()] if m is not None else text).rstrip()
    for marker in _MARKERS:
        if head.endswith(marker):
            head = head[:-len(marker)]
    return hold_back(head, *_MARKERS)


def _closing_paren(text: str, i: int) -> int | None:
    """The index of the ``)`` that closes the ``(`` at ``text[i]`` (strings and brackets
    skipped); None while it is not written."""
    if not text.startswith("(", i):
        return None
    depth, quote, k = 0, "", i
    while k < len(text):
        ch = text[k]
        if quote:
            if ch == "\\":
                k += 1
            elif text.startswith(quote, k):
                k += len(quote) - 1
                quote = ""
        elif ch in "\"'":
            quote = ch * 3 if text.startswith(ch * 3, k) else ch
            k += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return k if ch == ")" else None
        k += 1
    return None


def _call_arguments(source: str) -> str | None:
    """The keyword arguments of the call ``source`` as JSON text; None if it is no call
    of a name with literal keyword arguments only."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or node.args or not _is_name(node.func):
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = _literal(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a set, bytes, a complex number, inf
        return None


def _is_name(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) or (isinstance(node, ast.Attribute) and _is_name(node.value))


def _literal(node: ast.expr) -> Any:
    """``ast.literal_eval`` of ``node``, with JSON's true/false/null read as Python's."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_key(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _key(node: ast.expr | None) -> str:
    key = _literal(node) if node is not None else None
    if not isinstance(key, str):
        raise ValueError("a JSON object's keys are strings")
    return key
