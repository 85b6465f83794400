"""Prompts in, validated token ids out: the model's tokenizer and chat
template, the model-name check (the served model, also by its ``--model``
string, or a LoRA adapter an engine server lists), the context-length check,
and the checks every prompt and sampling parameter passes whichever front end
it came through (text is valid Unicode, token ids inside the vocabulary, chat
roles known, messages bounded in count).

Encoding runs off the event loop on two single-thread pools, each with its
own copy of the tokenizer (Hugging Face fast tokenizers must not be used
from two threads at once):

    prompt text (chat: all contents)      pool       queued at most
    <= LONG_PROMPT_CHARS characters       short      MAX_PENDING_SHORT
    longer, up to max_prompt_chars        long       MAX_PENDING_LONG
    longer than max_prompt_chars          refused at once: it cannot fit the context

so one huge prompt never stalls the short ones behind it. ``max_prompt_chars``
is ``max_model_len`` times the longest vocabulary entry (in characters) times
2: a prompt longer than that has more tokens than the context holds, so it is
refused without tokenizing. A full pool answers RESOURCE_EXHAUSTED (429).

The chat template is the model's, or the one ``--chat-template`` gives instead. Tools
reach the template as its ``tools`` variable; a template that never reads ``tools``
cannot show them to the model, so a request with tools is refused there (400) rather
than served as if the model knew them. A request's ``chat_template_kwargs`` (vLLM's) are
more variables of the template (``{"enable_thinking": false}``): an object whose keys are
not the renderer's own arguments. With ``--reasoning-parser gpt_oss`` chats are rendered in
the harmony format instead (``chat_renderer``; gateway/reasoning_parsers.py).
"""
from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import Collection
from typing import Any, Sequence

import json

from engine.sampling_params import SamplingParams, check_unicode
from engine.tokenizer import encode_prompt
from gateway.errors import ErrorKind, GatewayError, invalid

LONG_PROMPT_CHARS = 16_384
MAX_PENDING_SHORT = 512
MAX_PENDING_LONG = 8
MAX_MESSAGES = 1024
_MAX_LISTED_ADAPTERS = 20  # in a model_not_found message
# Roles the chat template is given; "developer" (OpenAI's newer name) is rendered as "system".
CHAT_ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}


@dataclass
class _Pool:
    """One tokenizer copy, the thread that uses it, and its queue bound."""

    name: str
    tokenizer: Any
    executor: ThreadPoolExecutor
    max_pending: int
    pending: int = 0


