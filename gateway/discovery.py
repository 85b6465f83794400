"""Where the gateway finds its engine servers, kept current while it runs.

``--prefill`` and ``--decode`` each take a comma-separated list of entries
(validated in gateway/config.py)::

    HOST:PORT        a fixed server
    dns:NAME:PORT    every address NAME resolves to (A/AAAA records: a Kubernetes headless
                     Service, a docker compose service scaled to several containers), each at PORT
    redis            every live server of that role registered in the Redis at --redis-url (engine
                     servers started with the same --redis-url register themselves)

Entries mix freely (``--decode dns:pdserve-decode:50071,10.0.0.7:50071``).
Every ``--discovery-interval`` seconds each dynamic entry is looked up again
and the registry is given the union per role (``InstanceRegistry.set_addresses``):
new servers join routing at once, servers gone from the answer leave routing
and drain (their in-flight requests finish; see gateway/instances.py). A
look-up that fails (DNS timeout, Redis down) keeps that entry's last answer,
so a resolver hiccup never empties the cluster; a name that does not exist
(NXDOMAIN: a headless Service with no ready pods) is an empty answer.

Redis registrations: engine servers keep their instance ids
(``address#nonce``) in ``pdserve:{ns}:alive`` with a heartbeat, and the
namespaces in ``pdserve:namespaces`` (rpc/prefix_index.py). The gateway takes
the fresh ids of the namespaces of its own served model name, and asks each
new id's server which tier it is: its health service knows
``pdserve.v1.Prefill`` or ``pdserve.v1.Decode`` and not the other. A server
that stops heartbeating (or leaves on SIGTERM) drops out within
``ALIVE_TTL_S``.

Redis outages: a look-up that fails keeps the last answer (above), and is
reported to the gateway's ``RedisStatus`` (one warning line per outage, shared
with the prefix index) instead of a line of its own. A Redis that comes back
empty (restarted: its ``run_id`` changed) has lost every registration until the
servers' next heartbeat: for ``ALIVE_TTL_S`` after the restart is seen, the
servers found before it are kept beside those registered again, so a restart
never drains a live server.

``resolve_host`` is the only place names are resolved; tests replace it.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import DNS_PREFIX, REDIS_ENTRY, join_host_port
from gateway.instances import DECODE, PREFILL, InstanceRegistry
from gateway.redis_status import RedisStatus, redis_client
from pdserve.v1 import engine_pb2
from rpc import tls
from rpc.prefix_index import ALIVE_TTL_S, NAMESPACES_KEY, address_of, alive_key, namespace_model

logger = logging.getLogger(__name__)

SERVICE_OF_ROLE = {PREFILL: engine_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
                   DECODE: engine_pb2.DESCRIPTOR.services_by_name["Decode"].full_name}
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def _slow(exc: BaseException) -> bool:
    """A Redis call that timed out (its server may be up, the host loaded)."""
    import redis

    return isinstance(exc, (redis.TimeoutError, asyncio.TimeoutError, TimeoutError))


def resolve_host(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to, as HOST:PORT (the system resolver:
    /etc/hosts, then DNS). A name that does not exist resolves to nothing;
    other failures raise OSError."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _NO_SUCH_NAME:
            return []
        raise
    return sorted({join_host_port(info[4][0], port) for info in infos})


class Discovery:
    """Owns the look-ups and the refresh task; the registry owns the instances."""

    def __init__(self, registry: InstanceRegistry, prefill: Iterable[str], decode: Iterable[str],
                 interval: float = 5.0, redis_url: str | None = None, model_name: str = "",
                 probe_timeout: float = 1.0, redis_status: RedisStatus | None = None) -> None:
        self.registry = registry
        self.redis_status = redis_status  # reports Redis look-ups (their failures log there)
        self.entries = {PREFILL: tuple(prefill), DECODE: tuple(decode)}
        self.interval = interval
        self.probe_timeout = probe_timeout
        self._last: dict[str, list[str]] = {}  # entry -> its last successful answer
        self._warned: set[str] = set()  # entries whose failure was logged (once, until they answer)
        self._redis = RedisRegistrations(redis_url, model_name) if any(
            REDIS_ENTRY in e for e in self.entries.values()) else None
        self._task: asyncio.Task[None] | None = None

    @property
    def is_dynamic(self) -> bool:
        return any(e.startswith(DNS_PREFIX) or e == REDIS_ENTRY for es in self.entries.values() for e in es)

    async def start(self) -> None:
        """Look everything up once (the registry then knows every server),
        then again every ``interval`` seconds if any entry is dynamic."""
        await self.refresh()
        if self.is_dynamic:
            self._task = asyncio.create_task(self._refresh_forever(), name="discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._redis is not None:
            await self._redis.close()

    async def refresh(self) -> None:
        """One round: every entry's answer, handed to the registry per role."""
        registered = await self._lookup(REDIS_ENTRY, self._redis.lookup) if self._redis else None
        for role, entries in self.entries.items():
            addresses: list[str] = []
            for entry in entries:
                if entry == REDIS_ENTRY:
                    addresses += (registered or {}).get(role, [])
                elif entry.startswith(DNS_PREFIX):
                    name, _, port = entry[len(DNS_PREFIX):].rpartition(":")
                    addresses += await self._lookup(entry, lambda: _resolve(name, int(port))) or []
                else:
                    addresses.append(entry)
            await self.registry.set_addresses(role, addresses)

    async def _lookup(self, entry: str, lookup):
        status = self.redis_status if entry == REDIS_ENTRY else None
        started = time.monotonic()
        try:
            answer = await lookup()
        except Exception as exc:  # the resolver's or Redis's failure: keep the last answer
            if status is not None and _slow(exc):
                # Redis answered late (a loaded host), not an outage: its probe decides those
                logger.debug("discovery: Redis did not answer in time (%s); keeping its last answer", exc)
            elif status is not None:
                status.failed(exc, started)
            elif entry not in self._warned:
                logger.warning("discovery: looking up %s failed (%s); keeping its last answer %s", entry,
                               exc or type(exc).__name__, self._last.get(entry, "(none)"))
                self._warned.add(entry)
            return self._last.get(entry)
        if status is not None:
            status.answered(started)
        if entry in self._warned:
            logger.info("discovery: %s answers again", entry)
            self._warned.discard(entry)
        self._last[entry] = answer
        return answer

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop discovery
                logger.exception("discovery round failed")


