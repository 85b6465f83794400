"""KV-aware routing end to end: a real Redis server (or none: the gateway's
in-memory index fed over gRPC), two real prefill servers, a decode server and
the gateway. A long shared prefix sent again and again goes to the prefill
server that holds it, is reported as cached, and stays token-exact; a
restarted server is credited with nothing.

With Redis (where the gateway also discovers its servers: ``--prefill redis
--decode redis``), Redis is SIGKILLed while requests run: none fails, the
gateway logs one warning line and shows the outage (the gauge
``pdserve:gateway_prefix_index_unreachable``, /cluster's ``prefix_index`` and
``degraded``), and keeps every server it had found. Redis restarted empty on
the same port: the engine servers publish their blocks again with nothing
restarted, prefix routing resumes, one info line, the gauge is 0 again.

Last, with every prefill server stopped, the decode server prefills by itself
and the gateway counts it (``pdserve:gateway_local_prefill_fallbacks_total``,
/cluster)."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from prometheus_client.parser import text_string_to_metric_families

from engine.block_hash import hash_request_blocks
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from gateway.prefix_index import RedisPrefixIndex
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from rpc.local_redis import LocalRedis
from tests.processes import EngineServer, GatewayProcess, free_port
from tests.processes import wait_for as _wait_for

pytestmark = pytest.mark.slow

PREFIX = [5 + (i * 7) % 370 for i in range(160)]  # 10 blocks of 16
MAX_TOKENS = 4


def Engine(role: str, model, redis_url: str | None, port: int | None = None) -> EngineServer:
    return EngineServer(role, ["--model", str(model), "--kv-cache-memory", "16MiB",
                               *(["--redis-url", redis_url] if redis_url else [])], port=port)


def _finished(server: EngineServer) -> int:
    return server.load().num_requests_finished


def _prompt(i: int) -> list[int]:
    return PREFIX + [100 + i, 200 + i, 300 + i]


def _generate(stub, prompt: list[int]):
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    deltas = list(stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                                             sampling=sampling), timeout=60))
    return [t for d in deltas for t in d.token_ids], deltas[-1].usage.cached_tokens


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="16MiB"))

    def run(prompt: list[int]) -> list[int]:
        req = engine.add_request(str(time.monotonic_ns()), prompt,
                                 SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        return req.output_token_ids
    return run


def _start(tiny_llama_dir, redis_url):
    prefills = [Engine("prefill", tiny_llama_dir, redis_url) for _ in range(2)]
    decode = Engine("decode", tiny_llama_dir, redis_url)
    if redis_url:  # found in Redis, where the servers register: a Redis outage must not lose them
        flags = ["--prefill", "redis", "--decode", "redis", "--discovery-interval", "0.5",
                 "--redis-url", redis_url, "--redis-timeout", "0.2",
                 "--served-model-name", Path(tiny_llama_dir).name]  # the engines' (namespaces are matched by it)
    else:
        flags = ["--prefill", ",".join(p.address for p in prefills), "--decode", decode.address]
    gw = GatewayProcess("gw-prefix", [*flags, "--max-model-len", "512"])
    try:
        for p in (*prefills, decode, gw):
            p.wait_ready()
        _wait_for(lambda: len(_cluster(gw)["instances"]) == 3, "the gateway to find every server")
        gw.wait_healthy()
    except BaseException:  # one did not start: stop the others (the test's own cleanup never runs)
        for p in (gw, *prefills, decode):
            p.stop()
        raise
    return prefills, decode, gw


def _warm_holder(stub, prefills, reference) -> "Engine":
    """Send the prefix once; the prefill server that served it holds it."""
    before = [_finished(p) for p in prefills]
    tokens, _ = _generate(stub, _prompt(0))
    assert tokens == reference(_prompt(0))
    deadline = time.monotonic() + 5  # a prefill request counts as finished once its blocks are released
    while not (served := [p for p, b in zip(prefills, before) if _finished(p) > b]):
        assert time.monotonic() < deadline, "no prefill server served the request"
        time.sleep(0.05)
    return served[0]


def _known_to_gateway(gw, holders, redis_url: str | None, ns: str, timeout: float = 10.0) -> None:
    """Until the gateway's index credits every holder with the prefix's 10 blocks: polled in
    Redis, or for the in-memory index through /cluster's ``prefix_blocks``."""
    if redis_url is not None:
        _indexed(redis_url, ns, {h.address: 10 for h in holders}, timeout)
        return
    deadline = time.monotonic() + timeout
    while True:
        blocks = {i["address"]: i.get("prefix_blocks")
                  for i in httpx.get(gw.http_url + "/cluster", timeout=10).json()["instances"]}
        if all((blocks.get(h.address) or 0) >= 10 for h in holders):
            return
        assert time.monotonic() < deadline, blocks
        time.sleep(0.05)


