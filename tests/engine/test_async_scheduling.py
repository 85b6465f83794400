"""Overlapped decode steps (``--async-scheduling``) on CPU: the decode-graph
path run eagerly (``graphs_without_capture``), so the step
scheduled ahead, its inputs taken from the sampled ids of the step in flight,
and the tokens discarded for requests that finished meanwhile all run for
real. Every test compares with the same engine stepping one step at a time."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler, SamplingRow


def _llm(model_dir, async_scheduling: bool, **kw) -> LLM:
    # overlap_mixed_steps (PDSERVE_OVERLAP_MIXED_STEPS=1): mixed steps overlap too, without graphs
    args = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory="4MiB", max_num_seqs=4,
                max_num_batched_tokens=32, graphs_without_capture=True, overlap_mixed_steps=True)
    args.update(kw)
    return LLM(str(model_dir), async_scheduling=async_scheduling, **args)


def _count_ahead(llm: LLM) -> dict[str, int]:
    """How often the engine scheduled a step ahead, and how often it could not."""
    sched, counts = llm.engine.scheduler, {"ahead": 0, "declined": 0}
    schedule_ahead = sched.schedule_ahead

    def counted(in_flight):
        out = schedule_ahead(in_flight)
        counts["ahead" if out is not None else "declined"] += 1
        return out

    sched.schedule_ahead = counted
    return counts


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 9, 14, 1, 22, 5, 7)]


def _params(stop: dict[int, list[int]]) -> list[SamplingParams]:
    """Greedy and seeded rows of several lengths, logprobs, min_tokens, a stop token that
    ends a request early (``stop[i]``), and one row with a penalty (it cannot go ahead)."""
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=stop[0]),
            SamplingParams(temperature=0.9, seed=5, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.7, seed=8, top_p=0.9, max_tokens=6, ignore_eos=True, min_tokens=4,
                           stop_token_ids=stop[3]),
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=stop[5]),
            SamplingParams(temperature=0.8, seed=2, max_tokens=13, ignore_eos=True)]


def _tokens(outputs) -> list[tuple[list[int], str]]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]


def test_overlapped_steps_give_the_tokens_of_one_step_at_a_time(tiny_llama_dir):
    prompts = _prompts()
    free = _llm(tiny_llama_dir, False).generate(prompts, _params({0: [], 3: [], 5: []}))
    # Stop tokens the requests meet part-way (the 4th output token; min_tokens holds row 3's
    # off until its 4th): those requests finish while the step after is already queued.
    stop = {i: [free[i].outputs[0].token_ids[3]] for i in (0, 3, 5)}
    serial = _llm(tiny_llama_dir, False)
    want = serial.generate(prompts, _params(stop))
    overlapped = _llm(tiny_llama_dir, True)
    counts = _count_ahead(overlapped)
    got = overlapped.generate(prompts, _params(stop))

    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].finish_reason for o in got[:1]] == ["stop"] and len(got[0].outputs[0].token_ids) == 4
    for g, w in zip(got[2].outputs[0].logprobs, want[2].outputs[0].logprobs):
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (w.token_id, w.rank, [t for t, _ in w.top])
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
    # Steps went ahead, and some could not (arrivals into the 4 rows, the penalty row).
    assert counts["ahead"] > 5 and counts["declined"] > 0
    for llm in (serial, overlapped):  # nothing kept: no request, no block, no step in flight
        e = llm.engine
        assert not e.has_unfinished_requests() and not e.scheduler.requests
        assert e.stats().kv_blocks_used == 0


def test_a_request_aborted_while_its_step_is_in_flight(tiny_llama_dir):
    """An abort between two calls, with the request's step queued: it reports no token
    after the abort, its companions are unchanged, and its blocks come back."""
    prompts = _prompts()[:3]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = _tokens(_llm(tiny_llama_dir, False).generate(prompts, sp))
    llm = _llm(tiny_llama_dir, True)
    e = llm.engine
    reqs = [e.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    while not (e._in_flight is not None and all(r.num_output_tokens >= 3 for r in reqs)):
        e.step()
    ahead = e.num_steps_ahead_total
    e.step()  # the three rows' step queued a step ahead of the host
    assert e.num_steps_ahead_total == ahead + 1 and [s.request for s in e._in_flight.out.scheduled] == reqs
    e.abort_request("r1")
    kept = list(reqs[1].output_token_ids)
    while e.has_unfinished_requests():
        e.step()
    assert reqs[1].output_token_ids == kept and reqs[1].status.name == "FINISHED_ABORTED"
    assert kept == want[1][0][:len(kept)]
    assert [list(r.output_token_ids) for r in (reqs[0], reqs[2])] == [want[0][0], want[2][0]]
    assert e.stats().kv_blocks_used == 0 and e._in_flight is None


def test_off_by_flag(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, False)
    counts = _count_ahead(llm)
    llm.generate(_prompts()[:2], SamplingParams(temperature=0, max_tokens=5))
    assert counts == {"ahead": 0, "declined": 0}


def test_a_row_sampled_ahead_draws_as_if_its_tokens_were_known():
    """A seeded row's draw and min_tokens depend on its step, which counts the pending
    token; penalties, which read the tokens, refuse a pending one."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(4))
    for params in (SamplingParams(temperature=0.9, seed=3), SamplingParams(temperature=1.0, seed=3, min_tokens=3,
                                                                          stop_token_ids=[7])):
        for known in ([4, 9], [4, 9, 12]):
            full = SamplingRow(params, [1, 2], known, frozenset({2}))
            ahead = SamplingRow(params, [1, 2], known[:-1], frozenset({2}), pending=1)
            assert ahead.step == full.step and ahead.suppressed_token_ids == full.suppressed_token_ids
            assert Sampler().sample(logits, [ahead]).token_ids == Sampler().sample(logits, [full]).token_ids
    with pytest.raises(ValueError, match="penalties"):
        SamplingRow(SamplingParams(presence_penalty=0.5), [1], [], frozenset(), pending=1)


