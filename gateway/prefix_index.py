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
(the last prompt token is always computed) and only an unbroken prefix:
first the blocks in its device cache, then, from the first block not there,
those in its host tier (``--kv-offloading-size``), as
``KVCacheManager.get_computed_blocks`` continues a hit (``TierMatch``: a
block on the device after the first one missing there counts only if it is
on the host too). ``match_tiers`` gives both counts, ``match`` their sum.
Blocks of a request under a LoRA adapter chain from the adapter's root hash
(``prompt_block_hashes(..., parent_hash=root_hash)``), so they never match the
base model's blocks nor another adapter's; the index itself does not care.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import grpc

from engine.block_hash import NONE_HASH, hash_request_blocks
from gateway.instances import Instance
from gateway.redis_status import RedisStatus, redis_client
from pdserve.v1 import engine_pb2, engine_pb2_grpc
from rpc.cache_feed import HOST
from rpc.prefix_index import ALIVE_TTL_S, address_of, alive_key, block_key, host_block_key

logger = logging.getLogger(__name__)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int = NONE_HASH) -> list[int]:
    """The chained hashes of the blocks a prefix-cache hit can cover
    (CPU-bound, ~1 µs a block: run it off the event loop). ``parent_hash`` is
    block 0's parent: ``NONE_HASH`` for the base model, the adapter's
    ``root_hash`` for a request under a LoRA adapter (as the engine hashes it)."""
    num_blocks = (len(token_ids) - 1) // block_size
    return hash_request_blocks(token_ids[:num_blocks * block_size], block_size, parent_hash=parent_hash)


class TierMatch(NamedTuple):
    """The leading blocks of a prompt an instance holds: ``device`` in its device cache, then
    ``host`` more in its host tier."""
    device: int
    host: int

    @property
    def total(self) -> int:
        return self.device + self.host


def leading_tier_match(hashes: Sequence[int], device: Container[int], host: Container[int]) -> TierMatch:
    """The engine's rule: the run of ``hashes`` in ``device``, then the run in ``host`` after it."""
    d = 0
    while d < len(hashes) and hashes[d] in device:
        d += 1
    h = d
    while h < len(hashes) and hashes[h] in host:
        h += 1
    return TierMatch(d, h - d)


class PrefixIndex(Protocol):
    async def match(self, namespace: str, hashes: Sequence[int]) -> dict[str, int]:
        """Instance address -> leading blocks of ``hashes`` it holds (both tiers)."""
        ...

    async def match_tiers(self, namespace: str, hashes: Sequence[int]) -> dict[str, TierMatch]:
        """Instance address -> leading blocks of ``hashes`` it holds, per tier (none omitted)."""
        ...

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    def to_json(self) -> dict[str, Any]:
        """The index in /cluster: its backend and, for Redis, whether it is reachable."""
        ...


class MemoryPrefixIndex:
    def __init__(self, instances: Iterable[Instance], retry_s: float = 1.0) -> None:
        self._instances = instances  # an InstanceRegistry (followed as it changes) or a fixed list
        self._blocks: dict[str, set[int]] = {}  # address -> hashes in its device cache now
        self._host: dict[str, set[int]] = {}  # address -> hashes in its host tier now
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
        self._host.pop(inst.address, None)
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
            self._host.pop(inst.address, None)
            await asyncio.sleep(self._retry_s)

    def num_blocks(self, address: str) -> int | None:
        """Full blocks ``address`` is credited with in its device cache now; None while it is
        not followed (not yet, or its stream broke)."""
        held = self._blocks.get(address)
        return len(held) if held is not None else None

    def num_host_blocks(self, address: str) -> int | None:
        """Full blocks ``address`` is credited with in its host tier now; None as ``num_blocks``."""
        if address not in self._blocks:
            return None
        return len(self._host.get(address, ()))

    def apply(self, address: str, batch: engine_pb2.CacheEventBatch) -> None:
        # (a batch without tiers is all the device's: a server without a host tier sends none)
        tiers = batch.tiers or [0] * len(batch.hashes)
        if batch.snapshot:
            self._blocks[address] = {h for h, t in zip(batch.hashes, tiers) if t != HOST}
            self._host[address] = {h for h, t in zip(batch.hashes, tiers) if t == HOST}
            self._namespace[address] = batch.cache_namespace
            return
        device = self._blocks.setdefault(address, set())
        host = self._host.setdefault(address, set())
        for h, stored, t in zip(batch.hashes, batch.stored, tiers):
            held = host if t == HOST else device
            if stored:
                held.add(h)
            else:
                held.discard(h)

    async def match(self, namespace: str, hashes: Sequence[int]) -> dict[str, int]:
        return {a: m.total for a, m in (await self.match_tiers(namespace, hashes)).items()}

    async def match_tiers(self, namespace: str, hashes: Sequence[int]) -> dict[str, TierMatch]:
        out = {}
        for a, ns in self._namespace.items():
            if ns == namespace and a in self._blocks:
                m = leading_tier_match(hashes, self._blocks[a], self._host.get(a, ()))
                if m.total:
                    out[a] = m
        return out


