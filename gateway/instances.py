"""The engine servers the gateway knows about, and a poller that keeps their
health and load fresh.

Each ``Instance`` owns one gRPC channel to one prefill or decode server. The
``InstanceRegistry`` polls every instance every ``poll_interval`` seconds with
``GetLoad`` and ``grpc.health.v1.Health/Check`` (both with a short deadline);
an instance is healthy when both answer and health says SERVING. A request
that finds an instance unreachable marks it unhealthy at once; the next
successful poll brings it back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import common_pb2, engine_pb2_grpc
from rpc.server import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"

# An engine server that restarts should be seen again within a poll or two,
# not after gRPC's default reconnect backoff (up to 120 s).
_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class Instance:
    """One engine server: its channel, stubs, last known load and health.

    ``num_in_flight`` counts this gateway's requests currently routed to it
    (fresher than the polled load between two polls); ``num_queued_tokens``
    the prompt tokens it is prefilling for them."""

    def __init__(self, role: str, address: str) -> None:
        self.role = role
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub: Any = (engine_pb2_grpc.PrefillStub(self.channel) if role == PREFILL
                          else engine_pb2_grpc.DecodeStub(self.channel))
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.load: common_pb2.LoadInfo | None = None
        self.is_healthy = False
        self.error: str | None = "not polled yet"
        self.num_in_flight = 0
        self.num_queued_tokens = 0

    @property
    def num_requests(self) -> int:
        """Best estimate of requests running or waiting on this instance."""
        polled = self.load.num_running + self.load.num_waiting if self.load else 0
        return max(polled, self.num_in_flight)

    @property
    def kv_usage(self) -> float:
        if self.load is None or self.load.kv_blocks_total <= 0:
            return 0.0
        return self.load.kv_blocks_used / self.load.kv_blocks_total

    @property
    def block_size(self) -> int | None:
        return self.load.block_size if self.load and self.load.block_size > 0 else None

    async def poll(self, timeout: float) -> None:
        """Refresh load and health; never raises."""
        try:
            load, health = await asyncio.gather(
                self.stub.GetLoad(common_pb2.LoadRequest(), timeout=timeout),
                self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout))
        except grpc.aio.AioRpcError as e:
            self.set_unhealthy(f"{e.code().name}: {e.details()}")
            return
        self.load = load
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            self.set_unhealthy(f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}")
            return
        if not self.is_healthy:
            logger.info("%s server %s is healthy (%d/%d KV blocks used)", self.role, self.address,
                        load.kv_blocks_used, load.kv_blocks_total)
        self.is_healthy, self.error = True, None

    def set_unhealthy(self, reason: str) -> None:
        if self.is_healthy or self.error != reason:
            logger.warning("%s server %s is unhealthy: %s", self.role, self.address, reason)
        self.is_healthy, self.error = False, reason

    def to_json(self) -> dict[str, Any]:
        """The /cluster entry of this instance."""
        load = self.load or common_pb2.LoadInfo()
        return {"role": self.role, "address": self.address, "metrics_url": load.metrics_url,
                "healthy": self.is_healthy, "num_running": load.num_running, "num_waiting": load.num_waiting,
                "kv_blocks_used": load.kv_blocks_used, "kv_blocks_total": load.kv_blocks_total,
                "error": self.error}

    async def close(self) -> None:
        await self.channel.close()


class InstanceRegistry:
    """Owns every Instance and the background poll task."""

    def __init__(self, prefill: tuple[str, ...], decode: tuple[str, ...], poll_interval: float = 0.5,
                 poll_timeout: float = 1.0) -> None:
        self.prefill = [Instance(PREFILL, a) for a in prefill]
        self.decode = [Instance(DECODE, a) for a in decode]
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout
        self._task: asyncio.Task[None] | None = None

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.prefill + self.decode)

    @property
    def has_healthy_decode(self) -> bool:
        return any(i.is_healthy for i in self.decode)

    async def start(self) -> None:
        """Poll once (so routing starts informed), then keep polling in the background."""
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name="instance-poller")

    async def poll_once(self) -> None:
        await asyncio.gather(*(i.poll(self.poll_timeout) for i in self))

    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # a bug in polling must not stop polling
                logger.exception("instance poll failed")
            await asyncio.sleep(max(0.0, self.poll_interval - (time.monotonic() - started)))

    def to_json(self) -> dict[str, Any]:
        """The /cluster body."""
        return {"instances": [i.to_json() for i in self]}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.gather(*(i.close() for i in self), return_exceptions=True)
