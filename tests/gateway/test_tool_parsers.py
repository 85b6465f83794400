"""Tool calls and structured outputs at the gateway, without servers: the parsers (a
streamed answer, cut anywhere, assembles to what the whole answer parses to), the
constraints they build (compiled by xgrammar against the default tokenizer: they admit
the calls they promise and nothing else), request validation (tools, tool_choice,
response_format, structured_outputs) and the response shapes (tool_calls, finish
reasons, the "error" finish's stop_reason)."""
from __future__ import annotations

import json

import pytest

from gateway.errors import GatewayError
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai_responses import ChatFormatter
from gateway.output_processor import GenerationDelta, Usage
from gateway.tool_parsers import FunctionTool, HermesToolParser, Llama3JsonToolParser, ToolPlan

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
MESSAGES = [{"role": "user", "content": "hi"}]


def _plan(parser, choice="auto", parallel=True, function=None) -> ToolPlan:
    tools = (FunctionTool("get_weather", WEATHER), FunctionTool("get_time", {"type": "object"}))
    return ToolPlan(tools, choice, parallel, parser, function)


def _streamed(plan: ToolPlan, text: str, size: int) -> tuple[str | None, list[tuple[str, str]]]:
    """The answer as a client assembles it from deltas of ``size`` characters."""
    stream, content, calls = plan.stream(), "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        new, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += new
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.id.startswith("call_") and d.name
                calls[d.index] = [d.name, d.arguments]
            else:
                calls[d.index][1] += d.arguments
    return content or None, [tuple(c) for c in calls.values()]


HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\"b", "n": [1, {"x": []}]}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", '{"city": "a}\\"b", "n": [1, {"x": []}]}'), ("get_time", "{}")]),
    ('<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>',  # name last: whole
     None, [("get_weather", '{"city": "Rome"}')]),
    ("Plain text, a < sign and <tool_ at the end", "Plain text, a < sign and <tool_ at the end", []),
    ("<tool_call>\nnot a call\n</tool_call>", "<tool_call>\nnot a call\n</tool_call>", []),
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}',
     None, [("get_weather", '{"city": "a;b"}'), ("get_time", "{}")]),
    ("The weather is fine.", "The weather is fine.", []),
    ('  {"city": "Paris"}', '  {"city": "Paris"}', []),  # JSON that is no call
]


@pytest.mark.parametrize("parser, text, content, calls",
                         [(HermesToolParser(), *c) for c in HERMES] + [(Llama3JsonToolParser(), *c) for c in LLAMA3])
def test_streamed_answers_assemble_to_the_whole_answer(parser, text, content, calls):
    plan = _plan(parser)
    whole = plan.parse(text)
    assert (whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == (content, calls)
    for size in range(1, 9):
        assert _streamed(plan, text, size) == (content, calls), size


def test_arguments_stream_as_they_are_written_and_content_is_held_only_at_a_possible_call():
    stream = _plan(HermesToolParser()).stream()
    assert stream.feed("Sure <tool") == ("Sure", [])  # " <tool" may start a call
    assert stream.feed("bar")[0] == " <toolbar"
    stream = _plan(HermesToolParser()).stream()
    content, (first,) = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert (content, first.name, first.arguments) == ("", "get_weather", "")  # the name, at once
    assert [(d.id, d.arguments) for d in stream.feed('{"ci')[1]] == [(None, '{"ci')]
    assert [d.arguments for d in stream.feed('ty": "Paris"}')[1]] == ['ty": "Paris"}']
    assert stream.feed("}\n</tool_call>", final=True) == ("", [])  # the object's own brace is no argument


def test_without_parallel_calls_only_the_first_counts():
    text = ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>')
    assert [c.name for c in _plan(HermesToolParser(), parallel=False).parse(text).tool_calls] == ["get_time"]


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    return tokenizer, xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))


def _accepts(compiler, structural_tag: str, text: str) -> bool:
    """The grammar takes ``text`` whole and may end there."""
    import xgrammar as xgr

    tokenizer, comp = compiler
    matcher = xgr.GrammarMatcher(comp.compile_structural_tag(structural_tag))
    return matcher.accept_string(text) and matcher.accept_token(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))


@pytest.mark.parametrize("parser, call, other", [
    (HermesToolParser(), '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>', "\n"),
    (Llama3JsonToolParser(), '{{"name": "{}", "parameters": {}}}', "; "),
])
def test_constraints_admit_the_calls_they_promise_and_nothing_else(compiler, parser, call, other):
    weather, time_ = call.format("get_weather", '{"city": "Paris"}'), call.format("get_time", "{}")
    required = _plan(parser, "required").structured_outputs().structural_tag
    assert _accepts(compiler, required, weather)
    assert _accepts(compiler, required, weather + other + time_)
    assert not _accepts(compiler, required, call.format("get_weather", '{"town": "Paris"}'))
    assert not _accepts(compiler, required, call.format("set_alarm", "{}"))
    assert not _accepts(compiler, required, "I will not call anything.")
    assert not _accepts(compiler, required, "")
    single = _plan(parser, "required", parallel=False).structured_outputs().structural_tag
    assert _accepts(compiler, single, weather) and not _accepts(compiler, single, weather + other + time_)
    named = _plan(parser, "function", function="get_time").structured_outputs().structural_tag
    assert _accepts(compiler, named, time_) and not _accepts(compiler, named, weather)
    assert _plan(parser).structured_outputs() is None  # auto: free text, parsed after