class InputProcessor:
    """Owns the tokenizer (encode side) and the limits a prompt must respect."""

    def __init__(self, tokenizer: Any, served_model_name: str, max_model_len: int, vocab_size: int,
                 long_prompt_chars: int = LONG_PROMPT_CHARS, chat_template: str | None = None,
                 model_aliases: Collection[str] = (), chat_renderer: Any = None) -> None:
        """``model_aliases``: other names a request's ``model`` may give the base model by
        (the ``--model`` string as typed, which vLLM serves under). ``chat_renderer``: renders
        chats instead of the template, ``(tokenizer, messages, add_generation_prompt, tools,
        template_kwargs) -> ids`` (harmony, for gpt-oss)."""
        self.tokenizer = tokenizer
        self.chat_renderer = chat_renderer
        # The template chats are rendered with (--chat-template, else the model's own; None: no chat).
        self.chat_template: str | None = chat_template or getattr(tokenizer, "chat_template", None) or None
        self.renders_tools = chat_renderer is not None or (self.chat_template is not None
                                                           and template_reads_tools(self.chat_template))
        self.served_model_name = served_model_name
        self.model_aliases = tuple(dict.fromkeys(a for a in model_aliases if a and a != served_model_name))
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.long_prompt_chars = long_prompt_chars
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_model_len * max(longest, 1) * 2
        self._short = _Pool("short", tokenizer, ThreadPoolExecutor(1, thread_name_prefix="tokenize"),
                            MAX_PENDING_SHORT)
        self._long = _Pool("long", copy.deepcopy(tokenizer),
                           ThreadPoolExecutor(1, thread_name_prefix="tokenize-long"), MAX_PENDING_LONG)

    def close(self) -> None:
        for pool in (self._short, self._long):
            pool.executor.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None, lora_adapters: Collection[str] = ()) -> str | None:
        """The LoRA adapter ``model`` selects: None for the base model (``model``
        empty, the served model name or one of ``model_aliases``, which win over an
        adapter of that name), ``model`` when it is one of ``lora_adapters``;
        NOT_FOUND naming every name served otherwise."""
        if not model or model == self.served_model_name or model in self.model_aliases:
            return None
        if model in lora_adapters:
            return model
        names = sorted(lora_adapters)
        shown = ", ".join(f"`{n:.100}`" for n in names[:_MAX_LISTED_ADAPTERS])
        more = f" and {len(names) - _MAX_LISTED_ADAPTERS} more" if len(names) > _MAX_LISTED_ADAPTERS else ""
        adapters = f" and the LoRA adapters {shown}{more}" if names else ""
        aliases = (f" (also as {', '.join(f'`{a}`' for a in self.model_aliases)}, its --model)"
                   if self.model_aliases else "")
        raise GatewayError(ErrorKind.NOT_FOUND,
                           f"The model `{model:.200}` does not exist. This server serves "
                           f"`{self.served_model_name}`{aliases}{adapters}.", code="model_not_found", param="model")

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Every sampling parameter in range (SamplingParams.validate, with
        this vocabulary for stop_token_ids); INVALID_ARGUMENT otherwise."""
        try:
            sampling.validate(vocab_size=self.vocab_size)
        except ValueError as e:
            raise invalid(str(e)) from e

    async def encode_text(self, text: str) -> list[int]:
        """Tokenize a raw prompt as is (special tokens the tokenizer adds included)."""
        if not isinstance(text, str):
            raise invalid("prompt must be a string", param="prompt")
        _check_text(text, "prompt")
        ids = await self._run(len(text), encode_prompt, text)
        return self.check_token_ids(ids)

    async def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                          tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render ``messages`` (and ``tools``, OpenAI function tools) with the chat
        template and tokenize. Each message is ``{"role", "content"}`` (plus an optional
        string ``name``; an assistant's ``tool_calls``, a tool result's ``tool_call_id``);
        roles other than CHAT_ROLES are refused, and tools when the template does not
        render them. ``template_kwargs``: the request's ``chat_template_kwargs``
        (``check_template_kwargs``)."""
        if not messages:
            raise invalid("messages must not be empty", param="messages")
        if len(messages) > MAX_MESSAGES:
            raise invalid(f"at most {MAX_MESSAGES} messages per request, got {len(messages)}", param="messages")
        if tools and not self.renders_tools:
            raise invalid(f"the chat template of {self.served_model_name} does not render tools, so the model "
                          "would never see them; start the gateway with --chat-template FILE, a template that "
                          "does (for ChatML models with Hermes-style tool calls: "
                          "deploy/chat_templates/hermes_tools.jinja)", param="tools")
        clean = [_template_message(i, m) for i, m in enumerate(messages)]
        kwargs = check_template_kwargs(template_kwargs)
        num_chars = sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in clean)
        num_chars += len(json.dumps(tools)) if tools else 0
        num_chars += len(json.dumps(kwargs, ensure_ascii=False)) if kwargs else 0
        try:
            if self.chat_renderer is not None:
                ids = await self._run(num_chars, self.chat_renderer, clean, add_generation_prompt, tools, kwargs)
            else:
                ids = await self._run(num_chars, render_chat, self.chat_template, clean, add_generation_prompt,
                                      tools, kwargs)
        except GatewayError:
            raise
        except ValueError as e:
            raise invalid(str(e), param="messages") from e
        except Exception as e:  # jinja errors: the template rejected the conversation
            raise invalid(f"cannot apply the chat template to these messages: {e}", param="messages") from e
        return self.check_token_ids(ids)

    def check_token_ids(self, ids: Sequence[int]) -> list[int]:
        """A non-empty list of ids inside the vocabulary, else INVALID_ARGUMENT."""
        ids = list(ids)
        if not ids:
            raise invalid("the prompt is empty (0 tokens); send at least one token", param="prompt")
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"token id {bad!r:.40} is out of range: the vocabulary has {self.vocab_size} tokens",
                          param="prompt")
        return ids

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The completion budget: ``max_tokens`` if it fits the context, the
        rest of the context if None; raises ``context_length_exceeded``."""
        room = self.max_model_len - num_prompt_tokens
        requested = max_tokens if max_tokens is not None else max(room, 1)
        if room < 1 or requested > room:
            raise invalid(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or completion.",
                code="context_length_exceeded", param="max_tokens" if room >= 1 else "messages")
        return requested

    def _too_long(self) -> GatewayError:
        return invalid(f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                       f"prompt is longer than {self.max_prompt_chars} characters, more tokens than that. "
                       "Please reduce the length of the prompt.", code="context_length_exceeded", param="prompt")

    async def _run(self, num_chars: int, fn: Any, *args: Any) -> Any:
        """``fn(tokenizer, *args)`` on the pool for prompts of ``num_chars``."""
        if num_chars > self.max_prompt_chars:
            raise self._too_long()
        pool = self._long if num_chars > self.long_prompt_chars else self._short
        if pool.pending >= pool.max_pending:
            raise GatewayError(ErrorKind.RESOURCE_EXHAUSTED,
                               f"the gateway's tokenizer queue for {pool.name} prompts is full "
                               f"({pool.max_pending} waiting); retry later", code="server_overloaded")
        pool.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool.executor, fn, pool.tokenizer, *args)
        finally:
            pool.pending -= 1


def _check_text(text: str, field_name: str) -> None:
    try:
        check_unicode(text, field_name)
    except ValueError as e:
        raise invalid(str(e), param=field_name) from e


def template_reads_tools(template: str) -> bool:
    """Whether a chat template reads its ``tools`` variable (and so can render tools)."""
    import jinja2
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:  # tags of transformers' own environment: look at the text
        return "tools" in template
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


# Arguments of transformers' apply_chat_template (and variables it sets itself): not
# chat_template_kwargs, which are the template's own variables.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})
# Variables whose type the gateway itself relies on (the qwen3 reasoning parser reads it).
_BOOLEAN_TEMPLATE_KWARGS = ("enable_thinking",)


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` checked: an object (None: empty), none of
    ``RESERVED_TEMPLATE_KWARGS``, ``enable_thinking`` a boolean, valid Unicode; a 400
    naming the field otherwise."""
    param = "chat_template_kwargs"
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise invalid(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}", param=param)
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {', '.join(repr(k) for k in reserved)}: "
                      "the request's own fields give it", param=param)
    for key in _BOOLEAN_TEMPLATE_KWARGS:
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise invalid(f"chat_template_kwargs.{key} must be a boolean, got {kwargs[key]!r:.40}", param=param)
    _check_text(json.dumps(kwargs, ensure_ascii=False), param)
    return dict(kwargs)


