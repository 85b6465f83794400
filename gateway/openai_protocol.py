"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``, and
vLLM's ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) as pydantic
models, and their mapping onto the engine's SamplingParams.

Unknown fields are ignored, like vLLM does. Fields that would silently
change the meaning of a request and that pdserve does not implement (suffix,
functions, function_call, audio, non-text modalities, prediction) are refused with a 400
that names the option.

``n`` choices, and vLLM's ``best_of`` (the ``n`` of that many sequences with the highest
cumulative logprob; not streamed), on both endpoints: each choice is a request of its own
on the engine servers sharing the prompt's KV (gateway/choices.py), choice i seeded with
seed + i; both bounded by the gateway's ``--max-n`` (128).

The prompt, as vLLM shows it: ``echo`` (completions) puts the prompt's text before the
choice's text, and with ``logprobs`` the prompt's tokens before the generated ones in the
logprobs (the first prompt token's logprob and top_logprobs null); vLLM's
``prompt_logprobs`` (both endpoints: 0..20, the top-N beside each prompt token's own)
returns the prompt's logprobs in vLLM's shape. Both are computed by the engine server that
computes the prompt, which then takes no prefix-cache hits for it. Chat's ``echo`` (vLLM's)
puts the last message's text before the answer when the answer continues it (its role is
the answer's: assistant, or any with ``add_generation_prompt`` false).

What the output must match, on both endpoints: OpenAI's ``response_format``
(``text``, ``json_object``, ``json_schema``) or vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``),
not both; vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar`` are its ``json``, ``regex``, ``choice`` and ``grammar`` (one of
them, alone: with ``response_format`` or ``structured_outputs`` it is a 400 naming
both), ``guided_decoding_backend`` may name xgrammar (or ``auto``), and
``guided_whitespace_pattern`` is refused (JSON comes out compact). Chat
requests also take ``tools``, ``tool_choice`` and ``parallel_tool_calls``
(``tool_plan``; gateway/tool_parsers.py): ``none`` leaves the tools out of the
prompt; ``auto`` (the default when tools are given) needs
``--enable-auto-tool-choice``; ``required`` and a named function are enforced by a
constraint (in the ``--tool-call-parser``'s format, or vLLM's JSON form without one), which
excludes ``response_format`` and ``structured_outputs``. ``chat_template_kwargs`` (vLLM's) are more
variables of the chat template (``{"enable_thinking": false}``; checked by
gateway/tokenization.py). With a ``--reasoning-parser`` the constraint applies to the
answer after the reasoning (gateway/reasoning_parsers.py).

Types are strict (JSON numbers for numbers, booleans for booleans: ``"1"``
or ``true`` is not an integer); ranges are checked once, by
``SamplingParams.validate``, for HTTP and gRPC alike. Sizes are bounded by
``--max-request-body`` before parsing and by the counts below after.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import SamplingParams
from engine.structured_outputs import KINDS, StructuredOutputsParams, check_schema
from gateway.errors import invalid
from gateway.tool_parsers import FunctionTool, ToolParser, ToolPlan

_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "min_tokens")


