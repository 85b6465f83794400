"""Structured outputs and tool calls end to end: one real prefill server, one real decode
server and a gateway on the default model (SmolLM2, ChatML) started with the shipped
Hermes tool template and parser (the session's ``hermes_cluster``, shared with the
Responses and Messages API tests), plus a second gateway in front of the same decode
server with no prefill server (the decode server prefills: the local path). Driven
through the official ``openai`` client, raw HTTP and gRPC; the requests of a test go
at once where they are independent (the servers batch them; each answer is checked).

What it proves: ``.parse(response_format=Model)`` returns the parsed object for several
models; JSON mode, regex, choice and grammar hold through the prefill -> decode hand-off
and the local path, also at ``max_tokens: 1`` and for a grammar complete after its first
token; ``tool_choice`` required and named return calls the client parses, streamed (in
pieces) and not, through HTTP and gRPC; ``auto`` parses a block the model wrote; a request no token can satisfy
finishes with "error" and its reason (in the prefill tier or the decode tier); bad
constraints are 400 / INVALID_ARGUMENT naming the problem, and are not retried; random
schemas (hypothesis-jsonschema) hold at temperature 1 and finish within a max_tokens
that fits them."""
from __future__ import annotations

import enum
import json
import re
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from pydantic import BaseModel, Field

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import HERMES_API_KEY, HERMES_MAX_MODEL_LEN
from tests.processes import REPO, GatewayProcess

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = HERMES_MAX_MODEL_LEN
TEMPLATE = REPO / "deploy" / "chat_templates" / "hermes_tools.jinja"
# Every gateway here takes the shared cluster's key.
AUTH = {"Authorization": f"Bearer {HERMES_API_KEY}"}
GRPC_AUTH = [("authorization", f"Bearer {HERMES_API_KEY}")]
TOOL_FLAGS = ["--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
              "--max-model-len", str(MAX_MODEL_LEN), "--api-key", HERMES_API_KEY]
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}]


@pytest.fixture(scope="module")
def cluster(hermes_cluster):
    """The shared cluster's gateway (``http_url``, ``grpc_address``, ``log``, and the addresses
    of its two servers) and ``local``: a gateway of this module's in front of its decode server
    alone."""
    address = {"prefill": hermes_cluster.prefill.address, "decode": hermes_cluster.decode.address}
    local = GatewayProcess("so-local", ["--decode", address["decode"], *TOOL_FLAGS])
    try:
        local.wait_ready()
        local.wait_healthy(api_key=HERMES_API_KEY)
        yield types.SimpleNamespace(http_url=hermes_cluster.http_url, grpc_address=hermes_cluster.grpc_address,
                                    log=hermes_cluster.log, local=local, prefill_address=address["prefill"],
                                    decode_address=address["decode"])
    finally:
        assert local.stop() == 0, local.logs()


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=HERMES_API_KEY, max_retries=0)


def _at_once(*calls):
    """Each of ``calls`` (no arguments) on a thread of its own, at once; their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _both(cluster) -> list[tuple[str, str]]:
    """(name, HTTP URL) of the disaggregated gateway and the local-prefill one."""
    return [("disaggregated", cluster.http_url), ("local", cluster.local.http_url)]


def _log(gw) -> str:
    """The gateway's whole log so far (its request lines)."""
    gw.log.flush()
    return Path(gw.log.name).read_text()


def _chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body}, headers=AUTH,
                      timeout=120)


# ---- response_format through the official client --------------------------------------------------------------
class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


class Trip(BaseModel):  # nested objects ($defs / $ref in the strict schema)
    origin: City
    destination: City


class Mood(str, enum.Enum):
    happy = "happy"
    sad = "sad"
    angry = "angry"


class Review(BaseModel):  # an enum and a bounded integer
    mood: Mood
    stars: int = Field(ge=1, le=5)


class Shopping(BaseModel):  # a list
    items: list[str] = Field(min_length=1, max_length=3)


