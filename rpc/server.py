"""A grpc.aio server with the standard health service (NOT_SERVING while
loading and draining) and server reflection, stopped gracefully on
SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rpc import ports, tls, tracing

logger = logging.getLogger(__name__)

# Keepalive between pdserve processes. A peer whose host vanished (a killed container, a lost
# node) sends no TCP RST: without pings, a call on its connection waits for data forever (or
# until --stream-idle-timeout). Clients ping every KEEPALIVE_TIME_MS, idle or not, and close the
# connection when a ping is not acknowledged within KEEPALIVE_TIMEOUT_MS, so a dead peer is seen
# within their sum (15 s) and its calls fail UNAVAILABLE (the gateway migrates its streams).
# The server must accept that rate: a ping received sooner than MIN_PING_INTERVAL_MS after the
# last one, while the server sent nothing, is a strike, and a few strikes close the connection
# with GOAWAY "too_many_pings". So MIN_PING_INTERVAL_MS <= KEEPALIVE_TIME_MS, with headroom.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
MIN_PING_INTERVAL_MS = 5_000


def server_options(min_ping_interval_ms: int = MIN_PING_INTERVAL_MS) -> list[tuple[str, Any]]:
    """A pdserve gRPC server's options: what its clients' keepalive pings need (the
    argument is for tests, which scale the timings down)."""
    return [
        # Defaults are fine for token streams; raise the message cap because a long
        # prompt's token ids or a big logprobs payload can exceed 4 MiB.
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        # Accept keepalive pings on connections with no call in flight (the gateway's idle
        # channels), and at the clients' rate (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
        # One port, one server: grpcio's default SO_REUSEPORT would let a second server bind a
        # port already served, beside the first, and the kernel spread connections over both.
        ports.EXCLUSIVE,
    ]


def channel_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS,
                    keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS) -> list[tuple[str, Any]]:
    """A channel's options towards a pdserve server: keepalive pings that find a dead peer
    (the arguments are for tests, which scale the timings down)."""
    return [
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
        # Since gRPC 1.60 (grpc/grpc#34647) an unacknowledged ping of any kind (keepalive or
        # the BDP probe's) closes the connection after this, 60 s by default, and it is what
        # bounds the wait: without it a dead peer was seen after a minute, not 15 s.
        ("grpc.http2.ping_timeout_ms", keepalive_timeout_ms),
        # Ping idle connections too (a gateway's channel between requests), and keep pinging a
        # connection on which the client sends nothing (a token stream only receives): by default
        # gRPC stops after 2 pings without data sent (GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


SERVER_OPTIONS = server_options()
CHANNEL_OPTIONS = channel_options()


class RpcServer:
    """Owns one grpc.aio server, its health servicer and its lifecycle."""

    def __init__(self, address: str, service_names: Iterable[str], internal: bool = True,
                 port_flag: str = "--port", options: list[tuple[str, Any]] | None = None) -> None:
        """``internal``: a port for other pdserve processes, mutual TLS when
        ``rpc.tls`` is configured; the gateway's client-facing port is not.
        A port that cannot be bound (in use) raises ``ports.PortUnavailable``
        naming ``port_flag``, the flag that changes it. ``options``: the gRPC server's
        (default ``SERVER_OPTIONS``)."""
        self.service_names = list(service_names)
        # A SERVER span per request-carrying call under the caller's
        # traceparent (none when tracing is off; see rpc/tracing.py).
        self.server = grpc.aio.server(options=SERVER_OPTIONS if options is None else options,
                                      interceptors=tracing.server_interceptors(self.service_names))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        add = (lambda a: tls.add_port(self.server, a)) if internal else self.server.add_insecure_port
        self.port = ports.add_grpc_port(add, address, "gRPC", port_flag)
        self._stop = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in [""] + self.service_names:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_and_drain(self, drain: Callable[[], Awaitable[None]] | None = None,
                             grace: float = 30.0) -> None:
        """Block until a stop signal, then: NOT_SERVING, drain, stop."""
        await self._stop.wait()
        logger.info("stopping: draining in-flight requests (grace %.0fs)", grace)
        await self.set_serving(False)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(), grace)
            except asyncio.TimeoutError:
                logger.warning("drain did not finish within %.0fs; aborting the rest", grace)
        await self.server.stop(grace=1.0)
