"""Block pool and KV cache manager invariants on tiny configs: exact block
ids, ref counts, LRU order, prefix hits, no leaks."""
from __future__ import annotations

import pytest

from engine.block_hash import NONE_HASH, hash_block_tokens, hash_request_blocks
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_hash_is_chained_and_stable():
    a = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert a == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert a != hash_block_tokens(NONE_HASH, [1, 2, 3, 5])
    b = hash_block_tokens(a, [5, 6, 7, 8])
    assert b != hash_block_tokens(NONE_HASH, [5, 6, 7, 8])  # parent matters
    assert hash_request_blocks(list(range(1, 11)), 4) == [a, hash_block_tokens(a, [5, 6, 7, 8])]
    assert 0 <= a < 2**63


def test_free_queue_lru_order_and_eviction():
    pool = BlockPool(4)
    pool.subscribe_events()
    assert pool.free_queue.block_ids() == [0, 1, 2, 3]
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1)
    pool.cache_block(a, 111)
    pool.free_blocks([b, a])  # tail-first: b evicted before a
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    assert pool.get_cached_block(111) is a
    pool.touch([a])  # a prefix hit takes a free cached block out of the queue
    assert a.ref_cnt == 1 and pool.free_queue.block_ids() == [2, 3, 1]
    pool.free_blocks([a])
    got = pool.get_new_blocks(4)
    assert [g.block_id for g in got] == [2, 3, 1, 0]
    assert pool.get_cached_block(111) is None  # evicted when reused
    assert pool.take_events() == ([(True, 111), (False, 111)], False)


def test_the_event_feed_is_bounded_and_its_owner_clears_lost():
    """Past max_events the buffer is dropped and marked lost; take_events returns and clears
    the mark; a snapshot starts recording (if not yet), drops the buffer and clears it."""
    pool = BlockPool(8)
    assert pool.take_events() == ([], False)  # nothing recorded before a subscriber
    pool.subscribe_events(max_events=2)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i)
    assert pool.take_events() == ([(True, 102)], True)  # the third event found the buffer full
    assert pool.take_events() == ([], False)
    pool.cache_block(pool.get_new_blocks(1)[0], 103)
    pool.cache_block(pool.get_new_blocks(1)[0], 104)
    pool.cache_block(pool.get_new_blocks(1)[0], 105)  # lost again
    assert sorted(pool.snapshot()) == [100, 101, 102, 103, 104, 105]
    assert pool.take_events() == ([], False)  # the snapshot is exact: nothing before it, not lost
    fresh = BlockPool(4)
    assert fresh.snapshot() == [] and fresh.is_recording
    fresh.cache_block(fresh.get_new_blocks(1)[0], 7)
    assert fresh.take_events() == ([(True, 7)], False)


def test_double_free_is_caught():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError):
        pool.free_blocks([a])


def test_prefix_hit_shares_blocks_with_ref_counts():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r1 = _req("r1", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(r1) == ([[]], 0)  # per cache group: one group here
    assert [b.block_id for b in kv.allocate_slots(r1, 10)] == [0, 1, 2]
    kv.cache_blocks(r1, 10)
    r2 = _req("r2", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits[0]] == [0, 1] and n == 8
    new = kv.allocate_slots(r2, 3, hits)
    assert [b.block_id for b in new] == [3]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    kv.forget(r1)
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [1, 1, 0, 1]
    kv.forget(r2)
    assert kv.pool.num_free_blocks == 10
    # r2's blocks freed tail first, after r1's tail block 2:
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


def test_whole_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1 = _req("r1", list(range(8)))
    kv.allocate_slots(r1, 8)
    kv.cache_blocks(r1, 8)
    r2 = _req("r2", list(range(8)))
    hits, n = kv.get_computed_blocks(r2)
    assert n == 4 and [b.block_id for b in hits[0]] == [0]


def test_allocation_counts_free_cached_hits_and_fails_cleanly():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r1 = _req("r1", list(range(8)))
    kv.allocate_slots(r1, 8)
    kv.cache_blocks(r1, 8)
    kv.forget(r1)  # blocks 0, 1 are free but cached
    r2 = _req("r2", list(range(8)) + list(range(50, 58)))
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8
    # needs 2 more blocks; only 1 free block is not one of the hits
    assert kv.allocate_slots(r2, 8, hits) is None
    assert kv.pool.num_free_blocks == 3 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.get_block_ids("r2") == []
