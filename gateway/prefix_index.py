"""Which engine server holds how much of a prompt's prefix: the gateway's
view of the cluster's prefix caches, for KV-aware routing.

One interface, two backends:

- ``RedisPrefixIndex`` reads what the engine servers publish to Redis (key
  scheme in ``rpc/prefix_index.py``): one pipelined round trip per request
  under a tight timeout. Every gateway replica sees the same picture. When
  Redis is unreachable, matches are empty (routing falls back to load), one
  warning line is logged per outage and a gauge is set (``gateway/redis_status.py``,
  shared with discovery), and Redis is probed until it answers. The engine
  servers publish their blocks again when it does (a fresh, empty Redis too).
- ``MemoryPrefixIndex`` follows each engine server's ``CacheEvents.Watch``
  stream and keeps the same sets in this process (``pdserve up`` without
  ``--redis-url``). A server whose stream breaks counts as holding nothing
  until it is followed again (from a fresh snapshot). Given the registry, it
  follows servers added at run time and forgets removed ones at once.

A match is the number of leading full blocks of the prompt an instance
holds, by the engine's own rule: at most ``(n - 1) // block_size`` blocks
(the last prompt token is always computed) and only an unbroken prefix.
Blocks of a request under a LoRA adapter chain from the adapter's root hash
(``prompt_block_hashes(..., parent_hash=root_hash)``), so they never match the
base model's blocks nor another adapter's; the index itself does not care.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import grpc

from engine.block_hash import NONE_HASH, hash_request_blocks
from gateway.instances import Instance
from gateway.redis_status import RedisStatus
from pdserve.v1 import engine_pb2, engine_pb2_grpc
from rpc.prefix_index import ALIVE_TTL_S, address_of, alive_key, block_key

logger = logging.getLogger(__name__)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int = NONE_HASH) -> list[int]:
    """The chained hashes of the blocks a prefix-cache hit can cover
    (CPU-bound, ~1 µs a block: run it off the event loop). ``parent_hash`` is
    block 0's parent: ``NONE_HASH`` for the base model, the adapter's
    ``root_hash`` for a request under a LoRA adapter (as the engine hashes it)."""
    num_blocks = (len(token_ids) - 1) // block_size
    return hash_request_blocks(token_ids[:num_blocks * block_size], block_size, parent_hash=parent_hash)


def leading_matches(holders_per_block: Iterable[Iterable[str]], candidates: Iterable[str]) -> dict[str, int]:
    """For each candidate key, how many leading blocks it holds (0 omitted)."""
    alive, counts = set(candidates), {}
    for i, holders in enumerate(holders_per_block):
        alive &= set(holders)
        if not alive:
            break
        for key in alive:
            counts[key] = i + 1
    return counts


class PrefixIndex(Protocol):
    async def match(self, namespace: str, hashes: Sequence[int]) -> dict[str, int]:
        """Instance address -> leading blocks of ``hashes`` it holds."""
        ...

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    def to_json(self) -> dict[str, Any]:
        """The index in /cluster: its backend and, for Redis, whether it is reachable."""
        ...


class MemoryPrefixIndex:
    def __init__(self, instances: Iterable[Instance], retry_s: float = 1.0) -> None:
        self._instances = instances  # an InstanceRegistry (followed as it changes) or a fixed list
        self._blocks: dict[str, set[int]] = {}  # address -> hashes it holds now
        self._namespace: dict[str, str] = {}
        self._retry_s = retry_s
        self._tasks: dict[str, asyncio.Task] = {}  # address -> its follower

    async def start(self) -> None:
        for inst in self._instances:
            self.follow(inst)
        add_listener = getattr(self._instances, "add_listener", None)
        if add_listener is not None:
            add_listener(self.follow, self.unfollow)

    def follow(self, inst: Instance) -> None:
        if inst.address not in self._tasks:
            self._tasks[inst.address] = asyncio.create_task(self._follow(inst), name=f"prefix-follow-{inst.address}")

    def unfollow(self, inst: Instance) -> None:
        """Stop following ``inst`` and credit it with nothing."""
        task = self._tasks.pop(inst.address, None)
        if task is not None:
            task.cancel()
        self._blocks.pop(inst.address, None)
        self._namespace.pop(inst.address, None)

    def to_json(self) -> dict[str, Any]:
        return {"backend": "memory", "unreachable": False}

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, inst: Instance) -> None:
        stub = engine_pb2_grpc.CacheEventsStub(inst.channel)
        while True:
            try:
                async for batch in stub.Watch(engine_pb2.WatchCacheEventsRequest()):
                    self.apply(inst.address, batch)
            except grpc.aio.AioRpcError as exc:
                logger.debug("prefix index: following %s: %s", inst.address, exc.code().name)
            self._blocks.pop(inst.address, None)  # not followed: credit it with nothing
            await asyncio.sleep(self._retry_s)

    def num_blocks(self, address: str) -> int | None:
        """Full blocks ``address`` is credited with now; None while it is not followed
        (not yet, or its stream broke)."""
        held = self._blocks.get(address)
        return len(held) if held is not None else None

    def apply(self, address: str, batch: engine_pb2.CacheEventBatch) -> None:
        if batch.snapshot:
            self._blocks[address] = set(batch.hashes)
            self._namespace[address] = batch.cache_namespace
            return
        held = self._blocks.setdefault(address, set())
        for h, stored in zip(batch.hashes, batch.stored):
            if stored:
                held.add(h)
            else:
                held.discard(h)

    async def match(self, namespace: str, hashes: Sequence[int]) -> dict[str, int]:
        candidates = [a for a, ns in self._namespace.items() if ns == namespace and a in self._blocks]
        return leading_matches(((a for a in candidates if h in self._blocks[a]) for h in hashes), candidates)


# One round trip, one command: Redis walks the prompt's blocks in order and
# stops at the first block no live instance holds (the leading run is all that
# counts), so a long prompt costs the server a few set reads, not a pipeline of
# hundreds of replies to parse here.
# KEYS[1] = the live-instance ZSET, KEYS[2..] = block keys in prompt order;
# ARGV[1] = the oldest heartbeat that still counts. Returns id, n, id, n, ...
_MATCH_LUA = """
local live = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')) do live[id] = true end
local counts = {}
for i = 2, #KEYS do
  local next_live, any = {}, false
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[i])) do
    if live[id] then next_live[id] = true; counts[id] = i - 1; any = true end
  end
  if not any then break end
  live = next_live