PARSE_CASES = [(Trip, "Plan a trip from Paris to Rome. Answer in JSON."),
               (Review, "Review the movie Up in JSON: a mood and 1 to 5 stars."),
               (Shopping, "List what to buy for a cake, as JSON.")]


@pytest.mark.parametrize("model, question", PARSE_CASES, ids=[m.__name__ for m, _ in PARSE_CASES])
def test_parse_returns_the_pydantic_object(oai, model, question):
    r = oai.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
                                   response_format=model, max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model), choice
    assert choice.message.parsed == model.model_validate_json(choice.message.content)


def test_json_mode_returns_json(oai):
    r = oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=100, temperature=0,
                                    response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


# ---- every kind of constraint, both paths -------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
KINDS = [
    ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ({"regex": r"\+1-[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", t)),
    ({"choice": ["Paris", "Rome", "Oslo"]}, lambda t: t in ("Paris", "Rome", "Oslo")),
    ({"grammar": 'root ::= ("yes" | "no") ", " [a-z]{2,8} "."'}, lambda t: re.fullmatch(r"(yes|no), [a-z]{2,8}\.", t)),
    ({"structural_tag": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<answer>", "content": {"type": "const_string", "value": "42"}, "end": "</answer>"}}},
     lambda t: t == "<answer>42</answer>"),
]


def test_every_kind_of_constraint_through_both_paths(cluster):
    def streamed_city(url: str) -> list[dict]:
        r = httpx.post(url + "/v1/completions", timeout=120, headers=AUTH, json={
            "prompt": "The capital of Italy is", "max_tokens": 20, "temperature": 0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
                "type": "object", "properties": {"city": {"enum": ["Rome", "Milan"]}}, "required": ["city"],
                "additionalProperties": False}}}})
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    calls, checks = [], []
    for path, url in _both(cluster):
        # Every kind across the hand-off; on the local path (one engine, its own first token)
        # a JSON schema and a structural tag.
        for spec, holds in KINDS if path == "disaggregated" else [KINDS[0], KINDS[-1]]:
            calls.append(lambda url=url, spec=spec: _chat(url, max_tokens=80, structured_outputs=spec))
            checks.append((path, spec, holds))
        # max_tokens 1: the first token alone, under the grammar; a grammar complete after
        # one token ends there, with "stop".
        calls.append(lambda url=url: _chat(url, max_tokens=1, structured_outputs={"json": PERSON}))
        checks.append((path, "cut", None))
        calls.append(lambda url=url: _chat(url, max_tokens=8, structured_outputs={"choice": ["A", "B", "C"]}))
        checks.append((path, "one", None))
        if path == "disaggregated":
            calls.append(lambda url=url: streamed_city(url))
            checks.append((path, "streamed", None))
    for (path, spec, holds), r in zip(checks, _at_once(*calls)):
        if spec == "cut":
            cut = r.json()["choices"][0]
            assert (cut["message"]["content"], cut["finish_reason"]) == ("{", "length"), (path, cut)
        elif spec == "one":
            one = r.json()
            assert one["choices"][0]["finish_reason"] == "stop" and one["choices"][0]["message"]["content"] in "ABC"
            assert one["usage"]["completion_tokens"] == 1, (path, one)
        elif spec == "streamed":
            assert json.loads("".join(e["choices"][0]["text"] for e in r))["city"] in ("Rome", "Milan")
            assert r[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            choice = r.json()["choices"][0]
            assert r.status_code == 200 and choice["finish_reason"] == "stop", (path, spec, r.text)
            assert holds(choice["message"]["content"]), (path, spec, choice)


def test_grpc_takes_structured_outputs(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="A phone number?")])
        phone = common_pb2.StructuredOutputs(regex=r"\+1-[0-9]{3}-[0-9]{4}")
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=40, structured_outputs=phone)
        msgs = list(stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=sampling), timeout=120,
                                  metadata=GRPC_AUTH))
        assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", "".join(m.text for m in msgs))
        assert msgs[-1].finish_reason == "stop"
        for bad, named in [(common_pb2.StructuredOutputs(regex="(unclosed"), "invalid regex"),
                           (common_pb2.StructuredOutputs(grammar=""), "structured_outputs.grammar")]:
            sampling = common_pb2.SamplingParams(max_tokens=4, structured_outputs=bad)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=sampling), timeout=120,
                                   metadata=GRPC_AUTH))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in e.value.details(), e.value
        # No token meets the constraint at the second output token: the decode server's finish.
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=[5431, 50],
                                             structured_outputs=common_pb2.StructuredOutputs(regex="AB"))
        msgs = list(stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=sampling), timeout=120,
                                  metadata=GRPC_AUTH))
        assert msgs[-1].finish_reason == "error" and "no token meets" in msgs[-1].finish_message, msgs[-1]