_STRICT = ConfigDict(extra="ignore", strict=True)
MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_CONTENT_PARTS = 1024
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 64
MAX_TOOL_CALLS = 128  # per assistant message


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``; ``strict`` is accepted and always holds."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: Union[dict[str, Any], bool, None] = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None

    def to_structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint (None for text); a bad one raises a 400 naming response_format."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type != "json_schema":
            raise invalid(f"response_format type {self.type!r:.40} is not supported; use text, json_object or "
                          "json_schema", param="response_format")
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise invalid('response_format type "json_schema" needs json_schema.schema', param="response_format")
        return _structured("response_format", json=json.dumps(self.json_schema.json_schema, ensure_ascii=False))


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints (OpenAI's and vLLM's extras)."""

    model_config = _STRICT

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    allowed_token_ids: list[int] | None = None
    priority: int = 0  # the engine servers' --scheduling-policy priority: lower is served first
    prompt_logprobs: int | None = None  # top-N beside each prompt token's own logprob (0: its own only)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    # vLLM's older names for structured_outputs' kinds (guided decoding): see output_constraint.
    guided_json: Union[str, dict[str, Any], bool, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # Accepted only to be refused by name (see _check_unsupported).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_unsupported(self) -> None:
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise invalid(f"best_of ({self.best_of}) > n ({self.n}) cannot be streamed: the best sequences are "
                          "known only when all have ended; drop stream or best_of", param="best_of")
        for name in ("functions", "function_call", "audio", "prediction"):
            if getattr(self, name) is not None:
                raise invalid(f"{name} is not supported", param=name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise invalid(f"modalities {self.modalities!r:.80} is not supported; only ['text']", param="modalities")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", param="stream_options")

    def output_constraint(self) -> StructuredOutputsParams | None:
        """What ``response_format``, ``structured_outputs`` or vLLM's older ``guided_*``
        fields ask the output to match (one of the three)."""
        given = self.response_format is not None and self.response_format.type != "text"
        guided = self._guided()
        if guided:
            kind = next(iter(guided))
            if len(guided) > 1:
                raise invalid("give one of guided_json, guided_regex, guided_choice, guided_grammar, got "
                              f"{' and '.join(f'guided_{k}' for k in guided)}", param=f"guided_{kind}")
            for other, present in (("response_format", given),
                                   ("structured_outputs", self.structured_outputs is not None)):
                if present:
                    raise invalid(f"give guided_{kind} or {other}, not both (guided_{kind} is vLLM's older name "
                                  f"for structured_outputs.{kind})", param=f"guided_{kind}")
            return guided_outputs(guided)
        if given and self.structured_outputs is not None:
            raise invalid("give response_format or structured_outputs, not both", param="response_format")
        if self.structured_outputs is not None:
            return structured_outputs_from_json(self.structured_outputs)
        return self.response_format.to_structured_outputs() if self.response_format is not None else None

    def _guided(self) -> dict[str, Any]:
        """The ``guided_*`` kinds given, by structured_outputs' names (``json``, ...); a 400
        for a backend other than xgrammar and for ``guided_whitespace_pattern``."""
        backend = self.guided_decoding_backend
        if backend is not None and backend not in GUIDED_BACKENDS:
            raise invalid(f"guided_decoding_backend {backend!r:.60} is not available: pdserve's engine servers "
                          f"compile every constraint with xgrammar (give {' or '.join(GUIDED_BACKENDS)}, or leave "
                          "it out)", param="guided_decoding_backend")
        if self.guided_whitespace_pattern is not None:
            raise invalid("guided_whitespace_pattern is not supported: JSON output is compact (no whitespace "
                          "between tokens)", param="guided_whitespace_pattern")
        return {kind: value for kind in GUIDED_KINDS if (value := getattr(self, f"guided_{kind}")) is not None}

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         structured: StructuredOutputsParams | None) -> SamplingParams:
        """SamplingParams with ``max_tokens`` as given (None: the rest of the
        context, resolved later); a bad value raises a 400 GatewayError."""
        self._check_unsupported()
        kw: dict[str, Any] = {k: getattr(self, k) for k in _OPTIONAL_SAMPLING if getattr(self, k) is not None}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(n=self.n, best_of=self.best_of, max_tokens=max_tokens, logprobs=logprobs, stop=stop,
                                  prompt_logprobs=self.engine_prompt_logprobs(),
                                  logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
                                  stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                                  skip_special_tokens=self.skip_special_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  structured_outputs=structured, **kw)
        except ValueError as e:
            raise invalid(str(e)) from e


    def engine_prompt_logprobs(self) -> int | None:
        """The top-N of the prompt logprobs the engine computes (None: none)."""
        return self.prompt_logprobs

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) as ids."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise invalid(f"logit_bias: {key!r:.40} is not a token id (keys are token ids, as strings)",
                              param="logit_bias") from None
        return bias


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    tool_choice: Any = None  # chat only: refused by name

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids (a list of one of either is fine)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise invalid(f"batched prompts are not supported: got {len(p)} prompts, send one per request",
                              param="prompt")
            p = p[0]
        if isinstance(p, list) and len(p) > MAX_PROMPT_TOKEN_IDS:
            raise invalid(f"prompt: at most {MAX_PROMPT_TOKEN_IDS} token ids, got {len(p)}", param="prompt")
        return p

    def engine_prompt_logprobs(self) -> int | None:
        """vLLM's ``prompt_logprobs``, and what ``echo`` with ``logprobs`` shows of the prompt:
        the larger top-N of the two (each response field shows its own)."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(wanted) if wanted else None

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise invalid("suffix is not supported: it needs the model's fill-in-the-middle template, which "
                          "pdserve does not apply; send the text before the gap as the prompt", param="suffix")
        if self.tool_choice not in (None, "none"):
            raise invalid("tool_choice is for chat completions only", param="tool_choice")
        return self._sampling_params(self.max_tokens, self.logprobs, self.output_constraint())


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined; each tool call's
        arguments as an object, the form chat templates expect); the role and the text
        are checked by InputProcessor.encode_chat."""
        content = self.content
        if isinstance(content, list):
            if len(content) > MAX_CONTENT_PARTS:
                raise invalid(f"at most {MAX_CONTENT_PARTS} content parts per message, got {len(content)}",
                              param="messages")
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise invalid(f"content parts of type {part.get('type')!r:.60} are not supported; only 'text'",
                                  param="messages")
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise invalid("a text content part's text must be a string", param="messages")
                parts.append(text)
            content = "".join(parts)
        for name in ("function_call", "audio"):
            if (self.model_extra or {}).get(name) is not None:
                raise invalid(f"messages with {name} are not supported", param="messages")
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise invalid(f"only assistant messages have tool_calls, not {self.role!r:.40}", param="messages")
            if len(self.tool_calls) > MAX_TOOL_CALLS:
                raise invalid(f"at most {MAX_TOOL_CALLS} tool_calls per message, got {len(self.tool_calls)}",
                              param="messages")
            out["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as templates read it: ``arguments`` (JSON text in
    OpenAI's API) parsed into an object where it is one."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise invalid("a message's tool_calls must each be {\"type\": \"function\", \"function\": "
                      "{\"name\", \"arguments\"}}", param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    elif not isinstance(arguments, dict):
        raise invalid("a tool call's function.arguments must be JSON text", param="messages")
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables of the chat template
    echo: bool = False  # vLLM's: the last message's text before the answer that continues it
    # OpenAI's: how long a reasoning model thinks; the chat template's ``reasoning_effort``
    # variable (gpt-oss: the harmony system message's "Reasoning: low|medium|high")
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def model_post_init(self, _context: Any) -> None:
        if self.reasoning_effort is not None and "reasoning_effort" not in (self.chat_template_kwargs or {}):
            self.chat_template_kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def echoed_text(self) -> str:
        """What vLLM's ``echo`` puts before the answer: the last message's text when the answer
        continues it (its role is the answer's: assistant, or with ``add_generation_prompt``
        false any role), else nothing."""
        if not self.echo or not self.messages:
            return ""
        last = self.messages[-1]
        if self.add_generation_prompt and last.role != "assistant":
            return ""
        return last.to_template_dict()["content"]

    def tool_plan(self, parser: ToolParser | None, enable_auto: bool) -> ToolPlan | None:
        """The request's ``tools``/``tool_choice``/``parallel_tool_calls`` (``tool_plan``)."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls, parser, enable_auto)

    def to_sampling_params(self, tools: ToolPlan | None = None) -> SamplingParams:
        """``tools``: from ``tool_plan`` (its constraint, for required or a named function)."""
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        sampling = self._sampling_params(max_tokens, logprobs, with_tool_constraint(self.output_constraint(), tools))
        if tools is not None and tools.keeps_special_tokens:
            sampling.skip_special_tokens = False  # the tool-call format's markers are special tokens
        return sampling

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel: bool,
              parser: ToolParser | None, enable_auto: bool) -> ToolPlan | None:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked into what the
    request allows; None when the model is to see no tools (none given, or ``tool_choice:
    "none"``). ``parser``/``enable_auto``: the gateway's ``--tool-call-parser`` /
    ``--enable-auto-tool-choice``. HTTP and gRPC requests both come through here."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice needs tools", param="tool_choice")
        return None
    functions = _function_tools(tools)
    choice, function = _tool_choice(tool_choice, {t.name for t in functions})
    if choice == "none":
        return None
    if choice == "auto" and (parser is None or not enable_auto):
        default = " (the default when tools are given)" if tool_choice is None else ""
        raise invalid(f'tool_choice "auto"{default} needs a gateway started with --enable-auto-tool-choice '
                      'and --tool-call-parser; send tool_choice "required", a named function or "none"',
                      param="tool_choice")
    if choice != "auto":  # constrained: each schema the grammar enforces must be enforceable
        for i, tool in enumerate(functions):
            if function in (None, tool.name):
                try:
                    check_schema(tool.parameters)
                except ValueError as e:
                    raise invalid(f"tools[{i}] ({tool.name}): function.parameters: {e}", param="tools") from e
    return ToolPlan(tuple(functions), choice, parallel, parser, function)


