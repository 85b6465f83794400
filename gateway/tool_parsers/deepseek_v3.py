"""DeepSeek-V3's calls (V3, V3-0324, R1-0528 chat templates):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The name is the text after ``<｜tool▁sep｜>`` up to the line's end; the arguments are the
model's own JSON text inside the fence (streamed as written; a missing fence is
tolerated). The content is the text before ``<｜tool▁calls▁begin｜>`` (or before the first
``<｜tool▁call▁begin｜>`` when the model leaves the list's marker out). The markers are
added tokens; requests with tools keep special tokens so they reach the text.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from gateway.tool_parsers.base import FunctionTool, ToolParser, _Call, _Split, hold_back, json_value_prefix

_FENCE = re.compile(r"\s*(?:```(?:json)?)?\s*")


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    keeps_special_tokens = True
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _calls_begin = CALLS_BEGIN
    _calls_end = CALLS_END
    _call_end = "\n```" + CALL_END
    _separator = "\n"

    def _call_begin(self, name: str) -> str:
        return f"{self.CALL_BEGIN}function{self.SEP}{name}\n```json\n"

    def split(self, text: str, final: bool, tools: Mapping[str, FunctionTool] | None = None) -> _Split:
        starts = [j for j in (text.find(self.CALLS_BEGIN), text.find(self.CALL_BEGIN)) if j >= 0]
        if not starts:
            return _Split(text if final else text[:hold_back(text, self.CALLS_BEGIN, self.CALL_BEGIN)])
        out = _Split(text[:min(starts)].rstrip())
        i = text.find(self.CALL_BEGIN, min(starts))
        while i >= 0:
            sep = text.find(self.SEP, i)
            eol = text.find("\n", sep + len(self.SEP)) if sep >= 0 else -1
            name = text[sep + len(self.SEP):eol].strip() if eol >= 0 else ""
            if not name:
                if eol < 0 and not final:
                    out.calls.append(_Call(None, ""))  # the name is not written yet
                break
            rest = text[eol:].lstrip()
            if not final and "```json".startswith(rest):
                out.calls.append(_Call(name, ""))  # the fence is being written
                break
            start = _FENCE.match(text, eol).end()
            if start >= len(text) or text[start] not in "{[":
                out.calls.append(_Call(name, ""))  # no JSON arguments (yet, or ever)
                break
            arguments, end = json_value_prefix(text, start)
            out.calls.append(_Call(name, arguments))
            if end is None:
                break
            i = text.find(self.CALL_BEGIN, end)
        if final and not any(c.name is not None for c in out.calls):
            return _Split(text)
        return out

