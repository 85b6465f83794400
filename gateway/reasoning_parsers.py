"""Thinking models' reasoning apart from their answer (``--reasoning-parser``, vLLM's names
and behaviour), and the per-request stream that splits a chat answer into reasoning,
content and tool calls.

    parser        the model writes                                       reasoning ends at
    qwen3         [<think>] reasoning </think> answer (Qwen3, QwQ, Qwen3.5)  </think>
    deepseek_r1   [<think>] reasoning </think> answer (DeepSeek-R1 & distills) </think>
    gpt_oss       harmony messages (gpt-oss): channel analysis = reasoning,  <|channel|>final<|message|>
                  commentary to=functions.NAME = a tool call, final = answer

``<think>`` and ``</think>`` must be tokens of the model's tokenizer (the gateway refuses
to start otherwise, as vLLM does). The chat template usually puts ``<think>`` in the
prompt, so the output starts inside the reasoning; a ``<think>`` the model writes itself
is dropped. Everything before the first ``</think>`` is reasoning and everything after
it the answer's content; an output without ``</think>`` is all reasoning (cut short).
A prompt whose last think tag is ``</think>`` (the template closed the reasoning, as
Qwen3's does for ``enable_thinking: false``) has no reasoning: its output is all content,
and so is qwen3's under ``chat_template_kwargs: {"enable_thinking": false}`` whatever the
template does. Tags are found in the detokenized text, so a tag split across stream
chunks is held back until it is known (a stream sends exactly what the whole answer
would hold). Deviations from vLLM: text before a ``<think>`` that the model writes
itself stays reasoning (vLLM's non-streamed parser drops it, its streamed one does not);
qwen3's reasoning ends at ``</think>`` only (vLLM also ends it at a ``<tool_call>``
followed by Qwen3.5's XML ``<function=...>``, a call format pdserve does not parse);
gpt-oss's reasoning ends at ``<|channel|>final<|message|>`` (vLLM waits for
``<|start|>assistant`` before it, and so misses a final message that opens the answer).

Tool calls (``--tool-call-parser``) are parsed from the content only, never from the
reasoning. Structured outputs constrain the content only: a request with a constraint
carries the reasoning's end token sequence (``StructuredOutputsParams.
reasoning_end_token_ids``), and the engine's grammar starts after it (engine/grammar.py);
a prompt that already ended the reasoning sends none. gpt-oss's forced tool calls
(``tool_choice`` required or a named function) are the exception: their constraint is
harmony's whole output, the analysis message included (gateway/tool_parsers/json_formats.py).

gpt_oss renders chats with the openai-harmony library (system message with today's date,
a developer message with the system/developer instructions and the tools, the
conversation) and parses the output tokens with its ``StreamableParser``. Its
vocabulary, o200k_base, is read from ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken``
or downloaded once (the library checks its SHA-256): a gateway that cannot load it does
not start, and says so.
"""
from __future__ import annotations

import datetime
import json
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.tool_parsers import ToolCall, ToolCallDelta, ToolPlan, new_call_id

logger = logging.getLogger(__name__)

HARMONY_VOCAB_ENV = "TIKTOKEN_ENCODINGS_BASE"


@dataclass
class ChatDelta:
    """What one output delta adds to the answer: reasoning, content, tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ChatAnswer:
    """A whole answer, as the non-streamed response carries it."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChatStream(ABC):
    """One chat request's answer: output deltas (token ids and their text) in, reasoning,
    content and tool-call deltas out. ``whole`` is the same applied to the whole output."""

    @property
    @abstractmethod
    def num_calls(self) -> int:
        """Tool calls sent so far."""

    @property
    def parses(self) -> bool:
        """Whether the answer is more than its text (reasoning or tool calls split off):
        then an empty content is null, as OpenAI and vLLM send it."""
        return True

    @abstractmethod
    def feed(self, token_ids: Sequence[int], text: str, final: bool = False) -> ChatDelta:
        """What ``token_ids`` (detokenized: ``text``) add; ``final`` on the last delta."""

    def whole(self, token_ids: Sequence[int], text: str) -> ChatAnswer:
        d = self.feed(token_ids, text, final=True)
        calls: list[ToolCall] = []
        for c in d.tool_calls:
            if c.id is not None:
                calls.append(ToolCall(c.id, c.name or "", c.arguments))
            else:
                last = calls[c.index]
                calls[c.index] = ToolCall(last.id, last.name, last.arguments + c.arguments)
        return ChatAnswer(d.reasoning or None, d.content or None, calls)


