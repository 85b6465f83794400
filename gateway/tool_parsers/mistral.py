"""Mistral's calls, after the ``[TOOL_CALLS]`` control token, in either of its forms:

    JSON list (Mistral 7B v0.3, Nemo, Small 3 / 3.1)   [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
    name and arguments (Small 3.2, Magistral,          [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}
    Devstral, Ministral 3; v11+ tokenizers)

The list's objects may carry an ``"id"`` after the arguments (the chat templates write
one); a lone object without the list is read too. In the second form ``[CALL_ID]id``
may come between the name and ``[ARGS]``. The content is the text before the first
``[TOOL_CALLS]``. ``[TOOL_CALLS]`` is a special token: requests with tools keep special
tokens so that it reaches the text. The constraint writes the JSON list form (the one
every Mistral tool model reads).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping

from gateway.tool_parsers.base import (FunctionTool, ToolParser, _Call, _Split, hold_back, json_value_prefix,
                                       read_call_object, skip_ws, value_end)

_NAME = re.compile(r"[^\[\]{}\s]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    _calls_begin = "[TOOL_CALLS]["
    _calls_end = "]"
    _call_end = "}"
    _separator = ", "

    def _call_begin(self, name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        i = text.find(self.BOT)
        if i < 0:
            return _Split(text if final else text[:hold_back(text, self.BOT)])
        out = _Split(text[:i].rstrip())
        k = skip_ws(text, i + len(self.BOT))
        if k >= len(text) and not final:
            return out
        if text.startswith("[", k) or text.startswith("{", k):
            self._json_form(text, k, final, out)
        else:
            self._named_form(text, i, final, out)
        if final and not any(c.name is not None for c in out.calls):
            return _Split(text)
        return out

    @staticmethod
    def _json_form(text: str, k: int, final: bool, out: _Split) -> None:
        """``[{...}, {...}]`` or one ``{...}`` from ``text[k]``."""
        if text[k] == "[":
            k = skip_ws(text, k + 1)
            if k >= len(text) or text[k] != "{":
                return
        while True:
            end, _ = value_end(text, k)
            call = read_call_object(text[k:end] if end is not None else text[k:], complete=end is not None or final)
            if call is not None:
                out.calls.append(call)
            if end is None:
                return
            k = skip_ws(text, end)
            if not text.startswith(",", k):
                return
            k = skip_ws(text, k + 1)
            if not text.startswith("{", k):
                return

    def _named_form(self, text: str, i: int, final: bool, out: _Split) -> None:
        """``[TOOL_CALLS]name[ARGS]{...}`` repeated, from the marker at ``text[i]``."""
        while i >= 0 and text.startswith(self.BOT, i):
            k = i + len(self.BOT)
            m = _NAME.match(text, k)
            if m is None:
                if k < len(text) or final:
                    return  # no name: not a call
                out.calls.append(_Call(None, ""))
                return
            k = m.end()
            if k >= len(text) and not final:
                out.calls.append(_Call(None, ""))  # the name may go on
                return
            if text.startswith(self.CALL_ID, k):
                j = text.find(self.ARGS, k)
                if j < 0:
                    if not final:
                        out.calls.append(_Call(None, ""))
                    return
                k = j
            if not text.startswith(self.ARGS, k):
                if not final and self.ARGS.startswith(text[k:]):
                    out.calls.append(_Call(None, ""))
                return
            k = skip_ws(text, k + len(self.ARGS))
            arguments, end = json_value_prefix(text, k)
            out.calls.append(_Call(m.group(0), arguments))
            if end is None:
                return
            i = skip_ws(text, end)