def with_tool_constraint(structured: StructuredOutputsParams | None,
                         tools: ToolPlan | None) -> StructuredOutputsParams | None:
    """The request's own constraint, or the one that forces its tool calls (not both)."""
    forced = tools.structured_outputs() if tools is not None else None
    if forced is None:
        return structured
    if structured is not None:
        raise invalid("a tool_choice that forces tool calls cannot be combined with response_format or "
                      "structured_outputs", param="tool_choice")
    return forced


def structured_outputs_from_json(spec: dict[str, Any]) -> StructuredOutputsParams:
    """vLLM's ``structured_outputs`` object: one of json (a schema, or its JSON text),
    regex, choice, grammar, json_object (true) or structural_tag (an object or its JSON
    text). A 400 naming the problem otherwise."""
    unknown = sorted(k for k in spec if k not in KINDS)
    if unknown:
        raise invalid(f"structured_outputs: {', '.join(repr(k)[:60] for k in unknown[:5])} is not supported; "
                      f"give one of {', '.join(KINDS)}", param="structured_outputs")
    kw = {k: v for k, v in spec.items() if v is not None}
    if isinstance(kw.get("json"), (dict, bool)):  # a schema; text is passed as it is
        kw["json"] = json.dumps(kw["json"], ensure_ascii=False)
    if isinstance(kw.get("structural_tag"), dict):
        kw["structural_tag"] = json.dumps(kw["structural_tag"], ensure_ascii=False)
    if "json_object" in kw and kw["json_object"] is not True:
        raise invalid("structured_outputs.json_object must be true", param="structured_outputs")
    if isinstance(kw.get("choice"), list):
        kw["choice"] = tuple(kw["choice"])
    return _structured("structured_outputs", **kw)