class TextChatStream(ChatStream):
    """Text models: the reasoning split off first (``ThinkStream``), then the content's tool
    calls (``ToolCallStream``); either may be absent."""

    def __init__(self, reasoning: ThinkStream | None, tools: ToolPlan | None) -> None:
        self._reasoning = reasoning
        self._tools = tools.stream() if tools is not None else None

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    @property
    def parses(self) -> bool:
        return self._reasoning is not None or self._tools is not None

    def feed(self, token_ids: Sequence[int], text: str, final: bool = False) -> ChatDelta:
        reasoning, content = self._reasoning.feed(text, final) if self._reasoning is not None else ("", text)
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content, final)
        return ChatDelta(reasoning, content, calls)


class ThinkStream:
    """``<think>`` reasoning ``</think>`` content, split from the detokenized text (module
    docstring). ``reasoning``: whether the output starts inside the reasoning (False: the
    prompt ended it, or thinking is off: all content)."""

    def __init__(self, start: str, end: str, reasoning: bool) -> None:
        self._start, self._end, self._reasoning = start, end, reasoning
        self._text = ""
        self._num_reasoning = self._num_content = 0  # characters of each sent

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``; both only grow as text is appended."""
        if not self._reasoning:
            return "", text
        i = text.find(self._end)
        if i >= 0:
            return self._strip_start(text[:i]), text[i + len(self._end):]
        if final:
            return self._strip_start(text), ""
        markers = (self._end,) if self._start in text else (self._end, self._start)
        return self._strip_start(text[:_hold_back(text, markers)]), ""

    def _strip_start(self, reasoning: str) -> str:
        """Without the first ``<think>`` (the model opened the reasoning itself)."""
        i = reasoning.find(self._start)
        return reasoning if i < 0 else reasoning[:i] + reasoning[i + len(self._start):]

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) after ``text``."""
        self._text += text
        reasoning, content = self.split(self._text, final)
        new = reasoning[self._num_reasoning:], content[self._num_content:]
        self._num_reasoning = max(self._num_reasoning, len(reasoning))
        self._num_content = max(self._num_content, len(content))
        return new


def _hold_back(text: str, markers: Sequence[str]) -> int:
    """Length of ``text`` without a trailing start of any of ``markers`` (it may become one)."""
    held = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:k]):
                held = k
                break
    return len(text) - held


class ReasoningParser(ABC):
    """A model family's reasoning format (``--reasoning-parser``)."""

    name = ""

    @abstractmethod
    def chat_stream(self, prompt_token_ids: Sequence[int], template_kwargs: Mapping[str, Any],
                    tools: ToolPlan | None) -> tuple[ChatStream, tuple[int, ...]]:
        """The request's answer stream, and the reasoning's end token sequence the grammar
        of a constrained request waits for (empty: the output starts in the content)."""

    def extra_stop_token_ids(self) -> list[int]:
        """Tokens that end the model's turn beside its eos (harmony's <|return|>, <|call|>)."""
        return []


class ThinkReasoningParser(ReasoningParser):
    """``<think>`` ... ``</think>`` models (qwen3, deepseek_r1)."""

    START, END = "<think>", "</think>"

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.name = name
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.START, self.END) if t not in vocab]
        if missing:
            raise ValueError(f"--reasoning-parser {name} needs {' and '.join(missing)} as token(s) of the model's "
                             "tokenizer, and it has none (is this a thinking model?)")
        self.start_id, self.end_id = vocab[self.START], vocab[self.END]

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt's last think tag is ``</think>`` (the template closed the
        reasoning: ``enable_thinking: false``), as vLLM's ``is_reasoning_end``."""
        for token in reversed(prompt_token_ids):
            if token == self.start_id:
                return False
            if token == self.end_id:
                return True
        return False

    def chat_stream(self, prompt_token_ids: Sequence[int], template_kwargs: Mapping[str, Any],
                    tools: ToolPlan | None) -> tuple[ChatStream, tuple[int, ...]]:
        thinking_off = self.name == "qwen3" and template_kwargs.get("enable_thinking") is False
        reasoning = not thinking_off and not self.prompt_ends_reasoning(prompt_token_ids)
        stream = TextChatStream(ThinkStream(self.START, self.END, reasoning), tools)
        return stream, (self.end_id,) if reasoning else ()