# One round trip, one command: Redis walks the prompt's blocks in order and
# stops at the first block no live instance holds in a tier that still counts
# for it (the leading run is all that counts), so a long prompt costs the
# server a few set reads, not a pipeline of hundreds of replies to parse here.
# Each live instance is in its device run ('d') until a block is missing from
# its device set; from there on, in its host run ('h') while the blocks are in
# its host set (the engine's rule: ``leading_tier_match``). A block's host set
# is read only when some live instance is in its host run or misses the block
# on device (in a cluster without host hits, one read per block, as before).
# KEYS[1] = the live-instance ZSET, then per block in prompt order its device
# key and its host key; ARGV[1] = the oldest heartbeat that still counts.
# Returns id, device blocks, host blocks, id, ...
_MATCH_LUA = """
local live = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')) do live[id] = 'd' end
local dev, last = {}, {}
for i = 1, (#KEYS - 1) / 2 do
  local on_dev, on_host = {}, {}
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[2 * i])) do on_dev[id] = true end
  for id, run in pairs(live) do  -- the host set only where some instance may continue there
    if run == 'h' or not on_dev[id] then
      for _, hid in ipairs(redis.call('SMEMBERS', KEYS[2 * i + 1])) do on_host[hid] = true end
      break
    end
  end
  local any = false
  for id, run in pairs(live) do
    if run == 'd' and on_dev[id] then dev[id] = i; last[id] = i; any = true
    elseif on_host[id] then live[id] = 'h'; last[id] = i; any = true
    else live[id] = nil end
  end
  if not any then break end
end
local out = {}
for id, n in pairs(last) do
  local d = dev[id] or 0
  out[#out + 1] = id; out[#out + 1] = d; out[#out + 1] = n - d
end
return out
"""


class RedisPrefixIndex:
    """Matches read from Redis. Whether Redis is reachable is ``status``'s to say (shared with
    discovery; it probes on its own): while it is not, matches are empty at no cost and
    routing goes by load alone; a call that cannot connect starts the outage at once. A
    match that only times out is empty for that request (a slow answer under load is not an
    outage)."""

    def __init__(self, url: str, timeout_s: float = 0.01, status: RedisStatus | None = None) -> None:
        import redis as sync_redis

        self.url = url
        self.status = status or RedisStatus(url)
        self._owns_status = status is None
        self._redis = redis_client(url, timeout_s)
        self._match = self._redis.register_script(_MATCH_LUA)
        self._errors = (sync_redis.RedisError, OSError)
        self._timeouts = (sync_redis.TimeoutError, asyncio.TimeoutError)
        self._timeout_s = timeout_s

    async def start(self) -> None:
        if self._owns_status:
            await self.status.start()
        await self._warm_up()

    async def _warm_up(self, tries: int = 5) -> None:
        """Connect and load the match script now: the first request would otherwise pay both
        inside its own tight bound, miss it, and be routed by load alone. Redis down: the
        status says so; the first match connects then."""
        for _ in range(tries):
            try:
                await self._redis.script_load(_MATCH_LUA)
                return
            except (*self._errors, *self._timeouts):
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self._owns_status:
            await self.status.close()
        await self._redis.aclose()

    def to_json(self) -> dict[str, Any]:
        return {"backend": "redis", **self.status.to_json()}

    async def match(self, namespace: str, hashes: Sequence[int]) -> dict[str, int]:
        return {a: m.total for a, m in (await self.match_tiers(namespace, hashes)).items()}

    async def match_tiers(self, namespace: str, hashes: Sequence[int]) -> dict[str, TierMatch]:
        if not hashes or self.status.is_unreachable:
            return {}
        keys = [alive_key(namespace)]
        for h in hashes:
            keys += (block_key(namespace, h), host_block_key(namespace, h))
        started = time.monotonic()
        try:
            # The client's socket timeout bounds each read; this bounds the whole call.
            flat = await asyncio.wait_for(self._match(keys=keys, args=[time.time() - ALIVE_TTL_S]),
                                          max(4 * self._timeout_s, 0.05))
        except self._timeouts as exc:
            logger.debug("prefix index: Redis did not answer in time (%s); this request is routed by load",
                         exc or type(exc).__name__)
            return {}
        except self._errors as exc:
            self.status.failed(exc, started)
            return {}
        self.status.answered(started)
        by_address: dict[str, TierMatch] = {}
        for iid, d, h in zip(flat[::3], flat[1::3], flat[2::3]):  # a restarted server may briefly have two live ids
            addr, m = address_of(iid.decode()), TierMatch(int(d), int(h))
            if addr not in by_address or (m.total, m.device) > (by_address[addr].total, by_address[addr].device):
                by_address[addr] = m
        return by_address