end
local out = {}
for id, n in pairs(counts) do out[#out + 1] = id; out[#out + 1] = n end
return out
"""


class RedisPrefixIndex:
    """Matches read from Redis. Whether Redis is reachable is ``status``'s to say (shared with
    discovery; it probes on its own): while it is not, matches are empty at no cost and
    routing goes by load alone; a call that cannot connect starts the outage at once. A
    match that only times out is empty for that request (a slow answer under load is not an
    outage)."""

    def __init__(self, url: str, timeout_s: float = 0.01, status: RedisStatus | None = None) -> None:
        import redis.asyncio as aredis
        import redis as sync_redis

        self.url = url
        self.status = status or RedisStatus(url)
        self._owns_status = status is None
        self._redis = aredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._match = self._redis.register_script(_MATCH_LUA)
        self._errors = (sync_redis.RedisError, OSError)
        self._timeouts = (sync_redis.TimeoutError, asyncio.TimeoutError)
        self._timeout_s = timeout_s

    async def start(self) -> None:
        if self._owns_status:
            await self.status.start()

    async def close(self) -> None:
        if self._owns_status:
            await self.status.close()
        await self._redis.aclose()

    def to_json(self) -> dict[str, Any]:
        return {"backend": "redis", **self.status.to_json()}

    async def match(self, namespace: str, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes or self.status.is_unreachable:
            return {}
        keys = [alive_key(namespace), *(block_key(namespace, h) for h in hashes)]
        try:
            # The client's socket timeout bounds each read; this bounds the whole call.
            flat = await asyncio.wait_for(self._match(keys=keys, args=[time.time() - ALIVE_TTL_S]),
                                          max(4 * self._timeout_s, 0.05))
        except self._timeouts as exc:
            logger.debug("prefix index: Redis did not answer in time (%s); this request is routed by load",
                         exc or type(exc).__name__)
            return {}
        except self._errors as exc:
            self.status.failed(exc)
            return {}
        self.status.answered()
        by_address: dict[str, int] = {}
        for iid, n in zip(flat[::2], flat[1::2]):  # a restarted server may briefly have two live ids
            addr = address_of(iid.decode())
            by_address[addr] = max(by_address.get(addr, 0), int(n))
        return by_address
