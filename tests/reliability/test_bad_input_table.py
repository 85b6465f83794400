"""Bad input through both front ends of a real cluster (gateway, prefill and
decode server processes on a tiny random model that uses the default model's
tokenizer): every case gets its documented answer (HTTP 400/401/404/413 with
the OpenAI error object, gRPC INVALID_ARGUMENT / UNAUTHENTICATED /
RESOURCE_EXHAUSTED with a message), and after each case the cluster still
serves a good request. At the end no KV block is held anywhere."""
from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.conftest import make_tiny_model
from tests.processes import EngineServer, GatewayProcess, running_cluster

pytestmark = pytest.mark.slow

KEY = "table-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = [("authorization", f"Bearer {KEY}")]
VOCAB = 49152  # the default model's tokenizer
MAX_MODEL_LEN = 256
MAX_BODY = 1 << 20


def _Engine(role: str, model: Path) -> EngineServer:
    return EngineServer(role, ["--model", str(model), "--num-gpu-blocks-override", "128",
                               "--max-model-len", str(MAX_MODEL_LEN)], name=role)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama over the default model's vocabulary, tokenizer and chat template."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-tok"), vocab_size=VOCAB,
                           max_position_embeddings=MAX_MODEL_LEN)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def gateway(tiny_with_tokenizer):
    prefill, decode = _Engine("prefill", tiny_with_tokenizer), _Engine("decode", tiny_with_tokenizer)
    gw = GatewayProcess("bad-input", ["--model", str(tiny_with_tokenizer), "--served-model-name", "tiny",
                                      "--prefill", prefill.address, "--decode", decode.address,
                                      "--max-request-body", str(MAX_BODY)], env={"PDSERVE_API_KEY": KEY})
    with running_cluster([prefill, decode], gw, api_key=KEY):
        gw.engines = (prefill, decode)  # type: ignore[attr-defined]
        yield gw


def _json(**body) -> bytes:
    return json.dumps(body).encode()


def _raw(text: str) -> bytes:
    return text.encode()


