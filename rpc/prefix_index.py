"""The cluster's prefix-cache index in Redis: the key scheme both sides use,
and the engine server's publisher.

Keys (``ns`` = the engines' cache namespace: model, block size, KV dtype)::

    pdserve:{ns}:b:{block_hash}   SET of instance ids holding that full block in their device cache
                                  (expires a day after its last addition: entries of dead instances
                                  do not pile up)
    pdserve:{ns}:h:{block_hash}   SET of instance ids holding it in their host tier
                                  (``--kv-offloading-size``), expiring alike
    pdserve:{ns}:alive            ZSET instance id -> time of its last heartbeat
    pdserve:{ns}:i:{instance_id}  a key with a short TTL, re-set by every heartbeat; finding it gone
                                  means Redis lost our entries (restarted, flushed): publish again
    pdserve:namespaces            ZSET ns -> time of the last heartbeat of any server in it: how a
                                  gateway that discovers its servers here (``--decode redis``)
                                  finds the namespaces of its model without scanning every key

An instance id is ``address#nonce`` and a new nonce starts every
publication epoch (each start, each re-publication after Redis came
back, and each snapshot after the engine's events were lost, since what
those events evicted is still listed under the old id): a reader counts
only ids whose heartbeat is fresh, so a dead or restarted server is never
credited with blocks it no longer holds, and its entries stop counting
within ``ALIVE_TTL_S``.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Callable

from rpc.cache_feed import HOST, QueueConsumer

if TYPE_CHECKING:
    from rpc.cache_feed import CacheEventFeed

logger = logging.getLogger(__name__)

ALIVE_TTL_S = 5.0  # a heartbeat older than this does not count
HEARTBEAT_S = 1.0
BLOCK_KEY_TTL_S = 24 * 3600
_CHUNK = 1000  # commands per pipeline round trip for big snapshots


def block_key(ns: str, block_hash: int) -> str:
    return f"pdserve:{ns}:b:{block_hash}"


def host_block_key(ns: str, block_hash: int) -> str:
    return f"pdserve:{ns}:h:{block_hash}"


def alive_key(ns: str) -> str:
    return f"pdserve:{ns}:alive"


def epoch_key(ns: str, instance_id: str) -> str:
    return f"pdserve:{ns}:i:{instance_id}"


def address_of(instance_id: str) -> str:
    return instance_id.rsplit("#", 1)[0]


NAMESPACES_KEY = "pdserve:namespaces"


def namespace_model(ns: str) -> str:
    """The served model name of a cache namespace (``model:block_size:kv_dtype``)."""
    return ns.rsplit(":", 2)[0]


class RedisIndexPublisher:
    """Engine server side: mirrors this server's prefix cache into Redis from
    a thread of its own (never the engine thread: that only hands over each
    step's events). Survives Redis outages: warns once, then re-publishes
    everything under a new epoch when Redis answers again."""

    def __init__(self, url: str, feed: CacheEventFeed, submit: Callable, timeout_s: float = 1.0) -> None:
        import redis

        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors = (redis.RedisError, OSError)
        self.url, self.feed, self._submit = url, feed, submit
        self.instance_id = ""
        self._consumer: QueueConsumer | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefix-index-publisher", daemon=True)
        self.num_published = 0  # batches written (tests and logs)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:  # leave at once rather than after the TTL
            if self.instance_id:
                self._redis.zrem(alive_key(self.feed.namespace), self.instance_id)
        except self._errors:
            pass
        if self._consumer is not None and self._consumer.sub is not None:
            self.feed.unsubscribe(self._consumer.sub)

    def _run(self) -> None:
        down = False
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                fresh = self._consumer is None or self._consumer.sub is None or self._consumer.sub.closed
                if fresh:
                    self._new_epoch()
                batch = self._consumer.get(timeout=0.1)  # type: ignore[union-attr]
                renamed = ""
                if batch is not None and batch.snapshot and not fresh:
                    # Events were lost (the feed re-snapshots): what they evicted is still in
                    # Redis under this id. The snapshot goes under a new id; the old one leaves.
                    renamed, self.instance_id = self.instance_id, self._new_instance_id()
                pipe = self._redis.pipeline(transaction=False)
                ns, iid = self.feed.namespace, self.instance_id
                if batch is not None:
                    self._write(batch.hashes, batch.stored, batch.tiers)
                    self.num_published += 1
                beat = fresh or renamed or time.monotonic() >= next_beat
                if beat:
                    pipe.set(epoch_key(ns, iid), 1, ex=int(ALIVE_TTL_S), get=True)
                    if renamed:  # before the new id counts: never both credited at once
                        pipe.zrem(alive_key(ns), renamed)
                    pipe.zadd(alive_key(ns), {iid: time.time()})
                    pipe.zremrangebyscore(alive_key(ns), "-inf", time.time() - 60 * ALIVE_TTL_S)
                    pipe.zadd(NAMESPACES_KEY, {ns: time.time()})
                    pipe.zremrangebyscore(NAMESPACES_KEY, "-inf", time.time() - 60 * ALIVE_TTL_S)
                    previous = pipe.execute()[0]
                    next_beat = time.monotonic() + HEARTBEAT_S
                    if previous is None and not (fresh or renamed):  # Redis lost our entries: publish them again
                        logger.warning("prefix index: Redis at %s lost this server's entries; publishing again",
                                       self.url)
                        self._drop_epoch()
                if down:
                    logger.info("prefix index: Redis at %s is reachable again", self.url)
                    down = False
            except self._errors as exc:
                if not down:
                    logger.warning("prefix index: Redis at %s unreachable (%s); serving goes on, the index "
                                   "is published again when it returns", self.url, exc)
                    down = True
                self._drop_epoch()
                self._stop.wait(1.0)

    def _new_epoch(self) -> None:
        """Subscribe afresh (a snapshot first) under a new instance id."""
        old = self.instance_id
        self.instance_id = self._new_instance_id()
        consumer = QueueConsumer()
        consumer.sub = self._submit(lambda e: self.feed.subscribe(e, consumer.deliver)).result(30)
        self._consumer = consumer
        if old:
            self._redis.zrem(alive_key(self.feed.namespace), old)

    def _new_instance_id(self) -> str:
        return f"{self.feed.address}#{uuid.uuid4().hex[:8]}"

    def _drop_epoch(self) -> None:
        if self._consumer is not None and self._consumer.sub is not None:
            self.feed.unsubscribe(self._consumer.sub)
        self._consumer = None

    def _write(self, hashes: list[int], stored: list[bool], tiers: list[int]) -> None:
        ns, iid = self.feed.namespace, self.instance_id
        for start in range(0, len(hashes), _CHUNK):
            pipe = self._redis.pipeline(transaction=False)
            for h, s, t in zip(hashes[start:start + _CHUNK], stored[start:start + _CHUNK],
                               tiers[start:start + _CHUNK]):
                key = host_block_key(ns, h) if t == HOST else block_key(ns, h)
                if s:
                    pipe.sadd(key, iid)
                    pipe.expire(key, BLOCK_KEY_TTL_S)
                else:
                    pipe.srem(key, iid)
            pipe.execute()
