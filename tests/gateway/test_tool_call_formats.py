"""The tool-call formats of the families pdserve serves (mistral, pythonic, qwen3_coder,
deepseek_v3, and the JSON form of forced calls without a parser): each parser on the
shapes real models write, streamed in random chunkings equal to the whole answer,
several calls, content before the calls, malformed text left as content; what each
model's own chat template writes for an assistant tool call parses back to that call;
each constraint (compiled by xgrammar against the default tokenizer) admits the calls it
promises, which the same format parses back, and nothing else."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.openai_protocol import ChatCompletionRequest
from gateway.tokenization import _template_message, render_chat
from gateway.tool_parsers import (PARSERS, DeepSeekV3ToolParser, FunctionTool, JsonCallsToolParser,
                                  MistralToolParser, PythonicToolParser, Qwen3CoderToolParser, ToolPlan, get_parser)

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}}
TOOLS = (FunctionTool("get_weather", WEATHER), FunctionTool("get_time", TIME))
DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _plan(parser, choice="auto", parallel=True, function=None) -> ToolPlan:
    return ToolPlan(TOOLS, choice, parallel, parser, function)


def _assembled(plan: ToolPlan, pieces: list[str]) -> tuple[str | None, list[tuple[str, dict]]]:
    """What a client assembles from a stream of ``pieces``: content, and each call's
    name and parsed arguments (which must be JSON once the stream ends)."""
    stream, content, calls = plan.stream(), "", []
    for i, piece in enumerate(pieces):
        new, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += new
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.name
                calls.append([d.name, d.arguments])
            else:
                calls[d.index][1] += d.arguments
    return content or None, [(n, json.loads(a)) for n, a in calls]


def _whole(plan: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    parsed = plan.parse(text)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# (parser, model output, content, calls)
CASES = [
    # Mistral 7B v0.3 / Nemo: a JSON list after [TOOL_CALLS] (with a space, as Small 3.1 writes it; with ids)
    (MistralToolParser(), '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
     None, [("get_weather", {"city": "Paris", "days": 3})]),
    (MistralToolParser(), 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "a]}\\"b"}, '
     '"id": "abc123xyz"}, {"name": "get_time", "arguments": {}, "id": "def456uvw"}]',
     "Checking.", [("get_weather", {"city": 'a]}"b'}), ("get_time", {})]),
    # Small 3.2 / Magistral / Devstral: [TOOL_CALLS]name[ARGS]{...} per call
    (MistralToolParser(), 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
     "Sure.", [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]),
    (MistralToolParser(), '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}', None, [("get_time", {})]),
    (MistralToolParser(), "No tools needed [TOOL_ here.", "No tools needed [TOOL_ here.", []),
    (MistralToolParser(), "[TOOL_CALLS] I cannot call that.", "[TOOL_CALLS] I cannot call that.", []),
    (MistralToolParser(), '[TOOL_CALLS][{"city": "Paris"}]', '[TOOL_CALLS][{"city": "Paris"}]', []),
    # pythonic: Llama 3.2 / 4, Gemma-style
    (PythonicToolParser(), '[get_weather(city="Paris", days=3)]', None, [("get_weather", {"city": "Paris", "days": 3})]),
    (PythonicToolParser(), "Let me see. [get_weather(city='Paris, \"FR\")', days=2), get_time(tz=None)]",
     "Let me see.", [("get_weather", {"city": 'Paris, "FR")', "days": 2}), ("get_time", {"tz": None})]),
    (PythonicToolParser(), '<|python_start|>[get_time(tz="UTC", opts={"a": [1, 2.5, True]}, flag=false)]'
     '<|python_end|>', None, [("get_time", {"tz": "UTC", "opts": {"a": [1, 2.5, True]}, "flag": False})]),
    (PythonicToolParser(), "A list [1, 2] and a call-like [f(x)] are text.",
     "A list [1, 2] and a call-like [f(x)] are text.", []),
    (PythonicToolParser(), "[get_time(tz=__import__('os').getcwd())]", "[get_time(tz=__import__('os').getcwd())]", []),
    (PythonicToolParser(), "[get_weather(city='Paris'", "[get_weather(city='Paris'", []),  # cut short
    # qwen3_coder
    (Qwen3CoderToolParser(), "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": "Paris", "days": 3})]),
    (Qwen3CoderToolParser(), "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork "
     "<b>\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "I'll check both.", [("get_weather", {"city": "New\nYork <b>"}), ("get_time", {})]),
    (Qwen3CoderToolParser(), "<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\nsoon\n</function>",
     None, [("get_weather", {"city": "Oslo", "days": "soon"})]),  # no <tool_call>, unclosed parameters
    (Qwen3CoderToolParser(), "<tool_call>\nno function here\n</tool_call>", "<tool_call>\nno function here\n</tool_call>",
     []),
    # deepseek_v3
    (DeepSeekV3ToolParser(), f'{DS_B}{DS_CB}function{DS_SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{DS_CE}{DS_E}',
     None, [("get_weather", {"city": "Paris"})]),
    (DeepSeekV3ToolParser(), f'Let me check.{DS_B}{DS_CB}function{DS_SEP}get_weather\n```json\n{{"city": "a`b"}}\n'
     f'```{DS_CE}\n{DS_CB}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CE}{DS_E}',
     "Let me check.", [("get_weather", {"city": "a`b"}), ("get_time", {})]),
    (DeepSeekV3ToolParser(), f"{DS_B}oops{DS_E}", f"{DS_B}oops{DS_E}", []),
]
# The JSON form (no parser; pythonic's required/named): only under a constraint.
JSON_CASES = [
    (JsonCallsToolParser(), '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", '
     '"parameters": {}}]', None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (JsonCallsToolParser(), "not a list", "not a list", []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES + JSON_CASES,
                         ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES + JSON_CASES)])
def test_each_format_parses_whole_and_in_every_small_chunking(parser, text, content, calls):
    plan = _plan(parser)
    assert _whole(plan, text) == (content, calls)
    for size in (1, 2, 3, 5, 7):
        assert _assembled(plan, [text[i:i + size] for i in range(0, len(text), size)]) == (content, calls), size


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES + JSON_CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_random_chunkings_assemble_to_the_whole_answer(case, cuts):
    parser, text, content, calls = case
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])] or [""]
    assert _assembled(_plan(parser), pieces) == (content, calls)


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(list("[]{}()<>=\",'\n :_abcfnt0123") + [
    "[TOOL_CALLS]", "[ARGS]", "<tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
    DS_B, DS_CB, DS_SEP, DS_CE, "```json", "get_weather", "<|python_start|>"]), max_size=30).map("".join),
    parser=st.sampled_from([MistralToolParser(), PythonicToolParser(), Qwen3CoderToolParser(),
                            DeepSeekV3ToolParser(), JsonCallsToolParser()]))
def test_any_text_parses_without_error_and_content_only_grows(text, parser):
    """Malformed text never raises; a stream's content is a prefix of the whole answer's
    content or, when no call was named, the whole text."""
    plan = _plan(parser)
    whole = plan.parse(text)
    stream, content = plan.stream(), ""
    for i, ch in enumerate(text):
        content += stream.feed(ch, final=i == len(text) - 1)[0]
    assert content == (whole.content or "")
    if not whole.tool_calls:
        assert whole.content == (text or None)


def test_arguments_stream_in_pieces_where_the_format_writes_them_in_pieces():
    stream = _plan(MistralToolParser()).stream()
    assert stream.feed("Hi [TOOL_") == ("Hi", [])  # may be the marker
    _, (first,) = stream.feed('CALLS]get_weather[ARGS]{"ci')
    assert (first.name, first.arguments) == ("get_weather", '{"ci')
    assert [d.arguments for d in stream.feed('ty": "Paris"}')[1]] == ['ty": "Paris"}']
    stream = _plan(Qwen3CoderToolParser()).stream()
    _, (first,) = stream.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert (first.name, first.arguments) == ("get_weather", "{")
    assert [d.arguments for d in stream.feed("is\n</parameter>\n")[1]] == ['"city": "Paris"']
    assert [d.arguments for d in stream.feed("<parameter=days>\n4\n</parameter>\n</function>")[1]] == [', "days": 4}']
    stream = _plan(PythonicToolParser()).stream()
    assert stream.feed("Sure [get_wea") == ("Sure", [])
    assert stream.feed("ther(city='X')") [1][0].arguments == '{"city": "X"}'  # a call is sent whole
    stream = _plan(DeepSeekV3ToolParser()).stream()
    _, (first,) = stream.feed(f"{DS_B}{DS_CB}function{DS_SEP}get_time\n```js")
    assert (first.name, first.arguments) == ("get_time", "")
    assert [d.arguments for d in stream.feed('on\n{"tz": "U')[1]] == ['{"tz": "U']


@pytest.mark.parametrize("value, schema, typed", [
    ("3", {"type": "integer"}, 3), ("3.5", {"type": "number"}, 3.5), ("2", {"type": "number"}, 2),
    ("True", {"type": "boolean"}, True), ("false", {"type": "boolean"}, False), ("null", {"type": "null"}, None),
    ("{'a': 1}", {"type": "object"}, {"a": 1}), ('[1, "x"]', {"type": "array"}, [1, "x"]),
    ("3", {"type": ["string", "integer"]}, 3), ("x3", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x3"),
    ("007", {"type": "string"}, "007"), ("many", {"type": "integer"}, "many"), ("5", None, "5"),
])
def test_qwen3_coder_values_are_typed_by_the_schema(value, schema, typed):
    properties = {"v": schema} if schema is not None else {}
    tools = (FunctionTool("f", {"type": "object", "properties": properties}),)
    text = f"<tool_call>\n<function=f>\n<parameter=v>\n{value}\n</parameter>\n</function>\n</tool_call>"
    call, = ToolPlan(tools, "auto", True, Qwen3CoderToolParser()).parse(text).tool_calls
    assert json.loads(call.arguments) == {"v": typed}


# ---- each model's own chat template ------------------------------------------------------------------------------
HISTORY_CALLS = {
    "mistral_nemo_instruct_2407.jinja": [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})],
    "devstral_small_2507.jinja": [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})],
    "llama4_pythonic.jinja": [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    "qwen3_coder.jinja": [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})],
    "deepseek_v3.jinja": [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})],
}
WRITES_NO_CONTENT = {"mistral_nemo_instruct_2407.jinja"}  # the template drops an assistant's text beside calls
TEMPLATE_PARSER = {"mistral_nemo_instruct_2407.jinja": "mistral", "devstral_small_2507.jinja": "mistral",
                   "llama4_pythonic.jinja": "pythonic", "qwen3_coder.jinja": "qwen3_coder",
                   "deepseek_v3.jinja": "deepseek_v3"}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.mark.parametrize("template_file", sorted(TEMPLATE_PARSER))
@pytest.mark.parametrize("content", [None, "Let me check."])
def test_the_parser_reads_back_what_the_models_template_writes(tokenizer, template_file, content):
    """A conversation with tools, an assistant's two calls and their results, rendered by
    the model's own template through the gateway's chat path (the request's messages as
    templates see them): the text the template writes for the assistant's turn parses
    back to those calls (and the content before them)."""
    template = (TEMPLATES / template_file).read_text()
    calls = HISTORY_CALLS[template_file]
    ids = ["abc123xyz", "def456uvw"]
    body = {"messages": [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in zip(ids, calls)]},
        *[{"role": "tool", "tool_call_id": i, "content": '{"ok": true}'} for i in ids]],
        "tools": [t.template_dict() for t in TOOLS]}
    request = ChatCompletionRequest(**body)
    messages = [_template_message(i, m) for i, m in enumerate(request.template_messages())]
    tools = [t.template_dict() for t in TOOLS]

    def text(msgs, add_generation_prompt):
        return tokenizer.decode(render_chat(tokenizer, template, msgs, add_generation_prompt, tools))

    prompt, conversation = text(messages[:1], True), text(messages, False)
    common = next((i for i, (a, b) in enumerate(zip(prompt, conversation)) if a != b), len(prompt))
    assert prompt[common:].strip() == "", (prompt, conversation)  # only the template's blanks differ
    answer = conversation[common:].lstrip()  # the assistant's turn, then the tool results
    plan = _plan(get_parser(TEMPLATE_PARSER[template_file]))
    if template_file in WRITES_NO_CONTENT:
        content = None
    assert _whole(plan, answer) == (content, calls), answer
    assert _assembled(plan, [answer[i:i + 3] for i in range(0, len(answer), 3)]) == (content, calls)


# ---- constraints -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(tokenizer):
    import xgrammar as xgr

    return tokenizer, xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))


def _accepts(compiler, structural_tag: str, text: str) -> bool:
    import xgrammar as xgr

    tokenizer, comp = compiler
    matcher = xgr.GrammarMatcher(comp.compile_structural_tag(structural_tag))
    return matcher.accept_string(text) and matcher.accept_token(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))


# (parser, one call written as the constraint writes it, the text between two calls)
CONSTRAINED = [
    (MistralToolParser(), '{{"name": "{}", "arguments": {}}}', "[TOOL_CALLS][{}]", ", "),
    (Qwen3CoderToolParser(), "<tool_call>\n<function={}>\n{}</function>\n</tool_call>", "{}", "\n"),
    (DeepSeekV3ToolParser(), DS_CB + "function" + DS_SEP + "{}\n```json\n{}\n```" + DS_CE, DS_B + "{}" + DS_E, "\n"),
    (None, '{{"name": "{}", "parameters": {}}}', "[{}]", ", "),
    (PythonicToolParser(), '{{"name": "{}", "parameters": {}}}', "[{}]", ", "),  # the JSON form
]


def _arguments(parser, arguments: dict) -> str:
    if isinstance(parser, Qwen3CoderToolParser):
        return "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return json.dumps(arguments)


@pytest.mark.parametrize("parser, call, calls, separator", CONSTRAINED,
                         ids=[p.name if p else "no-parser" for p, *_ in CONSTRAINED])
def test_constraints_admit_the_calls_they_promise_which_parse_back(compiler, parser, call, calls, separator):
    weather = call.format("get_weather", _arguments(parser, {"city": "Paris", "days": 3}))
    time_ = call.format("get_time", _arguments(parser, {"tz": "UTC"}))
    required = _plan(parser, "required")
    tag = required.structured_outputs().structural_tag
    both = calls.format(weather + separator + time_)
    assert _accepts(compiler, tag, calls.format(weather)), calls.format(weather)
    assert _accepts(compiler, tag, both), both
    assert _whole(required, both) == (None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})])
    assert not _accepts(compiler, tag, calls.format(call.format("set_alarm", _arguments(parser, {}))))
    assert not _accepts(compiler, tag, calls.format(call.format("get_weather", _arguments(parser, {"town": "x"}))))
    assert not _accepts(compiler, tag, "I will not call anything.")
    single = _plan(parser, "required", parallel=False).structured_outputs().structural_tag
    assert _accepts(compiler, single, calls.format(weather)) and not _accepts(compiler, single, both)
    named = _plan(parser, "function", function="get_time")
    assert _accepts(compiler, named.structured_outputs().structural_tag, calls.format(time_))
    assert not _accepts(compiler, named.structured_outputs().structural_tag, calls.format(weather))
    assert _whole(named, calls.format(time_)) == (None, [("get_time", {"tz": "UTC"})])


def test_required_and_named_need_no_parser_and_formats_keep_their_markers():
    for choice, function in [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice=choice,
                                    tools=[t.template_dict() for t in TOOLS])
        plan = req.tool_plan(None, False)
        assert plan is not None and plan.function == function and isinstance(plan.format, JsonCallsToolParser)
        sampling = req.to_sampling_params(plan)
        assert sampling.structured_outputs.kind == "structural_tag" and sampling.skip_special_tokens
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[t.template_dict() for t in TOOLS])
    with pytest.raises(GatewayError, match="--enable-auto-tool-choice"):
        req.tool_plan(None, False)  # auto still needs a parser
    for name in ("mistral", "deepseek_v3"):
        plan = req.tool_plan(get_parser(name), True)
        assert req.to_sampling_params(plan).skip_special_tokens is False  # the markers are special tokens
    assert req.to_sampling_params(req.tool_plan(get_parser("qwen3_coder"), True)).skip_special_tokens
    assert {"mistral", "pythonic", "qwen3_coder", "deepseek_v3", "hermes", "llama3_json"} <= set(PARSERS)