def _sticks_to(holders, stub, prefills, reference, first: int, n: int) -> None:
    """The next ``n`` prompts sharing the prefix all go to ``holders``, cached (the index
    knows them: ``_known_to_gateway`` first)."""
    before = [_finished(p) for p in prefills]
    for i in range(first, first + n):
        tokens, cached = _generate(stub, _prompt(i))
        assert tokens == reference(_prompt(i))
        assert cached >= len(PREFIX) - 16, cached  # the prefix's full blocks, at least
    gained = [_finished(p) - b for p, b in zip(prefills, before)]
    assert sum(gained) == n and all(g == 0 for p, g in zip(prefills, gained) if p not in holders), gained


def _indexed(redis_url: str, ns: str, want: dict[str, int | None], timeout: float = 10.0) -> dict[str, int]:
    """Poll the Redis index until the prefix's matches include ``want``."""
    hashes = hash_request_blocks(PREFIX, 16)
    deadline = time.monotonic() + timeout
    while True:
        got = asyncio.run(RedisPrefixIndex(redis_url, timeout_s=1.0).match(ns, hashes))
        if all(got.get(a) == n for a, n in want.items()):
            return got
        assert time.monotonic() < deadline, (got, want)
        time.sleep(0.2)


def _cluster(gw) -> dict:
    return httpx.get(gw.http_url + "/cluster", timeout=10).json()


def _gateway_metric(gw, name: str) -> dict[tuple, float]:
    """A gateway metric's samples by their labels (model_name left out)."""
    text = httpx.get(gw.http_url + "/metrics", timeout=10).text
    return {tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


class _Load:
    """Requests sharing the prefix sent back to back from ``threads`` threads until ``stop``;
    each must come back token-exact (``expected``: prompt index -> tokens)."""

    def __init__(self, grpc_address: str, expected: dict[int, list[int]], threads: int = 2) -> None:
        self.errors: list[str] = []
        self.num_ok = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(grpc_address, expected, k), daemon=True)
                         for k in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, grpc_address: str, expected: dict[int, list[int]], k: int) -> None:
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(grpc_address))
        keys = sorted(expected)
        i = k
        while not self._stop.is_set():
            key = keys[i % len(keys)]
            i += len(self._threads)
            try:
                tokens, _ = _generate(stub, _prompt(key))
            except grpc.RpcError as e:
                self.errors.append(f"prompt {key}: {e.code().name}: {e.details()}")
                continue
            if tokens != expected[key]:
                self.errors.append(f"prompt {key}: {tokens} != {expected[key]}")
            else:
                self.num_ok += 1

    def run_past(self, more: int) -> None:
        """Until ``more`` further requests have finished."""
        target = self.num_ok + more
        _wait_for(lambda: self.num_ok >= target or self.errors, f"{more} more requests", timeout=60)
        assert not self.errors, self.errors

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not self.errors, self.errors


def _outage_shows(gw, unreachable: bool) -> None:
    """Until the gateway's gauge and /cluster both say whether Redis is unreachable."""
    want = 1.0 if unreachable else 0.0
    _wait_for(lambda: _gateway_metric(gw, "pdserve:gateway_prefix_index_unreachable") == {(): want}
              and _cluster(gw)["prefix_index"]["unreachable"] is unreachable, f"unreachable={unreachable}")
    degraded = _cluster(gw)["degraded"]
    assert degraded["prefix_index_unreachable"] is unreachable, degraded


