"""/v1/responses without servers: the Responses request translated into the chat request
(messages, tools, tool_choice, text.format, max_output_tokens), what is refused and how the
errors name the Responses fields, and the response object and stream events built from a
chat answer (text, reasoning, tool calls, cut short), checked against the pinned openai
client's own types. End to end: tests/e2e/test_responses_api.py."""
from __future__ import annotations

import json

import pytest
import typing

from openai.types.responses import Response, ResponseStreamEvent

from gateway.errors import GatewayError
from gateway.output_processor import GenerationDelta, Usage
from gateway.reasoning_parsers import get_reasoning_parser, plain_chat_stream
from gateway.responses_output import ResponsesFormatter
from gateway.responses_protocol import ResponsesRequest, responses_errors
from gateway.tool_parsers import FunctionTool, HermesToolParser, ToolPlan

# The client's event classes by their type (its union is discriminated by the client only).
EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True}


def _chat(**body):
    return ResponsesRequest.model_validate(body).to_chat_request()


def test_a_string_input_and_instructions_are_a_system_and_a_user_message():
    chat = _chat(input="Hi", instructions="Be brief", max_output_tokens=7, temperature=0, top_p=0.5, user="u")
    assert chat.template_messages() == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    sampling = chat.to_sampling_params()
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, chat.user) == (7, 0, 0.5, "u")
    assert _chat(input="Hi").to_sampling_params().max_tokens is None  # the rest of the context, as chat


def test_reasoning_effort_is_the_chat_templates_variable():
    assert _chat(input="Hi", reasoning={"effort": "low"}).chat_template_kwargs == {"reasoning_effort": "low"}
    assert _chat(input="Hi", reasoning={"summary": "auto"}).chat_template_kwargs is None
    with pytest.raises(GatewayError):
        _chat(input="Hi", reasoning={"effort": "extreme"})


def test_items_become_the_chat_conversation():
    items = [{"role": "developer", "content": "rules"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                             {"type": "input_text", "text": "Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"}]
    messages = _chat(input=items, tools=[TOOL], tool_choice="none").template_messages()
    call = lambda i, city: {"id": f"call_{i}", "type": "function",  # noqa: E731
                            "function": {"name": "get_weather", "arguments": {"city": city} if city else {}}}
    assert messages == [
        {"role": "developer", "content": "rules"}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call(1, "Paris"), call(2, "Rome")]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "", "tool_calls": [call(3, None)]}]


def test_tools_tool_choice_and_text_format_become_the_chat_fields():
    chat = _chat(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                 parallel_tool_calls=False)
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                            "parameters": WEATHER, "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    plan = chat.tool_plan(HermesToolParser(), enable_auto=False)
    assert (plan.choice, plan.function, plan.parallel) == ("function", "get_weather", False)
    assert chat.to_sampling_params(plan).structured_outputs is not None  # the forced call's constraint
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = _chat(input="x", text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}})
    assert json.loads(fmt.to_sampling_params().structured_outputs.json) == schema
    assert _chat(input="x", text={"format": {"type": "json_object"}}).to_sampling_params().structured_outputs.json_object
    assert _chat(input="x", text={"format": {"type": "text"}}).to_sampling_params().structured_outputs is None