# ---- finish "error" -----------------------------------------------------------------------------------------------
# "A" is token 49, "AB" token 5431, "B" token 50: with min_tokens banning them as stop tokens
# the choice ["A"] has no first token (prefill tier) and the regex "AB" no second (decode tier).
NO_FIRST_TOKEN = {"structured_outputs": {"choice": ["A"]}, "min_tokens": 1, "stop_token_ids": [49]}
NO_SECOND_TOKEN = {"structured_outputs": {"regex": "AB"}, "min_tokens": 2, "stop_token_ids": [5431, 50]}


@pytest.mark.parametrize("body, text", [(NO_FIRST_TOKEN, ""), (NO_SECOND_TOKEN, "A")], ids=["first", "second"])
def test_no_token_meeting_the_constraint_finishes_with_error(cluster, body, text):
    for path, url in _both(cluster):
        r = _chat(url, max_tokens=8, **body)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] == "error", (path, r.text)
        assert choice["message"]["content"] == text and "no token meets" in choice["stop_reason"], (path, choice)
        chunks = httpx.post(url + "/v1/chat/completions", timeout=120, headers=AUTH,
                            json={"messages": ASK, "temperature": 0, "max_tokens": 8, "stream": True, **body})
        last = [json.loads(line[6:]) for line in chunks.text.splitlines() if line.startswith("data: {")][-1]
        assert last["choices"][0]["finish_reason"] == "error" and "no token meets" in last["choices"][0]["stop_reason"]
    assert re.search(r"finish=error \(request \S+: no token meets", _log(cluster))


# ---- bad input --------------------------------------------------------------------------------------------------
BAD = [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}}, "invalid json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "invalid grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "'uniqueItems' at #"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"not": {}}}}}}, "'not' at #/properties/a"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "'whitespace_pattern' is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g', which is not among the tools"),
]


@pytest.mark.parametrize("body, named", BAD, ids=[n for _, n in BAD])
def test_bad_constraints_are_400_naming_the_problem(cluster, body, named):
    for path, url in _both(cluster):
        r = _chat(url, max_tokens=4, **body)
        assert r.status_code == 400, (path, r.text)
        assert named in r.json()["error"]["message"], (path, r.json())


def test_an_invalid_constraint_is_not_retried(cluster):
    """A prefill server that refuses a constraint is not asked again, nor is the decode
    server asked to prefill it: the request log line names the prefill server."""
    r = httpx.post(cluster.http_url + "/v1/chat/completions", headers={**AUTH, "X-Request-Id": "unclosed-regex"}, timeout=120,
                   json={"messages": ASK, "max_tokens": 4, "structured_outputs": {"regex": "(still unclosed"}})
    assert r.status_code == 400 and "prefill server" in r.json()["error"]["message"], r.text
    line = next(x for x in _log(cluster).splitlines() if "request unclosed-regex " in x and "finish=" in x)
    assert f"prefill={cluster.prefill_address}" in line and "finish=error 400" in line, line


# ---- tool calls -------------------------------------------------------------------------------------------------
class GetWeather(BaseModel):
    city: str = Field(max_length=16)
    unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


class GetTime(BaseModel):
    timezone: str = Field(max_length=24)


