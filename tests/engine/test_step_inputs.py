"""The runner's flat step inputs (built with vectorised ops) equal a plain
per-token construction, on random mixes of prefill chunks, prefix hits and
decodes."""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step_plan import StepPlan


def _reference(out, block_sizes):
    """Per KV cache group g: slots [G, T] and tables [G, B, W] (one group for the tiny model)."""
    ids, positions, qsl, seq_lens, sample_idx = [], [], [0], [], []
    slots = [[] for _ in block_sizes]
    width = max(len(t) for s in out.scheduled for t in s.block_ids)
    tables = torch.zeros(len(block_sizes), len(out.scheduled), width, dtype=torch.int32)
    for i, s in enumerate(out.scheduled):
        start = s.request.num_computed_tokens
        end = start + s.num_new_tokens
        ids += s.request.all_token_ids[start:end]
        positions += range(start, end)
        for g, bs in enumerate(block_sizes):
            slots[g] += [s.block_ids[g][p // bs] * bs + p % bs for p in range(start, end)]
            tables[g, i, :len(s.block_ids[g])] = torch.tensor(s.block_ids[g], dtype=torch.int32)
        qsl.append(qsl[-1] + s.num_new_tokens)
        seq_lens.append(end)
        if s.samples:
            sample_idx.append(qsl[-1] - 1)
    return ids, positions, slots, tables, qsl, seq_lens, sample_idx


def test_step_inputs_match_a_per_token_construction(tiny_llama_dir):
    rng = random.Random(11)
    for budget, bs in ((7, 4), (64, 16), (300, 8)):
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), block_size=bs, kv_cache_memory="8MiB",
                                                       max_num_batched_tokens=budget, max_num_seqs=12))
        shared = [rng.randrange(3, 384) for _ in range(2 * bs)]  # prefix-cache hits for some prompts
        for i in range(10):
            head = shared if i % 3 == 0 else []
            prompt = head + [rng.randrange(3, 384) for _ in range(rng.randint(1, 60))]
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 6),
                                                               ignore_eos=True))
        steps = 0
        while engine.has_unfinished_requests():
            out = engine.scheduler.schedule()
            if out.scheduled:
                ids, pos, meta, sample_idx = engine.runner._prepare(out)
                want = _reference(out, engine.runner.cache_spec.block_sizes)
                assert ids.tolist() == want[0] and pos.tolist() == want[1]
                assert meta.slot_mapping.tolist() == want[2] and torch.equal(meta.block_tables, want[3])
                assert meta.query_start_loc.tolist() == want[4] and meta.seq_lens.tolist() == want[5]
                assert sample_idx.tolist() == want[6] and sample_idx.dtype == torch.long
                assert (ids.dtype, pos.dtype, meta.slot_mapping.dtype) == (torch.long,) * 3
                assert meta.block_tables.dtype == meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
                sampled, logprobs = engine.runner.run(out, StepPlan()).result()  # eager
                engine.scheduler.update_from_output(out, sampled, logprobs)
                steps += 1
            else:
                engine.step()
        assert steps > 5


def test_a_gpu_share_must_be_free_at_start_up():
    from engine.memory_profile import check_free_memory

    gib = 2 ** 30
    check_free_memory(100 * gib, 140 * gib, 0.7, "cuda:0")  # 98 GiB wanted, 100 free
    with pytest.raises(ValueError, match=r"cuda:1: 60.0 GiB free of 140.0 GiB .* 126.0 GiB .* hold 80.0 GiB"):
        check_free_memory(60 * gib, 140 * gib, 0.9, "cuda:1")
