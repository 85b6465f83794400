"""The prefix index's matching and its freshness, against a real Redis server
and real engines: a partial prefix and a gap in the middle give the same
answer from the Redis script and from the in-memory index; a re-snapshot
after lost events un-credits what those events evicted; a server killed with
SIGKILL is credited with nothing, at once in memory (its watch stream broke)
and after the heartbeat cutoff in Redis."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis as sync_redis

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from gateway.instances import DECODE, Instance
from gateway.prefix_index import MemoryPrefixIndex, RedisPrefixIndex, prompt_block_hashes
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from rpc.cache_feed import CacheEventFeed
from rpc.local_redis import LocalRedis
from rpc.prefix_index import ALIVE_TTL_S, RedisIndexPublisher, alive_key, block_key
from tests.processes import EngineServer, free_port, wait_for
from tests.services.index_calls import index_call

pytestmark = pytest.mark.slow

NS = "m:16:float32"


@pytest.fixture(scope="module")
def redis_server():
    server = LocalRedis(port=free_port()).start()
    yield server
    server.stop()


def _match(index, hashes, ns=NS) -> dict[str, int]:
    return index_call(index, "match", ns, hashes)


# Who holds which of the blocks 11, 12, 13, 14 (in prompt order).
HOLDINGS = {"a:1": [11, 12, 13],  # a partial prefix: 3 of 4
            "b:1": [11, 13, 14],  # a gap in the middle: only the first counts
            "c:1": [12, 13, 14]}  # not the first block: nothing
CASES = [([11, 12, 13, 14], {"a:1": 3, "b:1": 1}),
         ([11, 12], {"a:1": 2, "b:1": 1}),
         ([13, 14], {"a:1": 1, "b:1": 2, "c:1": 2}),
         ([99, 11], {})]


def test_partial_prefix_and_gap_in_the_redis_script_and_the_memory_index(redis_server):
    memory = MemoryPrefixIndex([])
    for addr, held in HOLDINGS.items():
        memory.apply(addr, engine_pb2.CacheEventBatch(cache_namespace=NS, snapshot=True, hashes=held))
    r = sync_redis.Redis.from_url(redis_server.url)
    r.flushall()
    now = time.time()
    for addr, held in HOLDINGS.items():
        for h in held:
            r.sadd(block_key(NS, h), f"{addr}#n1")
        r.zadd(alive_key(NS), {f"{addr}#n1": now})
    # A server whose heartbeat is past the cutoff holds every block and counts for nothing.
    for h in (11, 12, 13, 14):
        r.sadd(block_key(NS, h), "d:1#n1")
    r.zadd(alive_key(NS), {"d:1#n1": now - ALIVE_TTL_S - 1})
    redis_index = redis_server.url
    for hashes, want in CASES:
        assert _match(memory, hashes) == want, hashes
        assert _match(redis_index, hashes) == want, hashes
    assert _match(memory, [11, 12], ns="other:16:float32") == {}
    # An eviction in the middle of a's run cuts it there, in both.
    memory.apply("a:1", engine_pb2.CacheEventBatch(hashes=[12], stored=[False]))
    r.srem(block_key(NS, 12), "a:1#n1")
    for index in (memory, redis_index):
        assert _match(index, [11, 12, 13, 14]) == {"a:1": 1, "b:1": 1}


def test_a_resnapshot_after_lost_events_uncredits_what_they_evicted(tiny_llama_dir, redis_server):
    """Events lost in the engine (its buffer overflowed) are replaced by a snapshot. In
    Redis that snapshot must replace this server's entries, not add to them: the blocks
    evicted meanwhile are no longer held."""
    sync_redis.Redis.from_url(redis_server.url).flushall()
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), num_gpu_blocks_override=8,
                                                   max_model_len=128))
    ns = engine.cache_namespace
    engine_thread = ThreadPoolExecutor(1)  # the engine, the feed and the snapshot: one thread, as in a server
    feed = CacheEventFeed("127.0.0.1:1", ns)
    publisher = RedisIndexPublisher(redis_server.url, feed, lambda fn: engine_thread.submit(fn, engine))
    index = redis_server.url

    def run(prompt: list[int]) -> None:
        engine.add_request(str(time.monotonic_ns()), prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            feed.publish(engine)

    prompts = [[3 + (7 * i + k) % 370 for i in range(65)] for k in range(3)]  # 4 matchable blocks each
    hashes = [prompt_block_hashes(p, 16) for p in prompts]
    publisher.start()
    try:
        engine_thread.submit(run, prompts[0]).result()
        wait_for(lambda: _match(index, hashes[0], ns) == {"127.0.0.1:1": 4}, "the index to hold 4 blocks", 20.0)

        def lose_events():  # the buffer holds one event from now on: every step overflows it
            engine.scheduler.kv.pool._max_events = 1
            run(prompts[1])
            run(prompts[2])
            engine.scheduler.kv.pool._max_events = 65536
            return set(engine.scheduler.kv.pool.cached)
        cached = engine_thread.submit(lose_events).result()
        assert not set(hashes[0]) & cached and set(hashes[2]) <= cached  # prompt 0's blocks were evicted
        wait_for(lambda: _match(index, hashes[2], ns) == {"127.0.0.1:1": 4}, "the index to hold 4 blocks", 20.0)
        assert _match(index, hashes[0], ns) == {}
    finally:
        publisher.stop()
        engine_thread.shutdown()


def test_a_killed_server_is_credited_with_nothing(tiny_llama_dir, redis_server):
    """SIGKILL: the server removes nothing itself. The memory index drops it when its watch
    stream breaks; Redis stops counting it at the heartbeat cutoff."""
    sync_redis.Redis.from_url(redis_server.url).flushall()
    server = EngineServer("decode", ["--model", str(tiny_llama_dir), "--num-gpu-blocks-override", "64",
                                     "--redis-url", redis_server.url])
    try:
        server.wait_ready()
        prompt = [5 + (i * 11) % 370 for i in range(50)]  # 3 matchable blocks
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        list(engine_pb2_grpc.DecodeStub(server.channel).Generate(engine_pb2.DecodeRequest(
            request_id="p", prompt_token_ids=prompt, sampling=sampling, remote_prefill=False), timeout=60))
        ns = server.load().cache_namespace
        hashes = prompt_block_hashes(prompt, 16)
        held = {server.address: 3}

        async def follow_then_kill():
            memory = MemoryPrefixIndex([Instance(DECODE, server.address)], retry_s=0.1)
            await memory.start()
            try:
                seen = await _poll(lambda: memory.match(ns, hashes), held)
                server.proc.kill()
                server.proc.wait()
                return seen, await _poll(lambda: memory.match(ns, hashes), {})
            finally:
                await memory.close()
        assert asyncio.run(follow_then_kill()) == (held, {})
        listed = sync_redis.Redis.from_url(redis_server.url).smembers(block_key(ns, hashes[0]))
        assert [i.decode().split("#")[0] for i in listed] == [server.address]  # its entries stay in Redis...
        redis_index = redis_server.url
        # ... and stop counting once its last heartbeat is older than the cutoff.
        wait_for(lambda: _match(redis_index, hashes, ns) == {}, "the index to forget the instance", ALIVE_TTL_S + 10)
    finally:
        if server.proc.poll() is None:
            server.stop()


async def _poll(match, want, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while (got := await match()) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return got


def test_a_started_redis_index_has_connected_and_loaded_its_script(redis_server):
    """The first request after a gateway starts finds the match script already in Redis: it
    does not pay loading it (and connecting) inside its own 10 ms bound, and miss it."""
    sync = sync_redis.Redis.from_url(redis_server.url)
    sync.script_flush()

    async def start_and_look():
        index = RedisPrefixIndex(redis_server.url)  # the gateway's default bound
        try:
            await index.start()
            return sync.script_exists(index._match.sha)
        finally:
            await index.close()
    assert asyncio.run(start_and_look()) == [True]