GOOD = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}
# (name, path, body bytes, status, fragment of error.message); NaN and Infinity are what Python's
# JSON parser accepts and clients send by mistake.
HTTP_CASES = [
    ("temperature NaN", "/v1/completions", _raw('{"prompt": "hi", "temperature": NaN}'), 400,
     "temperature must be a finite number"),
    ("temperature Infinity", "/v1/completions", _raw('{"prompt": "hi", "temperature": Infinity}'), 400,
     "temperature must be a finite number"),
    ("repetition_penalty NaN", "/v1/completions", _raw('{"prompt": "hi", "repetition_penalty": NaN}'), 400,
     "repetition_penalty must be a finite number"),
    ("top_p -Infinity", "/v1/completions", _raw('{"prompt": "hi", "top_p": -Infinity}'), 400, "top_p"),
    ("temperature 1e39", "/v1/completions", _json(prompt="hi", temperature=1e39), 400, "temperature must be in"),
    ("seed 2^64", "/v1/completions", _json(prompt="hi", seed=2**64), 400, "seed must be in"),
    ("seed 2^63", "/v1/completions", _json(prompt="hi", seed=2**63), 400, "seed must be in"),
    ("seed negative", "/v1/completions", _json(prompt="hi", seed=-1), 400, "seed must be in"),
    ("top_k 2^40", "/v1/completions", _json(prompt="hi", top_k=2**40), 400, "top_k must be"),
    ("top_k -2", "/v1/completions", _json(prompt="hi", top_k=-2), 400, "top_k must be"),
    ("max_tokens 2^40", "/v1/completions", _json(prompt="hi", max_tokens=2**40), 400, "max_tokens must be in"),
    ("max_tokens 0", "/v1/completions", _json(prompt="hi", max_tokens=0), 400, "max_tokens must be in"),
    ("max_tokens past the context", "/v1/completions", _json(prompt="hi", max_tokens=MAX_MODEL_LEN), 400,
     "maximum context length"),
    ("min_tokens 2^40", "/v1/completions", _json(prompt="hi", min_tokens=2**40), 400, "min_tokens"),
    ("logprobs 21", "/v1/completions", _json(prompt="hi", logprobs=21), 400, "logprobs must be in [0, 20]"),
    ("top_logprobs 99", "/v1/chat/completions",
     _json(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=99), 400, "logprobs"),
    ("lone surrogate in prompt", "/v1/completions", _raw('{"prompt": "a\\ud800b"}'), 400, "not valid Unicode"),
    ("lone surrogate in chat", "/v1/chat/completions",
     _raw('{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400, "not valid Unicode"),
    ("lone surrogate in stop", "/v1/completions", _raw('{"prompt": "hi", "stop": ["\\ud800"]}'), 400,
     "not valid Unicode"),
    ("lone surrogate in model", "/v1/completions", _raw('{"prompt": "hi", "model": "\\ud800"}'), 404,
     "does not exist"),
    ("token id past the vocabulary", "/v1/completions", _json(prompt=[5, VOCAB]), 400, "out of range"),
    ("negative token id", "/v1/completions", _json(prompt=[-1]), 400, "out of range"),
    ("huge token id", "/v1/completions", _json(prompt=[2**70]), 400, "out of range"),
    ("empty prompt", "/v1/completions", _json(prompt=[]), 400, "empty"),
    ("stop_token_ids past the vocabulary", "/v1/completions", _json(prompt="hi", stop_token_ids=[10**6]), 400,
     "stop_token_ids"),
    ("too many stop strings", "/v1/completions", _json(prompt="hi", stop=[f"s{i}" for i in range(17)]), 400,
     "at most 16 stop strings"),
    ("stop string too long", "/v1/completions", _json(prompt="hi", stop=["x" * 5000]), 400, "at most 1024"),
    ("n 129", "/v1/completions", _json(prompt="hi", n=129), 400, "n must be in [1, 128]"),
    ("best_of below n", "/v1/completions", _json(prompt="hi", n=3, best_of=2), 400, "best_of"),
    ("best_of streamed", "/v1/completions", _json(prompt="hi", best_of=3, stream=True), 400, "cannot be streamed"),
    ("logit_bias past the vocabulary", "/v1/completions", _json(prompt="hi", logit_bias={"1000000": 10}), 400,
     "logit_bias"),
    ("logit_bias out of range", "/v1/completions", _json(prompt="hi", logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias not a token id", "/v1/completions", _json(prompt="hi", logit_bias={"five": 1}), 400, "logit_bias"),
    ("empty allowed_token_ids", "/v1/completions", _json(prompt="hi", allowed_token_ids=[]), 400,
     "allowed_token_ids"),
    ("prompt_logprobs 21", "/v1/completions", _json(prompt="hi", prompt_logprobs=21), 400, "prompt_logprobs"),
    ("priority past int32", "/v1/completions", _json(prompt="hi", priority=2**31), 400, "priority"),
    ("priority under fcfs", "/v1/completions", _json(prompt="hi", priority=3), 400, "--scheduling-policy"),
    ("tools", "/v1/chat/completions", _json(messages=[{"role": "user", "content": "hi"}],
                                            tools=[{"type": "function"}]), 400, "tools"),
    ("functions", "/v1/chat/completions", _json(messages=[{"role": "user", "content": "hi"}],
                                                functions=[{"name": "f"}]), 400, "functions"),
    ("unknown role", "/v1/chat/completions", _json(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "role 'wizard' is not supported"),
    ("content of the wrong type", "/v1/chat/completions", _json(messages=[{"role": "user", "content": 5}]),
     400, "content"),
    ("image content part", "/v1/chat/completions",
     _json(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "image_url"),
    ("no messages", "/v1/chat/completions", _json(messages=[]), 400, "messages must not be empty"),
    ("too many messages", "/v1/chat/completions", _json(messages=[{"role": "user", "content": "x"}] * 1025),
     400, "at most 1024 messages"),
    ("string for an integer", "/v1/completions", _json(prompt="hi", max_tokens="5"), 400, "max_tokens"),
    ("number for a boolean", "/v1/completions", _json(prompt="hi", stream=1), 400, "stream"),
    ("malformed JSON", "/v1/completions", _raw('{"prompt": "hi",'), 400, "not valid JSON"),
    ("a list, not an object", "/v1/completions", _raw("[1, 2]"), 400, "must be a JSON object"),
    ("not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "cannot be read as JSON"),
    ("deeply nested", "/v1/completions", _raw('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"), 400,
     "nested too deeply"),
    ("body over --max-request-body", "/v1/completions", _json(prompt="x" * (MAX_BODY + 10)), 413,
     "--max-request-body"),
    ("prompt longer than the context can hold", "/v1/completions", _json(prompt="ab " * 200_000), 400,
     "maximum context length"),
]


def _serves(gw: GatewayProcess) -> None:
    r = httpx.post(gw.http_url + "/v1/completions", json=GOOD, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
    out = list(stub.Generate(gateway_pb2.GenerateRequest(
        text="Hello there", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0)), timeout=60,
        metadata=GRPC_AUTH))
    assert out[-1].finish_reason == "length"


@pytest.mark.parametrize("name, path, body, status, fragment", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(gateway, name, path, body, status, fragment):
    r = httpx.post(gateway.http_url + path, content=body, timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, (name, r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and fragment in error["message"], (name, error)
    assert error["type"] == "invalid_request_error"
    _serves(gateway)


def _sp(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


def _req(**kw) -> bytes:
    return gateway_pb2.GenerateRequest(**kw).SerializeToString()


NAN, INF = float("nan"), float("inf")
OK = grpc.StatusCode
# (name, serialized request, metadata, status code, fragment of details)
GRPC_CASES = [
    ("temperature NaN", _req(text="hi", sampling=_sp(temperature=NAN)), GRPC_AUTH, OK.INVALID_ARGUMENT,
     "temperature must be a finite number"),
    ("repetition_penalty NaN", _req(text="hi", sampling=_sp(repetition_penalty=NAN, temperature=1.0)), GRPC_AUTH,
     OK.INVALID_ARGUMENT, "repetition_penalty"),
    ("min_p inf", _req(text="hi", sampling=_sp(min_p=INF)), GRPC_AUTH, OK.INVALID_ARGUMENT, "min_p"),
    ("seed negative", _req(text="hi", sampling=_sp(seed=-5)), GRPC_AUTH, OK.INVALID_ARGUMENT, "seed"),
    ("top_k -7", _req(text="hi", sampling=_sp(top_k=-7)), GRPC_AUTH, OK.INVALID_ARGUMENT, "top_k"),
    ("max_tokens -1", _req(text="hi", sampling=_sp(max_tokens=-1)), GRPC_AUTH, OK.INVALID_ARGUMENT,
     "max_tokens"),
    ("logprobs 100", _req(text="hi", sampling=_sp(logprobs=100)), GRPC_AUTH, OK.INVALID_ARGUMENT, "logprobs"),
    ("stop_token_ids past the vocabulary", _req(text="hi", sampling=_sp(stop_token_ids=[VOCAB])), GRPC_AUTH,
     OK.INVALID_ARGUMENT, "stop_token_ids"),
    ("too many stop strings", _req(text="hi", sampling=_sp(stop=["s"] * 17)), GRPC_AUTH, OK.INVALID_ARGUMENT,
     "stop strings"),
    ("negative token id", _req(token_ids=gateway_pb2.TokenIds(ids=[-1])), GRPC_AUTH, OK.INVALID_ARGUMENT,
     "out of range"),
    ("token id past the vocabulary", _req(token_ids=gateway_pb2.TokenIds(ids=[VOCAB])), GRPC_AUTH,
     OK.INVALID_ARGUMENT, "out of range"),
    ("unknown role", _req(chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="x", content="y")])),
     GRPC_AUTH, OK.INVALID_ARGUMENT, "role"),
    ("no prompt", _req(), GRPC_AUTH, OK.INVALID_ARGUMENT, "needs a prompt"),
    ("garbage bytes", b"\xff\xff\xff\xff", GRPC_AUTH, OK.INVALID_ARGUMENT, "not a valid pdserve.v1.GenerateRequest"),
    ("truncated message", _req(text="hello", sampling=_sp(max_tokens=3))[:-1], GRPC_AUTH, OK.INVALID_ARGUMENT,
     "not a valid"),
    ("invalid UTF-8 in text", b"\x12\x02\xff\xfe", GRPC_AUTH, OK.INVALID_ARGUMENT, "not a valid"),
    ("message over --max-request-body", _req(text="x" * (MAX_BODY + 10)), GRPC_AUTH, OK.RESOURCE_EXHAUSTED,
     "--max-request-body"),
    ("no API key", _req(text="hi"), [], OK.UNAUTHENTICATED, "API key"),
    ("wrong API key", _req(text="hi"), [("authorization", "Bearer nope")], OK.UNAUTHENTICATED, "API key"),
]


def test_an_over_limit_body_sent_after_its_headers_still_gets_the_413(gateway):
    """A client sends its headers, then its body (as every client does): the gateway, which
    answers from the declared Content-Length, reads and drops the body before it closes. Closing
    on unread bytes resets the connection, and the client loses the answer."""
    body = _json(prompt="x" * (MAX_BODY + 10))
    url = urlparse(gateway.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        time.sleep(0.5)  # the gateway has its answer by now
        s.sendall(body)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    assert "--max-request-body" in json.loads(text)["error"]["message"]
    _serves(gateway)


@pytest.mark.parametrize("name, data, metadata, code, fragment", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(gateway, name, data, metadata, code, fragment):
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        call = channel.unary_stream("/pdserve.v1.Gateway/Generate", request_serializer=None,
                                    response_deserializer=gateway_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(data, timeout=60, metadata=metadata))
    assert e.value.code() == code and fragment in e.value.details(), (name, e.value.code(), e.value.details())
    _serves(gateway)


# Out-of-range sampling values, one row per value: refused by name at every front end and at
# the engine servers themselves (a direct caller does not pass the gateway's checks).
SAMPLING_RANGES = [("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 2.01),
                   ("frequency_penalty", -3.0), ("top_p", 1.01), ("top_p", 0.0), ("min_p", 1.5),
                   ("min_p", -0.1), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                   ("temperature", -0.5)]


def _engine_calls(gateway, prompt: list[int], sampling: common_pb2.SamplingParams):
    """Direct Decode (local and remote prefill) and Prefill calls, as a client of the engine
    servers would make them: each is a function that raises the call's RpcError."""
    prefill, decode = gateway.engines
    decode_stub = engine_pb2_grpc.DecodeStub(decode.channel)
    prefill_stub = engine_pb2_grpc.PrefillStub(prefill.channel)

    def on_decode(remote: bool):
        return lambda: list(decode_stub.Generate(engine_pb2.DecodeRequest(
            request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt, sampling=sampling,
            remote_prefill=remote), timeout=30))

    def on_prefill():
        return prefill_stub.Prefill(engine_pb2.PrefillRequest(
            request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt, sampling=sampling,
            decode_address=decode.address, dst_block_ids=[0]), timeout=30)
    return {"decode": on_decode(False), "decode remote": on_decode(True), "prefill": on_prefill}


@pytest.mark.parametrize("field, value", SAMPLING_RANGES, ids=[f"{f}={v}" for f, v in SAMPLING_RANGES])
def test_sampling_values_out_of_range_are_refused_by_name(gateway, field, value):
    r = httpx.post(gateway.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value},
                   headers=AUTH, timeout=60)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gateway.grpc_address))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gateway_pb2.GenerateRequest(text="hi", sampling=_sp(max_tokens=2, **{field: value})),
                           timeout=60, metadata=GRPC_AUTH))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    for where, call in _engine_calls(gateway, [5, 6, 7], _sp(max_tokens=2, **{field: value})).items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), where


@pytest.mark.parametrize("prompt", [[5, VOCAB], [VOCAB + 1000], [-1, 5]], ids=["vocab", "past", "negative"])
def test_engine_servers_refuse_token_ids_outside_the_vocabulary(gateway, prompt):
    """The engine's own check: a direct caller bypasses the gateway's, and the server lives."""
    for where, call in _engine_calls(gateway, prompt, _sp(max_tokens=2, temperature=0)).items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (where, e.value.details())
        assert f"out of range for vocabulary size {VOCAB}" in e.value.details(), where
    for engine in gateway.engines:
        engine.wait_idle()
    _serves(gateway)


# OpenAI fields pdserve refuses, each by name: a feature that comes to support one replaces
# its row on purpose rather than accepting it silently.
CHAT = [{"role": "user", "content": "hi"}]
REFUSED_FIELDS = [
    ("function_call", "/v1/chat/completions", {"messages": CHAT, "function_call": "auto"}),
    ("audio", "/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}),
    ("prediction", "/v1/chat/completions", {"messages": CHAT, "prediction": {"type": "content", "content": "x"}}),
    ("modalities", "/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "end"}),
    ("response_format", "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}),
    ("response_format", "/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}}),
    ("structured_outputs", "/v1/completions", {"prompt": "hi", "structured_outputs": {"whitespace_pattern": " "}}),
    ("tool_choice", "/v1/completions", {"prompt": "hi", "tool_choice": "required"}),
    ("tool_choice", "/v1/chat/completions",  # this gateway has no --tool-call-parser: auto needs one
     {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}),
]


@pytest.mark.parametrize("field, path, body", REFUSED_FIELDS,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(REFUSED_FIELDS)])
def test_unsupported_openai_fields_are_refused_by_name(gateway, field, path, body):
    r = httpx.post(gateway.http_url + path, json={"max_tokens": 2, **body}, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_keys_guard_v1_and_cluster_but_not_health_and_metrics(gateway):
    for path in ("/v1/models", "/cluster"):
        r = httpx.get(gateway.http_url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(gateway.http_url + path, headers=AUTH, timeout=10).status_code == 200
    for path in ("/health", "/metrics"):
        assert httpx.get(gateway.http_url + path, timeout=10).status_code == 200


def test_no_block_is_held_after_the_table(gateway):
    deadline = time.monotonic() + 20
    while True:
        instances = httpx.get(gateway.http_url + "/cluster", headers=AUTH, timeout=10).json()["instances"]
        used = {i["address"]: i["kv_blocks_used"] for i in instances}
        if not any(used.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(used.values()) and all(i["healthy"] for i in instances), instances
