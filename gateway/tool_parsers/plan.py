"""A chat request's tools and what it allows of them (``ToolPlan``): the format its answer
is parsed in and the constraint that enforces ``required`` or a named function."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.structured_outputs import StructuredOutputsParams
from gateway.tool_parsers.base import FunctionTool, ParsedMessage, ToolCall, ToolCallStream, ToolParser
from gateway.tool_parsers.json_formats import JsonCallsToolParser


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools and what it allows of them: ``choice`` "auto", "required",
    or "function" (exactly one call of ``function``). ``parser``: the gateway's
    ``--tool-call-parser`` (None: none given; required and named calls then use the JSON
    form)."""

    tools: tuple[FunctionTool, ...]
    choice: str
    parallel: bool
    parser: ToolParser | None
    function: str | None = None

    @property
    def format(self) -> ToolParser:
        """The format the answer is parsed in: the parser's own for auto and for a
        constraint it can build; the JSON form otherwise."""
        if self.choice == "auto" and self.parser is not None:
            return self.parser
        if self.parser is not None and self.parser.has_constraint:
            return self.parser
        return JsonCallsToolParser()

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the request must keep special tokens in its text (the format's markers)."""
        return self.format.keeps_special_tokens

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint that enforces ``required`` or a named function (None for auto)."""
        if self.choice == "auto":
            return None
        if self.choice == "required":
            return self.format.constraint(self.tools, self.parallel)
        return self.format.constraint([t for t in self.tools if t.name == self.function], parallel=False)

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.template_dict() for t in self.tools]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.format, self.parallel and self.choice != "function",
                              {t.name: t for t in self.tools})

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