# ---- gpt-oss: the harmony format ----------------------------------------------------------------

class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss (``gpt_oss``): chats rendered and answers parsed by openai-harmony."""

    name = "gpt_oss"
    FINAL = "<|channel|>final<|message|>"  # the answer's start (vLLM's is this after <|start|>assistant)

    def __init__(self) -> None:
        self.encoding = load_harmony_encoding()
        self._lock = threading.Lock()  # the tokenizer pools' two threads render
        self.end_ids = tuple(self.encoding.encode(self.FINAL, allowed_special="all"))

    def extra_stop_token_ids(self) -> list[int]:
        return list(self.encoding.stop_tokens_for_assistant_actions())

    def chat_stream(self, prompt_token_ids: Sequence[int], template_kwargs: Mapping[str, Any],
                    tools: ToolPlan | None) -> tuple[ChatStream, tuple[int, ...]]:
        parallel = tools is None or (tools.parallel and tools.choice != "function")
        # forced calls: their structural tag spans the analysis too (HarmonyToolParser)
        forced = tools is not None and tools.choice != "auto"
        return HarmonyChatStream(self.encoding, parallel), () if forced else self.end_ids

    def render_chat(self, _tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None, template_kwargs: Mapping[str, Any]) -> list[int]:
        """The conversation's token ids in the harmony format (``InputProcessor``'s
        ``chat_renderer``; ``messages`` as the chat template would see them)."""
        from openai_harmony import Conversation, Role

        conversation = Conversation.from_messages(harmony_messages(messages, tools,
                                                                   template_kwargs.get("reasoning_effort")))
        with self._lock:
            if add_generation_prompt:
                return list(self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
            return list(self.encoding.render_conversation(conversation))


def load_harmony_encoding() -> Any:
    """openai-harmony's gpt-oss encoding; a ValueError saying what to do when it cannot load."""
    import os

    try:
        from openai_harmony import HarmonyEncodingName
        from openai_harmony import load_harmony_encoding as load
    except ImportError as e:  # pragma: no cover - a dependency of pdserve
        raise ValueError(f"--reasoning-parser gpt_oss needs the openai-harmony package: {e}") from None
    try:
        return load(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:
        where = os.environ.get(HARMONY_VOCAB_ENV)
        hint = (f"{HARMONY_VOCAB_ENV}={where} must be a directory holding o200k_base.tiktoken (the original file: "
                "its SHA-256 is checked)" if where else
                f"set {HARMONY_VOCAB_ENV} to a directory holding o200k_base.tiktoken (as vLLM does offline), or "
                "give the gateway internet access to download it once")
        raise ValueError(f"--reasoning-parser gpt_oss: openai-harmony cannot load the o200k_base vocabulary "
                         f"({e}); {hint}") from None


def harmony_messages(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     reasoning_effort: str | None = None) -> list[Any]:
    """The chat as harmony messages: system (date, reasoning channels, the reasoning effort:
    ``reasoning_effort`` low, medium or high, harmony's default medium when None), developer
    (system/developer instructions and the function tools), then the turns; an assistant's
    tool calls are commentary messages to ``functions.NAME``, a tool result is a message
    from ``functions.NAME`` (the name of the call it answers)."""
    from openai_harmony import (Author, ChannelConfig, DeveloperContent, Message, ReasoningEffort, Role,
                                SystemContent, ToolDescription)

    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    if reasoning_effort is not None:
        efforts = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
        if reasoning_effort not in efforts:
            raise ValueError(f"reasoning_effort must be low, medium or high, got {reasoning_effort!r:.40}")
        system = system.with_reasoning_effort(efforts[reasoning_effort])
    if not tools:  # no function calls: no commentary channel (as vLLM)
        system = system.with_channel_config(ChannelConfig.require_channels(["analysis", "final"]))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([
                ToolDescription.new(t["function"]["name"], t["function"].get("description") or "",
                                    parameters=t["function"].get("parameters")) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                arguments = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
                if isinstance(call.get("id"), str):
                    call_names[call["id"]] = fn["name"]
                out.append(Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
                           .with_recipient(f"functions.{fn['name']}").with_content_type("<|constrain|>json"))
        elif role == "tool":
            name = call_names.get(m.get("tool_call_id") or "", m.get("name") or "tool")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), content)
                       .with_recipient("assistant").with_channel("commentary"))
    return out


