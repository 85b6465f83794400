"""Hybrid linear-attention models through the offline API: chunked prefill carries the state
across steps, prefix hits restore it from a snapshot (engine/linear_state_cache.py), preempted
requests recompute it, and every token is transformers' (float32, first difference only at a
tie). Tiny random Qwen3-Next / Qwen3.5 checkpoints written by transformers itself."""
from __future__ import annotations

import pytest

from engine.linear_state_cache import StateSnapshots
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, random_prompts
from tests.engine.test_qwen3_next import make_checkpoint

MAX_TOKENS = 10
SP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3-next", "qwen3.5"])
def hybrid(request, tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("hybrid") / request.param, request.param, seed=7)
    return d, hf_model(d)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("hybrid-one") / "qwen3-next", "qwen3-next", seed=7)
    return d, hf_model(d)


def _prompts():
    base = random_prompts([41], seed=3)[0]  # a shared prefix past five boundaries of 8
    return [base + t for t in random_prompts([5, 13, 2], seed=4)] + random_prompts([23], seed=5)


def test_prefix_hits_restore_the_state(hybrid):
    d, m = hybrid
    prompts = _prompts()
    want = hf_greedy(m, prompts, MAX_TOKENS)
    llm = LLM(str(d), block_size=4, max_num_batched_tokens=8, linear_state_snapshot_interval=8)
    outs = llm.generate(prompts[:1], SP) + llm.generate(prompts[1:], SP)
    assert_greedy_match(m, prompts, want, [o.outputs[0].token_ids for o in outs])
    # the prefix up to the last boundary with a snapshot (40 of 41 shared tokens) came from the cache
    assert [o.num_cached_tokens for o in outs] == [0, 40, 40, 0]
    kv = llm.engine.scheduler.kv
    assert kv.num_used_blocks == 0 and not kv.states.slot_of and len(kv.states.free) == 256


def test_without_snapshots_prompts_are_computed_whole(qwen3_next):
    d, m = qwen3_next
    prompts = _prompts()[:2]
    want = hf_greedy(m, prompts, MAX_TOKENS)
    llm = LLM(str(d), block_size=4, linear_state_snapshots=0)
    outs = llm.generate(prompts[:1], SP) + llm.generate(prompts[1:], SP)
    assert_greedy_match(m, prompts, want, [o.outputs[0].token_ids for o in outs])
    assert [o.num_cached_tokens for o in outs] == [0, 0]


def test_preempted_requests_recompute_their_state(hybrid):
    """Too few blocks for the batch: requests are preempted mid-decode and recompute (from a
    snapshot where one is kept); their slots go back and tokens stay transformers'."""
    d, m = hybrid
    prompts = random_prompts([30, 26, 33, 21], seed=9)
    want = hf_greedy(m, prompts, MAX_TOKENS)
    llm = LLM(str(d), block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=16,
              linear_state_snapshot_interval=8)
    outs = llm.generate(prompts, SP)
    assert_greedy_match(m, prompts, want, [o.outputs[0].token_ids for o in outs])
    s = llm.engine.scheduler
    assert s.num_preemptions_total > 0
    assert s.kv.num_used_blocks == 0 and not s.kv.states.slot_of


def test_chunks_end_on_snapshot_boundaries():
    snaps = StateSnapshots(first_slot=5, num_snapshots=2, interval=8)
    assert snaps.chunk_end(0, 100, 41) == 40  # the prompt's last boundary before its final token
    assert snaps.chunk_end(40, 1, 41) == 1
    assert snaps.chunk_end(0, 20, 41) == 16  # a middle chunk ends on the last boundary it reaches
    assert snaps.chunk_end(3, 4, 41) == 4  # reaches none
    assert snaps.chunk_end(41, 1, 41) == 1  # decoding
    # prefixes as block hashes, the boundary's last: b shares a's first block
    a, b, c = snaps.take([10, 11]), snaps.take([10, 20, 22]), snaps.take([30, 33])  # the third evicts the oldest
    assert (a.slot, b.slot) == (5, 6) and c.slot == 5 and snaps.find(11) is None and snaps.find(22) == 6
    # what a kept snapshot covers: a block another kept prefix holds stays covered when one goes
    assert (a.covered, a.uncovered) == ([10, 11], []) and (b.covered, b.uncovered) == ([20, 22], [])
    assert (c.covered, c.uncovered) == ([30, 33], [11])
    assert [h for h in (10, 11, 20, 22, 30, 33) if snaps.covers(h)] == [10, 20, 22, 30, 33]
    assert snaps.take([10, 20, 22]) == (None, [], [])  # kept already


