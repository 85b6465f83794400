"""Decode-graph bookkeeping on CPU: padded batch sizes, which steps may
replay a graph (the planner's view of them), the persistent input buffers
against the eager path's inputs, a decode through those buffers (run
eagerly, without capture) against the eager engine, and the --enforce-eager
flag. The capture and
replay themselves run in tests/engine/test_cuda_graphs_gpu.py."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.cuda_graphs import DecodeInputs, capture_sizes
from engine.graph_setup import build_decode_graphs
from engine.planner import decode_graph, is_pure_decode, padded_size, plan_step
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_plan import GraphMenu, StepPath, StepRuntime


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert capture_sizes(24) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(0)


@pytest.mark.parametrize("n, size", [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 24), (25, 32), (33, 48),
                                     (129, 192), (193, 256), (256, 256), (257, None), (0, None)])
def test_padded_size_is_the_smallest_that_holds_the_batch(n, size):
    assert padded_size(capture_sizes(256), n) == size


def _sched(prompt: list[int], computed: int, new: int, blocks: list[int]) -> ScheduledRequest:
    r = Request(f"r{len(prompt)}-{computed}", prompt, SamplingParams(max_tokens=8))
    r.num_computed_tokens = computed
    return ScheduledRequest(r, new, (blocks,))


def test_pure_decode_means_one_last_token_each():
    assert is_pure_decode([_sched([5, 6, 7], 2, 1, [0]), _sched([1], 0, 1, [3])])
    assert not is_pure_decode([])
    assert not is_pure_decode([_sched([5, 6, 7], 2, 1, [0]), _sched([1, 2, 3, 4], 0, 4, [3])])  # a prefill
    assert not is_pure_decode([_sched([5, 6, 7], 1, 1, [0])])  # a one-token chunk that does not sample


def test_fill_writes_rows_and_padding(tmp_path):
    bs = 4
    inp = DecodeInputs(max_num_seqs=8, max_blocks_per_seq=5, block_size=bs, device=torch.device("cpu"))
    # A full batch of 8 first, so the later smaller one must overwrite stale rows.
    big = [_sched(list(range(10 + i)), 9 + i, 1, [7, 6, 5, 4, 3]) for i in range(8)]
    inp.upload(8, inp.fill(big, 8))
    a = _sched(list(range(100, 106)), 5, 1, [9, 2])  # position 5: block 2, offset 1
    b = _sched([42], 0, 1, [11])  # position 0: block 11
    c = _sched(list(range(17)), 16, 1, [1, 3, 8, 0, 12])  # position 16: block 12, offset 0
    width = inp.fill([a, b, c], 4)
    assert width == 5
    inp.upload(4, width)
    ids, positions, meta = inp.views(4, num_splits=3)
    assert ids.tolist() == [105, 42, 16, 0]
    assert positions.tolist() == [5, 0, 16, 0]
    assert meta.slot_mapping.tolist() == [[2 * bs + 1, 11 * bs, 12 * bs, -1]]  # [G, T]: one group
    assert meta.seq_lens.tolist() == [6, 1, 17, 1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_tables.shape == (1, 4, 5)
    assert meta.block_tables.tolist() == [[[9, 2, 0, 0, 0], [11, 0, 0, 0, 0], [1, 3, 8, 0, 12], [0, 0, 0, 0, 0]]]
    assert meta.num_splits == 3
    assert ids.dtype == positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32
    with pytest.raises(ValueError, match="does not fit"):
        inp.fill([a, b, c], 2)
    with pytest.raises(ValueError, match="buffers hold 5"):
        inp.fill([_sched(list(range(30)), 29, 1, list(range(6)))], 1)


def _decoding_engine(model_dir, n: int, max_num_seqs: int = 6):
    """A CPU engine with n requests of different lengths, all past prefill."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, kv_cache_memory="4MiB",
              max_num_seqs=max_num_seqs)
    e = llm.engine
    g = torch.Generator().manual_seed(3)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, length in enumerate([3, 9, 14, 1, 22, 5][:n]):
        e.add_request(f"q{i}", torch.randint(3, 384, (length,), generator=g).tolist(), sp)
    while any(r.num_output_tokens == 0 for r in e.scheduler.requests.values()):
        e.step()
    return llm