class HarmonyChatStream(ChatStream):
    """gpt-oss's answer, parsed token by token: analysis (and calls to built-in tools) is
    reasoning, one message after another joined by a newline; commentary to
    ``functions.NAME`` a tool call whose arguments are the message's text; final (and
    commentary to nobody) the content. Output harmony cannot parse ends the parsing: the
    rest of the text is content."""

    FUNCTIONS = "functions."

    def __init__(self, encoding: Any, parallel: bool = True) -> None:
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self._parallel = parallel
        self._message = -1  # index of the message the last delta belonged to
        self._calls: list[str] = []  # ids of the calls sent
        self._num_reasoning_messages = 0
        self._skip_call = False  # the call being written is dropped (a second one without parallel calls)
        self._broken = False

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def feed(self, token_ids: Sequence[int], text: str, final: bool = False) -> ChatDelta:
        out = ChatDelta()
        if self._broken:
            out.content = text
            return out
        for token in token_ids:
            try:
                self._parser.process(token)
            except Exception as e:  # HarmonyError: not harmony (or cut in a header)
                logger.warning("harmony: cannot parse the output past token %d: %s", token, e)
                self._broken = True
                return out
            delta = self._parser.last_content_delta
            if delta:
                self._take(delta, out)
        return out

    def _take(self, delta: str, out: ChatDelta) -> None:
        parser = self._parser
        new_message = len(parser.messages) != self._message
        self._message = len(parser.messages)
        recipient, channel = parser.current_recipient, parser.current_channel
        if recipient and recipient.startswith(self.FUNCTIONS):
            if new_message:
                if self._calls and not self._parallel:
                    self._skip_call = True
                    return
                self._skip_call = False
                self._calls.append(new_call_id())
                out.tool_calls.append(ToolCallDelta(len(self._calls) - 1, delta, self._calls[-1],
                                                    recipient[len(self.FUNCTIONS):]))
            elif not self._skip_call:
                index = len(self._calls) - 1
                if out.tool_calls and out.tool_calls[-1].index == index:  # one piece per call and delta
                    last = out.tool_calls[-1]
                    out.tool_calls[-1] = ToolCallDelta(index, last.arguments + delta, last.id, last.name)
                else:
                    out.tool_calls.append(ToolCallDelta(index, delta))
        elif channel == "analysis" or recipient:
            if new_message:
                if self._num_reasoning_messages:
                    out.reasoning += "\n"
                self._num_reasoning_messages += 1
            out.reasoning += delta
        else:  # final, commentary to nobody (a preamble), or no channel
            out.content += delta


# ---- construction --------------------------------------------------------------------------------

PARSERS = ("deepseek_r1", "gpt_oss", "qwen3")


def get_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser ``--reasoning-parser`` names; ValueError (what is missing) otherwise."""
    if name == "gpt_oss":
        return HarmonyReasoningParser()
    if name in ("qwen3", "deepseek_r1"):
        return ThinkReasoningParser(tokenizer, name)
    raise ValueError(f"--reasoning-parser {name!r} is not known; choose one of {', '.join(PARSERS)}")


def plain_chat_stream(tools: ToolPlan | None) -> ChatStream:
    """A gateway without a reasoning parser: the answer's tool calls, if any, else its text."""
    return TextChatStream(None, tools)