def test_a_request_arriving_while_steps_overlap_starts_at_the_next_step(tiny_llama_dir):
    """Admission, not only output: a prompt added while a decode step is in flight is
    scheduled by the very next engine step (into the step it queues ahead, beside the
    decode row), not after the running request finishes."""
    llm = _llm(tiny_llama_dir, True)
    e = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = e.add_request("a", _prompts()[0], sp)
    while not (e._in_flight is not None and a.num_output_tokens >= 3):
        e.step()
    b = e.add_request("b", _prompts()[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    ahead = e.num_steps_ahead_total
    e.step()
    assert b.times.first_scheduled is not None and e.num_steps_ahead_total == ahead + 1
    assert [s.request for s in e._in_flight.out.scheduled] == [a, b]
    e.step()
    assert b.num_computed_tokens > 0
    assert a.num_output_tokens < 10 and not a.is_finished
    while e.has_unfinished_requests():
        e.step()
    assert b.num_output_tokens == 4 and a.num_output_tokens == 40 and e.stats().kv_blocks_used == 0


def test_prefill_chunks_overlap_and_give_the_tokens_of_one_step_at_a_time(tiny_llama_dir):
    """Mixed steps go ahead too: with a budget of 8 tokens, prompts of up to 22 are cut into
    chunks that run beside decode rows, each chunk queued while the one before is in flight,
    and a prompt's last chunk's token feeds the step after it on the device. Prompts arrive
    while others decode; sampled, seeded, stopped-early and logprob rows all match."""
    prompts = _prompts()
    free = _llm(tiny_llama_dir, False, max_num_batched_tokens=8).generate(prompts, _params({0: [], 3: [], 5: []}))
    stop = {i: [free[i].outputs[0].token_ids[3]] for i in (0, 3, 5)}

    def run(async_scheduling: bool, overlap_mixed: bool = True):
        # (overlap_mixed_steps=False: PDSERVE_OVERLAP_MIXED_STEPS=0)
        llm = _llm(tiny_llama_dir, async_scheduling, max_num_batched_tokens=8, overlap_mixed_steps=overlap_mixed)
        e, params, mixed = llm.engine, _params(stop), []
        run_plan = e.runner.run

        def counted(out, plan, *args, **kw):  # steps queued (not waited for) with a prefill chunk, ahead or not
            chunk = any(s.num_new_tokens > 1 for s in out.scheduled)
            went_ahead = any(s.lookahead or s.computed_ahead for s in out.scheduled)
            if chunk and plan.overlapped:
                mixed.append(went_ahead)
            return run_plan(out, plan, *args, **kw)

        e.runner.run = counted
        reqs, done = [], {}
        for step in range(400):
            if step % 3 == 0 and len(reqs) < len(prompts):  # arrivals while others run
                i = len(reqs)
                reqs.append(e.add_request(f"r{i}", prompts[i], params[i]))
            e.step()
            if len(reqs) == len(prompts) and not e.has_unfinished_requests():
                break
        assert not e.has_unfinished_requests() and e.stats().kv_blocks_used == 0
        return [(list(r.output_token_ids), r.status.name) for r in reqs], mixed, e

    want, _, _ = run(False)
    got, mixed, e = run(True)
    assert got == want
    assert sum(mixed) >= 5 and e.num_steps_ahead_total > 10  # chunks went ahead, many times
    got, mixed, e = run(True, overlap_mixed=False)  # only decode steps overlap
    assert got == want and e.num_steps_ahead_total > 10 and mixed == []


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_step_graphs_give_the_tokens_of_eager_steps(tiny_llama_dir, monkeypatch, overlap):
    """PDSERVE_MIXED_GRAPHS: steps with prefill chunks run the mixed-step graph path (padded
    to a token bucket and to max_num_seqs sequences, the sampled rows gathered), here eagerly
    on its persistent buffers. Buckets of 4 and 8 tokens: a step's tokens pad to one of them,
    a larger step (none here: the budget is 8) would run eagerly. Overlapped or not, with
    arrivals, sampled, stopped-early and logprob rows, the tokens are those of eager steps."""
    prompts = _prompts()
    free = _llm(tiny_llama_dir, False, max_num_batched_tokens=8).generate(prompts, _params({0: [], 3: [], 5: []}))
    stop = {i: [free[i].outputs[0].token_ids[3]] for i in (0, 3, 5)}
    want = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
            for o in _llm(tiny_llama_dir, False, max_num_batched_tokens=8).generate(prompts, _params(stop))]
    monkeypatch.setenv("PDSERVE_MIXED_GRAPHS", "4,8")
    llm = _llm(tiny_llama_dir, True, max_num_batched_tokens=8, max_num_seqs=6, overlap_mixed_steps=overlap)
    graphs = llm.engine.runner.graphs
    assert graphs.mixed_sizes == [4, 8]
    got = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
           for o in llm.generate(prompts, _params(stop))]
    assert got == want
    assert graphs.num_mixed_replays >= 5
    if overlap:
        assert llm.engine.num_steps_ahead_total > 5
    e = llm.engine
    assert not e.has_unfinished_requests() and e.stats().kv_blocks_used == 0


