"""Peers lost without a word, and a lost gateway (real processes, real Redis, tiny model).

- **A decode server's host vanishes** (a killed container, a lost node): its connections stay
  open and nothing more arrives, no TCP reset. Here decode servers are reached through a
  loopback TCP relay that can go silent (tests/silent_relay.py: it keeps every connection
  open and stops forwarding, both ways, as a vanished host would), with
  ``--stream-idle-timeout 0``, so only the gateway channel's unanswered pings (rpc/server.py:
  keepalive, and the ping timeout that bounds every ping) can find the dead peer: a stream on
  it migrates within keepalive time + timeout of the loss (gRPC's default ping timeout made
  it a minute) and finishes with exactly the tokens of the same request computed in one engine
  (greedy: what the cluster streams without a loss; computed offline, not through the paced
  decode servers).
  tests/reliability/test_keepalive.py checks the keepalive pings on a quiet connection.
- **The gateway restarts** (SIGKILL, a new process on the same tiers and Redis): the stream in
  flight is lost with the process, and its decode server frees the blocks; the new gateway
  finds every server through Redis discovery, and a repeated long prompt is routed by the
  Redis prefix index to the prefill server that holds it and reported as cached, with the
  same tokens.
- **A prefill server dies mid-transfer** while it sends a prompt's KV layer by layer (held
  after layer 0 by its hidden test flag ``--test-pause-kv-send``, then SIGKILLed): the gateway
  retries on the other prefill server, the request finishes with the tokens it has without
  the kill, and the decode server frees the blocks it had reserved for the lost transfer.

No KV block stays held anywhere afterwards."""
from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from rpc import server as rpc_server
from rpc.local_redis import LocalRedis
from tests.conftest import offline_greedy
from tests.processes import EngineServer, GatewayProcess, free_port, wait_for
from tests.silent_relay import SilentRelay

pytestmark = pytest.mark.slow

PREFIX = [5 + (i * 7) % 370 for i in range(160)]  # 10 blocks of 16
# A dead peer is noticed within keepalive time + timeout of its last data; allow for the
# resumed request's prefill on a loaded 2-core machine.
DETECT_S = (rpc_server.KEEPALIVE_TIME_MS + rpc_server.KEEPALIVE_TIMEOUT_MS) / 1000
# The decode servers' steps are paced (their hidden --test-step-delay): a tiny model streams
# hundreds of tokens in well under a second, and a test must find a stream still running to
# silence its server or kill its gateway under it.
STEP_DELAY_S = 0.02


def Engine(role: str, model, redis_url: str) -> EngineServer:
    paced = ["--test-step-delay", str(STEP_DELAY_S)] if role == "decode" else []
    return EngineServer(role, ["--model", str(model), "--kv-cache-memory", "16MiB", "--redis-url", redis_url, *paced])