def _redis_outage(gw, redis, prefills, holder, reference) -> set:
    """SIGKILL Redis under load, restart it empty; returns the prefill servers that hold the prefix."""
    expected = {i: reference(_prompt(i)) for i in range(10, 14)}
    before = [_finished(p) for p in prefills]
    load = _Load(gw.grpc_address, expected)
    try:
        load.run_past(2)
        redis.proc.kill()  # SIGKILL, mid-load
        redis.proc.wait()
        _outage_shows(gw, True)
        assert len(_cluster(gw)["instances"]) == 3  # discovery kept every server it had found in Redis
        load.run_past(4)  # routed by load alone meanwhile
        redis.start()  # the same port, empty
        _outage_shows(gw, False)
        load.run_past(4)  # ... while the servers register and publish again
    finally:
        load.stop()
    assert len(_cluster(gw)["instances"]) == 3
    log = gw.log_text()
    warnings = [line for line in log.splitlines() if " WARNING " in line and "redis" in line.lower()]
    assert len(warnings) == 1, "\n".join(warnings)  # one outage, one line (the index's and discovery's)
    assert len(re.findall(r"Redis at \S+ answers again", log)) == 1, log[-3000:]
    return {holder} | {p for p, b in zip(prefills, before) if _finished(p) > b}


def _falls_back_to_local_prefill(gw, stub, prefills, reference) -> None:
    """No prefill server left: the decode server prefills, and the gateway counts why."""
    assert all(p.stop() == 0 for p in prefills if p.proc.poll() is None)
    _wait_for(lambda: not any(i["healthy"] for i in _cluster(gw)["instances"] if i["role"] == "prefill"),
              "no healthy prefill server")
    tokens, _ = _generate(stub, _prompt(30))
    assert tokens == reference(_prompt(30))
    counted = _cluster(gw)["degraded"]["local_prefill_fallbacks"]
    assert set(counted) <= {"no_prefill_server", "no_healthy_prefill_server"} and sum(counted.values()) >= 1, counted
    metric = _gateway_metric(gw, "pdserve:gateway_local_prefill_fallbacks_total")
    assert {labels[0][1]: int(v) for labels, v in metric.items()} == counted, metric


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_shared_prefix_goes_where_it_is_cached(tiny_llama_dir, reference, backend):
    redis = LocalRedis(port=free_port()).start() if backend == "redis" else None
    prefills, decode, gw = _start(tiny_llama_dir, redis.url if redis else None)
    procs = [gw, *prefills, decode]
    try:
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
        assert _cluster(gw)["degraded"] == {"prefix_index_unreachable": False, "local_prefill_fallbacks": {},
                                            "migrations": {}, "kv_host_staged_transfers": 0}
        holder = _warm_holder(stub, prefills, reference)
        ns = holder.load().cache_namespace
        _known_to_gateway(gw, {holder}, redis.url if redis else None, ns)
        _sticks_to({holder}, stub, prefills, reference, 1, 4)
        if redis is not None:
            assert _cluster(gw)["prefix_index"]["backend"] == "redis"
            holders = _redis_outage(gw, redis, prefills, holder, reference)
            # The servers published again, with no restart, and prefix routing resumes.
            _known_to_gateway(gw, holders, redis.url, ns)
            _sticks_to(holders, stub, prefills, reference, 20, 3)
            # A restarted server is credited with nothing it held before.
            assert holder.stop() == 0
            restarted = Engine("prefill", tiny_llama_dir, redis.url, port=holder.port)
            procs.append(restarted)
            restarted.wait_ready()
            _indexed(redis.url, ns, {holder.address: None})
            prefills = [p for p in prefills if p is not holder] + [restarted]
        _falls_back_to_local_prefill(gw, stub, prefills, reference)
    finally:
        codes = [p.stop() for p in procs if p.proc.poll() is None]
        if redis is not None:
            redis.stop()
    assert set(codes) <= {0}, [p.logs() for p in procs]
