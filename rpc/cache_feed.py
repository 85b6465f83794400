"""An engine server's prefix-cache feed: the full-block hashes entering and
leaving its caches, each with its tier (the device cache; the host tier,
``--kv-offloading-size``), fanned out to whoever indexes them (the Redis
publisher in this process, the gateways watching over gRPC).

    engine thread, after each step:  the device cache's events (engine.take_cache_events())
                                     and the host tier's (engine.host_kv.take_events()) -> every subscriber
    subscribe (in the engine thread): a snapshot of every cached hash in both, then the events after it

The two tiers are independent sets (a block loaded back from the host is on
both until one of them drops it), so a batch lists the device's events, then
the host's, each in order. Lost events in either tier replace the batch with a
snapshot of both. The disk tier (``--kv-offloading-path``) is not fed: see
docs/architecture.md, "Prefix index".

Nothing is recorded until the first subscription. A subscriber that falls
more than ``max_pending`` batches behind is dropped (its ``closed`` is set)
and must subscribe again, which starts it from a fresh snapshot; so nothing
here grows without bound.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import grpc

from pdserve.v1 import engine_pb2, engine_pb2_grpc

if TYPE_CHECKING:  # the gateway imports the key scheme next door and must not load the engine (torch)
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


DEVICE, HOST = engine_pb2.CACHE_TIER_DEVICE, engine_pb2.CACHE_TIER_HOST


@dataclass
class CacheBatch:
    snapshot: bool  # True: ``hashes`` is everything cached now, in every tier (all stored)
    hashes: list[int] = field(default_factory=list)
    stored: list[bool] = field(default_factory=list)
    tiers: list[int] = field(default_factory=list)  # DEVICE | HOST per hash

    def to_proto(self, instance_id: str, namespace: str) -> engine_pb2.CacheEventBatch:
        # (tiers left empty when every entry is the device's: what a reader without tiers expects)
        tiers = self.tiers if any(t != DEVICE for t in self.tiers) else []
        return engine_pb2.CacheEventBatch(instance_id=instance_id, cache_namespace=namespace,
                                          snapshot=self.snapshot, hashes=self.hashes, stored=self.stored,
                                          tiers=tiers)


def take_snapshot(engine: LLMEngine) -> CacheBatch:
    """Everything ``engine`` caches now, both tiers; each tier records its events from here."""
    device = engine.cache_snapshot()
    host = engine.host_kv.snapshot() if engine.host_kv is not None else []
    return CacheBatch(True, device + host, [True] * (len(device) + len(host)),
                      [DEVICE] * len(device) + [HOST] * len(host))


def take_events(engine: LLMEngine) -> CacheBatch | None:
    """What changed in both tiers since the last call or snapshot (None: nothing); a snapshot
    instead when either tier lost events."""
    events, lost = engine.take_cache_events()
    host_events: list[tuple[bool, int]] = []
    if engine.host_kv is not None:
        host_events, host_lost = engine.host_kv.take_events()
        lost = lost or host_lost
    if lost:
        return take_snapshot(engine)
    if not events and not host_events:
        return None
    both = events + host_events
    return CacheBatch(False, [h for _, h in both], [s for s, _ in both],
                      [DEVICE] * len(events) + [HOST] * len(host_events))


class Subscription:
    """One subscriber's pending batches; ``deliver`` is called in the engine thread."""

    def __init__(self, deliver: Callable[[CacheBatch], None], max_pending: int) -> None:
        self._deliver = deliver
        self.max_pending = max_pending
        self.num_pending = 0  # delivered, not yet consumed (engine thread adds, consumer subtracts)
        self.closed = False

    def deliver(self, batch: CacheBatch) -> bool:
        if self.closed or self.num_pending >= self.max_pending:
            self.closed = True
            return False
        self.num_pending += 1
        self._deliver(batch)
        return True

    def consumed(self) -> None:
        self.num_pending -= 1


class CacheEventFeed:
    def __init__(self, address: str, namespace: str, max_pending: int = 1024) -> None:
        # A new id on every start (and every re-publication): an index never
        # credits this server with blocks an earlier life of it held.
        self.address = address
        self.namespace = namespace
        self.instance_id = f"{address}#{uuid.uuid4().hex[:8]}"
        self.max_pending = max_pending
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()

    # ---- engine thread ---------------------------------------------------
    def subscribe(self, engine: LLMEngine, deliver: Callable[[CacheBatch], None]) -> Subscription:
        sub = Subscription(deliver, self.max_pending)
        self.publish(engine)  # the others get what is pending before the snapshot resets it
        sub.deliver(take_snapshot(engine))
        with self._lock:
            self._subs.append(sub)
        return sub

    def publish(self, engine: LLMEngine) -> None:
        """After a step: hand the step's cache events to every subscriber."""
        if not self._subs:
            return
        batch = take_events(engine)
        if batch is None:
            return
        with self._lock:
            self._subs = [s for s in self._subs if s.deliver(batch)]

    def unsubscribe(self, sub: Subscription) -> None:
        sub.closed = True
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)


class CacheEventsServicer(engine_pb2_grpc.CacheEventsServicer):
    """``pdserve.v1.CacheEvents``: the feed as a gRPC stream (one per watcher)."""

    name = "pdserve.v1.CacheEvents"

    def __init__(self) -> None:
        self.feed: CacheEventFeed | None = None
        self.submit: Callable | None = None  # runs a function in the engine thread, returns a future

    def attach(self, feed: CacheEventFeed, submit: Callable) -> None:
        self.feed, self.submit = feed, submit

    async def Watch(self, request: engine_pb2.WatchCacheEventsRequest, context: grpc.aio.ServicerContext):
        if self.feed is None or self.submit is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading")
        feed = self.feed
        aloop = asyncio.get_running_loop()
        batches: asyncio.Queue[CacheBatch] = asyncio.Queue()
        sub = await asyncio.wrap_future(self.submit(lambda e: feed.subscribe(
            e, lambda b: aloop.call_soon_threadsafe(batches.put_nowait, b))))
        try:
            while not sub.closed or not batches.empty():
                try:
                    batch = await asyncio.wait_for(batches.get(), 1.0)
                except asyncio.TimeoutError:
                    continue
                sub.consumed()
                yield batch.to_proto(feed.instance_id, feed.namespace)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "the watcher fell too far behind; watch again for a fresh snapshot")
        finally:
            feed.unsubscribe(sub)


class QueueConsumer:
    """A thread-side subscriber (the Redis publisher): batches in a queue."""

    def __init__(self) -> None:
        self.queue: "queue.Queue[CacheBatch]" = queue.Queue()
        self.sub: Subscription | None = None

    def deliver(self, batch: CacheBatch) -> None:
        self.queue.put(batch)

    def get(self, timeout: float) -> CacheBatch | None:
        try:
            batch = self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if self.sub is not None:
            self.sub.consumed()
        return batch
