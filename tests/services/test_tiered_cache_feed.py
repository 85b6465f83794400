"""An engine's prefix-cache feed with a host tier (--kv-offloading-size), into both indexes: a
prompt's blocks are credited on device, then on host once other prompts evicted them there,
then on device again once a hit loaded them back; the in-memory index (fed the gRPC batches)
and Redis (fed by the publisher; a real Redis server) agree at each stage. The gateway's router
over that index counts what it expected cached per tier (its /metrics counter and /cluster
agree), and the engine's metrics count the hit by the tier it came from."""
from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from gateway.instances import InstanceRegistry
from gateway.metrics import GatewayMetrics
from gateway.prefix_index import MemoryPrefixIndex, TierMatch, prompt_block_hashes
from gateway.router import Router
from gateway.service import GatewayService
from gateway.tokenization import InputProcessor
from pdserve.v1 import common_pb2
from rpc.cache_feed import CacheEventFeed
from rpc.engine_metrics import _SchedulerCollector
from rpc.local_redis import LocalRedis
from rpc.prefix_index import RedisIndexPublisher
from tests.processes import free_port, wait_for
from tests.services.index_calls import index_call

ADDR = "127.0.0.1:1"
# The tiny model's block: 3 layers x K,V x 16 tokens x 2 KV heads x 16 x 4 bytes.
BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4


def _tiers(index, ns, hashes) -> dict[str, TierMatch]:
    return index_call(index, "match_tiers", ns, hashes)


@pytest.fixture(scope="module")
def redis_url():
    server = LocalRedis(port=free_port()).start()
    yield server.url
    server.close()


def _gateway_metrics(text: str) -> dict[str, float]:
    """pdserve:gateway_routed_cached_tokens_total by tier, from a /metrics body."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^pdserve:gateway_routed_cached_tokens_total\{model_name="m",tier="(\w+)"\} (\S+)$', text, re.M)}


def _engine_hits(engine: LLMEngine) -> dict[str, float]:
    """The engine server's prefix-hit counters: vLLM's names, and the per-source series."""
    return {s.name + (f"/{s.labels['source']}" if "source" in s.labels else ""): s.value
            for family in _SchedulerCollector(engine, {"role": "prefill"}).collect() for s in family.samples
            if "prefix_cache" in s.name or "prompt_tokens_cached" in s.name}


def test_a_prefix_moves_device_host_device_in_both_indexes(tiny_llama_dir, default_model_dir, redis_url):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), num_gpu_blocks_override=8,
                                                   max_model_len=128, kv_offloading_size=32 * BLOCK_BYTES / 2**30))
    assert engine.host_kv is not None and engine.host_kv.num_blocks == 32
    ns = engine.cache_namespace
    engine_thread = ThreadPoolExecutor(1)  # the engine and the feed: one thread, as in a server
    feed = CacheEventFeed(ADDR, ns)
    memory = MemoryPrefixIndex([])
    # The gRPC stream's batches, as the gateway's in-memory index applies them.
    engine_thread.submit(lambda: feed.subscribe(engine, lambda b: memory.apply(
        ADDR, b.to_proto(feed.instance_id, ns)))).result()
    publisher = RedisIndexPublisher(redis_url, feed, lambda fn: engine_thread.submit(fn, engine))

    def run(prompt: list[int]) -> int:
        req = engine.add_request(str(time.monotonic_ns()), prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            feed.publish(engine)
        return req.num_cached_tokens

    prompts = [[3 + (7 * i + k) % 370 for i in range(65)] for k in range(3)]  # 4 matchable blocks each
    a = prompt_block_hashes(prompts[0], 16)
    # The gateway's service and router over the in-memory index: one prefill server (the engine),
    # on an event loop of this test's own (gRPC's aio channels take the current loop when made;
    # an earlier test's asyncio.run leaves none set in this thread).
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    registry = InstanceRegistry((ADDR,), ("127.0.0.1:2",))
    for inst in registry:
        inst.is_healthy = True
        inst.load = common_pb2.LoadInfo(kv_blocks_total=8, cache_namespace=ns, block_size=16)
    inputs = InputProcessor(load_tokenizer(default_model_dir), "m", max_model_len=128, vocab_size=384)
    service = GatewayService(inputs, registry, GatewayMetrics("m"), request_timeout=10, log_requests=False,
                             router=Router(registry, memory))

    def route(prompt: list[int]) -> dict[str, float]:
        """Route ``prompt``: the gateway's counter by tier, /metrics and /cluster alike."""
        assert loop.run_until_complete(service.router.route(prompt))[0].prefill.address == ADDR
        counted = _gateway_metrics(service.metrics.render().decode())
        assert counted == service.cluster_json()["routed_cached_tokens"]
        return counted

    publisher.start()
    try:
        def stage(want: TierMatch) -> None:
            assert _tiers(memory, ns, a) == {ADDR: want}
            wait_for(lambda: _tiers(redis_url, ns, a) == {ADDR: want}, f"Redis to hold {want}", 20.0)

        assert _gateway_metrics(service.metrics.render().decode()) == {"device": 0, "host": 0}
        assert engine_thread.submit(run, prompts[0]).result() == 0
        stage(TierMatch(4, 0))
        assert route(prompts[0]) == {"device": 64, "host": 0}
        for p in prompts[1:]:  # 5 blocks each of 8: prompt 0's leave the device for the host
            engine_thread.submit(run, p).result()
        stage(TierMatch(0, 4))
        assert memory.num_host_blocks(ADDR) >= 4
        assert route(prompts[0]) == {"device": 64, "host": 64}  # the router expects a host hit ...
        before = _engine_hits(engine)
        assert engine_thread.submit(run, prompts[0]).result() == 64  # ... loaded back from the host
        after = _engine_hits(engine)
        moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        assert moved == {"pdserve:prefix_cache_queries_total": 65, "pdserve:external_prefix_cache_queries_total": 65,
                         "pdserve:external_prefix_cache_hits_total": 64, "pdserve:prompt_tokens_cached_total": 64,
                         "pdserve:prompt_tokens_cached_by_source_total/host": 64}
        stage(TierMatch(4, 0))  # (on both now: the device counts)
    finally:
        publisher.stop()
        engine_thread.shutdown()
        engine.close()
        inputs.close()
        loop.run_until_complete(registry.close())
        asyncio.set_event_loop(None)
        loop.close()


def test_the_host_tier_reports_what_enters_and_leaves_it():
    """Stores, the LRU's drops, a bounded buffer; nothing before the first snapshot."""
    import torch

    from engine.kv_offload import HostKVTier

    host = HostKVTier(2, (1, 2, 4), torch.float32, torch.device("cpu"))
    host.offload(1, 0)
    assert host.take_events() == ([], False)  # not recording yet
    assert host.snapshot() == [1]
    host.offload(2, 1)
    host.offload(1, 2)  # here already: only touched
    host.offload(3, 3)  # full: 2, the least recently used, leaves
    assert host.take_events() == ([(True, 2), (False, 2), (True, 3)], False)
    host.events.restart(1)  # a one-event buffer from here
    host.offload(4, 0)
    host.offload(5, 1)
    assert host.take_events() == ([(True, 5)], True)  # overflowed: only a snapshot is exact
    assert host.snapshot() == [4, 5] and host.take_events() == ([], False)
