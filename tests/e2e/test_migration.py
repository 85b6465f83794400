"""Migration end to end (real processes, the default model).

- A decode server SIGKILLed under eight streams in flight (greedy, seeded with penalties, a
  stop string, JSON-constrained through ``response_format``, logprobs, one non-streamed, one
  seeded over gRPC, the same one under a LoRA adapter) and a ninth request whose prompt the
  prefill server is computing into that server's blocks costs none of them. Each finishes with
  no error and exactly the text, token ids, usage and finish reason of the same request served
  without a kill (the LoRA one's under its adapter, whose tokens are not the base model's); the
  survivor holds no KV block afterwards and ``pdserve:gateway_migrations_total`` counts the
  migrations.
- A decode server SIGSTOPped (hung, its connections open) under two seeded streams: they
  migrate after ``--stream-idle-timeout`` and finish exactly while it is still stopped (its
  late output is never read); once SIGCONTed it frees their blocks. ``pdserve trace`` shows
  such a request as one trace: both decode servers' spans and the seam.
- ``--migration-limit 1`` and two kills: the request migrates once, then ends with an error
  naming both servers, and nothing stays held.

Every stream of the kill goes to the same decode server: the other one is kept busy with
ballast requests (sent to it directly) while they are routed, so the router picks the idle
one; the ballast is cancelled before the kill."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from pdserve.cli.trace_model import find_request, load_file
from tests.engine.lora_adapters import make_adapter
from tests.processes import REPO, EngineServer, GatewayProcess

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
LORA = "smol"  # the adapter every engine server serves (--lora-modules)
ENGINE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN), "--enable-lora"]
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
                 {"temperature": 0.7, "seed": 2, "max_tokens": 120,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}, True),
        "logprobs": (_chat("Name three colours and why."),
                     {"temperature": 1.0, "seed": 99, "logprobs": True, "top_logprobs": 2, **free}, True),
        "unstreamed": (_chat("What is 2 + 2? Explain at length."), {"temperature": 0, **free}, False),
    }
    if stop is not None:
        reqs["stop"] = (_chat("Tell me about the sea."), {"temperature": 0, "stop": [stop], **free}, True)
    return reqs


GRPC_PROMPT = "Count slowly from one to twenty:"


def _grpc_request(model: str = "") -> gateway_pb2.GenerateRequest:
    # Seeded: its draws are an exponential race on (seed, k) noise, which the last bits that
    # differ between a prefill-computed and a decode-computed logit do not move (engine/sampler.py).
    return gateway_pb2.GenerateRequest(text=GRPC_PROMPT, model=model, sampling=common_pb2.SamplingParams(
        temperature=0.8, seed=4321, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.1))


# Long enough that the prefill server is still computing it when the kill comes.
LONG_PROMPT = "Summarise this list of words: " + " ".join(f"word{i % 97} item{i}" for i in range(120))
LONG = (_chat(LONG_PROMPT), {"temperature": 0.8, "seed": 5, "max_tokens": 8, "extra_body": {"ignore_eos": True}}, True)


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


def _run_chat(oai: openai.OpenAI, messages, kwargs, streamed: bool, ids: list | None = None):
    ids = [] if ids is None else ids  # the response id, for `pdserve trace`

    def run(pieces: list) -> dict:
        if not streamed:
            r = oai.chat.completions.create(model=MODEL, messages=messages, **kwargs)
            pieces.append(r.choices[0].message.content)
            return {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
                    "usage": (r.usage.prompt_tokens, r.usage.completion_tokens), "tokens": None}
        text, finish, usage, tokens = "", None, None, []
        for chunk in oai.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs):
            ids.append(chunk.id)
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


def _run_grpc(stub, model: str = ""):
    def run(pieces: list) -> dict:
        ids, text, finish, usage = [], "", None, None
        for d in stub.Generate(_grpc_request(model), timeout=120):
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


def _ballast(server, n: int) -> list:
    """``n`` long requests sent straight to decode server ``server`` (cancel the calls to end
    them), running or queued there, and seen by the gateway's load poll: it routes elsewhere."""
    stub = engine_pb2_grpc.DecodeStub(server.channel)
    calls = [stub.Generate(engine_pb2.DecodeRequest(
        request_id=f"ballast-{i}", prompt_token_ids=[1 + i, 2, 3, 4],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)), timeout=120)
        for i in range(n)]
    _wait(lambda: server.load().num_running + server.load().num_waiting >= n, 20, "ballast running")
    time.sleep(1.2)  # the gateway polled the server's load
    return calls