async def _resolve(name: str, port: int) -> list[str]:
    return await asyncio.get_running_loop().run_in_executor(None, resolve_host, name, port)


class RedisRegistrations:
    """The live engine servers of one served model in the Redis the engine
    servers publish to, by role."""

    def __init__(self, url: str | None, model_name: str, timeout_s: float = 1.0) -> None:
        if not url:
            raise ValueError("discovery from Redis needs --redis-url")
        self.model_name = model_name
        self._redis = redis_client(url, timeout_s)
        self._roles: dict[str, str] = {}  # instance id -> role (asked once per id)
        self._timeout_s = timeout_s
        self._skipped: set[str] = set()  # namespaces of other models (logged once)
        self._run_id: str | None = None  # the Redis server's, as of the last look-up
        self._last: dict[str, list[str]] = {PREFILL: [], DECODE: []}  # the last answer
        self._kept: dict[str, list[str]] = {}  # found before a restart of Redis, kept until...
        self._kept_until = 0.0  # ... this time.monotonic()

    async def close(self) -> None:
        await self._redis.aclose()

    async def lookup(self) -> dict[str, list[str]]:
        """The live servers by role (and, for ``ALIVE_TTL_S`` after Redis restarted, those
        found before it)."""
        run_id = (await self._redis.info("server")).get("run_id")
        if self._run_id is not None and run_id != self._run_id:
            kept = self._kept if time.monotonic() < self._kept_until else {}
            self._kept = {role: list(dict.fromkeys([*kept.get(role, []), *addrs])) for role, addrs in self._last.items()}
            self._kept_until = time.monotonic() + ALIVE_TTL_S
            logger.info("discovery: Redis restarted; keeping the %d server(s) found before until they register "
                        "again", sum(map(len, self._kept.values())))
        self._run_id = run_id
        out = await self._registered()
        self._last = {role: list(addrs) for role, addrs in out.items()}
        if time.monotonic() < self._kept_until:
            for role, addrs in self._kept.items():
                out[role] += [a for a in addrs if a not in out[role]]
        return out

    async def _registered(self) -> dict[str, list[str]]:
        fresh = time.time() - ALIVE_TTL_S
        namespaces = [ns.decode() for ns in await self._redis.zrangebyscore(NAMESPACES_KEY, fresh, "+inf")]
        mine = [ns for ns in namespaces if namespace_model(ns) == self.model_name]
        for ns in set(namespaces) - set(mine) - self._skipped:
            logger.info("discovery: Redis namespace %s is another model's (this gateway serves %s)", ns,
                        self.model_name)
            self._skipped.add(ns)
        pipe = self._redis.pipeline(transaction=False)
        for ns in mine:
            pipe.zrangebyscore(alive_key(ns), fresh, "+inf")
        ids = sorted({i.decode() for members in await pipe.execute() for i in members})
        unknown = [i for i in ids if i not in self._roles]
        for iid, role in zip(unknown, await asyncio.gather(*(probe_role(address_of(i), self._timeout_s)
                                                              for i in unknown))):
            if role is not None:
                self._roles[iid] = role
        self._roles = {i: r for i, r in self._roles.items() if i in ids}  # forget ids gone from Redis
        out: dict[str, list[str]] = {PREFILL: [], DECODE: []}
        for iid in ids:
            if iid in self._roles and address_of(iid) not in out[self._roles[iid]]:
                out[self._roles[iid]].append(address_of(iid))  # a restarted server may briefly have two ids
        return out


async def probe_role(address: str, timeout: float) -> str | None:
    """Which tier the server at ``address`` is (None: it did not answer)."""
    channel = tls.aio_channel(address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for role, service in SERVICE_OF_ROLE.items():
            try:
                await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                return role
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    logger.debug("discovery: %s did not say its role: %s", address, e.code().name)
                    return None
        logger.warning("discovery: %s is registered in Redis but serves neither tier", address)
        return None
    finally:
        await channel.close()
