"""/v1/messages end to end through the official ``anthropic`` client: one real prefill
server, one real decode server and a gateway on the default model (SmolLM2) with the
shipped Hermes tool template and parser (the session's ``hermes_cluster``, shared with the
Responses API's tests).

What it proves: a Messages request is the chat request it translates into (greedy text
and prompt length equal the chat completion of the same conversation, streamed and
not, also for a conversation carrying a tool call and its result); a forced tool
(``tool_choice: {"type": "tool"}``) comes back as a ``tool_use`` block whose ``input``
matches the tool's schema (jsonschema), streamed in ``input_json_delta`` pieces and
whole; ``output_config.format`` (the client's ``messages.parse``) gives a validated
object; bad inputs are Anthropic's errors with their statuses; no KV block stays held."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest

from tests.e2e.conftest import HERMES_API_KEY as API_KEY
from tests.e2e.conftest import HERMES_MAX_MODEL_LEN as MAX_MODEL_LEN

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # the client's own arguments leave sampling out
SYSTEM = "You are a helpful assistant."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def cluster(hermes_cluster):
    return hermes_cluster


@pytest.fixture(scope="module")
def claude(cluster):
    return anthropic.Anthropic(base_url=cluster.http_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=API_KEY, max_retries=0)


def _at_once(*calls):
    """Each of ``calls`` (no arguments) on a thread of its own, at once (the servers batch
    them); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_text_equals_the_chat_completion(claude, oai):
    def streamed():
        with claude.messages.stream(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12,
                                    extra_body=GREEDY) as stream:
            return list(stream.text_stream), stream.get_final_message()

    ref, m, (pieces, final) = _at_once(
        lambda: oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *ASK],
                                            max_tokens=12, temperature=0),
        lambda: claude.messages.create(model=MODEL, system=[{"type": "text", "text": SYSTEM}], messages=ASK,
                                       max_tokens=12, extra_body=GREEDY),
        streamed)
    (block,) = m.content
    assert block.type == "text" and block.text == ref.choices[0].message.content, (m, ref)
    assert m.id.startswith("msg_") and m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        ref.choices[0].finish_reason]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == ref.usage.prompt_tokens
    assert m.usage.output_tokens == ref.usage.completion_tokens
    assert "".join(pieces) == block.text == final.content[0].text and len(pieces) > 1
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_a_forced_tool_call_is_schema_valid_and_its_result_renders(claude, oai):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]

    def streamed():
        with claude.messages.stream(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=40, extra_body=GREEDY,
                                    tool_choice={"type": "tool", "name": "get_weather"}) as stream:
            return [e.partial_json for e in stream if e.type == "input_json" and e.partial_json], \
                stream.get_final_message()

    m, (pieces, final) = _at_once(
        lambda: claude.messages.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=40, extra_body=GREEDY,
                                       tool_choice={"type": "tool", "name": "get_weather"}), streamed)
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_"), m
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    assert final.content[0].input == call.input and final.stop_reason == "tool_use"
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input

    # The call and its result sent back: the same prompt and greedy answer as the chat request.
    result = f"{call.input['city']}: sunny, 21 degrees"
    conversation = [*ask, {"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    answer, ref = _at_once(
        lambda: claude.messages.create(model=MODEL, messages=conversation, tools=[WEATHER], max_tokens=8,
                                       extra_body=GREEDY, tool_choice={"type": "auto"}),
        lambda: oai.chat.completions.create(model=MODEL, tools=tools, max_tokens=8, temperature=0, messages=[
            *ask, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result}]))
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == ref.usage.prompt_tokens
    assert "".join(b.text for b in answer.content if b.type == "text") == (ref.choices[0].message.content or "")


def test_bad_inputs_are_anthropic_errors(cluster, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, messages=ASK, max_tokens=MAX_MODEL_LEN)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "maximum context length" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[*ASK, {"role": "assistant", "content": "The"}])
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        claude.messages.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=4,
                               tool_choice={"type": "tool", "name": "get_time"})
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=cluster.http_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=ASK, max_tokens=4)
