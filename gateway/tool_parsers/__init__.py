"""Tool calls in the model's own words: the parsers that find them in generated text,
and the structured-output constraint that makes the model write them.

    parser        family: the model writes a call as                               module
    hermes        Hermes 2 Pro, Qwen2.5, Qwen3 (deploy/chat_templates/hermes_tools.jinja):  json_formats
                  <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>, "\\n" between
    llama3_json   Llama 3.1 / 3.2 / 3.3 (their own templates): {"name": NAME,            json_formats
                  "parameters": {...}} after an optional <|python_tag|>, "; " between
    mistral       Mistral 7B v0.3, Nemo, Small, Magistral, Devstral: [TOOL_CALLS][{"name",  mistral
                  "arguments"}, ...] or [TOOL_CALLS]NAME[ARGS]{...} per call
    pythonic      Llama 3.2 / 4 pythonic templates, ToolACE, Gemma-style prompts:          pythonic
                  [NAME(a=1, b="x"), ...] read with ast
    qwen3_coder   Qwen3-Coder: <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n        qwen3_coder
                  </parameter>\\n</function>\\n</tool_call>, values typed by the schema
    deepseek_v3   DeepSeek-V3 / R1-0528: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function    deepseek_v3
                  <｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    openai        gpt-oss harmony messages (with --reasoning-parser gpt_oss, parsed   json_formats
                  from the tokens by gateway/reasoning_parsers.py; tool_choice auto only)

With a ``--reasoning-parser``, calls are parsed from the answer's content, after the
reasoning, never from the reasoning itself (gateway/reasoning_parsers.py).

A request's ``ToolPlan`` says what it allows (``tool_choice``):

    auto       the model writes freely; calls are parsed out of the text afterwards (no
               constraint; needs --tool-call-parser and --enable-auto-tool-choice)
    required   the engine's grammar forces at least one call of any of the tools, each call's
               arguments matching that tool's ``parameters`` schema (one call only without
               ``parallel_tool_calls``)
    function   (a named function) the grammar forces exactly one call of that function

Required and named calls are written in the parser's own format where a structural tag
can describe it (hermes, llama3_json, mistral's JSON list, qwen3_coder's XML, deepseek_v3),
and in the JSON form ``[{"name": NAME, "parameters": {...}}, ...]`` otherwise: with no
``--tool-call-parser`` (as in vLLM, where both work through structured outputs without a
parser) and under ``pythonic``. Either way the constrained output is parsed back by the
same format, so the answer carries tool_calls (gateway/tool_parsers/base.py).
"""
from __future__ import annotations

from gateway.tool_parsers.base import (FunctionTool, ParsedMessage, ToolCall, ToolCallDelta, ToolCallStream,
                                       ToolParser, finish_reason, new_call_id)
from gateway.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from gateway.tool_parsers.json_formats import (HarmonyToolParser, HermesToolParser, JsonCallsToolParser,
                                               Llama3JsonToolParser)
from gateway.tool_parsers.mistral import MistralToolParser
from gateway.tool_parsers.plan import ToolPlan
from gateway.tool_parsers.pythonic import PythonicToolParser
from gateway.tool_parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = ["PARSERS", "DeepSeekV3ToolParser", "FunctionTool", "HarmonyToolParser", "HermesToolParser",
           "JsonCallsToolParser", "Llama3JsonToolParser", "MistralToolParser", "ParsedMessage",
           "PythonicToolParser", "Qwen3CoderToolParser", "ToolCall", "ToolCallDelta", "ToolCallStream",
           "ToolParser", "ToolPlan", "finish_reason", "get_parser", "new_call_id"]

# --tool-call-parser's choices (vLLM's names).
PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser, Qwen3CoderToolParser,
    DeepSeekV3ToolParser, HarmonyToolParser)}


def get_parser(name: str) -> ToolParser:
    """The parser named by ``--tool-call-parser``; ValueError listing the known ones."""
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()