def _error(body: dict, parser=HermesToolParser(), enable_auto=True) -> GatewayError:
    with pytest.raises(GatewayError) as e:
        req = ChatCompletionRequest(**{"messages": MESSAGES, **body})
        req.to_sampling_params(req.tool_plan(parser, enable_auto))
        req.template_messages()
    assert e.value.kind.http_status == 400
    return e.value


@pytest.mark.parametrize("body, parser, enable_auto, param, fragment", [
    ({"tools": TOOLS}, HermesToolParser(), False, "tool_choice", "(the default when tools are given) needs"),
    ({"tools": TOOLS, "tool_choice": "auto"}, None, False, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, HermesToolParser(), True,
     "tool_choice", "'nope', which is not among the tools (get_time, get_weather)"),
    ({"tool_choice": "required"}, HermesToolParser(), True, "tool_choice", "needs tools"),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, HermesToolParser(), True, "tools",
     "only function tools"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, HermesToolParser(), True, "tools", "used twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
      "tool_choice": "required"}, HermesToolParser(), True, "tools", "tools[0] (f): function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, HermesToolParser(), True,
     "tool_choice", "cannot be combined"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None, False, "response_format",
     "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, None, False, "response_format", "'yaml' is not supported"),
    ({"structured_outputs": {"json_object": False}}, None, False, "structured_outputs", "must be true"),
    ({"structured_outputs": {"choice": []}}, None, False, "structured_outputs", "1 to 1024 strings"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, None, False, "messages",
     "only assistant messages"),
])
def test_bad_tool_and_constraint_requests_name_the_problem(body, parser, enable_auto, param, fragment):
    e = _error(body, parser, enable_auto)
    assert e.param == param and fragment in e.message, e


def test_requests_map_onto_the_engines_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = ChatCompletionRequest(messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}).to_sampling_params()
    assert json.loads(so.structured_outputs.json) == schema
    assert ChatCompletionRequest(messages=MESSAGES, response_format={"type": "json_object"}) \
        .to_sampling_params().structured_outputs.json_object
    assert ChatCompletionRequest(messages=MESSAGES, response_format={"type": "text"}) \
        .to_sampling_params().structured_outputs is None
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    for spec, kind, value in [({"json": schema}, "json", json.dumps(schema)),
                              ({"json": '{"type": "string"}'}, "json", '{"type": "string"}'),
                              ({"choice": ["a", "b"]}, "choice", ("a", "b")), ({"regex": "a+"}, "regex", "a+"),
                              ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
                              ({"structural_tag": tag}, "structural_tag", json.dumps(tag))]:
        p = CompletionRequest(prompt="x", structured_outputs=spec).to_sampling_params().structured_outputs
        assert (p.kind, p.spec) == (kind, value)
    req = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert req.tool_plan(None, False) is None and req.to_sampling_params().structured_outputs is None
    with pytest.raises(GatewayError, match="chat completions only"):
        CompletionRequest(prompt="x", tool_choice="required").to_sampling_params()
    history = ChatCompletionRequest(messages=[
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]).template_messages()
    assert history[0]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}  # as templates expect it
    assert history[1] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}


def _formatter(plan: ToolPlan | None) -> ChatFormatter:
    return ChatFormatter("chatcmpl-1", "m", lambda t: str(t), include_usage=False, want_logprobs=False, tools=plan)


def test_responses_carry_tool_calls_and_the_error_finish():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    usage = Usage(3, 9, 0)
    body = _formatter(_plan(HermesToolParser(), "required")).response([GenerationDelta([1], text, [], "stop", usage)])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call, = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    fmt = _formatter(_plan(HermesToolParser(), "required"))
    chunks = [c for i in range(0, len(text), 10)
              for c in fmt.stream_delta(GenerationDelta([1], text[i:i + 10], [], None))]
    chunks += fmt.stream_delta(GenerationDelta([], "", [], "stop", usage))
    parts = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert parts[0]["id"].startswith("call_") and parts[0]["function"]["name"] == "get_weather"
    assert all(set(p) == {"index", "function"} for p in parts[1:]) and len(parts) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    error = GenerationDelta([], "", [], "error", usage, "request r: no token meets the constraint")
    failed = _formatter(None).response([error])["choices"][0]
    assert (failed["finish_reason"], failed["stop_reason"]) == ("error", "request r: no token meets the constraint")
    assert _formatter(None).stream_delta(error)[0]["choices"][0]["stop_reason"].endswith("meets the constraint")