def test_buffers_match_the_eager_inputs(tiny_llama_dir):
    llm = _decoding_engine(tiny_llama_dir, 3)
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: eager, as before
    graphs = build_decode_graphs(runner, use_graphs=False)
    out = llm.engine.scheduler.schedule()
    assert is_pure_decode(out.scheduled) and len(out.scheduled) == 3
    ids_e, pos_e, meta_e, sample_idx = runner._prepare(out)
    size = padded_size(graphs.sizes, 3)
    assert size == 4
    graphs.inputs.upload(size, graphs.inputs.fill(out.scheduled, size))
    ids_g, pos_g, meta_g = graphs.inputs.views(size)
    n, w = 3, meta_e.block_tables.shape[2]
    assert torch.equal(ids_g[:n], ids_e) and torch.equal(pos_g[:n], pos_e)
    assert torch.equal(meta_g.slot_mapping[:, :n], meta_e.slot_mapping)
    assert torch.equal(meta_g.seq_lens[:n], meta_e.seq_lens)
    assert torch.equal(meta_g.query_start_loc[:n + 1], meta_e.query_start_loc)
    assert torch.equal(meta_g.block_tables[:, :n, :w], meta_e.block_tables)
    assert sample_idx.tolist() == [0, 1, 2]
    # The padding row writes nowhere and reads block 0 only.
    assert meta_g.slot_mapping[:, n:].tolist() == [[-1]] and meta_g.seq_lens[n:].tolist() == [1]
    assert meta_g.block_tables[:, n:, 0].tolist() == [[0]]


