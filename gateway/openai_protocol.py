"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) as
pydantic models, and their mapping onto the engine's SamplingParams.

Unknown fields are ignored, like vLLM does. Fields that would silently
change the meaning of a request and that pdserve does not implement (echo,
suffix, n > 1, best_of > 1, logit_bias, tools, tool_choice, functions,
function_call, audio, non-text modalities, prediction, non-text response
formats) are refused with a 400 that names the option.

Types are strict (JSON numbers for numbers, booleans for booleans: ``"1"``
or ``true`` is not an integer); ranges are checked once, by
``SamplingParams.validate``, for HTTP and gRPC alike. Sizes are bounded by
``--max-request-body`` before parsing and by the counts below after.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from engine.sampling_params import SamplingParams
from gateway.errors import invalid

_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "min_tokens")


_STRICT = ConfigDict(extra="ignore", strict=True)
MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_CONTENT_PARTS = 1024


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


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
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted only to be refused by name (see _check_unsupported).
    functions: Any = None
    function_call: Any = None
    tool_choice: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_unsupported(self) -> None:
        if self.best_of not in (None, 1):
            raise invalid(f"best_of must be 1, got {self.best_of}", param="best_of")
        if self.logit_bias:
            raise invalid("logit_bias is not supported", param="logit_bias")
        for name in ("functions", "function_call", "audio", "prediction"):
            if getattr(self, name) is not None:
                raise invalid(f"{name} is not supported", param=name)
        if self.tool_choice not in (None, "none"):
            raise invalid("tool_choice is not supported (tools are not supported)", param="tool_choice")
        if self.modalities is not None and self.modalities != ["text"]:
            raise invalid(f"modalities {self.modalities!r:.80} is not supported; only ['text']", param="modalities")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", param="stream_options")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams with ``max_tokens`` as given (None: the rest of the
        context, resolved later); a bad value raises a 400 GatewayError."""
        self._check_unsupported()
        kw: dict[str, Any] = {k: getattr(self, k) for k in _OPTIONAL_SAMPLING if getattr(self, k) is not None}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(n=self.n, max_tokens=max_tokens, logprobs=logprobs, stop=stop,
                                  stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                                  skip_special_tokens=self.skip_special_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output, **kw)
        except ValueError as e:
            raise invalid(str(e)) from e


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

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

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise invalid("echo is not supported", param="echo")
        if self.suffix:
            raise invalid("suffix is not supported", param="suffix")
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined); the
        role and the text are checked by InputProcessor.encode_chat."""
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
        for name in ("tool_calls", "function_call", "tool_call_id", "audio"):
            if (self.model_extra or {}).get(name) is not None:
                raise invalid(f"messages with {name} are not supported", param="messages")
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str = "text"


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self) -> SamplingParams:
        if self.tools:
            raise invalid("tools are not supported", param="tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise invalid(f"response_format {self.response_format.type!r} is not supported", param="response_format")
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

