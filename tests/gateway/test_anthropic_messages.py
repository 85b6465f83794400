"""/v1/messages (the Anthropic Messages API): its translation into the chat request
(gateway/anthropic_protocol.py) and its bodies and events (gateway/anthropic_responses.py)
as pure functions, then a real gateway process in front of the fake engine servers,
driven through the official ``anthropic`` client and raw HTTP (auth, error shapes,
streaming framing, stop sequences, a failure mid-stream)."""
from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

from gateway.anthropic_protocol import CountTokensRequest, MessagesRequest
from gateway.anthropic_responses import MessagesFormatter
from gateway.errors import GatewayError
from gateway.output_processor import GenerationDelta, Usage
from gateway.reasoning_parsers import ThinkStream, TextChatStream, plain_chat_stream
from gateway.tool_parsers import HermesToolParser
from tests.gateway.conftest import API_KEY, SCRIPT_TEXT

MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _request(**body) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": MODEL, "max_tokens": 8, **body})


def _chat(parser=None, enable_auto=False, **body):
    return _request(**body).to_chat_request(parser, enable_auto)


# ---- the request's translation --------------------------------------------------------------------------------
def test_system_text_blocks_and_sampling_become_the_chat_request():
    chat = _chat(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {}}],
                 messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
                           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
                 stop_sequences=["\n\n"], temperature=0.5, top_p=0.9, top_k=5, metadata={"user_id": "u1"},
                 stream=True)
    assert chat.template_messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                                        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    sampling = chat.to_sampling_params(chat.tool_plan(None, False))
    assert (sampling.max_tokens, sampling.stop, sampling.temperature, sampling.top_p, sampling.top_k) == \
        (8, ["\n\n"], 0.5, 0.9, 5)
    assert chat.stream and chat.model == MODEL and chat.chat_template_kwargs is None


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages():
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "two calls", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                     "content": [{"type": "text", "text": "rain"}]},
                    {"type": "text", "text": "Thanks"}]}]
    out = _chat(messages=messages).template_messages()
    assert out == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "id": "toolu_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "id": "toolu_2", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "Thanks"}]


@pytest.mark.parametrize("choice, openai_choice, parallel", [
    (None, "auto", True), ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
    ({"type": "any"}, "required", True), ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, False)])
def test_tools_and_tool_choice(choice, openai_choice, parallel):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL]}
    if choice is not None:
        body["tool_choice"] = choice
    chat = _chat(HermesToolParser(), True, **body)
    assert (chat.tool_choice, chat.parallel_tool_calls) == (openai_choice, parallel)
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters":
                                                            WEATHER_TOOL["input_schema"],
                                                            "description": "The weather in a city"}}]
    plan = chat.tool_plan(HermesToolParser(), True)
    constraint = chat.to_sampling_params(plan).structured_outputs
    if choice is None or choice["type"] in ("auto", "none"):
        assert constraint is None
    else:  # forced: the hermes structural tag naming the function
        assert '"name\\": \\"get_weather\\"' in constraint.structural_tag


def test_output_config_format_and_thinking():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = _chat(messages=[{"role": "user", "content": "x"}], thinking={"type": "disabled"},
                 output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert json.loads(chat.to_sampling_params().structured_outputs.json) == schema
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert _chat(messages=[{"role": "user", "content": "x"}],
                 thinking={"type": "enabled", "budget_tokens": 1024}).chat_template_kwargs == {"enable_thinking": True}


def test_count_tokens_needs_no_max_tokens():
    chat = CountTokensRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}) \
        .to_chat_request(None, False)
    assert chat.template_messages() == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, parser, needle", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, None, "type 'image'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]}, None, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     None, "tool_use blocks belong in assistant messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f"}]},
                   {"role": "user", "content": "x"}]}, None, None),  # input defaults to {}
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, None, "tool_use_id"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
     HermesToolParser(), "server tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}, HermesToolParser(), "input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL]}, None, '{"type": "auto"} (the default'),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}}, None,
     "--tool-call-parser"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool"}},
     HermesToolParser(), "needs the tool's name"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": []}, None, "mcp_servers is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "text"}}}, None,
     "output_config.format"),
])
def test_refusals_name_the_problem(body, parser, needle):
    if needle is None:
        _chat(parser, False, **body)
        return
    with pytest.raises(GatewayError) as e:
        _chat(parser, False, **body)
    assert needle in e.value.message and e.value.kind.http_status == 400


# ---- bodies and events ----------------------------------------------------------------------------------------
def _deltas(texts: list[str], finish: str = "stop", stop_string: str | None = None,
            cached: int = 0) -> list[GenerationDelta]:
    out = [GenerationDelta([i], t) for i, t in enumerate(texts)]
    out[-1].finish_reason, out[-1].stop_string = finish, stop_string
    out[-1].usage = Usage(10, len(texts), cached)
    return out


def _formatter(answer=None) -> MessagesFormatter:
    return MessagesFormatter("msg_1", MODEL, str, answer or plain_chat_stream(None), 10)


def _streamed(fmt: MessagesFormatter, deltas: list[GenerationDelta]) -> list[dict]:
    events = fmt.stream_start()
    for d in deltas:
        events += fmt.stream_delta(d)
    return events


@pytest.mark.parametrize("finish, stop_string, reason", [
    ("stop", None, "end_turn"), ("stop", "\n", "stop_sequence"), ("length", None, "max_tokens")])