def test_decode_through_the_buffers_matches_eager(tiny_llama_dir):
    """Every decode step through the padded persistent buffers (the code a
    graph replays, run eagerly here) gives the eager path's logits and
    tokens; the steps with prefill fall back to eager."""
    prompts = [[5, 9, 31], list(range(40, 57)), [200], list(range(3, 14))]
    sp = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=7, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=1.3)]
    kw = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory="4MiB", max_num_seqs=6,
              max_num_batched_tokens=16, async_scheduling=False)  # each step checked as it runs
    eager = LLM(str(tiny_llama_dir), **kw).generate(prompts, sp)

    llm = LLM(str(tiny_llama_dir), graphs_without_capture=True, **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and not runner.graphs.use_graphs
    seen, pending = [], []
    fill, replay = runner.graphs.fill_decode, runner.graphs.replay

    def checked_fill(scheduled, size, splits, ahead_ids=None):
        pending.append(list(scheduled))
        return fill(scheduled, size, splits, ahead_ids)

    def checked_replay(*step):
        logits = replay(*step)
        scheduled = pending.pop()  # the same step eagerly: the KV it rewrites is identical
        ids, pos, meta, idx = runner._prepare(SchedulerOutput(scheduled=scheduled))
        ref = runner.forward_logits(ids, pos, runner.kv_cache, meta)[idx]
        torch.testing.assert_close(logits[:len(scheduled)], ref, rtol=1e-5, atol=1e-5)
        seen.append(len(scheduled))
        return logits

    runner.graphs.fill_decode, runner.graphs.replay = checked_fill, checked_replay
    steps = []
    run = runner.run
    runner.run = lambda out, plan, *a, **kw: steps.append(len(out.scheduled)) or run(out, plan, *a, **kw)
    graphed = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    lp_g, lp_e = graphed[2].outputs[0].logprobs, eager[2].outputs[0].logprobs
    assert len(lp_g) == len(lp_e) == 10
    for g, e in zip(lp_g, lp_e):
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (e.token_id, e.rank, [t for t, _ in e.top])
        assert g.logprob == pytest.approx(e.logprob, abs=1e-5)
    # Budget 16: the 17-token prompt's prefill shares steps with decodes, which run eagerly.
    assert runner.graphs.num_replays == len(seen) and 0 < len(seen) < len(steps)
    assert {4, 3, 2} <= set(seen)  # 3 rows run padded to 4


def test_the_planner_declines_what_no_graph_holds(tiny_llama_dir):
    llm = _decoding_engine(tiny_llama_dir, 3, max_num_seqs=6)
    menu = build_decode_graphs(llm.engine.runner, use_graphs=False).menu
    small = StepRuntime(dataclasses.replace(menu, decode_sizes=(1, 2)))  # a batch of 3 is larger than any
    assert plan_step(llm.engine.scheduler.schedule().scheduled, small).path is StepPath.EAGER
    llm.engine.add_request("new", [4, 5, 6, 7], SamplingParams(max_tokens=2))
    mixed = llm.engine.scheduler.schedule().scheduled
    assert len(mixed) == 4 and plan_step(mixed, StepRuntime(menu)).path is StepPath.EAGER  # no mixed-step graphs
    assert plan_step(mixed[:3], StepRuntime(menu)).path is StepPath.DECODE_GRAPH


@torch.inference_mode()
def test_a_batch_replays_the_split_variant_its_longest_context_fits(tiny_llama_dir):
    """Sizes may have a graph per split count: the first whose context holds the batch's
    longest context is replayed (here the requests' contexts are 5-15 tokens)."""
    from engine.cuda_graphs import DecodeGraphs

    llm = _decoding_engine(tiny_llama_dir, 3, max_num_seqs=6)
    runner = llm.engine.runner
    base = build_decode_graphs(runner, use_graphs=False)
    assert base.variants[4] == [(runner.config.scheduler.max_model_len, None)]  # CPU: one, the kernel's choice
    variants = {s: [(10, 2), (400, 5)] for s in base.sizes}
    graphs = DecodeGraphs(runner.forward_logits, runner.kv_cache, base.inputs, base.sizes, variants,
                          use_graphs=False)
    scheduled = llm.engine.scheduler.schedule().scheduled
    longest = max(s.request.num_computed_tokens + 1 for s in scheduled)
    assert longest > 10 and decode_graph(scheduled, graphs.menu) == (4, 5)
    step = graphs.fill_decode(scheduled, 4, 5)
    graphs.replay(step.size, step.splits)
    assert graphs.last_splits == 5
    short = [s for s in scheduled if s.request.num_computed_tokens + 1 <= 10]
    assert short and decode_graph(short, graphs.menu) == (padded_size(base.sizes, len(short)), 2)
    beyond = GraphMenu(tuple(base.sizes), 6, base.inputs.max_blocks_per_seq,
                       variants={s: ((8, 3), (12, 4)) for s in base.sizes})
    assert decode_graph(scheduled, beyond) == (4, 4)  # the last holds every context


def _parse(argv: list[str]) -> EngineArgs:
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(p.parse_args(argv))


def test_enforce_eager_flag(tiny_llama_dir):
    assert _parse([]).enforce_eager is False
    assert _parse(["--enforce-eager"]).enforce_eager is True
    assert _parse(["--enforce-eager", "--no-enforce-eager"]).enforce_eager is False
    args = _parse(["--model", str(tiny_llama_dir), "--device", "cpu", "--enforce-eager"])
    config = args.create_engine_config()
    assert config.runtime.enforce_eager is True and "enforce_eager=True" in config.describe()
    assert _parse(["--model", str(tiny_llama_dir), "--device", "cpu"]).create_engine_config().runtime.enforce_eager \
        is False
    # pdserve up hands the flag on to the engine servers it starts.
    from pdserve.cli.up import engine_flags

    assert engine_flags(argparse.Namespace(enforce_eager=True)) == ["--enforce-eager"]
    assert engine_flags(argparse.Namespace(enforce_eager=False)) == []


def test_graphs_without_capture_says_it_turned_graphs_off(tiny_llama_dir, caplog):
    with caplog.at_level("WARNING", logger="engine.model_runner"):
        llm = LLM(str(tiny_llama_dir), kv_cache_memory="4MiB", graphs_without_capture=True)
    runner = llm.engine.runner
    assert runner.use_cuda_graphs is False and runner.graphs is not None and not runner.graphs.use_graphs
    assert any("graphs_without_capture: CUDA graphs are off" in r.getMessage() for r in caplog.records)
    assert "graphs_without_capture=True (tests)" in llm.engine.config.describe()


def test_the_removed_graphs_variable_is_refused(tiny_llama_dir, monkeypatch):
    """A served process must not inherit the test mode: the old variable stops the start."""
    monkeypatch.setenv("PDSERVE_DECODE_GRAPHS", "eager")
    with pytest.raises(ValueError, match="PDSERVE_DECODE_GRAPHS is no longer read.*graphs_without_capture"):
        LLM(str(tiny_llama_dir), kv_cache_memory="4MiB")
