"""Anthropic Messages API request bodies (``POST /v1/messages``,
``POST /v1/messages/count_tokens``) and their translation into the chat request the
OpenAI chat endpoint serves (``ChatCompletionRequest``), as vLLM and SGLang do: the
chat template, tokenization, tool calls, structured outputs, reasoning, routing and
streaming are the chat path's; gateway/anthropic_responses.py shapes the answer back.

    Anthropic                                   chat request
    system (text or text blocks)                a first system message
    messages[].content text blocks / string     the message's text (blocks joined)
    assistant tool_use {id, name, input}        tool_calls [{id, function: {name, arguments: JSON}}]
    user tool_result {tool_use_id, content}     a tool message {tool_call_id, content}, in order
    assistant thinking / redacted_thinking      dropped (earlier turns' reasoning is not replayed)
    max_tokens (required), stop_sequences       max_tokens, stop
    temperature, top_p, top_k                   the same
    tools [{name, description, input_schema}]   function tools (parameters: input_schema)
    tool_choice auto / any / tool / none        auto / required / a named function / none
      disable_parallel_tool_use                 parallel_tool_calls: false
    output_config.format {json_schema, schema}  response_format json_schema
    thinking enabled|adaptive / disabled        chat_template_kwargs enable_thinking true / false
    metadata, service_tier, output_config.effort, cache_control, thinking.budget_tokens:
                                                accepted, no effect

Refused with a 400 naming the option: content blocks other than text, tool_use,
tool_result and thinking (images, documents, ...), server tools (a tool ``type`` other
than ``custom``), ``mcp_servers``, ``container``, and a conversation that ends with an
assistant turn (Anthropic's prefill: the chat template cannot continue a message).
Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (``error_json``).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from gateway.errors import GatewayError, invalid
from gateway.openai_protocol import ChatCompletionRequest, ChatMessage
from gateway.tool_parsers import ToolParser

# The routes whose errors take Anthropic's shape.
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")

_STRICT = ConfigDict(extra="ignore", strict=True)
_DROPPED_BLOCKS = ("thinking", "redacted_thinking")


class MessageParam(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class ToolChoiceParam(BaseModel):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputConfigParam(BaseModel):
    model_config = _STRICT
    format: dict[str, Any] | None = None
    effort: str | None = None  # accepted, no effect


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the conversation of a Messages request."""

    model_config = _STRICT
    model: str
    messages: list[MessageParam]
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None
    # Accepted only to be refused by name.
    mcp_servers: Any = None
    container: Any = None

    def to_chat_request(self, parser: ToolParser | None, enable_auto: bool) -> ChatCompletionRequest:
        """The chat request this one means (module docstring); ``parser`` / ``enable_auto``:
        the gateway's ``--tool-call-parser`` / ``--enable-auto-tool-choice``, for errors in
        this API's words."""
        for name in ("mcp_servers", "container"):
            if getattr(self, name) is not None:
                raise invalid(f"{name} is not supported", param=name)
        if self.messages and self.messages[-1].role == "assistant":
            raise invalid("the last message is an assistant turn (a prefill to continue); this is not supported: "
                          "end the conversation with a user message", param="messages")
        messages = [*self._system(), *(m for i, msg in enumerate(self.messages) for m in _chat_messages(i, msg))]
        tools = _function_tools(self.tools)
        tool_choice, parallel = self._tool_choice(parser, enable_auto)
        kwargs: dict[str, Any] = dict(model=self.model, messages=messages, tool_choice=tool_choice,
                                      parallel_tool_calls=parallel, tools=tools,
                                      chat_template_kwargs=self._template_kwargs())
        kwargs.update(self._sampling())
        return ChatCompletionRequest(**kwargs)

    def _sampling(self) -> dict[str, Any]:
        return {}

    def _system(self) -> list[ChatMessage]:
        if self.system is None or self.system == "":
            return []
        if isinstance(self.system, str):
            return [ChatMessage(role="system", content=self.system)]
        return [ChatMessage(role="system", content=[_text_block(b, "system") for b in self.system])]

    def _tool_choice(self, parser: ToolParser | None, enable_auto: bool) -> tuple[Any, bool]:
        """(OpenAI's tool_choice, parallel_tool_calls)."""
        choice = self.tool_choice
        if choice is None:
            kind, name, parallel = ("auto" if self.tools else None), None, True
        else:
            kind, name, parallel = choice.type, choice.name, not choice.disable_parallel_tool_use
        if self.tools and kind == "auto" and (parser is None or not enable_auto):
            default = " (the default when tools are given)" if choice is None else ""
            raise invalid(f'tool_choice {{"type": "auto"}}{default} needs a gateway started with '
                          '--enable-auto-tool-choice and --tool-call-parser; send tool_choice {"type": "any"}, '
                          '{"type": "tool", "name": ...} or {"type": "none"}', param="tool_choice")
        if self.tools and kind in ("any", "tool") and parser is None:
            raise invalid(f'tool_choice {{"type": "{kind}"}} needs a gateway started with --tool-call-parser',
                          param="tool_choice")
        if kind == "tool":
            if name is None:
                raise invalid('tool_choice {"type": "tool"} needs the tool\'s name', param="tool_choice")
            return {"type": "function", "function": {"name": name}}, False
        return ("required" if kind == "any" else kind), parallel

    def _template_kwargs(self) -> dict[str, Any] | None:
        kind = (self.thinking or {}).get("type")
        if kind in ("enabled", "adaptive"):
            return {"enable_thinking": True}
        return {"enable_thinking": False} if kind == "disabled" else None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted (user_id), no effect
    output_config: OutputConfigParam | None = None

    def _sampling(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": list(self.stop_sequences or []),
                               "stream": self.stream}
        out.update({k: v for k in ("temperature", "top_p", "top_k") if (v := getattr(self, k)) is not None})
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise invalid('output_config.format must be {"type": "json_schema", "schema": {...}}',
                              param="output_config")
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                             "schema": fmt["schema"]}}
        return out


