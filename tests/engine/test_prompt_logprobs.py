"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) against transformers'
float32 log-softmax over the prompt: tiny random checkpoints of several families and the
default model, whole prompts and small chunks, prefix caching bypassed, a preemption that
recomputes the prompt adding nothing twice; the step planner keeps such steps eager."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.planner import plan_step
from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.step_plan import GraphMenu, StepPath, StepPlan, StepRuntime
from tests.conftest import make_tiny_model
from tests.engine.families import hf_model, make_family_model, random_prompts

TOL = 1e-4


def reference(model, prompt: list[int], top_n: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """transformers' (logprob, rank, top-N) of prompt tokens 1.., float32 log-softmax."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(prompt[1:])
    chosen = lp.gather(1, target.unsqueeze(1))
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    top_lp, top_ids = lp.topk(top_n, dim=-1)
    return [(float(chosen[i]), ranks[i], list(zip(top_ids[i].tolist(), top_lp[i].tolist())))
            for i in range(len(prompt) - 1)]


def assert_matches(got: list, prompt: list[int], ref: list, top_n: int) -> None:
    assert got[0] is None and len(got) == len(prompt)
    for i, (lp, want) in enumerate(zip(got[1:], ref), start=1):
        assert lp.token_id == prompt[i]
        assert lp.logprob == pytest.approx(want[0], abs=TOL), f"prompt token {i}"
        assert len(lp.top) == top_n
        for (tid, v), (want_id, want_v) in zip(lp.top, want[2]):
            assert v == pytest.approx(want_v, abs=TOL)
            # an id may differ only where two logprobs tie within the tolerance
            assert tid == want_id or abs(v - want_v) < TOL
        if abs(lp.logprob - want[0]) < TOL and lp.rank != want[1]:  # a near-tie moves the rank by one at most
            assert abs(lp.rank - want[1]) <= 1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt-logprobs")
    return {"llama": make_tiny_model(root / "llama"),
            "qwen3": make_family_model(root / "qwen3", "qwen3", seed=1),
            "gemma3": make_family_model(root / "gemma3", "gemma3", seed=2)}


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_prompt_logprobs_equal_transformers_whole_and_chunked(models, name):
    hf = hf_model(models[name])
    prompts = random_prompts([1, 2, 9, 37], seed=len(name))
    refs = [reference(hf, p, 3) if len(p) > 1 else [] for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for budget in (2048, 8):  # the whole prompt in one step; chunks of 8 beside other rows
        llm = LLM(str(models[name]), max_num_batched_tokens=budget, kv_cache_memory="8MiB", block_size=4)
        outs = llm.generate(prompts, sp)
        for p, ref, o in zip(prompts, refs, outs):
            assert_matches(o.prompt_logprobs, p, ref, 3)


def test_prompt_logprobs_zero_gives_the_tokens_own_and_none_asks_nothing(models):
    llm = LLM(str(models["llama"]), kv_cache_memory="8MiB", block_size=4)
    p = random_prompts([12], seed=5)[0]
    ref = reference(hf_model(models["llama"]), p, 1)
    out, plain = llm.generate([p, p], [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                       SamplingParams(temperature=0, max_tokens=1)])
    assert_matches(out.prompt_logprobs, p, ref, 0)
    assert [lp.rank for lp in out.prompt_logprobs[1:]] == [r[1] for r in ref]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_bypass_the_prefix_cache(models):
    """A cached prompt is computed again for its logprobs (cached positions have no logits);
    a request without them still takes the hit."""
    llm = LLM(str(models["llama"]), kv_cache_memory="8MiB", block_size=4, enable_prefix_caching=True)
    p = random_prompts([30], seed=7)[0]
    ref = reference(hf_model(models["llama"]), p, 2)
    first = llm.generate([p], SamplingParams(temperature=0, max_tokens=1))[0]
    assert first.num_cached_tokens == 0
    hit = llm.generate([p], SamplingParams(temperature=0, max_tokens=1))[0]
    assert hit.num_cached_tokens == 28
    again = llm.generate([p], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert again.num_cached_tokens == 0
    assert_matches(again.prompt_logprobs, p, ref, 2)


def test_prompt_logprobs_of_the_default_model(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    p = tok("The capital of France is Paris, and the capital of Italy is Rome.")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    ref = reference(hf, p, 5)
    del hf
    llm = LLM(str(default_model_dir), kv_cache_memory="64MiB", max_num_batched_tokens=8)  # chunks of 8
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))[0]
    assert_matches(out.prompt_logprobs, p, ref, 5)


def test_a_recomputed_chunk_records_nothing_twice():
    r = Request("r", list(range(10, 20)), SamplingParams(prompt_logprobs=0))
    assert r.needs_prompt_logprobs and r.prompt_logprob_positions(0, 4) == range(0, 4)
    r.record_prompt_logprobs(1, ["a", "b", "c", "d"])  # prompt tokens 1..4, from positions 0..3
    assert r.prompt_logprob_positions(0, 6) == range(4, 6)  # after a preemption: positions 0..3 are known
    r.record_prompt_logprobs(1, ["A", "B", "C", "D", "e", "f"])
    assert r.prompt_logprobs == ["a", "b", "c", "d", "e", "f"]
    assert r.prompt_logprob_positions(6, 10) == range(6, 9)  # the last position gives the first output token
    r.record_prompt_logprobs(7, ["g", "h", "i"])
    assert not r.needs_prompt_logprobs and r.prompt_logprob_positions(0, 11) == range(9, 9)
    resumed = Request("s", [5, 6, 7], SamplingParams(prompt_logprobs=1), resume_output_token_ids=[8, 9])
    assert resumed.prompt_logprob_positions(0, 5) == range(0, 2)  # the client's prompt only


def test_steps_computing_prompt_logprobs_run_eagerly_and_are_read_at_once():
    menu = GraphMenu(decode_sizes=(1, 2, 4), max_num_seqs=8, max_blocks_per_seq=8, mixed_sizes=(16, 32))
    runtime = StepRuntime(menu, overlap=True, overlap_mixed=True)

    def row(params: SamplingParams, computed: int = 0, new: int = 10) -> ScheduledRequest:
        r = Request("r", list(range(1, 13)), params)
        r.num_computed_tokens = computed
        return ScheduledRequest(r, new, ([0, 1, 2],))

    plain = row(SamplingParams())
    assert plan_step([plain], runtime).path is StepPath.MIXED_GRAPH
    assert plan_step([row(SamplingParams(prompt_logprobs=2))], runtime) == StepPlan()
    # the chunk holding only the prompt's last position gives no prompt logprob: a graph may hold it
    assert plan_step([row(SamplingParams(prompt_logprobs=2), computed=11, new=1)], runtime).path \
        is StepPath.DECODE_GRAPH


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_is_checked(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-3), ("bfloat16", 0.15)])
def test_prompt_logprobs_on_cuda_at_a_large_vocabulary(tmp_path, dtype, tol):
    """On CUDA, a 152k vocabulary and 2,048-token chunks (a [2048, 152k] float32 table per
    chunk, about 1.2 GB): float32 within float32 rounding of transformers' float32 on the same
    GPU, bf16 within bf16 rounding of transformers' bf16 there; the logits of one chunk at a time
    are held, not the prompt's."""
    vocab = 151936
    path = make_tiny_model(tmp_path / "m", vocab_size=vocab, max_position_embeddings=4096)
    p = random_prompts([3000], vocab=vocab, seed=11)[0]
    hf = hf_model(path, getattr(torch, dtype), "cuda")
    with torch.no_grad():
        logits = hf(torch.tensor([p], device="cuda")).logits[0, :-1].float()
    want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(p[1:], device="cuda").unsqueeze(1))[:, 0].cpu()
    del hf, logits
    torch.cuda.empty_cache()
    llm = LLM(str(path), dtype=dtype, device="cuda", block_size=16, kv_cache_memory="256MiB",
              max_num_batched_tokens=2048, max_model_len=4096)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))[0]
    peak = torch.cuda.max_memory_allocated() - base
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    assert [lp.token_id for lp in out.prompt_logprobs[1:]] == p[1:]
    diff = (got - want).abs()
    assert diff.max() < tol, (diff.max(), diff.mean())
    assert peak < 4 * 2048 * vocab * 4, peak / 2**30  # a few chunk-sized tables at most