def render_chat(tokenizer: Any, template: str | None, messages: Sequence[dict[str, Any]],
                add_generation_prompt: bool, tools: list[dict[str, Any]] | None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the conversation rendered with ``template`` (runs on a pool's thread);
    ``template_kwargs``: more template variables (checked by ``check_template_kwargs``)."""
    if not template:
        raise ValueError("this model has no chat template; send a plain prompt instead, or start the gateway "
                         "with --chat-template FILE")
    kw: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        kw["tools"] = tools
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                                        chat_template=template, **kw)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
        ids = ids["input_ids"]
    return list(ids)


def _template_message(index: int, message: Any) -> dict[str, Any]:
    """One message as the chat template sees it: a known role, string content
    (valid Unicode), if given a string ``name``, an assistant's ``tool_calls``
    (a list of calls) and a tool result's ``tool_call_id`` (a string)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object with role and content", param="messages")
    role = message.get("role")
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in CHAT_ROLES:
        raise invalid(f"{where}.role {message.get('role')!r:.60} is not supported; use one of "
                      f"{', '.join(CHAT_ROLES)} (or developer)", param="messages")
    content = message.get("content")
    content = "" if content is None else content
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string", param="messages")
    _check_text(content, f"{where}.content")
    out = {"role": role, "content": content}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str) or len(name) > 256:
            raise invalid(f"{where}.name must be a string of at most 256 characters", param="messages")
        _check_text(name, f"{where}.name")
        out["name"] = name
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise invalid(f"{where}.tool_calls must be a list, on an assistant message", param="messages")
        _check_text(json.dumps(tool_calls, ensure_ascii=False), f"{where}.tool_calls")
        out["tool_calls"] = tool_calls
    tool_call_id = message.get("tool_call_id")
    if tool_call_id is not None:
        if not isinstance(tool_call_id, str) or len(tool_call_id) > 256:
            raise invalid(f"{where}.tool_call_id must be a string of at most 256 characters", param="messages")
        _check_text(tool_call_id, f"{where}.tool_call_id")
        out["tool_call_id"] = tool_call_id
    return out
