"""/v1/responses end to end: one real prefill server, one real decode server and a gateway
on the default model (SmolLM2, ChatML) with the shipped Hermes tool template and parser
(the session's ``hermes_cluster``, shared with the Messages API's tests), driven through the official ``openai`` client (``responses.create``, streamed and not,
``responses.stream`` and ``responses.parse``, with ``text_format`` a pydantic model).

What it proves: a Responses request runs as the chat request it translates into (the
greedy text and the token counts equal chat completions' for the same conversation); a
forced function call comes back as a function_call item, streamed in pieces, and its
result sent back as a function_call_output item renders as chat's tool message; a
``text.format`` JSON schema holds (jsonschema) and the client parses it into its model;
what a stateless server cannot do, and bodies of the wrong types, are 400s the client
raises as BadRequestError, in OpenAI's error shape. Few tokens each. Reasoning items:
tests/e2e/test_reasoning.py."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import HERMES_API_KEY

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def oai(hermes_cluster):
    return openai.OpenAI(base_url=hermes_cluster.http_url + "/v1", api_key=HERMES_API_KEY, max_retries=0)


def _at_once(*calls):
    """Each of ``calls`` (no arguments) on a thread of its own, at once (the servers batch
    them); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _chat_text(oai, messages, max_tokens, **kw):
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].message.content, r.usage, r.choices[0].finish_reason


def test_text_equals_chat_completions_streamed_and_not(oai):
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": ASK}]
    # The client's stream helper, items as input, and max_output_tokens cutting the answer short.
    items = [{"type": "message", "role": "developer", "content": messages[0]["content"]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]

    def helper_stream():
        with oai.responses.stream(model=MODEL, input=items, max_output_tokens=16, temperature=0) as stream:
            return [e.delta for e in stream if e.type == "response.output_text.delta"], stream.get_final_response()

    (text, usage, finish), r, events, (streamed, final), cut = _at_once(
        lambda: _chat_text(oai, messages, 16),
        lambda: oai.responses.create(model=MODEL, instructions=messages[0]["content"], input=ASK,
                                     max_output_tokens=16, temperature=0, metadata={"case": "text"}),
        lambda: list(oai.responses.create(model=MODEL, instructions=messages[0]["content"], input=ASK,
                                          max_output_tokens=16, temperature=0, stream=True)),
        helper_stream,
        lambda: oai.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0))
    assert finish == "stop" and "Paris" in text, text
    assert (r.object, r.status, r.model, r.store, r.metadata) == ("response", "completed", MODEL, False, {"case": "text"})
    assert r.id.startswith("resp_") and r.output_text == text
    message, = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)

    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                             "response.output_item.added", "response.content_part.added"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == text
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text

    assert final.output_text == "".join(streamed) == text
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == ("incomplete",
                                                                                   "max_output_tokens", 3)
    assert cut.output[0].status == "incomplete" and text.startswith(cut.output_text) and cut.output_text


def test_a_forced_function_call_and_its_result(oai):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    forced = {"type": "function", "name": "get_weather"}

    def streamed_call():
        with oai.responses.stream(model=MODEL, input=ask, tools=[WEATHER], tool_choice=forced, max_output_tokens=40,
                                  temperature=0) as stream:
            return [e.delta for e in stream if e.type == "response.function_call_arguments.delta"], \
                stream.get_final_response()

    r, (pieces, final) = _at_once(
        lambda: oai.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice=forced,
                                     max_output_tokens=40, temperature=0), streamed_call)
    call, = r.output
    assert (r.status, call.type, call.name, call.status) == ("completed", "function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    streamed, = final.output
    assert len(pieces) > 1 and "".join(pieces) == streamed.arguments == call.arguments
    assert streamed.name == "get_weather"

    # The result goes back as a function_call_output item: the same prompt as chat's tool message.
    result = '{"temperature": 21, "sky": "clear"}'
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    answer, (text, usage, _) = _at_once(
        lambda: oai.responses.create(model=MODEL, input=[*ask, *r.output, {"type": "function_call_output",
                                                                          "call_id": call.call_id, "output": result}],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0),
        lambda: _chat_text(oai, [*ask, {"role": "assistant", "content": None, "tool_calls": [chat_call]},
                                 {"role": "tool", "tool_call_id": call.call_id, "content": result}], 8,
                           tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                    if k != "type"}}], tool_choice="none"))
    assert answer.output_text == text and answer.usage.input_tokens == usage.prompt_tokens


class Capital(BaseModel):
    city: str = Field(max_length=12)


def test_a_json_schema_output_holds_and_the_client_parses_it(oai):
    schema = Capital.model_json_schema() | {"additionalProperties": False}
    r = oai.responses.create(model=MODEL, input=ASK + " Answer in JSON.", max_output_tokens=24, temperature=0,
                             text={"format": {"type": "json_schema", "name": "capital", "schema": schema,
                                              "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
    parsed = oai.responses.parse(model=MODEL, input=ASK + " Answer in JSON.", max_output_tokens=24, temperature=0,
                                 text_format=Capital)
    assert isinstance(parsed.output_parsed, Capital) and parsed.output_text == r.output_text
    with oai.responses.stream(model=MODEL, input=ASK + " Answer in JSON.", max_output_tokens=24, temperature=0,
                              text_format=Capital) as stream:  # the client sends Capital's schema
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Capital) and final.output_text == r.output_text


@pytest.mark.parametrize("body, param, fragment", [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "send the whole conversation in input"),
    ({"store": True}, "store", "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools", "no hosted tools"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input_image"),
    ({"input": 5}, None, "input"),
    ({"max_output_tokens": "8"}, None, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs schema"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_openai_400s(oai, body, param, fragment, stream):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(**{"model": MODEL, "input": ASK, "stream": stream, **body})
    error = e.value.body
    assert e.value.status_code == 400 and fragment in error["message"], error
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_the_error_body_is_openais_shape(oai):
    r = httpx.post(str(oai.base_url) + "responses", json={"input": ASK, "previous_response_id": "resp_1"}, timeout=30,
                   headers={"Authorization": f"Bearer {HERMES_API_KEY}"})
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
