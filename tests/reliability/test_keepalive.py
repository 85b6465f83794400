"""Keepalive between pdserve processes (rpc/server.py): a real gRPC server with pdserve's server
options and a channel with pdserve's channel options, their timings scaled down by the same
factor (the options take them as arguments), on loopback.

- A quiet call (``Health/Watch`` sends the status once, then nothing) whose peer vanishes
  (tests/silent_relay.py: the connection stays open, nothing more arrives, no reset) fails
  UNAVAILABLE within keepalive time + timeout: with no data flowing, only the keepalive ping
  finds the dead peer.
- The server accepts the client's pings: the same quiet call lives through many keepalive
  periods and still works (no GOAWAY "too_many_pings"). A server whose minimum ping interval
  is above the client's keepalive time (the misconfiguration) does close it, so that check
  would see one.
- The production values keep those relations (the server's minimum ping interval at most the
  keepalive time, the ping timeout bounding the keepalive's wait)."""
from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc import server as rpc_server
from rpc.server import RpcServer, channel_options, server_options
from tests.silent_relay import SilentRelay

SCALE = 10  # production timings / SCALE
KEEPALIVE_MS = rpc_server.KEEPALIVE_TIME_MS // SCALE
TIMEOUT_MS = rpc_server.KEEPALIVE_TIMEOUT_MS // SCALE
MIN_PING_MS = rpc_server.MIN_PING_INTERVAL_MS // SCALE


async def _server(min_ping_interval_ms: int) -> RpcServer:
    rpc = RpcServer("127.0.0.1:0", ["pdserve.v1.Decode"], options=server_options(min_ping_interval_ms))
    await rpc.start()
    return rpc


async def _quiet_watch(address: str):
    """A channel with pdserve's (scaled) options and a Health/Watch call on it, past its first
    message: from then on nothing flows unless the status changes."""
    channel = grpc.aio.insecure_channel(address, options=channel_options(KEEPALIVE_MS, TIMEOUT_MS))
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    first = await asyncio.wait_for(call.read(), 10)
    assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
    return channel, call


def test_a_quiet_call_to_a_vanished_peer_fails_within_keepalive_time_and_timeout():
    async def main() -> float:
        rpc = await _server(MIN_PING_MS)
        relay = SilentRelay(f"127.0.0.1:{rpc.port}")
        try:
            channel, call = await _quiet_watch(relay.address)
            await asyncio.sleep(3 * KEEPALIVE_MS / 1000)  # quiet: every ping so far answered
            relay.silence()
            silenced = time.monotonic()
            try:
                await asyncio.wait_for(call.read(), 10 * (KEEPALIVE_MS + TIMEOUT_MS) / 1000)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            else:
                raise AssertionError("the call read a message from a silent peer")
            await channel.close()
            return time.monotonic() - silenced
        finally:
            relay.close()
            await rpc.server.stop(None)

    took = asyncio.run(main())
    assert took < 1.5 * (KEEPALIVE_MS + TIMEOUT_MS) / 1000, took


async def _survives(min_ping_interval_ms: int, periods: int = 6) -> grpc.aio.AioRpcError | None:
    """Whether a quiet call lives ``periods`` keepalive periods against a server with this
    minimum ping interval and then still carries a message (None), or the error that ended it."""
    rpc = await _server(min_ping_interval_ms)
    try:
        channel, call = await _quiet_watch(f"127.0.0.1:{rpc.port}")
        read = asyncio.ensure_future(call.read())  # not cancelled on the way: that would cancel the call
        await asyncio.wait({read}, timeout=periods * KEEPALIVE_MS / 1000)
        if read.done():
            error = read.exception()
            await channel.close()
            assert isinstance(error, grpc.aio.AioRpcError), f"a status change nobody made: {read.result()}"
            return error
        await rpc.set_serving(True)
        assert (await asyncio.wait_for(read, 5)).status == health_pb2.HealthCheckResponse.SERVING
        await channel.close()
        return None
    finally:
        await rpc.server.stop(None)


def test_the_servers_accept_the_clients_keepalive_pings():
    assert asyncio.run(_survives(MIN_PING_MS)) is None
    # The check sees a server that refuses them: a minimum interval above the keepalive time.
    refused = asyncio.run(_survives(4 * KEEPALIVE_MS))
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    assert "too many pings" in (refused.details() or "").lower(), refused


def test_the_production_values_keep_the_relations():
    server, client = dict(rpc_server.SERVER_OPTIONS), dict(rpc_server.CHANNEL_OPTIONS)
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert client["grpc.http2.ping_timeout_ms"] == client["grpc.keepalive_timeout_ms"]
    assert client["grpc.http2.max_pings_without_data"] == 0
    assert (client["grpc.keepalive_time_ms"] + client["grpc.keepalive_timeout_ms"]) / 1000 <= 15
