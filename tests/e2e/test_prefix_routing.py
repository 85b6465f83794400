"""KV-aware routing end to end: a real Redis server (or none: the gateway's
in-memory index fed over gRPC), two real prefill servers, a decode server and
the gateway. A long shared prefix sent again and again goes to the prefill
server that holds it, is reported as cached, and stays token-exact; a
restarted server is credited with nothing; Redis going away costs no request,
and Redis coming back empty is refilled without restarting anything."""
from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from engine.block_hash import hash_request_blocks
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from gateway.prefix_index import RedisPrefixIndex
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from rpc.local_redis import LocalRedis
from tests.processes import EngineServer, GatewayProcess, free_port

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
    flags = ["--prefill", ",".join(p.address for p in prefills), "--decode", decode.address,
             "--max-model-len", "512"] + (["--redis-url", redis_url, "--redis-timeout", "0.2"] if redis_url else [])
    gw = GatewayProcess("gw-prefix", flags)
    try:
        for p in (*prefills, decode, gw):
            p.wait_ready()
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


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_shared_prefix_goes_where_it_is_cached(tiny_llama_dir, reference, backend):
    redis = LocalRedis(port=free_port()).start() if backend == "redis" else None
    prefills, decode, gw = _start(tiny_llama_dir, redis.url if redis else None)
    procs = [gw, *prefills, decode]
    try:
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
        holder = _warm_holder(stub, prefills, reference)
        ns = holder.load().cache_namespace
        _known_to_gateway(gw, {holder}, redis.url if redis else None, ns)
        _sticks_to({holder}, stub, prefills, reference, 1, 4)
        if redis is None:
            return
        # Redis goes away: requests keep succeeding (routed by load alone)...
        redis.stop()
        before = [_finished(p) for p in prefills]
        for i in range(10, 13):
            tokens, _ = _generate(stub, _prompt(i))
            assert tokens == reference(_prompt(i))
        holders = {holder} | {p for p, b in zip(prefills, before) if _finished(p) > b}
        # ... and comes back empty: the servers publish again, with no restart, and prefix routing resumes.
        redis.start()
        _known_to_gateway(gw, holders, redis.url, ns)
        _sticks_to(holders, stub, prefills, reference, 20, 3)
        # A restarted server is credited with nothing it held before.
        assert holder.stop() == 0
        restarted = Engine("prefill", tiny_llama_dir, redis.url, port=holder.port)
        procs.append(restarted)
        restarted.wait_ready()
        _indexed(redis.url, ns, {holder.address: None})
    finally:
        codes = [p.stop() for p in procs if p.proc.poll() is None]
        if redis is not None:
            redis.stop()
    assert set(codes) <= {0}, [p.logs() for p in procs]