STALL_S = 3.0  # the stalling gateway's --stream-idle-timeout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    """One prefill server; decode servers a, b (the kill test's gateway ``gw``) and c, d (the
    SIGSTOP test's gateway ``stall`` and the limit test's ``limited``); every engine server
    serves the LoRA adapter ``LORA``, and every process writes its spans to one traces file."""
    env = {"PDSERVE_TRACES_FILE": str(tmp_path_factory.mktemp("traces") / "traces.jsonl")}
    adapter = make_adapter(default_model_dir, tmp_path_factory.mktemp("lora") / LORA, seed=5, r=8, alpha=16, scale=0.5)
    flags = [*ENGINE_FLAGS, "--lora-modules", f"{LORA}={adapter}"]
    prefill = EngineServer("prefill", flags, env=env)
    decodes = [EngineServer("decode", flags, env=env) for _ in range(4)]
    # No idle deadline on the kill test's gateway: a decode server's first structured-output
    # request waits for its grammar compiler, which on a loaded 2-core machine was seen to take
    # over a minute; the deadline would move that stream, and the count of migrations with it.
    gw = GatewayProcess("migrate", ["--prefill", prefill.address, "--decode", ",".join(d.address for d in decodes[:2]),
                                    "--stream-idle-timeout", "0", *GW_FLAGS], env=env)
    cd = ",".join(d.address for d in decodes[2:])
    stall = GatewayProcess("migrate-stall", ["--prefill", prefill.address, "--decode", cd,
                                             "--stream-idle-timeout", str(STALL_S), *GW_FLAGS], env=env)
    limited = GatewayProcess("migrate-limit1", ["--prefill", prefill.address, "--decode", cd,
                                                "--migration-limit", "1", *GW_FLAGS], env=env)
    procs = [gw, stall, limited, prefill, *decodes]
    try:
        for p in (prefill, *decodes, gw, stall, limited):
            p.wait_ready()
        for g in (gw, stall, limited):
            g.wait_healthy()
        yield gw, stall, limited, prefill, decodes, env["PDSERVE_TRACES_FILE"]
    finally:
        for p in procs:
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)  # a failed SIGSTOP test's server would not stop
                p.kill()


def test_streams_survive_their_decode_server_being_killed(cluster):
    gw, _, _, prefill, (a, b, _, _), traces = cluster
    oai = openai.OpenAI(base_url=gw.http_url + "/v1", api_key="unused", max_retries=0)
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
    # The references, with both decode servers up and nothing killed (seeded sampling is
    # reproducible); the stop string comes from the greedy text, well after the first tokens.
    reqs = _requests(None)
    with ThreadPoolExecutor(8) as pool:
        futures = {name: pool.submit(_run_chat(oai, *r), []) for name, r in reqs.items()}
        futures["grpc"] = pool.submit(_run_grpc(stub), [])
        futures["lora"] = pool.submit(_run_grpc(stub, LORA), [])
        want = {name: f.result(timeout=120) for name, f in futures.items()}
    assert want["lora"]["tokens"] != want["grpc"]["tokens"]  # the adapter changes the tokens
    greedy = want["greedy"]["text"]
    stop = greedy[len(greedy) * 2 // 3:][:6]
    assert stop.strip() and greedy.index(stop) > len(greedy) // 3, greedy
    reqs = _requests(stop)
    r = reqs["stop"]
    want["stop"] = _run_chat(oai, *r)([])
    assert want["stop"]["finish"] == "stop" and stop not in want["stop"]["text"]

    ballast = _ballast(b, 10)  # the router sends every stream to a
    before = _metric(gw, "pdserve:gateway_migrations_total")
    streams = {name: Stream(_run_chat(oai, *r)) for name, r in reqs.items()}
    streams["grpc"] = Stream(_run_grpc(stub))
    streams["lora"] = Stream(_run_grpc(stub, LORA))
    _wait(lambda: a.load().num_running == len(streams), 30, "every stream running on a")
    streamed = [s for name, s in streams.items() if name != "unstreamed"]
    _wait(lambda: all(len([p for p in s.pieces if p]) >= 3 for s in streamed), 60,
          "every stream produced a few tokens")
    # The ninth: killed before its first token, while the prefill server computes it into a.
    long_ids: list = []
    streams["long"] = Stream(_run_chat(oai, *LONG, ids=long_ids))
    _wait(lambda: prefill.load().num_running == 1, 30, "the long prompt being prefilled for a")
    for call in ballast:
        call.cancel()
    assert all(s.result is None and s.error is None for s in streams.values())  # all still in flight
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()

    got = {name: s.join() for name, s in streams.items()}
    want["long"] = _run_chat(oai, *LONG)([])  # after the kill: the prefill server's cache was cold for it
    for name in got:
        assert got[name] == want[name], name
    json.loads(got["json"]["text"])
    assert all(len(got[n]["tokens"]) == MAX_TOKENS and got[n]["finish"] == "length" for n in ("grpc", "lora"))
    after = _metric(gw, "pdserve:gateway_migrations_total")
    assert sum(after.values()) - sum(before.values()) == len(streams), after
    b.wait_idle()
    prefill.wait_idle()
    # The long one moved with nothing streamed, lost under the prefill, not failed by it.
    seam = _migration_events(traces, long_ids[0])
    assert [e["attributes"]["pdserve.migration.resume_tokens"] for e in seam] == [0], seam
    assert "was lost while prefill server" in seam[0]["attributes"]["pdserve.migration.error"], seam


def _migration_events(traces_file: str, request_id: str, timeout: float = 10.0) -> list[dict]:
    """The "migration" events of the request's root span, once it reached the traces file."""
    deadline = time.monotonic() + timeout
    while True:
        found = find_request(load_file(traces_file), request_id) if os.path.exists(traces_file) else []
        if found:
            return [e for e in found[0].root.events if e.get("name") == "migration"]
        assert time.monotonic() < deadline, f"no trace of {request_id}"
        time.sleep(0.2)