def _chat_messages(index: int, message: MessageParam) -> list[ChatMessage]:
    """One Anthropic message as chat messages: an assistant turn is one message (its
    text and its tool calls); a user turn's tool results are tool messages, in order
    among its text."""
    where = f"messages[{index}]"
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    out: list[ChatMessage] = []
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in message.content:
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_call(block, where))
        elif kind == "tool_result" and message.role == "user":
            if texts:
                out.append(ChatMessage(role="user", content=texts))
                texts = []
            out.append(_tool_result(block, where))
        elif kind in _DROPPED_BLOCKS and message.role == "assistant":
            continue
        elif kind in ("tool_use", "tool_result", *_DROPPED_BLOCKS):
            raise invalid(f"{where}: {kind} blocks belong in {'user' if kind == 'tool_result' else 'assistant'} "
                          f"messages, not {message.role}", param="messages")
        else:
            raise invalid(f"{where}: content blocks of type {kind!r:.60} are not supported; only text, tool_use, "
                          "tool_result and thinking", param="messages")
    if message.role == "assistant":
        return [ChatMessage(role="assistant", content=texts, tool_calls=calls or None)]
    if texts or not out:
        out.append(ChatMessage(role="user", content=texts))
    return out


def _text_block(block: Any, where: str) -> dict[str, Any]:
    """A text block as a chat content part (its text checked by ChatMessage)."""
    if not isinstance(block, dict) or block.get("type") != "text":
        raise invalid(f"{where}: only text blocks are supported here, got {_block_type(block)}", param=where)
    return {"type": "text", "text": block.get("text")}


def _block_type(block: Any) -> str:
    return f"type {block.get('type')!r:.60}" if isinstance(block, dict) else type(block).__name__


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
        raise invalid(f"{where}: a tool_use block is {{\"type\": \"tool_use\", \"id\": string, \"name\": string, "
                      "\"input\": object}", param="messages")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_result(block: dict[str, Any], where: str) -> ChatMessage:
    """A tool result as a tool message (``is_error`` is accepted; the template has no place for it)."""
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise invalid(f"{where}: a tool_result block needs its tool_use_id (a string)", param="messages")
    if not isinstance(content, (str, list)):
        raise invalid(f"{where}: a tool_result's content is a string or text blocks", param="messages")
    parts = content if isinstance(content, str) else [_text_block(b, where + " tool_result") for b in content]
    return ChatMessage(role="tool", content=parts, tool_call_id=call_id)


def _function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's custom tools as OpenAI function tools (checked further by the chat path)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise invalid(f"tools[{i}]: server tools (type {tool.get('type')!r:.60}) are not supported; only "
                          "custom tools with a name and an input_schema", param="tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"tools[{i}].input_schema must be a JSON schema object", param="tools")
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


# Anthropic's error type of each HTTP status (4xx others: invalid_request_error; 5xx others: api_error).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_json(error: GatewayError) -> dict[str, Any]:
    """A GatewayError in Anthropic's shape (the message as the OpenAI shape cleans it)."""
    return error_body(error.kind.http_status, error.to_openai()["error"]["message"])