def _request(prompt: list[int], max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


def _generate(stub, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    deltas = list(stub.Generate(_request(prompt, max_tokens), timeout=90))
    return [t for d in deltas for t in d.token_ids], deltas[-1].usage.cached_tokens


def _cluster(gw: GatewayProcess) -> list[dict]:
    return httpx.get(gw.http_url + "/cluster", timeout=10).json()["instances"]


@pytest.fixture(scope="module")
def tiers(tiny_llama_dir):
    """Redis, two prefill servers and two decode servers, all registered in Redis."""
    redis = LocalRedis(port=free_port()).start()
    servers = [Engine(role, tiny_llama_dir, redis.url) for role in ("prefill", "prefill", "decode", "decode")]
    try:
        for s in servers:
            s.wait_ready()
        yield redis, servers[:2], servers[2:]
    finally:
        for s in servers:
            s.kill()
        redis.close()


def _gateway(name: str, flags: list[str]) -> GatewayProcess:
    return GatewayProcess(name, [*flags, "--max-model-len", "512"])


def _holds_a_request(server: EngineServer) -> bool:
    load = server.load()
    return bool(load.num_running or load.num_waiting)


def test_a_stream_on_a_vanished_decode_host_migrates_within_the_keepalive_deadline(tiers, tiny_llama_dir):
    _, prefills, decodes = tiers
    prompt = [9 + (j * 13) % 370 for j in range(40)]
    want = offline_greedy(tiny_llama_dir, prompt, 300)
    relays = [SilentRelay(d.address) for d in decodes]
    gw = _gateway("gw-keepalive", ["--prefill", ",".join(p.address for p in prefills),
                                   "--decode", ",".join(r.address for r in relays), "--stream-idle-timeout", "0"])
    try:
        gw.wait_ready()
        gw.wait_healthy()
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
        stream = stub.Generate(_request(prompt, 300), timeout=120)
        got = list(next(stream).token_ids)
        # The first token is the prefill server's: the decode server holding the stream may still be
        # receiving its KV (the request counts as waiting there, then as running).
        lost = wait_for(lambda: [i for i, d in enumerate(decodes) if _holds_a_request(d)],
                        "a decode server to hold the stream")[0]
        relays[lost].silence()
        silenced = time.monotonic()
        got += [t for d in stream for t in d.token_ids]
        took = time.monotonic() - silenced
        assert got == want
        # Noticed by the keepalive ping (the stream had no deadline of its own), not later; the
        # rest of the stream is then served at the paced decode servers' speed.
        assert took < DETECT_S + 5 + 300 * STEP_DELAY_S, (took, gw.logs())
        lost_address = relays[lost].address
        health = {i["address"]: i["healthy"] for i in _cluster(gw)}
        assert health[lost_address] is False, health
    finally:
        gw.kill()
        for r in relays:
            r.close()
    for s in (*prefills, *decodes):
        s.wait_idle(timeout=30)  # the lost server finished the stream nobody read, and freed it


def test_a_restarted_gateway_rebuilds_its_view_from_discovery_and_the_redis_index(tiers, tiny_llama_dir):
    redis, prefills, decodes = tiers
    # --redis-timeout: a loaded test machine can miss the default 10 ms bound, which routes by load
    # (by design); what is under test here is the rebuilt view, not the bound.
    flags = ["--prefill", "redis", "--decode", "redis", "--redis-url", redis.url, "--discovery-interval", "0.5",
             "--redis-timeout", "0.25", "--served-model-name", Path(tiny_llama_dir).name]
    addresses = {s.address for s in (*prefills, *decodes)}
    first = _gateway("gw-before-restart", flags)
    try:
        first.wait_ready()
        wait_for(lambda: {i["address"] for i in _cluster(first) if i["healthy"]} == addresses,
                 "the first gateway to find every server")
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(first.grpc_address))
        want, _ = _generate(stub, PREFIX + [100], 8)
        # A stream in flight when the gateway dies: lost with it (the client retries).
        orphan = stub.Generate(_request(PREFIX + [101], 340), timeout=60)
        next(orphan)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        with pytest.raises(grpc.RpcError) as lost:
            list(orphan)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        first.kill()
    for s in decodes:
        s.wait_idle(timeout=30)  # the orphaned stream's decode server freed its blocks

    second = _gateway("gw-after-restart", flags)
    try:
        second.wait_ready()
        wait_for(lambda: {i["address"] for i in _cluster(second) if i["healthy"]} == addresses,
                 "the restarted gateway to find every server through discovery")
        assert len(_cluster(second)) == len(addresses)
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(second.grpc_address))
        for i in range(3):  # each routed by the Redis index to the prefill server that holds the prefix
            tokens, cached = _generate(stub, PREFIX + [100], 8)
            assert tokens == want
            assert cached >= len(PREFIX) - 16, cached
        routes = re.findall(r"route=(\w+) matched_tokens=(\d+)", second.log_text())
        assert len(routes) == 3 and all(r == "prefix" and int(m) >= len(PREFIX) - 16 for r, m in routes), routes
    finally:
        code = second.stop()
        assert code == 0, second.logs()
    for s in (*prefills, *decodes):
        s.wait_idle()


def test_a_prefill_server_killed_mid_layerwise_send_costs_no_request(tiers, tiny_llama_dir):
    """The prefill server dies while it sends a prompt's KV layer by layer (its hidden test flag
    ``--test-pause-kv-send`` holds every layer-wise send after layer 0: the transfer has begun on
    the decode server, its layers not all sent): the gateway retries on the other prefill server,
    the request finishes with the tokens it has without the kill, and the decode server frees
    the blocks it had reserved for the lost transfer."""
    redis, prefills, decodes = tiers
    decode, healthy = decodes[0], prefills[0]
    prompt = [11 + (j * 17) % 370 for j in range(60)]
    ref = _gateway("gw-reference", ["--prefill", healthy.address, "--decode", decode.address])
    paused = EngineServer("prefill", ["--model", str(tiny_llama_dir), "--kv-cache-memory", "16MiB",
                                      "--test-pause-kv-send", "0:120"], name="prefill-paused")
    # The paused server first: with equal loads and nothing routed yet, the first request goes there.
    gw = _gateway("gw-prefill-loss", ["--prefill", f"{paused.address},{healthy.address}", "--decode", decode.address])
    try:
        for p in (ref, paused, gw):
            p.wait_ready()
        gw.wait_healthy()
        served_before = healthy.load().num_requests_finished
        result: dict = {}

        def run() -> None:
            stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
            result["tokens"], _ = _generate(stub, prompt, 16)

        reader = threading.Thread(target=run, daemon=True)
        reader.start()
        try:
            wait_for(lambda: "test hook: the layer-wise KV send of request" in paused.log_text(),
                     "the paused server's layer-wise send to begin", timeout=60)
        except AssertionError:
            raise AssertionError(gw.logs() + paused.logs()) from None
        assert decode.load().kv_blocks_used > 0  # blocks reserved for the transfer in flight
        paused.proc.send_signal(signal.SIGKILL)
        paused.proc.wait()
        reader.join(60)
        assert not reader.is_alive()
        wait_for(lambda: healthy.load().num_requests_finished > served_before, "the retry on the other server")
        # The same request where no server dies (served after: a cold cache would have sent it to
        # the paused server, and the healthy one's warm prefix cache does not change greedy tokens).
        ref.wait_healthy()
        want, _ = _generate(gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(ref.grpc_address)), prompt, 16)
        assert result.get("tokens") == want, (result, gw.logs())
        decode.wait_idle()  # the lost transfer's blocks freed, the retry's too
        healthy.wait_idle()
    finally:
        for p in (gw, ref, paused):
            p.kill()
