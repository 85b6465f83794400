"""The prefix index with two tiers (device cache, host tier) and the router that weighs them.

The index gives, per instance, the engine's own hit: the leading run of blocks in its device
cache, then the run in its host tier from there (``TierMatch``). The same holdings give the
same answer from the in-memory index and from the Redis script (a real Redis server). The
router prefers an instance holding a prompt's prefix on device over one holding it on host,
and either over one holding none, through either index; a host hit counts at
``HOST_HIT_CREDIT`` of a device hit against queued work."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis as sync_redis

from gateway.instances import InstanceRegistry
from gateway.prefix_index import MemoryPrefixIndex, RedisPrefixIndex, TierMatch, prompt_block_hashes
from gateway.router import HOST_HIT_CREDIT, Router, in_flight
from pdserve.v1 import common_pb2, engine_pb2
from rpc.cache_feed import DEVICE, HOST
from rpc.local_redis import LocalRedis
from rpc.prefix_index import alive_key, block_key, host_block_key
from tests.processes import free_port

NS = "m:16:float32"


@pytest.fixture(scope="module")
def redis_url():
    server = LocalRedis(port=free_port()).start()
    yield server.url
    server.close()


def _memory(holdings: dict[str, tuple[list[int], list[int]]]) -> MemoryPrefixIndex:
    """An in-memory index fed one snapshot per address: (device hashes, host hashes)."""
    index = MemoryPrefixIndex([])
    for addr, (device, host) in holdings.items():
        index.apply(addr, engine_pb2.CacheEventBatch(
            cache_namespace=NS, snapshot=True, hashes=device + host, stored=[True] * (len(device) + len(host)),
            tiers=[DEVICE] * len(device) + [HOST] * len(host)))
    return index


def _redis(url: str, holdings: dict[str, tuple[list[int], list[int]]]) -> None:
    """The same holdings written as the engine servers' publishers write them."""
    r = sync_redis.Redis.from_url(url)
    r.flushall()
    for addr, (device, host) in holdings.items():
        iid = f"{addr}#n1"
        for h in device:
            r.sadd(block_key(NS, h), iid)
        for h in host:
            r.sadd(host_block_key(NS, h), iid)
        r.zadd(alive_key(NS), {iid: time.time()})


async def _tiers(index, hashes, ns=NS) -> dict[str, TierMatch]:
    return await index.match_tiers(ns, hashes)


# Who holds which of the blocks 11..15 (in prompt order), (device, host).
HOLDINGS = {"dev:1": ([11, 12, 13, 14, 15], []),       # all on device
            "host:1": ([], [11, 12, 13, 14, 15]),      # all on host
            "mix:1": ([11, 12], [13, 14, 99]),         # device, then host from the first device miss
            "both:1": ([11, 12, 14], [11, 13, 14]),    # 13 only on host: the run goes on there; 14 on both
            "gap:1": ([11, 13, 14], [12]),             # back on device after the host run: not counted
            "late:1": ([12, 13], [14])}                # not the first block: nothing
CASES = [([11, 12, 13, 14, 15], {"dev:1": TierMatch(5, 0), "host:1": TierMatch(0, 5), "mix:1": TierMatch(2, 2),
                                 "both:1": TierMatch(2, 2), "gap:1": TierMatch(1, 1)}),
         ([11, 12], {"dev:1": TierMatch(2, 0), "host:1": TierMatch(0, 2), "mix:1": TierMatch(2, 0),
                     "both:1": TierMatch(2, 0), "gap:1": TierMatch(1, 1)}),
         ([13, 14], {"dev:1": TierMatch(2, 0), "host:1": TierMatch(0, 2), "mix:1": TierMatch(0, 2),
                     "both:1": TierMatch(0, 2), "gap:1": TierMatch(2, 0), "late:1": TierMatch(1, 1)}),
         ([98, 11], {})]


def test_both_tiers_match_alike_in_memory_and_in_redis(redis_url):
    async def go():
        memory = _memory(HOLDINGS)
        _redis(redis_url, HOLDINGS)
        redis_index = RedisPrefixIndex(redis_url, timeout_s=1.0)
        try:
            for hashes, want in CASES:
                for index in (memory, redis_index):
                    assert await _tiers(index, hashes) == want, (type(index).__name__, hashes)
                    assert await index.match(NS, hashes) == {a: m.total for a, m in want.items()}
            assert await _tiers(memory, [11], ns="other:16:float32") == {}
            assert await _tiers(redis_index, [11], ns="other:16:float32") == {}
            # Events per tier: host:1 drops 12 from its host tier, dev:1 evicts 13 to its host tier.
            memory.apply("host:1", engine_pb2.CacheEventBatch(hashes=[12], stored=[False], tiers=[HOST]))
            memory.apply("dev:1", engine_pb2.CacheEventBatch(hashes=[13, 13], stored=[False, True],
                                                             tiers=[DEVICE, HOST]))
            r = sync_redis.Redis.from_url(redis_url)
            r.srem(host_block_key(NS, 12), "host:1#n1")
            r.srem(block_key(NS, 13), "dev:1#n1")
            r.sadd(host_block_key(NS, 13), "dev:1#n1")
            for index in (memory, redis_index):
                got = await _tiers(index, [11, 12, 13, 14])
                assert got["host:1"] == TierMatch(0, 1) and got["dev:1"] == TierMatch(2, 1), got
            assert memory.num_blocks("dev:1") == 4 and memory.num_host_blocks("dev:1") == 1
            assert memory.num_host_blocks("nobody:1") is None
            # A batch without tiers is the device's (a server without a host tier sends none).
            memory.apply("late:1", engine_pb2.CacheEventBatch(hashes=[11], stored=[True]))
            assert (await _tiers(memory, [11, 12]))["late:1"] == TierMatch(2, 0)
        finally:
            await redis_index.close()
    asyncio.run(go())