TOOLS = [openai.pydantic_function_tool(GetWeather, name="get_weather", description="The weather in a city"),
         openai.pydantic_function_tool(GetTime, name="get_time", description="The time in a timezone")]
WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


def test_required_tool_calls_are_parsed_by_the_client_whole_and_streamed(oai):
    def streamed():
        with oai.chat.completions.stream(model="SmolLM2-135M-Instruct", messages=WEATHER, tools=TOOLS, max_tokens=150,
                                         temperature=0, tool_choice="required") as stream:
            return stream.get_final_completion()

    r, final = _at_once(lambda: oai.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=WEATHER,
                                                           tools=TOOLS, tool_choice="required", max_tokens=150,
                                                           temperature=0), streamed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert all(isinstance(c.function.parsed_arguments, GetWeather if c.function.name == "get_weather" else GetTime)
               for c in calls), calls
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    assert all(isinstance(c.function.parsed_arguments, GetWeather if c.function.name == "get_weather" else GetTime)
               for c in choice.message.tool_calls), choice.message.tool_calls


def test_named_tool_call_streams_in_pieces(oai):
    with oai.chat.completions.stream(model="SmolLM2-135M-Instruct", messages=WEATHER, tools=TOOLS, max_tokens=150,
                                     temperature=0, tool_choice={"type": "function", "function": {"name": "get_time"}}
                                     ) as stream:
        pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
        final = stream.get_final_completion()
    call, = final.choices[0].message.tool_calls
    assert call.function.name == "get_time" and isinstance(call.function.parsed_arguments, GetTime)
    assert len(pieces) > 1 and final.choices[0].finish_reason == "tool_calls"
    assert "".join(p.arguments_delta for p in pieces) == call.function.arguments


def test_required_and_named_calls_need_no_tool_call_parser(cluster):
    """A gateway with a tool template but no --tool-call-parser (in front of the same decode
    server): required and named calls are forced in vLLM's JSON form and come back as
    tool_calls, streamed and not; auto still needs a parser."""
    gw = GatewayProcess("so-noparser", ["--decode", cluster.decode_address, "--chat-template", str(TEMPLATE),
                                        "--max-model-len", str(MAX_MODEL_LEN), "--api-key", HERMES_API_KEY])
    try:
        gw.wait_ready()
        gw.wait_healthy(api_key=HERMES_API_KEY)
        oai = openai.OpenAI(base_url=gw.http_url + "/v1", api_key=HERMES_API_KEY, max_retries=0)

        def named():
            with oai.chat.completions.stream(model="SmolLM2-135M-Instruct", messages=WEATHER, tools=TOOLS,
                                             max_tokens=150, temperature=0,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}}
                                             ) as stream:
                return stream.get_final_completion()

        r, final, auto = _at_once(
            lambda: oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=WEATHER, tools=TOOLS,
                                                tool_choice="required", max_tokens=150, temperature=0),
            named, lambda: _chat(gw.http_url, messages=WEATHER, tools=TOOLS, tool_choice="auto", max_tokens=8))
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        for call in choice.message.tool_calls:
            (GetTime if call.function.name == "get_time" else GetWeather).model_validate_json(call.function.arguments)
        call, = final.choices[0].message.tool_calls
        assert call.function.name == "get_time" and final.choices[0].finish_reason == "tool_calls", final
        GetTime.model_validate_json(call.function.arguments)
        assert auto.status_code == 400 and "--tool-call-parser" in auto.text, auto.text
    finally:
        assert gw.stop() == 0, gw.logs()


