"""Migration end to end (real processes, the default model): a decode server SIGKILLed
under seven streams in flight (greedy, seeded with penalties, a stop string, JSON-constrained
through ``response_format``, logprobs, one non-streamed, one over gRPC) costs none of them.
Each finishes with no error and exactly the text, token ids, usage and finish reason of the
same request served without a kill; the survivor holds no KV block afterwards and
``pdserve:gateway_migrations_total`` counts the migrations. A gateway with
``--migration-limit 0`` ends the stream of a killed server with an error naming it, and
nothing stays held.

Every stream of the kill goes to the same decode server: the other one is kept busy with
ballast requests (sent to it directly) while they are routed, so the router picks the idle
one; the ballast is cancelled before the kill."""
from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
ENGINE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN)]
GW_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN)]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
MAX_TOKENS = 32
MODEL = "SmolLM2-135M-Instruct"


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


# name -> (messages, keyword arguments of chat.completions.create, streamed)
def _requests(stop: str | None) -> dict[str, tuple[list[dict], dict, bool]]:
    free = {"max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
    reqs = {
        "greedy": (_chat("Tell me about the sea."), {"temperature": 0, **free}, True),
        "seeded": (_chat("Write a short poem about bees."),
                   {"temperature": 0.9, "seed": 1234, "frequency_penalty": 0.5, "presence_penalty": 0.4,
                    "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.2,
                                                             "min_tokens": MAX_TOKENS // 2}}, True),
        "json": (_chat("Describe a person as JSON with a name, an age and a city."),
                 {"temperature": 0.7, "seed": 7, "max_tokens": 120,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}, True),
        "logprobs": (_chat("Name three colours and why."),
                     {"temperature": 1.0, "seed": 99, "logprobs": True, "top_logprobs": 2, **free}, True),
        "unstreamed": (_chat("What is 2 + 2? Explain at length."), {"temperature": 0, **free}, False),
    }
    if stop is not None:
        reqs["stop"] = (_chat("Tell me about the sea."), {"temperature": 0, "stop": [stop], **free}, True)
    return reqs


GRPC_PROMPT = "Count slowly from one to twenty:"


def _grpc_request() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(text=GRPC_PROMPT, sampling=common_pb2.SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.1))


class Stream:
    """One request in a thread: its tokens as they come, then its result (or error)."""

    def __init__(self, run) -> None:
        self.pieces: list = []
        self.result: dict | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(run,), daemon=True)
        self._thread.start()

    def _main(self, run) -> None:
        try:
            self.result = run(self.pieces)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def join(self, timeout: float = 90) -> dict:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)
        assert self.result is not None
        return self.result


def _run_chat(oai: openai.OpenAI, messages, kwargs, streamed: bool):
    def run(pieces: list) -> dict:
        if not streamed:
            r = oai.chat.completions.create(model=MODEL, messages=messages, **kwargs)
            pieces.append(r.choices[0].message.content)
            return {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
                    "usage": (r.usage.prompt_tokens, r.usage.completion_tokens), "tokens": None}
        text, finish, usage, tokens = "", None, None, []
        for chunk in oai.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs):
            if chunk.usage is not None:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for c in chunk.choices:
                text += c.delta.content or ""
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
                if c.logprobs is not None and c.logprobs.content:
                    tokens += [lp.token for lp in c.logprobs.content]
        return {"text": text, "finish": finish, "usage": usage, "tokens": tokens or None}
    return run


def _run_grpc(stub):
    def run(pieces: list) -> dict:
        ids, text, finish, usage = [], "", None, None
        for d in stub.Generate(_grpc_request(), timeout=120):
            ids += d.token_ids
            pieces.extend(d.token_ids)
            text += d.text
            if d.finish_reason:
                finish, usage = d.finish_reason, (d.usage.prompt_tokens, d.usage.completion_tokens)
        return {"text": text, "finish": finish, "usage": usage, "tokens": ids}
    return run