def _set(inst, running: int = 0) -> None:
    inst.is_healthy = True
    inst.load = common_pb2.LoadInfo(num_running=running, kv_blocks_total=100, cache_namespace=NS, block_size=16)


PROMPT = list(range(100, 164))  # 64 tokens: 3 blocks of 16 can be prefix hits ((64 - 1) // 16)


def test_the_router_prefers_device_over_host_and_either_over_none(redis_url):
    """Three prefill servers, equal load: ``dev`` holds the prompt's 3 blocks on device,
    ``host`` the same on host, ``none`` nothing. Through the in-memory index and through
    Redis: dev wins; without dev, host; the credit of a host hit holds against queued work
    (host beats none by ``HOST_HIT_CREDIT`` of the hit's tokens); decode servers alike."""
    hashes = prompt_block_hashes(PROMPT, 16)
    holdings = {"dev:1": (hashes, []), "host:1": ([], hashes)}

    async def go(index):
        reg = InstanceRegistry(("none:1", "host:1", "dev:1"), ("d1:1",))
        for inst in reg:
            _set(inst)
        none, host, dev = reg.prefill
        router = Router(reg, index)
        route, _ = await router.route(PROMPT)
        assert route.prefill is dev and route.reason == "prefix"
        assert route.cached_tokens(dev) == 48 and route.host_cached_tokens(dev) == 0
        assert route.cached_tokens(host) == 48 and route.host_cached_tokens(host) == 48
        assert router.routed_cached_tokens == {"device": 48, "host": 0}
        route, _ = await router.route(PROMPT, exclude_prefill=["dev:1"])
        assert route.prefill is host and route.reason == "prefix"
        assert router.routed_cached_tokens == {"device": 48, "host": 48}
        # Queued work against the credit: host computes 64 - 0.99 * 48 = 16.48 tokens' worth.
        saved = HOST_HIT_CREDIT * 48
        with in_flight(host, tokens=int(saved) - 1):
            assert (await router.route(PROMPT, exclude_prefill=["dev:1"]))[0].prefill is host
        with in_flight(host, tokens=int(saved) + 1):
            assert (await router.route(PROMPT, exclude_prefill=["dev:1"]))[0].prefill is none
        # ... and dev's full credit beats host's by the load-back cost: 48 * (1 - credit) tokens.
        with in_flight(dev, tokens=1):
            assert (await router.route(PROMPT))[0].prefill is host
        assert (await router.route(PROMPT))[0].prefill is dev
        await reg.close()

    async def decode(index):
        """Decode servers, no prefill tier: the same order."""
        reg = InstanceRegistry((), ("none:1", "host:1", "dev:1"))
        for inst in reg:
            _set(inst, running=1)
        router = Router(reg, index)
        picks = [(await router.route(PROMPT, exclude))[0].decode.address
                 for exclude in ((), ("dev:1",), ("dev:1", "host:1"))]
        assert picks == ["dev:1", "host:1", "none:1"]
        await reg.close()

    async def both():
        memory = _memory(holdings)
        _redis(redis_url, holdings)
        redis_index = RedisPrefixIndex(redis_url, timeout_s=1.0)
        try:
            for index in (memory, redis_index):
                await go(index)
                await decode(index)
        finally:
            await redis_index.close()
    asyncio.run(both())


def test_an_index_without_tiers_counts_every_hit_as_device():
    """An index that has only ``match`` (no tiers) is credited in full, as before."""
    class Plain:
        async def match(self, namespace, hashes):
            return {"p2:2": 3}

    async def go():
        reg = InstanceRegistry(("p1:1", "p2:2"), ("d1:1",))
        for inst in reg:
            _set(inst)
        route, _ = await Router(reg, Plain()).route(PROMPT)
        assert route.prefill.address == "p2:2" and route.cached_tokens(route.prefill) == 48
        assert route.host_cached_tokens(route.prefill) == 0
        await reg.close()
    asyncio.run(go())


def test_the_host_hit_credit_is_checked():
    async def go():
        reg = InstanceRegistry((), ("d1:1",))
        with pytest.raises(ValueError, match="host hit credit"):
            Router(reg, host_hit_credit=1.5)
        await reg.close()
    asyncio.run(go())


def test_a_decode_server_holding_the_prefix_on_host_prefills_locally():
    """Conditional disaggregation (``--local-prefill-threshold``): the tokens a decode server
    would compute are the prompt less its hit in both tiers. Its host tier holds the prompt's 3
    blocks: 16 tokens left, under a threshold of 20, so it prefills itself; with the prefix in
    no tier of it, 64 are left and the prefill tier does it."""
    hashes = prompt_block_hashes(PROMPT, 16)

    async def go(holdings, want_reason):
        reg = InstanceRegistry(("p1:1",), ("d1:1",))
        for inst in reg:
            _set(inst)
        route, _ = await Router(reg, _memory(holdings), local_prefill_threshold=20).route(PROMPT)
        await reg.close()
        assert route.reason == want_reason, route
        return route

    async def both():
        route = await go({"d1:1": ([], hashes)}, "local")
        assert route.prefill is None and route.host_cached_tokens(route.decode) == 48
        route = await go({"p1:1": ([], hashes)}, "prefix")  # on the prefill server's host tier
        assert route.prefill.address == "p1:1"
    asyncio.run(both())