def test_a_hung_decode_server_loses_no_stream_and_shows_none_of_its_late_output(cluster):
    _, stall, _, prefill, (_, _, c, d), traces = cluster
    oai = openai.OpenAI(base_url=stall.http_url + "/v1", api_key="unused", max_retries=0)
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stall.grpc_address))
    reqs = _requests(None)
    want = {"seeded": _run_chat(oai, *reqs["seeded"])([]), "grpc": _run_grpc(stub)([])}
    ballast = _ballast(d, 4)  # the router sends both streams to c
    ids: list = []
    streams = {"seeded": Stream(_run_chat(oai, *reqs["seeded"], ids=ids)), "grpc": Stream(_run_grpc(stub))}
    _wait(lambda: c.load().num_running == 2, 30, "both streams running on c")
    for call in ballast:
        call.cancel()
    _wait(lambda: all(len([p for p in s.pieces if p]) >= 3 for s in streams.values()), 60,
          "both streams produced a few tokens")
    before = _metric(stall, "pdserve:gateway_migrations_total")
    c.proc.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        got = {name: s.join() for name, s in streams.items()}  # while c is still stopped
        assert time.monotonic() - stopped >= STALL_S  # they waited out the deadline, no longer
        assert got == want
        after = _metric(stall, "pdserve:gateway_migrations_total")
        assert sum(v - before.get(k, 0) for k, v in after.items() if 'cause="stalled"' in k) == 2, after
    finally:
        c.proc.send_signal(signal.SIGCONT)
    c.wait_idle()  # it ran again, and freed the blocks of the streams it lost
    d.wait_idle()
    prefill.wait_idle()

    # `pdserve trace`: one trace, both decode servers' spans under the request, and the seam.
    rid = ids[0]
    assert len(_migration_events(traces, rid)) == 1
    deadline = time.monotonic() + 10
    while True:  # c's spans reach the file once it ended the request, after SIGCONT
        (t,) = find_request(load_file(traces), rid)
        below = t.children()
        served = {f"{s.attributes['server.address']}:{s.attributes['server.port']}" for s in t.spans
                  if s.name == "pdserve.v1.Decode/Generate" and any(k.service == "pdserve-decode"
                                                                    for k in below.get(s.span_id, []))}
        if served == {c.address, d.address} and not t.missing:
            break
        assert time.monotonic() < deadline, (served, t.missing)
        time.sleep(0.3)
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "trace", rid, "--traces-file", traces],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"trace {t.trace_id}  request {rid}")
    seam = [line for line in out.stdout.splitlines() if line.startswith("seam ")]
    assert len(seam) == 1 and re.fullmatch(rf"seam 1 at [0-9.]+ ms: decode server {c.address} lost \(stalled\) "
                                           rf"after \d+ tokens; resumed on decode server {d.address}", seam[0]), out.stdout


def test_past_the_migration_limit_the_request_ends_with_an_error_naming_both_servers(cluster):
    _, _, limited, prefill, (_, b, c, d), _ = cluster
    limited.wait_healthy()  # c was stopped a while ago
    body = {"model": MODEL, "messages": _chat("Tell me a long story."), "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    events: list[str] = []
    killed: list[EngineServer] = []
    with httpx.Client(timeout=60) as client, client.stream("POST", limited.http_url + "/v1/chat/completions",
                                                           json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) >= 3 * (len(killed) + 1) and len(killed) < 2:
                victim = next(s for s in (c, d) if s not in killed and s.load().num_running)
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait()
                killed.append(victim)
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert len(killed) == 2 and len(errors) == 1, events[-3:]
    message = errors[0]["message"]
    assert f"{killed[0].address}, {killed[1].address}" in message and "--migration-limit 1" in message, message
    assert re.search(r"lost its decode servers", message)
    assert sum(_metric(limited, "pdserve:gateway_migrations_total").values()) == 1
    prefill.wait_idle()
    b.wait_idle()