def test_auto_parses_the_block_the_model_wrote(cluster):
    """tool_choice auto generates freely and parses afterwards; here the text is forced
    into a Hermes block by a structural tag, and streamed and whole answers agree."""
    force = {"structural_tag": {"type": "structural_tag", "format": {
        "type": "tag", "begin": '<tool_call>\n{"name": "get_time", "arguments": ',
        "content": {"type": "json_schema", "json_schema": GetTime.model_json_schema()}, "end": "}\n</tool_call>"}}}
    body = {"messages": WEATHER, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 150,
            "structured_outputs": force}
    r, chunks, plain = _at_once(
        lambda: _chat(cluster.http_url, **body).json(),
        lambda: httpx.post(cluster.http_url + "/v1/chat/completions", timeout=120, headers=AUTH,
                           json={**body, "temperature": 0, "stream": True}).text,
        # With tool_choice none the tools are neither shown nor parsed: the same text is content.
        lambda: _chat(cluster.http_url, **{**body, "tool_choice": "none", "max_tokens": 8}).json()["choices"][0])
    message = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None, r
    call, = message["tool_calls"]
    assert call["function"]["name"] == "get_time"
    GetTime.model_validate_json(call["function"]["arguments"])
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in chunks.splitlines() if line.startswith("data: {")]
    parts = [c for d in deltas for c in d.get("tool_calls", [])]
    assert parts[0]["id"].startswith("call_") and parts[0]["function"]["name"] == "get_time"
    assert all("id" not in p and set(p["function"]) == {"arguments"} for p in parts[1:])
    assert "".join(p["function"]["arguments"] for p in parts) == call["function"]["arguments"]
    assert plain["message"]["content"].startswith("<tool") and "tool_calls" not in plain["message"], plain


def _grpc_tools() -> list:
    return [gateway_pb2.FunctionTool(name=t["function"]["name"], description=t["function"]["description"],
                                     parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS]


@pytest.mark.parametrize("mode", ["disaggregated", "local"])
def test_grpc_tool_calls(cluster, mode):
    """The same tools through gRPC, on both gateways: calls arrive parsed in ToolCallDelta
    pieces (id and name on the first), the text is the content only, and the end is
    "tool_calls"; a conversation carrying a call and its result renders; bad tools are
    INVALID_ARGUMENT naming them."""
    messages = [gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in WEATHER]
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=150)
    address = cluster.grpc_address if mode == "disaggregated" else cluster.local.grpc_address
    with grpc.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        def generate(**chat: Any) -> list:
            chat = gateway_pb2.ChatMessages(messages=chat.pop("messages", messages), tools=_grpc_tools(), **chat)
            return list(stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=sampling), timeout=120,
                                      metadata=GRPC_AUTH))

        choices = [{"tool_choice": "required"}, {"tool_choice_function": "get_time"},
                   {"tool_choice": "required", "parallel_tool_calls": False}]
        if mode == "local":  # the same gateway code: one case shows the decode server's prefill keeps it
            choices = choices[1:2]
        for choice, msgs in zip(choices, _at_once(*[lambda c=c: generate(**c) for c in choices])):
            assert msgs[-1].finish_reason == "tool_calls" and not "".join(m.text for m in msgs), (choice, msgs[-1])
            pieces = [c for m in msgs for c in m.tool_calls]
            starts = [p for p in pieces if p.id]
            assert starts and all(p.id.startswith("call_") and p.name for p in starts), pieces
            assert all(not p.name for p in pieces if not p.id) and len(pieces) > len(starts), pieces
            for start in starts:
                arguments = "".join(p.arguments for p in pieces if p.index == start.index)
                (GetTime if start.name == "get_time" else GetWeather).model_validate_json(arguments)
            if "tool_choice_function" in choice:
                assert [p.name for p in starts] == ["get_time"], starts
            if "parallel_tool_calls" in choice:
                assert len(starts) == 1, starts
        if mode == "local":
            return
        # The call and its result, sent back: the model answers in text.
        call = gateway_pb2.ToolCall(id=starts[0].id, name=starts[0].name, arguments=arguments)
        history = [*messages, gateway_pb2.ChatMessage(role="assistant", tool_calls=[call]),
                   gateway_pb2.ChatMessage(role="tool", content='{"temperature": 21}', tool_call_id=call.id)]
        msgs = generate(messages=history, tool_choice="none")
        assert msgs[-1].finish_reason in ("stop", "length") and "".join(m.text for m in msgs), msgs[-1]
        for bad, named in [({"tool_choice_function": "nope"}, "'nope', which is not among the tools"),
                           ({"tool_choice": "sometimes"}, "tool_choice 'sometimes' is not supported"),
                           ({"tool_choice": "required", "tool_choice_function": "get_time"},
                            "tool_choice or tool_choice_function, not both")]:
            with pytest.raises(grpc.RpcError) as e:
                generate(**bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in e.value.details(), e.value
        chat = gateway_pb2.ChatMessages(messages=messages, tool_choice="required",
                                        tools=[gateway_pb2.FunctionTool(name="f", parameters_json="{not json")])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=sampling), timeout=120,
                               metadata=GRPC_AUTH))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools[0].parameters_json" in e.value.details()


