"""OpenAI's Responses API request (``POST /v1/responses``) and its translation into the
chat request ``/v1/chat/completions`` serves, as vLLM does: the chat path's template,
tool calls, structured outputs, reasoning parser, routing and streaming then apply
unchanged, and gateway/responses_output.py turns the answer back into a response.

    Responses field                       chat request
    instructions                          a first system message
    input: "text"                         one user message
    input items:
      message (role user | system |       a message of that role (developer: system); its
        developer | assistant)              input_text / output_text / refusal parts joined
      function_call {call_id, name,       an assistant message's tool_calls (consecutive
        arguments}                          calls, and the text just before them, are one message)
      function_call_output {call_id,      a tool message (tool_call_id)
        output}
      reasoning                           left out (templates drop past reasoning)
    tools [{type: function, name, ...}]   tools [{type: function, function: {name, ...}}]
    tool_choice {type: function, name}    tool_choice {type: function, function: {name}}
    text.format (text | json_object |     response_format
      json_schema {name, schema, strict})
    max_output_tokens                     max_completion_tokens
    temperature, top_p, parallel_tool_calls, user, and vLLM's seed, top_k, min_p,
    repetition_penalty, presence_penalty, frequency_penalty, chat_template_kwargs: as they are

Stateless: nothing is stored, so ``store`` is reported false, and what needs a stored
response or conversation (``previous_response_id``, ``store: true``, ``conversation``,
``background``, a stored ``prompt``) is a 400 that says to send the whole conversation in
``input``. Hosted tools (web search, file search, MCP, ...), non-text input (images,
files, audio), ``include`` other than ``reasoning.encrypted_content`` (there is none to
give), ``top_logprobs``, ``max_tool_calls`` and ``truncation: "auto"`` are 400s naming the
field. ``reasoning`` (effort, summary) is repeated in the response; its effort is the chat's
``reasoning_effort`` (low, medium, high: the chat template's variable, harmony's system message
for gpt-oss); with a ``--reasoning-parser`` the answer's reasoning comes back as a reasoning item.

Errors raised while the chat request is checked name the Responses fields
(``responses_errors``): ``max_output_tokens`` for ``max_tokens``, ``text.format`` for
``response_format``, ``input`` for ``messages``.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.errors import GatewayError, invalid
from gateway.openai_protocol import MAX_TOOL_NAME_CHARS, MAX_TOOLS, ChatCompletionRequest

MAX_INPUT_ITEMS = 4096
MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# The chat request's own fields that a Responses request may carry as they are (vLLM's extras).
_PASSED_ON = ("temperature", "top_p", "user", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "chat_template_kwargs")
_TEXT_PARTS = ("input_text", "output_text", "text")
_STATELESS = ("(pdserve stores no responses): send the whole conversation in input, earlier output items "
              "included, with store false or left out")


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields are ignored, as on the other endpoints."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: Union[str, list[dict[str, Any]], None] = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # What a stateless server cannot do, or does not (refused by name in to_chat_request).
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # vLLM's extras, passed on to the chat request
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means (module docstring); a 400 naming the field otherwise."""
        self._check_stateless()
        self._check_unsupported()
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += input_messages(self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "parallel_tool_calls": self.parallel_tool_calls,
                                "max_completion_tokens": self.max_output_tokens}
        body.update({k: getattr(self, k) for k in _PASSED_ON if getattr(self, k) is not None})
        if self.tools is not None:
            body["tools"] = chat_tools(self.tools)
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if (self.reasoning or {}).get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        if self.text is not None:
            response_format = chat_response_format(self.text)
            if response_format is not None:
                body["response_format"] = response_format
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # a part this translation let through with the wrong type
            err = e.errors()[0]
            raise invalid(f"input: {'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}",
                          param="input") from e

    def _check_stateless(self) -> None:
        if self.previous_response_id is not None:
            raise invalid(f"previous_response_id is not supported {_STATELESS}", param="previous_response_id")
        if self.store:
            raise invalid(f"store true is not supported {_STATELESS}", param="store")
        if self.conversation is not None:
            raise invalid(f"conversation is not supported {_STATELESS}", param="conversation")
        if self.background:
            raise invalid("background is not supported: pdserve stores no responses to poll; send background "
                          "false (or leave it out) and stream the response instead", param="background")
        if self.prompt is not None:
            raise invalid("prompt (a stored prompt template) is not supported: send the text in instructions "
                          "and input", param="prompt")

    def _check_unsupported(self) -> None:
        if self.input is None:
            raise invalid("input is required: a string or a list of input items", param="input")
        other = [i for i in self.include or () if i != "reasoning.encrypted_content"]
        if other:
            raise invalid(f"include {other[0]!r:.80} is not supported (reasoning items come back as plain "
                          "text; nothing else can be included)", param="include")
        if self.truncation not in (None, "disabled"):
            raise invalid(f"truncation {self.truncation!r:.40} is not supported: the input is never cut; "
                          'send truncation "disabled" or leave it out', param="truncation")
        if self.top_logprobs:
            raise invalid("top_logprobs is not supported on /v1/responses; use /v1/chat/completions with "
                          "logprobs", param="top_logprobs")
        if self.max_tool_calls is not None:
            raise invalid("max_tool_calls is not supported; send parallel_tool_calls false for one call at most",
                          param="max_tool_calls")
        if self.reasoning is not None and any(not isinstance(v, (str, type(None))) for v in self.reasoning.values()):
            raise invalid("reasoning is {\"effort\": ..., \"summary\": ...} with string values", param="reasoning")
        if self.metadata is not None:
            check_metadata(self.metadata)

    def echo(self) -> dict[str, Any]:
        """The request's fields a response repeats (OpenAI's response object)."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls, "temperature": self.temperature,
                "top_p": self.top_p, "user": self.user, "metadata": dict(self.metadata or {}),
                "tools": list(self.tools or []),
                "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
                "text": {"format": (self.text or {}).get("format") or {"type": "text"}},
                "reasoning": {"effort": None, "summary": None, **(self.reasoning or {})}}


def input_messages(items: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The chat messages of ``input`` (a string: one user message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if items is None:
        return []
    if len(items) > MAX_INPUT_ITEMS:
        raise invalid(f"at most {MAX_INPUT_ITEMS} input items, got {len(items)}", param="input")
    messages: list[dict[str, Any]] = []
    joins_call = False  # whether a function_call here belongs to the last (assistant) message
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise invalid(f"{where}: a message needs a role (user, system, developer or assistant)",
                              param="input")
            messages.append({"role": role, "content": _message_text(item.get("content"), where)})
            joins_call = role == "assistant"
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if joins_call:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            joins_call = True
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _message_text(item.get("output"), where, "output")})
            joins_call = False
        elif kind == "reasoning":
            continue
        else:
            raise invalid(f"{where}: input items of type {kind!r:.60} are not supported; send message, "
                          "function_call, function_call_output or reasoning items", param="input")
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key} must be a string", param="input")
    return value


def _message_text(content: Any, where: str, key: str = "content") -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.{key} must be a string or a list of input_text parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in (*_TEXT_PARTS, "refusal"):
            raise invalid(f"{where}.{key}: content parts of type {kind!r:.60} are not supported; only input_text "
                          "and output_text (the model reads text only)", param="input")
        if not isinstance(text, str):
            raise invalid(f"{where}.{key}: a {kind} part's text must be a string", param="input")
        parts.append(text)
    return "".join(parts)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools ({type, name, description, parameters, strict}) in the
    chat shape; anything else is a 400 naming it."""
    if len(tools) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools per request, got {len(tools)}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise invalid(f"{where}: only function tools are supported ({{\"type\": \"function\", \"name\", "
                          f"\"parameters\"}}); pdserve runs no hosted tools (got type {tool.get('type')!r:.40})",
                          param="tools")
        name = tool.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME_CHARS:
            raise invalid(f"{where}.name must be a string of 1 to {MAX_TOOL_NAME_CHARS} characters", param="tools")
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "a boolean")):
            if tool.get(key) is not None and not isinstance(tool[key], kind):
                raise invalid(f"{where}.{key} must be {what}", param="tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                         "strict") if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none, auto, required: checked with the tools (openai_protocol.tool_plan)
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise invalid('tool_choice is "none", "auto", "required" or {"type": "function", "name": ...} '
                      f"(hosted tools and allowed_tools are not supported; got type {choice.get('type')!r:.40})",
                      param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as the chat request's ``response_format`` (None: plain text)."""
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid('text.format is {"type": "text" | "json_object" | "json_schema", ...}', param="text")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] != "json_schema":
        raise invalid(f"text.format type {fmt['type']!r:.40} is not supported; use text, json_object or "
                      "json_schema", param="text")
    if not isinstance(fmt.get("schema"), (dict, bool)):
        raise invalid('text.format type "json_schema" needs schema (a JSON schema object)', param="text")
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if fmt.get(key) is not None and not isinstance(fmt[key], kind):
            raise invalid(f"text.format.{key} must be a {'string' if kind is str else 'boolean'}", param="text")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "description", "schema", "strict")
                                                   if fmt.get(k) is not None}}


def check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_KEYS or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                                                for k, v in metadata.items()):
        raise invalid(f"metadata: at most {MAX_METADATA_KEYS} keys of at most {MAX_METADATA_KEY_CHARS} "
                      f"characters, values of at most {MAX_METADATA_VALUE_CHARS}", param="metadata")


# The chat request's names in its errors -> the Responses request's (messages: the param only,
# since a message's index counts the instructions' system message).
_RENAMED = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format", "text.format"))
_RENAMED_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                   "response_format": "text", "messages": "input"}


@contextmanager
def responses_errors() -> Iterator[None]:
    """GatewayErrors raised inside name the Responses fields, not the chat request's."""
    try:
        yield
    except GatewayError as e:
        for chat_name, name in _RENAMED:
            e.message = e.message.replace(chat_name, name)
        e.param = _RENAMED_PARAMS.get(e.param or "", e.param)
        e.args = (e.message,)
        raise