GUIDED_KINDS = ("json", "regex", "choice", "grammar")  # guided_json, ... : structured_outputs' kinds
GUIDED_BACKENDS = ("xgrammar", "auto")


def guided_outputs(guided: dict[str, Any]) -> StructuredOutputsParams:
    """vLLM's older ``guided_<kind>`` (one kind) as the structured_outputs constraint it
    was renamed to; a 400 naming the ``guided_<kind>`` field otherwise."""
    (kind, value), = guided.items()
    if kind == "json" and isinstance(value, (dict, bool)):  # a schema; text is passed as it is
        value = json.dumps(value, ensure_ascii=False)
    elif kind == "choice":
        value = tuple(value)
    try:
        return StructuredOutputsParams(**{kind: value})
    except ValueError as e:
        raise invalid(str(e).replace(f"structured_outputs.{kind}", f"guided_{kind}"),
                      param=f"guided_{kind}") from e


def _structured(param: str, **kw: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kw), its ValueError a 400 naming ``param``."""
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        message = str(e) if str(e).startswith("structured_outputs") else f"{param}: {e}"
        raise invalid(message, param=param) from e


def _function_tools(tools: list[dict[str, Any]]) -> list[FunctionTool]:
    """OpenAI's ``tools``: function tools with unique names; a 400 naming the bad one."""
    if len(tools) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools per request, got {len(tools)}", param="tools")
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid(f"{where}: only function tools are supported ({{\"type\": \"function\", \"function\": "
                          f"{{...}}}}), got type {tool.get('type')!r:.40}", param="tools")
        fn = tool["function"]
        name, description, parameters, strict = (fn.get("name"), fn.get("description"), fn.get("parameters"),
                                                 fn.get("strict"))
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME_CHARS:
            raise invalid(f"{where}.function.name must be a string of 1 to {MAX_TOOL_NAME_CHARS} characters",
                          param="tools")
        if any(t.name == name for t in out):
            raise invalid(f"{where}: the function name {name!r} is used twice", param="tools")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{where}.function.description must be a string", param="tools")
        if parameters is None:  # OpenAI: no parameters is an empty parameter list
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema object", param="tools")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"{where}.function.strict must be a boolean", param="tools")
        out.append(FunctionTool(name, parameters, description, strict))
    return out


def _tool_choice(choice: str | dict[str, Any] | None, names: set[str]) -> tuple[str, str | None]:
    """("none" | "auto" | "required", None), or ("function", the name of the function to
    call: one of ``names``)."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"tool_choice {choice!r:.40} is not supported; use none, auto, required or "
                          '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        return choice, None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid('a named tool_choice is {"type": "function", "function": {"name": ...}}', param="tool_choice")
    if name not in names:
        raise invalid(f"tool_choice names the function {name!r:.80}, which is not among the tools "
                      f"({', '.join(sorted(names))[:400]})", param="tool_choice")
    return "function", name


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body): the name requests will give as
    ``model``, the adapter's directory as the engine servers see it, and whether it may
    replace an adapter of that name already loaded."""

    model_config = _STRICT
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; its ``lora_int_id`` is ignored)."""

    model_config = _STRICT
    lora_name: str
