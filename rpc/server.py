"""A grpc.aio server with the standard health service (NOT_SERVING while
loading and draining) and server reflection, stopped gracefully on
SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rpc import ports, tls, tracing

logger = logging.getLogger(__name__)

# Defaults are fine for token streams; raise the message cap because a long
# prompt's token ids or a big logprobs payload can exceed 4 MiB.
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Let clients keep idle channels open with keepalive pings.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # One port, one server: grpcio's default SO_REUSEPORT would let a second server bind a
    # port already served, beside the first, and the kernel spread connections over both.
    ports.EXCLUSIVE,
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
]


class RpcServer:
    """Owns one grpc.aio server, its health servicer and its lifecycle."""

    def __init__(self, address: str, service_names: Iterable[str], internal: bool = True,
                 port_flag: str = "--port") -> None:
        """``internal``: a port for other pdserve processes, mutual TLS when
        ``rpc.tls`` is configured; the gateway's client-facing port is not.
        A port that cannot be bound (in use) raises ``ports.PortUnavailable``
        naming ``port_flag``, the flag that changes it."""
        self.service_names = list(service_names)
        # A SERVER span per request-carrying call under the caller's
        # traceparent (none when tracing is off; see rpc/tracing.py).
        self.server = grpc.aio.server(options=SERVER_OPTIONS,
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