# ---- random schemas ---------------------------------------------------------------------------------------------
# The schemas a property test draws: objects of bounded strings, bounded integers, booleans,
# enums, short arrays and one level of nested objects; every part is bounded, so each schema
# has a longest output. hypothesis-jsonschema generates them from a schema of their encoding
# as JSON arrays (["string", maxLength], ["object", [[name, value], ...]], ...): its own
# strategy for JSON objects does not run on the pinned hypothesis (it calls an internal that
# hypothesis no longer has), its arrays do.
def _tuple(*items: dict) -> dict:
    return {"type": "array", "items": list(items), "minItems": len(items), "additionalItems": False}


def _int(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


_NAME = {"type": "string", "pattern": "^[a-z]{1,6}$"}
_LEAF = {"anyOf": [
    _tuple({"const": "string"}, _int(0, 6)),
    _tuple({"const": "integer"}, _int(-50, 0), _int(0, 50)),
    _tuple({"const": "boolean"}),
    _tuple({"const": "enum"}, {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                               "minItems": 1, "maxItems": 3, "uniqueItems": True}),
]}
_ARRAY = _tuple({"const": "array"}, _LEAF, _int(1, 3))


def _object_of(values: dict) -> dict:
    return _tuple({"const": "object"}, {"type": "array", "minItems": 1, "maxItems": 3, "items": _tuple(_NAME, values)})


SCHEMAS = from_schema(_object_of({"anyOf": [_LEAF, _ARRAY, _object_of({"anyOf": [_LEAF, _ARRAY]})]}))


def _as_schema(encoded: list) -> dict:
    """A drawn encoding as a JSON schema; an object's properties are required every other
    one (by name), no others allowed."""
    kind = encoded[0]
    if kind == "string":
        return {"type": "string", "maxLength": encoded[1]}
    if kind == "integer":
        return {"type": "integer", "minimum": encoded[1], "maximum": encoded[2]}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": encoded[1]}
    if kind == "array":
        return {"type": "array", "items": _as_schema(encoded[1]), "maxItems": encoded[2]}
    props = {name: _as_schema(value) for name, value in encoded[1]}
    return {"type": "object", "properties": props, "required": sorted(props)[::2], "additionalProperties": False}


def _max_tokens(schema: dict) -> int:
    """The longest output of ``schema`` in tokens: in bytes (a token is at least one byte),
    a string character at most 6 (an escape), compact JSON."""
    if "enum" in schema:
        return max(len(json.dumps(v).encode()) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (_max_tokens(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k)) + 2 + _max_tokens(v) + 2 for k, v in schema["properties"].items())


@settings(max_examples=2, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(st.tuples(SCHEMAS.map(_as_schema), st.integers(0, 2**31 - 1)), min_size=6, max_size=6))
def test_random_schemas_hold_at_temperature_one(cluster, batch):
    def one(case: tuple[dict, int]) -> tuple[dict, dict]:
        schema, seed = case
        r = _chat(cluster.http_url, temperature=1.0, seed=seed, max_tokens=_max_tokens(schema),
                  structured_outputs={"json": schema})
        assert r.status_code == 200, (schema, r.text)
        return schema, r.json()["choices"][0]

    with ThreadPoolExecutor(len(batch)) as pool:  # one batch on the decode server
        for schema, choice in pool.map(one, batch):
            assert choice["finish_reason"] == "stop", (schema, choice)
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
