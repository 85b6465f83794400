"""The host KV tier (--kv-offloading-size, engine/kv_offload.py): blocks the device cache
evicts are copied to host memory and a prefix hit there loads them back, bit for bit."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.kv_cache_groups import build_layout
from engine.kv_cache_manager import KVCacheManager
from engine.kv_offload import HostKVTier
from engine.request import Request
from rpc.engine_metrics import _SchedulerCollector
from tests.engine.families import make_family_model, random_prompts

BS = 4  # block size of the engine tests


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("offload") / "qwen3", "qwen3", seed=3)


def _llm(model, device_blocks: int, host_blocks: int = 0, **kw) -> LLM:
    # The tiny model's block: 3 layers x K,V x 4 tokens x 2 heads x 16 x 4 bytes (a power of two
    # of GiB times it is exact in a float).
    block_bytes = 3 * 2 * BS * 2 * 16 * 4
    extra = dict(kv_offloading_size=host_blocks * block_bytes / 2**30) if host_blocks else {}
    return LLM(str(model), block_size=BS, num_gpu_blocks_override=device_blocks, max_num_batched_tokens=64,
               dtype="float32", **extra, **kw)  # float32 on CUDA too: the block bytes above


def _greedy(llm: LLM, prompts, max_tokens: int = 6):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def _hashes(llm: LLM, prompt: list[int], n: int) -> list[int]:
    kv = llm.engine.scheduler.kv
    r = Request("probe", list(prompt), SamplingParams())
    out = kv._block_hashes(r, n)
    kv.req_hashes.pop("probe", None)
    return out


def _assert_no_leaks(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert not kv._host_hits
    if kv.host is not None:
        kv.host.check()
        assert kv.host.num_used_blocks <= kv.host.num_blocks
        assert kv.host.num_pending_copies == 0


def test_evicted_prefix_reloads_from_host_exactly(model):
    """A long prompt's blocks leave the device cache for the host tier under other prompts; the
    same prompt again hits there: its blocks come back bit for bit, counted as cached tokens
    (host hits), and its greedy tokens are those of the uncached run."""
    llm = _llm(model, device_blocks=16, host_blocks=64)
    prompt, *others = random_prompts([40, 40, 40, 40], seed=11)
    first = _greedy(llm, [prompt])[0]
    assert first.num_cached_tokens == 0
    kv, host = llm.engine.scheduler.kv, llm.engine.host_kv
    hashes = _hashes(llm, prompt, 9)  # the hit covers (40 - 1) // 4 full blocks
    fresh = [llm.engine.runner.kv_cache[:, kv.pool.cached[h].block_id].to("cpu", copy=True) for h in hashes]
    for p in others:  # each fills the device cache: the prompt's blocks are evicted to the host
        _greedy(llm, [p])
    assert not any(h in kv.pool.cached for h in hashes)
    assert all(h in host for h in hashes)
    assert host.stored_blocks_total >= len(hashes)
    assert host.loaded_blocks_total == 0
    for h, want in zip(hashes, fresh):  # the host copy is the device block as computed
        assert torch.equal(host.buffer[host._lru[h]].cpu(), want)

    again = _greedy(llm, [prompt])[0]
    assert again.num_cached_tokens == 36
    assert host.loaded_blocks_total == 9  # every hit came from the host tier
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    for h, want in zip(hashes, fresh):  # loaded back and registered as device blocks again
        assert torch.equal(llm.engine.runner.kv_cache[:, kv.pool.cached[h].block_id].cpu(), want)
    s = llm.engine.stats()
    assert (s.host_kv_loaded_total, s.host_kv_hit_tokens_total) == (9, 36)
    assert s.host_kv_stored_total == host.stored_blocks_total > 0
    assert s.prefix_hits_total == 36
    assert s.prefix_hits_by_source == {"device": 0, "host": 36, "disk": 0}
    families = list(_SchedulerCollector(llm.engine, {"role": "t"}).collect())
    metrics = {m.name: m.samples[0].value for m in families}
    assert metrics["pdserve:kv_offload_loaded_blocks"] == 9
    # vLLM's names: the device cache's hits, the tiers behind it (its connectors'), all, per source.
    assert (metrics["pdserve:prefix_cache_hits"], metrics["pdserve:external_prefix_cache_hits"],
            metrics["pdserve:prompt_tokens_cached"]) == (0, 36, 36)
    assert metrics["pdserve:external_prefix_cache_queries"] == metrics["pdserve:prefix_cache_queries"] == 5 * 40
    by_source = next(m for m in families if m.name == "pdserve:prompt_tokens_cached_by_source")
    assert {x.labels["source"]: x.value for x in by_source.samples} == {"device": 0, "host": 36, "disk": 0}
    assert metrics["pdserve:kv_offload_stored_blocks"] == host.stored_blocks_total
    assert metrics["pdserve:kv_offload_host_usage_perc"] == host.num_used_blocks / 64
    _assert_no_leaks(llm)


def test_host_bound_holds_under_overflow_and_nothing_leaks(model):
    """Far more evicted blocks than the host tier holds: it keeps its bound, drops the least
    recently used, its accounting stays whole; requests that finish, are aborted or take host
    hits leave no block held in either tier, and hits still give the uncached tokens."""
    llm = _llm(model, device_blocks=12, host_blocks=8)
    prompts = random_prompts([20] * 8, seed=21)
    want = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]  # 8 x 5 blocks through 12 device blocks
    host = llm.engine.host_kv
    assert llm.engine.scheduler.num_preemptions_total > 0  # (preempted requests give their blocks back too)
    assert host.num_used_blocks == host.num_blocks == 8
    assert host.dropped_blocks_total > 0
    assert host.stored_blocks_total > host.num_blocks
    host.check()
    assert not any(h in host for h in _hashes(llm, prompts[0], 4))  # the oldest went first
    # Hits in the host tier (a prompt evicted late) give the same tokens.
    loaded = host.loaded_blocks_total
    outs = [_greedy(llm, [p])[0] for p in prompts[-3:]]  # (the first: all four blocks in the host tier)
    assert [o.outputs[0].token_ids for o in outs] == want[-3:]
    assert host.loaded_blocks_total >= loaded + 4
    assert all(o.num_cached_tokens == 16 for o in outs)
    # An aborted request (a cached prefix, mid-prompt) gives everything back.
    req = llm.engine.add_request("aborted", prompts[-1] + [7] * 16, SamplingParams(max_tokens=4))
    llm.engine.step()
    llm.engine.abort_request(req.request_id)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _assert_no_leaks(llm)


def test_off_by_default(model):
    """Without the flag: no host tier, no eviction hook, no offload stats; the CLI flag parses."""
    llm = _llm(model, device_blocks=12)
    assert llm.engine.host_kv is None and llm.engine.config.cache.kv_offloading_size == 0
    kv = llm.engine.scheduler.kv
    assert kv.host is None and kv.pool.on_evict is None
    _greedy(llm, random_prompts([20] * 4, seed=5))
    s = llm.engine.stats()
    assert (s.host_kv_blocks_total, s.host_kv_stored_total, s.host_kv_loaded_total) == (0, 0, 0)
    families = {m.name: m for m in _SchedulerCollector(llm.engine, {"role": "t"}).collect()}
    assert not any("kv_offload" in name or "external_prefix_cache" in name for name in families)
    by_source = {x.labels["source"]: x.value for x in families["pdserve:prompt_tokens_cached_by_source"].samples}
    assert by_source == {"device": s.prefix_hits_total, "host": 0, "disk": 0}
    _assert_no_leaks(llm)
    ns = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--model", "m", "--kv-offloading-size", "2.5"])
    assert EngineArgs.from_cli_args(ns).kv_offloading_size == 2.5


def test_cache_groups_and_linear_state_are_refused():
    two = build_layout(["sliding_attention", "full_attention"], [8, None], BS)
    tier = HostKVTier(4, (1, 2, BS, 1, 2), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="one KV cache group only"):
        KVCacheManager(16, BS, layout=two).attach_host_tier(tier)
    linear = build_layout(["full_attention", "linear_attention"], [None, None], BS)
    with pytest.raises(ValueError, match="linear-attention"):
        KVCacheManager(16, BS, layout=linear, num_state_slots=2).attach_host_tier(tier)


def test_stores_of_an_allocation_never_take_its_host_hits():
    """A full host tier whose every block a request hits: the device blocks its allocation
    evicts are not stored over them (dropped instead), and the loads read what was stored."""
    kv = KVCacheManager(4, BS)
    tier = HostKVTier(2, (1, 1, BS), torch.float32, torch.device("cpu"))
    kv.attach_host_tier(tier)
    cache = torch.arange(4 * BS, dtype=torch.float32).view(1, 4, 1, BS)  # [slots, blocks, 1, BS]
    a = Request("a", list(range(9)), SamplingParams(max_tokens=1))  # 2 full blocks
    kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    a_blocks = kv.get_block_ids("a")[:2]
    a_slots = kv.req_hashes["a"][BS][:2]
    kv.free(a)
    b = Request("b", list(range(100, 116)), SamplingParams(max_tokens=1))  # evicts a's 2 blocks
    kv.allocate_slots(b, 16)
    tier.flush(cache)
    stored = tier.buffer.clone()
    a_slots = [tier._lru[h] for h in a_slots]  # a's blocks, in order, in the host tier
    assert tier.num_used_blocks == 2
    assert all(torch.equal(stored[s], cache[:, b]) for s, b in zip(a_slots, a_blocks))
    kv.cache_blocks(b, 16)
    kv.free(b)
    cache.add_(1000)  # what b wrote over a's blocks
    a2 = Request("a2", list(range(9)), SamplingParams(max_tokens=1))
    hits, n = kv.get_computed_blocks(a2)
    assert n == 8 and hits == [[]]  # both from the host tier
    # its 3 blocks evict 3 of b's cached ones: the host is full and pinned, so they are dropped
    new = kv.allocate_slots(a2, 1, hits)
    assert new is not None and len(new) == 3
    tier.flush(cache)
    tier.check()
    assert torch.equal(tier.buffer, stored)
    assert all(torch.equal(cache[:, b.block_id], stored[s]) for s, b in zip(a_slots, new))
    kv.free(a2)
    assert kv.pool.num_free_blocks == 4


def test_a_prefill_tier_request_takes_its_prefix_from_the_host_tier(model):
    """The prefill tier's path (``add_prefill_request``: compute the prompt, hold its blocks for
    the KV send): a prompt whose prefix went to the host tier loads it back instead of
    computing it, and the blocks held for the send are those of a fresh computation, bit for bit."""
    llm = _llm(model, device_blocks=16, host_blocks=64)
    engine = llm.engine
    prompt, *others = random_prompts([40, 40, 40, 40], seed=12)

    def prefill(rid: str):
        req = engine.add_prefill_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4))
        while req.request_id not in engine.scheduler.held:
            engine.step()
        kv = engine.runner.kv_cache[:, engine.get_block_ids(rid)].clone()
        engine.release_after_send(rid)
        return req, kv

    first, fresh = prefill("p0")
    assert first.num_cached_tokens == 0
    for p in others:  # the prompt's blocks leave the device cache for the host tier
        _greedy(llm, [p])
    again, loaded = prefill("p1")
    assert again.num_cached_tokens == 36 and engine.host_kv.loaded_blocks_total == 9
    assert again.output_token_ids == first.output_token_ids
    assert torch.equal(loaded[:, :9], fresh[:, :9])  # the prefix's blocks, as computed the first time
    while engine.has_unfinished_requests():
        engine.step()
    _assert_no_leaks(llm)