def test_text_body_and_events(finish, stop_string, reason):
    deltas = _deltas(["Hel", "lo"], finish, stop_string, cached=4)
    body = _formatter().response(deltas)
    assert body == {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
                    "content": [{"type": "text", "text": "Hello"}], "stop_reason": reason, "stop_sequence": stop_string,
                    "usage": {"input_tokens": 6, "output_tokens": 2, "cache_read_input_tokens": 4}}
    events = _streamed(_formatter(), deltas)
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": 10, "output_tokens": 0}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "Hello"
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_string},
                          "usage": body["usage"]}


def test_thinking_then_tool_use_blocks():
    from gateway.openai_protocol import tool_plan

    plan = tool_plan([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}], "auto", True,
                     HermesToolParser(), True)
    texts = ["hmm", "</think>", "Sure.", '<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": ',
             '"Paris"}}\n</tool_call>']
    answer = lambda: TextChatStream(ThinkStream("<think>", "</think>", True), plan)  # noqa: E731
    body = _formatter(answer()).response(_deltas(texts))
    (thinking, text, call) = body["content"]
    assert thinking == {"type": "thinking", "thinking": "hmm", "signature": ""} and text == {"type": "text",
                                                                                           "text": "Sure."}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["name"] == "get_weather"
    assert call["input"] == {"city": "Paris"} and body["stop_reason"] == "tool_use"
    events = _streamed(_formatter(answer()), _deltas(texts))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [s["type"] for s in starts] == ["thinking", "text", "tool_use"]
    assert starts[2]["name"] == "get_weather" and starts[2]["input"] == {}
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
              and e["delta"]["type"] == "input_json_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2] and events[-2]["delta"]["stop_reason"] == "tool_use"


def test_an_error_event_and_no_done():
    fmt = _formatter()
    assert fmt.sse_done() == b""
    frame = fmt.sse_event({"error": {"message": "decode step failed", "type": "internal_error"}})
    assert frame.startswith(b"event: error\ndata: ")
    assert json.loads(frame.split(b"data: ", 1)[1]) == {"type": "error", "error": {"type": "api_error",
                                                                                  "message": "decode step failed"}}


# ---- a real gateway in front of fake engine servers ------------------------------------------------------------
@pytest.fixture(scope="module")
def claude(cluster):
    return anthropic.Anthropic(base_url=cluster.main.http_url, api_key=API_KEY, max_retries=0)


def _events(r: httpx.Response) -> list[tuple[str, dict]]:
    out = []
    for frame in r.text.split("\n\n"):
        if frame:
            name, data = frame.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), frame
            out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_client_text_streamed_and_not(cluster, claude):
    m = claude.messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Hi"}])
    assert re.fullmatch("msg_[0-9a-f]{32}", m.id) and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.content[0].text == SCRIPT_TEXT and m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens == len(cluster.fake.state.script) + 1
    with claude.messages.stream(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert SCRIPT_TEXT.startswith(text) and final.content[0].text == text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5 and final.usage.input_tokens == m.usage.input_tokens
    m = claude.messages.create(model=MODEL, max_tokens=50, stop_sequences=["fake"],
                               messages=[{"role": "user", "content": "Hi"}])
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == ("Hello! I am a ", "stop_sequence", "fake")


def test_raw_stream_framing_and_request_id(cluster):
    r = httpx.post(cluster.main.http_url + "/v1/messages", headers={"x-api-key": API_KEY}, timeout=20,
                   json={"model": MODEL, "max_tokens": 3, "stream": True,
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert all(name == body["type"] for name, body in events)
    assert events[0][1]["message"]["id"] == r.headers["x-request-id"] and events[-1][0] == "message_stop"


def test_errors_have_anthropic_shape(cluster, claude):
    url = cluster.main.http_url
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/v1/messages", headers=headers, json={})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error", r.json()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {  # required, as Anthropic's
        "type": "invalid_request_error", "message": "invalid request: max_tokens: Field required"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}],
                               extra_body={"max_tokens": "8"})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="type 'image'"):
        claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": API_KEY}, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in r.json()["error"]["message"]


def test_overloaded_and_a_failure_mid_stream(cluster, claude):
    cluster.fake.state.knobs.queue_full = True
    with pytest.raises(anthropic.RateLimitError):
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    cluster.fake.state.knobs.queue_full = False
    cluster.fake.state.knobs.fail_after_deltas = 2
    with pytest.raises(anthropic.APIStatusError, match="decode step failed"):
        with claude.messages.stream(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "x"}]) as s:
            list(s.text_stream)


def test_count_tokens(cluster, claude):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    m = claude.messages.create(model=MODEL, max_tokens=1, messages=messages, system="Be brief.")
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 5


def test_output_format_reaches_the_engine_as_a_json_schema(cluster, claude):
    """The client's ``messages.parse(output_format=...)`` sends ``output_config.format``: the
    engine servers get its schema as the request's JSON constraint."""
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        sunny: bool

    with pytest.raises(ValueError):  # the fake engine's script is no JSON: the client cannot parse it
        claude.messages.parse(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                              output_format=Forecast)
    (decode,) = cluster.fake.state.decode_requests
    schema = json.loads(decode.sampling.structured_outputs.json)
    assert schema["properties"].keys() == {"city", "sunny"} and schema["additionalProperties"] is False
