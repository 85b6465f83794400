"""Which engine server holds how much of a prompt's prefix: the gateway's
view of the cluster's prefix caches, for KV-aware routing.

One interface, two backends:

- ``RedisPrefixIndex`` reads what the engine servers publish to Redis (key
  scheme in ``rpc/prefix_index.py``): one pipelined round trip per request
  under a tight timeout. Every gateway replica sees the same picture. When
  Redis does not answer, matches are empty (routing falls back to load), a
  warning is logged once, and Redis is tried again after a pause.
- ``MemoryPrefixIndex`` follows each engine server's ``CacheEvents.Watch``
  stream and keeps the same sets in this process (``pdserve up`` without
  ``--redis-url``). A server whose stream breaks counts as holding nothing
  until it is followed again (from a fresh snapshot).

A match is the number of leading full blocks of the prompt an instance
holds, by the engine's own rule: at most ``(n - 1) // block_size`` blocks
(the last prompt token is always computed) and only an unbroken prefix.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import grpc

from engine.block_hash import hash_request_blocks
from gateway.instances import Instance
from pdserve.v1 import engine_pb2, engine_pb2_grpc
from rpc.prefix_index import ALIVE_TTL_S, address_of, alive_key, block_key

logger = logging.getLogger(__name__)
_REDIS_RETRY_S = 1.0


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the blocks a prefix-cache hit can cover
    (CPU-bound, ~1 µs a block: run it off the event loop)."""
    num_blocks = (len(token_ids) - 1) // block_size
    return hash_request_blocks(token_ids[:num_blocks * block_size], block_size)


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


class MemoryPrefixIndex:
    def __init__(self, instances: Iterable[Instance], retry_s: float = 1.0) -> None:
        self._instances = list(instances)
        self._blocks: dict[str, set[int]] = {}  # address -> hashes it holds now
        self._namespace: dict[str, str] = {}
        self._retry_s = retry_s
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(i), name=f"prefix-follow-{i.address}")
                       for i in self._instances]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

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


class RedisPrefixIndex:
    def __init__(self, url: str, timeout_s: float = 0.01) -> None:
        import redis.asyncio as aredis
        import redis as sync_redis

        self.url = url
        self._redis = aredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors = (sync_redis.RedisError, OSError, asyncio.TimeoutError)
        self._timeout_s = timeout_s
        self._retry_at = 0.0
        self._down = False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        await self._redis.aclose()

    async def match(self, namespace: str, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes or time.monotonic() < self._retry_at:
            return {}
        try:
            pipe = self._redis.pipeline(transaction=False)
            for h in hashes:
                pipe.smembers(block_key(namespace, h))
            pipe.zrangebyscore(alive_key(namespace), time.time() - ALIVE_TTL_S, "+inf")
            # The client's socket timeout bounds each read; this bounds the whole round trip.
            *holders, alive = await asyncio.wait_for(pipe.execute(), max(4 * self._timeout_s, 0.05))
        except self._errors as exc:
            if not self._down:
                logger.warning("prefix index: Redis at %s did not answer (%s); routing by load alone until "
                               "it does", self.url, exc or type(exc).__name__)
                self._down = True
            self._retry_at = time.monotonic() + _REDIS_RETRY_S
            return {}
        if self._down:
            logger.info("prefix index: Redis at %s answers again", self.url)
            self._down = False
        ids = [i.decode() for i in alive]
        counts = leading_matches(({m.decode() for m in members} for members in holders), ids)
        by_address: dict[str, int] = {}
        for iid, n in counts.items():  # a restarted server may briefly have two live ids
            addr = address_of(iid)
            by_address[addr] = max(by_address.get(addr, 0), n)
        return by_address