def _metric(gw: GatewayProcess, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(gw.http_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster():
    prefill = EngineServer("prefill", ENGINE_FLAGS)
    decodes = [EngineServer("decode", ENGINE_FLAGS) for _ in range(3)]  # the third one is the limit gateway's
    gw = GatewayProcess("migrate", ["--prefill", prefill.address, "--decode",
                                    ",".join(d.address for d in decodes[:2]), *GW_FLAGS])
    limited = GatewayProcess("migrate-limit0", ["--prefill", prefill.address, "--decode", decodes[2].address,
                                                "--migration-limit", "0", *GW_FLAGS])
    procs = [gw, limited, prefill, *decodes]
    try:
        for p in (prefill, *decodes, gw, limited):
            p.wait_ready()
        gw.wait_healthy()
        limited.wait_healthy()
        yield gw, limited, prefill, decodes
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.kill()


def test_streams_survive_their_decode_server_being_killed(cluster):
    gw, _, prefill, (a, b, _) = cluster
    oai = openai.OpenAI(base_url=gw.http_url + "/v1", api_key="unused", max_retries=0)
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
    # The references, with both decode servers up and nothing killed (seeded sampling is
    # reproducible); the stop string comes from the greedy text, well after the first tokens.
    reqs = _requests(None)
    with ThreadPoolExecutor(8) as pool:
        futures = {name: pool.submit(_run_chat(oai, *r), []) for name, r in reqs.items()}
        futures["grpc"] = pool.submit(_run_grpc(stub), [])
        want = {name: f.result(timeout=120) for name, f in futures.items()}
    greedy = want["greedy"]["text"]
    stop = greedy[len(greedy) * 2 // 3:][:6]
    assert stop.strip() and greedy.index(stop) > len(greedy) // 3, greedy
    reqs = _requests(stop)
    r = reqs["stop"]
    want["stop"] = _run_chat(oai, *r)([])
    assert want["stop"]["finish"] == "stop" and stop not in want["stop"]["text"]

    # Ballast on b: the router sends every stream to a.
    b_stub = engine_pb2_grpc.DecodeStub(b.channel)
    ballast = [b_stub.Generate(engine_pb2.DecodeRequest(
        request_id=f"ballast-{i}", prompt_token_ids=[1 + i, 2, 3, 4],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)), timeout=120)
        for i in range(10)]
    _wait(lambda: b.load().num_running + b.load().num_waiting >= 10, 20, "ballast running on b")
    time.sleep(1.2)  # the gateway polled b's load
    before = _metric(gw, "pdserve:gateway_migrations_total")
    streams = {name: Stream(_run_chat(oai, *r)) for name, r in reqs.items()}
    streams["grpc"] = Stream(_run_grpc(stub))
    _wait(lambda: a.load().num_running == len(streams), 30, "every stream running on a")
    for call in ballast:
        call.cancel()
    streamed = [s for name, s in streams.items() if name != "unstreamed"]
    _wait(lambda: all(len([p for p in s.pieces if p]) >= 3 for s in streamed), 60,
          "every stream produced a few tokens")
    assert all(s.result is None and s.error is None for s in streams.values())  # all still in flight
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()

    got = {name: s.join() for name, s in streams.items()}
    for name in got:
        assert got[name] == want[name], name
    json.loads(got["json"]["text"])
    assert len(got["grpc"]["tokens"]) == MAX_TOKENS and got["grpc"]["finish"] == "length"
    after = _metric(gw, "pdserve:gateway_migrations_total")
    assert sum(after.values()) - sum(before.values()) == len(streams), after
    b.wait_idle()
    prefill.wait_idle()


def test_migration_limit_zero_ends_the_stream_with_an_error_naming_the_server(cluster):
    _, limited, prefill, (_, _, c) = cluster
    body = {"model": MODEL, "messages": _chat("Tell me a long story."), "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    events: list[str] = []
    with httpx.Client(timeout=60) as client, client.stream("POST", limited.http_url + "/v1/chat/completions",
                                                           json=body) as resp:
        assert resp.status_code == 200
        killed = False
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) >= 4 and not killed:
                c.proc.send_signal(signal.SIGKILL)
                c.proc.wait()
                killed = True
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert len(errors) == 1, events[-3:]
    assert c.address in errors[0]["message"] and "--migration-limit 0" in errors[0]["message"], errors[0]
    assert re.search(r"lost its decode server", errors[0]["message"])
    assert _metric(limited, "pdserve:gateway_migrations_total") == {}
    prefill.wait_idle()