def test_mixed_step_graph_buckets(tiny_llama_dir, monkeypatch):
    """The buckets a step can fill (at most the budget), and none for a bad setting."""
    monkeypatch.setenv("PDSERVE_MIXED_GRAPHS", "4,16,64")
    assert _llm(tiny_llama_dir, True, max_num_batched_tokens=32).engine.runner.graphs.mixed_sizes == [4, 16]
    monkeypatch.setenv("PDSERVE_MIXED_GRAPHS", "4,x")
    with pytest.raises(ValueError, match="PDSERVE_MIXED_GRAPHS"):
        _llm(tiny_llama_dir, True)
    monkeypatch.setenv("PDSERVE_MIXED_GRAPHS", "0")
    assert _llm(tiny_llama_dir, True).engine.runner.graphs.mixed_sizes == []
    monkeypatch.delenv("PDSERVE_MIXED_GRAPHS")  # the default: only where graphs are captured (CUDA)
    assert _llm(tiny_llama_dir, True).engine.runner.graphs.mixed_sizes == []


@pytest.mark.parametrize("overlap_env, mixed_env, overlap", [
    (None, "4,8", True), ("0", "4,8", False), (None, "0", False), ("1", "0", True)])
def test_mixed_steps_overlap_by_default_where_mixed_graphs_hold_them(tiny_llama_dir, monkeypatch, overlap_env,
                                                                    mixed_env, overlap):
    """The runner's own default (its graph path run eagerly, as graphs_without_capture builds
    it): steps with prefill chunks overlap where mixed-step graphs exist, unless
    PDSERVE_OVERLAP_MIXED_STEPS=0; =1 overlaps them without graphs too."""
    monkeypatch.setenv("PDSERVE_MIXED_GRAPHS", mixed_env)
    if overlap_env is None:
        monkeypatch.delenv("PDSERVE_OVERLAP_MIXED_STEPS", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_OVERLAP_MIXED_STEPS", overlap_env)
    runner = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4, kv_cache_memory="4MiB",
                 max_num_seqs=4, max_num_batched_tokens=8, graphs_without_capture=True).engine.runner
    assert runner.graphs is not None and runner.overlap_mixed is overlap


def test_a_request_aborted_while_its_prefill_chunk_is_in_flight(tiny_llama_dir):
    """Overlapped mixed steps: a request cancelled between two calls while a chunk of its
    prompt is queued (and the next one scheduled ahead) reports nothing more, its companions
    keep their tokens, and every block comes back."""
    prompts = _prompts()[:3]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    long = list(range(3, 3 + 40))  # 40 tokens at a budget of 8: five chunks
    want = _tokens(_llm(tiny_llama_dir, False, max_num_batched_tokens=8).generate(prompts, sp))
    llm = _llm(tiny_llama_dir, True, max_num_batched_tokens=8)
    e = llm.engine
    reqs = [e.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    def step_until(done) -> None:  # (bounded: a schedule that never ends fails, not hangs)
        for _ in range(300):
            if done():
                return
            e.step()
        raise AssertionError("the engine did not get there in 300 steps")

    step_until(lambda: all(r.num_output_tokens >= 1 for r in reqs))
    victim = e.add_request("long", long, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    step_until(lambda: e._in_flight is not None and victim.num_computed_tokens >= 8
               and any(s.request is victim for s in e._in_flight.out.scheduled))
    assert victim.num_computed_tokens < len(long)  # still prefilling, a chunk of it in flight
    e.abort_request("long")
    step_until(lambda: not e.has_unfinished_requests())
    assert victim.status.name == "FINISHED_ABORTED" and victim.num_output_tokens == 0
    assert [(list(r.output_token_ids), r.status.name) for r in reqs] == \
        [(w[0], "FINISHED_LENGTH") for w in want]
    assert e.stats().kv_blocks_used == 0 and e._in_flight is None and not e.scheduler.requests
