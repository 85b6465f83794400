"""Reasoning parsers without servers: vLLM's behaviour of qwen3 and deepseek_r1 on whole
answers, the same answers streamed in chunks of every size (tags split across chunks),
tool calls parsed from the content only, the response shapes (``reasoning_content`` deltas
before the content's), the engine's grammar holding back until the reasoning's end token
sequence, that sequence through the proto, ``chat_template_kwargs`` checks and rendering,
and the flags (the gateway's and ``pdserve up``'s). End to end: tests/e2e/test_reasoning.py;
gpt-oss (harmony): test_reasoning_harmony.py."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from gateway.config import GatewayConfig, add_cli_args
from gateway.errors import GatewayError
from gateway.openai_protocol import ChatCompletionRequest
from gateway.openai_responses import ChatFormatter
from gateway.output_processor import GenerationDelta, Usage
from gateway.reasoning_parsers import ThinkReasoningParser, get_reasoning_parser
from gateway.tokenization import InputProcessor, check_template_kwargs
from gateway.tool_parsers import FunctionTool, HermesToolParser, ToolPlan

START_ID, END_ID, OTHER = 7, 8, 3


class _Vocab:
    """A tokenizer as the parsers see it: ``<think>`` and ``</think>`` are tokens."""

    @staticmethod
    def get_vocab() -> dict[str, int]:
        return {"<think>": START_ID, "</think>": END_ID, "a": OTHER}


OPEN = [OTHER, START_ID, OTHER]  # the template opened the reasoning (deepseek_r1, Qwen3.5)
PLAIN = [OTHER, OTHER]  # no think tag in the prompt (Qwen3: the model writes <think>)
CLOSED = [OTHER, START_ID, OTHER, END_ID, OTHER]  # enable_thinking false: the template closed it
# (parser, chat_template_kwargs, prompt, output) -> (reasoning_content, content), as vLLM answers
CASES = [
    ("deepseek_r1", {}, OPEN, "Let me see.\n</think>\n\nIt is 4.", ("Let me see.\n", "\n\nIt is 4.")),
    ("deepseek_r1", {}, PLAIN, "<think>\nhmm</think>It is 4.", ("\nhmm", "It is 4.")),
    ("deepseek_r1", {}, OPEN, "cut short while thinking", ("cut short while thinking", None)),
    ("deepseek_r1", {}, OPEN, "done</think>", ("done", None)),
    ("deepseek_r1", {}, OPEN, "a</think>b</think>c", ("a", "b</think>c")),  # the first end counts
    ("deepseek_r1", {}, CLOSED, "It is 4.", (None, "It is 4.")),
    ("deepseek_r1", {}, [START_ID, END_ID, START_ID], "x</think>y", ("x", "y")),  # the last tag counts
    ("qwen3", {}, PLAIN, "<think>\nsum</think>\n\n4", ("\nsum", "\n\n4")),
    ("qwen3", {}, OPEN, "sum</think>4", ("sum", "4")),
    ("qwen3", {}, PLAIN, "no tags at all", ("no tags at all", None)),  # thinking on: cut short
    ("qwen3", {"enable_thinking": False}, PLAIN, "no tags at all", (None, "no tags at all")),
    ("qwen3", {"enable_thinking": True}, CLOSED, "4", (None, "4")),
    ("qwen3", {}, PLAIN, "a <thinking> b </thin</think>c", ("a <thinking> b </thin", "c")),
]


def _split(parser, kwargs, prompt, text, size=None, tools=None):
    """(reasoning, content, calls) of ``text``: whole, or fed in chunks of ``size`` characters."""
    stream, ends = get_reasoning_parser(parser, _Vocab()).chat_stream(prompt, kwargs, tools)
    if size is None:
        whole = stream.whole([], text)
        return whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.tool_calls], ends
    reasoning, content, calls = "", "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        d = stream.feed([], piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + d.reasoning, content + d.content
        for c in d.tool_calls:
            calls.setdefault(c.index, [c.name, ""])[1] += c.arguments
    return reasoning or None, content or None, [tuple(c) for c in calls.values()], ends


@pytest.mark.parametrize("parser, kwargs, prompt, text, expected", CASES)
def test_whole_and_streamed_answers_split_as_vllm_does(parser, kwargs, prompt, text, expected):
    reasoning, content, _, ends = _split(parser, kwargs, prompt, text)
    assert (reasoning, content) == expected
    assert ends == ((END_ID,) if expected[0] is not None or "</think>" in text else ())
    for size in range(1, 9):  # tags cut anywhere between chunks
        assert _split(parser, kwargs, prompt, text, size)[:2] == expected, size


def test_parsers_need_the_think_tokens(tokenizer):
    with pytest.raises(ValueError, match="<think> and </think>"):
        get_reasoning_parser("qwen3", tokenizer)  # SmolLM2 has neither
    with pytest.raises(ValueError, match="not known"):
        get_reasoning_parser("granite", _Vocab())
    assert isinstance(get_reasoning_parser("deepseek_r1", _Vocab()), ThinkReasoningParser)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
HERMES_AUTO = ToolPlan((FunctionTool("get_weather", WEATHER),), "auto", True, HermesToolParser())
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_tool_call_after_the_thinking_block_parses_and_none_inside_it():
    text = f"I could write {CALL} but I should think first</think>\n\n{CALL}"
    expected = (f"I could write {CALL} but I should think first", None, [("get_weather", '{"city": "Paris"}')])
    for size in (None, 1, 3, 7):
        assert _split("qwen3", {}, PLAIN, text, size, HERMES_AUTO)[:3] == expected, size
    # Only reasoning (cut short before </think>): the call inside it is no call.
    assert _split("deepseek_r1", {}, OPEN, CALL, None, HERMES_AUTO)[:3] == (CALL, None, [])


def _deltas(texts: list[str]) -> list[GenerationDelta]:
    out = [GenerationDelta([i], t) for i, t in enumerate(texts)]
    out[-1].finish_reason, out[-1].usage = "stop", Usage(3, len(texts), 0)
    return out


def _formatter(tools=None, kwargs=None) -> ChatFormatter:
    stream, _ = get_reasoning_parser("deepseek_r1", _Vocab()).chat_stream(OPEN, kwargs or {}, tools)
    return ChatFormatter("chatcmpl-1", "m", str, include_usage=False, want_logprobs=False, answer=stream,
                         reasoning=True)


def test_reasoning_content_streams_before_the_content_and_the_whole_message_has_both():
    texts = ["Hm", "m, 2+2", "</th", "ink>\n", "It is", " 4."]
    fmt = _formatter()
    chunks = [c for d in _deltas(texts) for c in fmt.stream_delta(d)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"reasoning_content": "Hm", "reasoning": "Hm"},
                      {"reasoning_content": "m, 2+2", "reasoning": "m, 2+2"},
                      {"content": "\n"}, {"content": "It is"}, {"content": " 4."}]  # "</th": held, nothing sent
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    message = _formatter().response(_deltas(texts))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\nIt is 4.", "reasoning_content": "Hmm, 2+2",
                       "reasoning": "Hmm, 2+2"}
    cut = _formatter().response(_deltas(["still ", "thinking"]))["choices"][0]["message"]
    assert (cut["reasoning_content"], cut["content"]) == ("still thinking", None)
    both = _formatter().stream_delta(_deltas(["a</think>b"])[0])[0]["choices"][0]["delta"]
    assert list(both) == ["reasoning_content", "reasoning", "content"]  # one chunk: reasoning first


def test_a_streamed_tool_call_after_thinking_ends_with_tool_calls():
    text = f"call it</think>{CALL}"
    fmt = _formatter(HERMES_AUTO)
    chunks = [c for d in _deltas([text[i:i + 5] for i in range(0, len(text), 5)]) for c in fmt.stream_delta(d)]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert reasoning == "call it" and calls[0]["function"]["name"] == "get_weather"
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Paris"}'
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_grammar_waits_for_the_reasoning_end_then_constrains_what_follows():
    """The matcher never sees the reasoning tokens (text no JSON grammar takes): until the
    end sequence (two tokens here) every token is allowed, then the mask is the JSON
    object's start. (A small vocabulary of its own: no tokenizer to load.)"""
    import time
    from pathlib import Path

    import xgrammar as xgr

    from engine.grammar import GrammarManager
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.structured_outputs import GrammarState

    words = ["<eos>", "{", "}", '"', ":", " ", "a", "Plain", " words", "!!", "END", *map(chr, range(97, 123))]
    eos, brace, plain, bang, end = 0, 1, 7, 9, 10
    gm = GrammarManager(Path("."), len(words), [eos])
    gm._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(words, stop_token_ids=[eos]), cache_enabled=False)
    gm._compiler_ready_at = time.monotonic()
    req = Request("r", [1, 2, 3], SamplingParams(structured_outputs={"json_object": True,
                                                                     "reasoning_end_token_ids": [bang, end]}))

    def allowed(token: int) -> bool:
        return bool((int(gm.fill([req])[0][token // 32]) >> (token % 32)) & 1)

    while (state := gm.poll(req)[0]) is GrammarState.WAIT:
        pass
    for token in [plain, 8, end, bang, bang]:  # reasoning (an END without "!!" before it is no end)
        assert state is GrammarState.READY and allowed(plain) and allowed(eos) and allowed(brace)
        req.append_output_token(token)
        state = gm.poll(req)[0]
    req.append_output_token(end)  # "!!" "END": the reasoning ends, the JSON object starts here
    assert gm.poll(req)[0] is GrammarState.READY
    assert allowed(brace) and not allowed(plain) and not allowed(eos)
    req.append_output_token(brace)
    assert gm.poll(req)[0] is GrammarState.READY and not allowed(brace)  # the matcher took "{" only
    gm.free("r")
    gm.close()


def test_the_reasoning_end_travels_with_the_constraint_and_is_no_part_of_its_key():
    from engine.structured_outputs import StructuredOutputsParams
    from rpc.convert import sampling_from_proto, sampling_to_proto
    from engine.sampling_params import SamplingParams

    so = StructuredOutputsParams(regex="[a-z]+", reasoning_end_token_ids=(5, 6))
    back = sampling_from_proto(sampling_to_proto(SamplingParams(structured_outputs=so))).structured_outputs
    assert back == so and back.reasoning_end_token_ids == (5, 6)
    assert so.key == StructuredOutputsParams(regex="[a-z]+").key  # the same compiled grammar
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        StructuredOutputsParams(regex="x", reasoning_end_token_ids=(-1,))


def test_chat_template_kwargs_are_checked_and_reach_the_template(tokenizer):
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if flavour is defined %}[{{ flavour }}]{% endif %}")
    inputs = InputProcessor(tokenizer, "m", 512, len(tokenizer), chat_template=template)
    try:
        ids = asyncio.run(inputs.encode_chat([{"role": "user", "content": "hi"}], True, None,
                                             {"flavour": "mint", "enable_thinking": False}))
        assert tokenizer.decode(ids) == "hi[mint]"
        assert tokenizer.decode(asyncio.run(inputs.encode_chat([{"role": "user", "content": "hi"}]))) == "hi"
    finally:
        inputs.close()
    for bad, named in ((["x"], "must be an object"), ({"tools": []}, "'tools'"),
                       ({"add_generation_prompt": False}, "'add_generation_prompt'"),
                       ({"enable_thinking": "false"}, "enable_thinking must be a boolean")):
        with pytest.raises(GatewayError, match=named) as e:
            check_template_kwargs(bad)
        assert e.value.param == "chat_template_kwargs"
    with pytest.raises(Exception, match="chat_template_kwargs"):  # pydantic: not an object
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], chat_template_kwargs="x")


def _parse(*argv: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return GatewayConfig.from_args(parser.parse_args(["--decode", "a:1", *argv]))


def test_the_flag_and_its_checks_and_pdserve_up_passes_it_on():
    from pdserve.cli import build_parser
    from pdserve.cli.up import Cluster

    assert _parse("--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    assert _parse().reasoning_parser is None
    with pytest.raises(SystemExit):
        _parse("--reasoning-parser", "granite")
    cfg = _parse("--reasoning-parser", "gpt_oss", "--enable-auto-tool-choice")  # harmony's own calls
    assert cfg.tool_call_parser is None and cfg.enable_auto_tool_choice
    with pytest.raises(ValueError, match="does not apply"):
        _parse("--reasoning-parser", "gpt_oss", "--tool-call-parser", "hermes")
    with pytest.raises(ValueError, match="needs --reasoning-parser gpt_oss"):
        _parse("--tool-call-parser", "openai")
    argv = Cluster(build_parser("up").parse_args(["up", "--reasoning-parser", "deepseek_r1"])).gateway_argv()
    assert _parse(*argv[1:]).reasoning_parser == "deepseek_r1"
    assert "--reasoning-parser" not in Cluster(build_parser("up").parse_args(["up"])).gateway_argv()


def test_the_request_field_is_typed():
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}}
    assert ChatCompletionRequest(**body).chat_template_kwargs == {"enable_thinking": False}
    assert json.loads(ChatCompletionRequest(**body).model_dump_json())["chat_template_kwargs"] == {
        "enable_thinking": False}


def test_without_a_reasoning_parser_the_message_has_no_reasoning_fields():
    """As the front ends build it (``begin_chat`` without a parser): tool calls parsed, an
    empty content null; without tools the text as it is."""
    from gateway.reasoning_parsers import plain_chat_stream

    def message(tools, text):
        fmt = ChatFormatter("c", "m", str, include_usage=False, want_logprobs=False, answer=plain_chat_stream(tools))
        return fmt.response(_deltas([text]))["choices"][0]["message"]

    assert message(HERMES_AUTO, CALL)["content"] is None and len(message(HERMES_AUTO, CALL)["tool_calls"]) == 1
    assert message(None, "a</think>b") == {"role": "assistant", "content": "a</think>b"}
    assert message(None, "") == {"role": "assistant", "content": ""}