def test_what_a_hybrid_model_refuses_or_keeps(qwen3_next):
    """Speculative decoding (the state cannot step back over rejected proposals) and LoRA are
    refused at start, by name; an FP8 KV cache serves, its attention layers scaled (linear layers
    have no KV)."""
    import json

    from engine.layers.attention import Attention

    d, m = qwen3_next
    with pytest.raises(ValueError, match="speculative-config.*linear-attention"):
        LLM(str(d), speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    with pytest.raises(ValueError, match="enable-lora"):
        LLM(str(d), enable_lora=True)
    llm = LLM(str(d), kv_cache_dtype="fp8", block_size=4)
    attn = [mod for mod in llm.engine.runner.model.modules() if isinstance(mod, Attention)]
    assert attn and all(a.k_scale == a.v_scale == 1.0 for a in attn)
    prompts = random_prompts([20], seed=2)
    out = llm.generate(prompts, SP)[0].outputs[0].token_ids
    # an 8-bit cache stays close: the first tokens are transformers' (greedy, float32 reference)
    assert out[:2] == hf_greedy(m, prompts, 2)[0]


def test_the_prefix_index_hears_of_blocks_up_to_a_snapshot(qwen3_next):
    """What the prefix index publishes for a hybrid model is what a hit there saves: the blocks up
    to the last boundary with a state snapshot, not every full block."""
    d, _ = qwen3_next
    llm = LLM(str(d), block_size=4, max_num_batched_tokens=64, linear_state_snapshot_interval=16)
    kv = llm.engine.scheduler.kv
    assert kv.cache_snapshot() == []  # subscribed from here on
    prompt = random_prompts([41], seed=3)[0]  # one chunk to 32 (a boundary), then 9 tokens
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)  # 46 tokens: 11 full blocks
    llm.generate([prompt], short)
    events, lost = kv.take_cache_events()
    stored = [h for stored, h in events if stored]
    assert not lost and len(stored) == 8  # 32 tokens' blocks
    again = llm.generate([prompt + [7]], short)[0]
    assert again.num_cached_tokens == 32


def test_the_prefix_index_drops_blocks_whose_snapshot_was_evicted(qwen3_next):
    """One snapshot slot: a second prompt's snapshot evicts the first's, and with it the first
    prompt's blocks leave the prefix index (they stay cached: no hit restores their state any
    more, and none is taken); computed again, its snapshot comes back and so do they."""
    d, _ = qwen3_next
    llm = LLM(str(d), block_size=4, max_num_batched_tokens=64, linear_state_snapshot_interval=16,
              linear_state_snapshots=1)
    kv = llm.engine.scheduler.kv
    assert kv.cache_snapshot() == []
    a, b = random_prompts([41, 41], seed=6)  # one chunk to 32 (a boundary: a snapshot), then 9 tokens
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def run(prompt: list[int]) -> tuple[set[int], set[int], int]:
        """(hashes published, hashes withdrawn, tokens of its prefix hit)."""
        out = llm.generate([prompt], short)[0]
        events, lost = kv.take_cache_events()
        assert not lost
        return {h for s, h in events if s}, {h for s, h in events if not s}, out.num_cached_tokens

    stored_a, dropped, _ = run(a)
    assert len(stored_a) == 8 and not dropped  # 32 tokens' blocks, under a's snapshot
    stored_b, dropped, _ = run(b)
    assert len(stored_b) == 8 and dropped == stored_a  # b's snapshot took a's slot
    assert all(kv.pool.get_cached_block(h) is not None for h in stored_a)  # still cached, unpublished
    assert set(kv.cache_snapshot()) == stored_b  # what the index now holds: what a hit restores
    again, dropped, hit = run(a + [7])
    assert hit == 0  # as the index said: no snapshot, no hit
    assert again == stored_a and dropped == stored_b  # a's snapshot is back, b's went
    assert run(a + [9])[2] == 32
