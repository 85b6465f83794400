"""The engine servers the gateway knows about, and a poller that keeps their
health and load fresh.

Each ``Instance`` owns one gRPC channel to one prefill or decode server. The
``InstanceRegistry`` polls every instance every ``poll_interval`` seconds with
``GetLoad`` and ``grpc.health.v1.Health/Check`` (both with a short deadline);
an instance is healthy when both answer and health says SERVING. A request
that finds an instance unreachable marks it unhealthy at once; the next
successful poll brings it back.

Membership changes at run time (``set_addresses``, called by discovery,
gateway/discovery.py): a new address becomes an Instance, polled at once;
an address no longer listed is taken out of routing and *drains*: it stays
in ``draining`` (shown in /cluster) while this gateway still has requests on
it, then is dropped. It is not closed explicitly: a request that picked it
just before the removal (and has not reached it yet, e.g. a prefill waiting
for its decode reservation) can still use it; its channel closes when the
last reference goes. An address listed again while draining comes back as
the same Instance. Listeners (the in-memory prefix index) hear of both.

LoRA: a server started with --enable-lora lists the adapters it serves in its
``LoadInfo`` (``lora_adapters``, each with its fingerprint, root hash and
whether it is in a device slot now; ``max_loras`` slots). ``lora_adapter`` and
``needs_lora_swap`` read that for routing (gateway/lora.py, gateway/router.py);
``InstanceRegistry.poll_once(instances)`` refreshes it at once after a load or
unload.

Logs: a server that has never been healthy is loading (or not started yet): it
gets one line, ``waiting for decode server HOST:PORT to load``, and a warning
only if it is still not serving ``LOAD_WARNING_S`` after it was added (a
refused connection or NOT_SERVING before that is the normal start). Once a
server has been healthy, each change to unhealthy is a warning with its
reason.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import common_pb2, engine_pb2_grpc
from rpc import tls
from rpc.server import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)
_LATE_POLLS_TOLERATED = 3  # consecutive late polls before a busy server counts as unhealthy
# A server not serving this long after it was added gets a warning (before: "waiting for ... to load").
LOAD_WARNING_S = 120.0

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

    def __init__(self, role: str, address: str, load_warning_s: float = LOAD_WARNING_S) -> None:
        self.role = role
        self.address = address
        self.added_at = time.monotonic()
        self.load_warning_s = load_warning_s
        self.has_been_healthy = False
        self._load_logged = 0  # 1: "waiting for ... to load" logged; 2: the late warning too
        self.channel = tls.aio_channel(address, _CHANNEL_OPTIONS)
        self.stub: Any = (engine_pb2_grpc.PrefillStub(self.channel) if role == PREFILL
                          else engine_pb2_grpc.DecodeStub(self.channel))
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.load: common_pb2.LoadInfo | None = None
        self.is_healthy = False
        self.error: str | None = "not polled yet"
        self.num_in_flight = 0
        self.num_queued_tokens = 0
        self.num_late_polls = 0  # consecutive polls that ran past their deadline
        self.is_draining = False  # taken out of routing; kept while requests are in flight on it
        self._num_lora_changes = 0  # adapters loaded or unloaded here through this gateway

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

    def lora_adapter(self, name: str) -> common_pb2.LoRAAdapter | None:
        """LoRA adapter ``name`` as this server last listed it (None: it does not serve it)."""
        if self.load is None:
            return None
        return next((a for a in self.load.lora_adapters if a.name == name), None)

    @property
    def draft_model(self) -> str:
        """The draft model this server speculates with (or, a prefill server, computes the KV
        of), as it last said; "" for none."""
        return self.load.draft_model if self.load is not None else ""

    def needs_lora_swap(self, name: str | None) -> bool:
        """Whether a request under adapter ``name`` would first have to take another
        adapter's device slot here (and, while that one is in use, wait for it):
        ``name`` is not in a slot and every slot (``max_loras``) is taken. False for
        the base model (None) and wherever ``name`` is not listed."""
        if name is None or self.load is None:
            return False
        adapter = self.lora_adapter(name)
        if adapter is None or adapter.in_slot:
            return False
        return sum(a.in_slot for a in self.load.lora_adapters) >= self.load.max_loras

    def note_lora_change(self, loaded: common_pb2.LoRAAdapter | None = None, unloaded: str | None = None) -> None:
        """What a load (the server's answer) or an unload through this gateway changed, in
        the listed adapters at once: the next request sees it whether or not the poll that
        follows comes back in time, and a poll begun before it cannot take it back."""
        self._num_lora_changes += 1
        if self.load is None:
            return
        name = loaded.name if loaded is not None else unloaded
        kept = [a for a in self.load.lora_adapters if a.name != name]
        del self.load.lora_adapters[:]
        self.load.lora_adapters.extend([*kept, loaded] if loaded is not None else kept)

    async def poll(self, timeout: float) -> None:
        """Refresh load and health; never raises."""
        changes = self._num_lora_changes
        try:
            load, health = await asyncio.gather(
                self.stub.GetLoad(common_pb2.LoadRequest(), timeout=timeout),
                self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout))
        except grpc.aio.AioRpcError as e:
            # A server busy enough to answer a poll late is still serving: only several late answers
            # in a row count. A refused connection or any other error counts at once.
            self.num_late_polls = self.num_late_polls + 1 if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else 0
            if not 0 < self.num_late_polls < _LATE_POLLS_TOLERATED:
                self.set_unhealthy(f"{e.code().name}: {e.details()}")
            return
        self.num_late_polls = 0
        if changes != self._num_lora_changes and self.load is not None:  # answered before a load or unload
            del load.lora_adapters[:]
            load.lora_adapters.extend(self.load.lora_adapters)
        self.load = load
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            self.set_unhealthy(f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}")
            return
        if not self.is_healthy:
            logger.info("%s server %s is healthy (%d/%d KV blocks used)", self.role, self.address,
                        load.kv_blocks_used, load.kv_blocks_total)
        self.is_healthy, self.error, self.has_been_healthy = True, None, True

    def set_unhealthy(self, reason: str) -> None:
        if not self.has_been_healthy:  # loading, or not started yet: see the module docstring
            waited = time.monotonic() - self.added_at
            if self._load_logged == 0:
                logger.info("waiting for %s server %s to load", self.role, self.address)
                self._load_logged = 1
            if self._load_logged == 1 and waited >= self.load_warning_s:
                logger.warning("%s server %s is still not serving %.0f s after the gateway found it: %s", self.role,
                               self.address, waited, reason)
                self._load_logged = 2
        elif self.is_healthy or self.error != reason:
            logger.warning("%s server %s is unhealthy: %s", self.role, self.address, reason)
        self.is_healthy, self.error = False, reason

    def to_json(self) -> dict[str, Any]:
        """The /cluster entry of this instance."""
        load = self.load or common_pb2.LoadInfo()
        return {"role": self.role, "address": self.address, "metrics_url": load.metrics_url,
                "healthy": self.is_healthy, "num_running": load.num_running, "num_waiting": load.num_waiting,
                "kv_blocks_used": load.kv_blocks_used, "kv_blocks_total": load.kv_blocks_total,
                "error": self.error, "draining": self.is_draining, "num_in_flight": self.num_in_flight,
                "max_loras": load.max_loras, "draft_model": load.draft_model or None,
                "lora_adapters": [{"name": a.name, "in_slot": a.in_slot, "fingerprint": a.fingerprint}
                                  for a in load.lora_adapters]}

    async def close(self) -> None:
        await self.channel.close()


Listener = Callable[[Instance], None]


class InstanceRegistry:
    """Owns every Instance (routable ones in ``prefill``/``decode``, removed
    ones in ``draining``) and the background poll task."""

    def __init__(self, prefill: Iterable[str] = (), decode: Iterable[str] = (), poll_interval: float = 0.5,
                 poll_timeout: float = 1.0) -> None:
        self.prefill = [Instance(PREFILL, a) for a in prefill]
        self.decode = [Instance(DECODE, a) for a in decode]
        self.draining: list[Instance] = []
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[tuple[Listener, Listener]] = []

    def add_listener(self, on_added: Listener, on_removed: Listener) -> None:
        """Call ``on_added(instance)`` / ``on_removed(instance)`` as routing gains or loses one."""
        self._listeners.append((on_added, on_removed))

    async def set_addresses(self, role: str, addresses: Iterable[str]) -> None:
        """Make ``addresses`` the routable ``role`` servers: new ones are
        added (and polled before this returns, once polling has started),
        missing ones drain."""
        active = self.prefill if role == PREFILL else self.decode
        wanted = list(dict.fromkeys(addresses))
        for inst in [i for i in active if i.address not in wanted]:
            active.remove(inst)
            inst.is_draining = True
            self.draining.append(inst)
            logger.info("%s server %s removed from routing; draining %d in-flight request(s)", role,
                        inst.address, inst.num_in_flight)
            for _, on_removed in self._listeners:
                on_removed(inst)
        known = {i.address for i in active}
        added = []
        for address in wanted:
            if address in known:
                continue
            inst = next((i for i in self.draining if i.role == role and i.address == address), None)
            if inst is not None:
                self.draining.remove(inst)
                inst.is_draining = False
            else:
                inst = Instance(role, address)
            active.append(inst)
            added.append(inst)
            logger.info("%s server %s added", role, address)
            for on_added, _ in self._listeners:
                on_added(inst)
        if added and self._task is not None:
            await asyncio.gather(*(i.poll(self.poll_timeout) for i in added))

    def drop_drained(self) -> None:
        """Forget removed instances this gateway has no requests on any more."""
        for inst in [i for i in self.draining if i.num_in_flight == 0]:
            self.draining.remove(inst)
            logger.info("%s server %s drained", inst.role, inst.address)

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.prefill + self.decode)

    @property
    def has_healthy_decode(self) -> bool:
        return any(i.is_healthy for i in self.decode)

    async def start(self) -> None:
        """Poll once (so routing starts informed), then keep polling in the background."""
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name="instance-poller")

    async def poll_once(self, instances: Iterable[Instance] | None = None) -> None:
        """Poll ``instances`` (default: every routable one) now."""
        await asyncio.gather(*(i.poll(self.poll_timeout) for i in (self if instances is None else instances)))

    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
                self.drop_drained()
            except Exception:  # a bug in polling must not stop polling
                logger.exception("instance poll failed")
            await asyncio.sleep(max(0.0, self.poll_interval - (time.monotonic() - started)))

    def to_json(self) -> dict[str, Any]:
        """The /cluster body."""
        return {"instances": [i.to_json() for i in [*self, *self.draining]]}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.gather(*(i.close() for i in [*self, *self.draining]), return_exceptions=True)