@pytest.mark.parametrize("body, param, fragment", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation in input"),
    ({"input": "x", "store": True}, "store", "stores no responses"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"input": "x", "background": True}, "background", "stream the response instead"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt"),
    ({}, "input", "input is required"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input", "'input_image' are not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference' are not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "input[0].call_id"),
    ({"input": [{"content": "x"}]}, "input", "needs a role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "no hosted tools"),
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools", "tools[0].name"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice", "hosted tools"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text", "text.format type 'grammar'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text", "needs schema"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"input": "x", "truncation": "auto"}, "truncation", "never cut"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
    ({"input": "x", "max_tool_calls": 1}, "max_tool_calls", "parallel_tool_calls false"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 keys"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body, param, fragment):
    with pytest.raises(GatewayError) as e:
        _chat(**body)
    assert e.value.kind.http_status == 400 and e.value.param == param and fragment in e.value.message, e.value


def test_errors_of_the_chat_checks_name_the_responses_fields():
    with pytest.raises(GatewayError) as e, responses_errors():
        _chat(input="x", max_output_tokens=0).to_sampling_params()
    assert "max_output_tokens" in e.value.message and "max_tokens" not in e.value.message, e.value
    with pytest.raises(GatewayError) as e, responses_errors():
        _chat(input="x", text={"format": {"type": "json_schema", "schema": {"type": "object", "x-bad": {"$ref": 1}},
                                          "name": "a"}}).to_sampling_params()
    assert e.value.param == "text" and "response_format" not in e.value.message, e.value
    assert e.value.to_openai()["error"]["type"] == "invalid_request_error"


def _deltas(texts: list[str], finish: str = "stop") -> list[GenerationDelta]:
    out = [GenerationDelta(token_ids=[i], text=t) for i, t in enumerate(texts)]
    out[-1].finish_reason, out[-1].usage = finish, Usage(prompt_tokens=10, completion_tokens=len(texts),
                                                         cached_tokens=4)
    return out


def _formatter(answer=None, **body) -> ResponsesFormatter:
    request = ResponsesRequest.model_validate({"input": "x", **body})
    return ResponsesFormatter("resp-abc", "m", request.echo(), answer or plain_chat_stream(None))


def _stream(fmt: ResponsesFormatter, deltas: list[GenerationDelta]) -> list[dict]:
    events = fmt.stream_start() + [e for d in deltas for e in fmt.stream_delta(d)]
    for e in events:
        EVENTS[e["type"]].model_validate(e)  # the client's own event types, strictly
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_streams_as_responses_events_and_the_body_is_the_last_one():
    events = _stream(_formatter(temperature=0, metadata={"k": "v"}), _deltas(["The", " answer", "."]))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[7]["text"] == "The answer."
    body = _formatter(temperature=0, metadata={"k": "v"}).response(_deltas(["The", " answer", "."]))
    final = events[-1]["response"]
    assert Response.model_validate(body).output_text == Response.model_validate(final).output_text == "The answer."
    assert {k: v for k, v in body.items() if k not in ("output", "created_at")} == \
        {k: v for k, v in final.items() if k not in ("output", "created_at")}
    assert (body["id"], body["object"], body["status"], body["store"], body["temperature"], body["metadata"]) == \
        ("resp_abc", "response", "completed", False, 0, {"k": "v"})
    assert body["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                             "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13}
    assert body["output"][0]["content"] == [{"type": "output_text", "text": "The answer.", "annotations": [],
                                             "logprobs": []}]


def test_max_output_tokens_reached_is_incomplete():
    events = _stream(_formatter(max_output_tokens=2), _deltas(["a", "b"], finish="length"))
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert (last["response"]["status"], last["response"]["incomplete_details"]) == \
        ("incomplete", {"reason": "max_output_tokens"})
    assert last["response"]["output"][0]["status"] == "incomplete"
    failed = _formatter().response([GenerationDelta([], "", finish_reason="error", finish_message="no token",
                                                    usage=Usage(3, 0, 0))])
    assert (failed["status"], failed["error"]["message"]) == ("failed", "no token")


def test_an_empty_answer_is_an_empty_message():
    events = _stream(_formatter(), _deltas([""]))
    assert [e["type"] for e in events][2:] == ["response.output_item.added", "response.content_part.added",
                                               "response.output_text.done", "response.content_part.done",
                                               "response.output_item.done", "response.completed"]
    assert Response.model_validate(events[-1]["response"]).output_text == ""


class _Vocab:
    @staticmethod
    def get_vocab() -> dict[str, int]:
        return {"<think>": 7, "</think>": 8}


def test_reasoning_and_a_tool_call_are_items_of_their_own():
    tools = ToolPlan((FunctionTool("get_weather", WEATHER),), "auto", True, HermesToolParser())
    texts = ["Hm", "m</think>", "<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": ',
             '"Paris"}}\n</tool_call>']
    answer = lambda: get_reasoning_parser("deepseek_r1", _Vocab()).chat_stream([7], {}, tools)[0]  # noqa: E731
    events = _stream(_formatter(answer()), _deltas(texts))
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta"]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    body = _formatter(answer()).response(_deltas(texts))
    reasoning, call = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm"}]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == \
        ("function_call", "get_weather", {"city": "Paris"})
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 2  # "Hm", "m</think>"
    Response.model_validate(body)


def test_sse_events_are_named_and_there_is_no_done():
    fmt = _formatter()
    event = fmt.stream_start()[0]
    assert fmt.sse_event(event).startswith(b"event: response.created\ndata: {")
    assert fmt.sse_event({"error": {"message": "x"}}).startswith(b"event: error\ndata: ")
    assert fmt.sse_done() == b""
