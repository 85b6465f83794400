"""Speculative decoding with n-gram proposals, on CPU through the offline API: greedy
output is token for token plain decoding's (with stop tokens, max_tokens landing inside
an accepted run, penalties, min_tokens and preemption), verification keeps the target's
distribution when sampling (a chi-square test over many seeds), rejected positions'
blocks go back to the pool, and the configuration is checked."""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.sampler import SamplingRow, verify_async
from engine.speculative import SpeculativeConfig, Speculator, ngram_propose
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.slow
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
ENGINE = dict(kv_cache_memory="16MiB", max_model_len=512, block_size=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A random model repeats itself greedily: n-gram proposals are often right.
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "model", seed=3)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    phrase = torch.randint(3, 384, (6,), generator=g).tolist()
    return [phrase * 3 + torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 4, 9, 2)]


def _run(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]


def _proposing(monkeypatch, propose) -> None:
    """Engines built from here on (an n-gram ``--speculative-config``) propose with
    ``propose(request, k)`` instead of the n-gram lookup; k and disable_by_batch_size stay
    the config's. (The scheduler takes its speculator when it is built.)"""
    def from_config(config: SpeculativeConfig, propose_batch=None) -> Speculator:
        assert config.method == "ngram" and propose_batch is None
        return Speculator(config.num_speculative_tokens, propose=propose,
                          disable_by_batch_size=config.disable_by_batch_size)
    monkeypatch.setattr(Speculator, "from_config", staticmethod(from_config))


def test_ngram_proposals():
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 3, 1, 4) == [4, 1, 2]  # longest suffix first, what followed it
    assert ngram_propose([5, 9, 5, 8, 5], 2, 1, 4) == [8, 5]  # the latest occurrence wins
    assert ngram_propose([1, 2, 3, 4, 5], 3, 1, 4) == []
    assert ngram_propose([1, 2, 3, 1, 2], 3, 3, 3) == []  # shorter than prompt_lookup_min: nothing


def test_greedy_output_is_plain_decodings(model_dir, monkeypatch):
    prompts = _prompts()
    plain = LLM(str(model_dir), **ENGINE)
    eos = _run(plain, prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0][0][7]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),  # lands inside an accepted run
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[eos]),  # a stop token mid-run
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4, min_tokens=5)]
    want = _run(plain, prompts, params)
    spec = LLM(str(model_dir), **ENGINE, speculative_config=SPEC)  # the n-gram proposer
    assert _run(spec, prompts, params) == want
    assert spec.engine.scheduler.spec.num_drafts > 5
    # Proposals that are mostly right (plain decoding's own continuation, every eighth token
    # wrong): long accepted runs, max_tokens and the stop token landing inside them.
    continuation = {tuple(p): toks for p, (toks, _) in zip(prompts, want)}

    def oracle(req, k: int) -> list[int]:
        done = req.num_output_tokens
        right = continuation[tuple(req.prompt_token_ids)][done:done + k]
        return [0 if (done + j) % 8 == 7 else t for j, t in enumerate(right)]

    _proposing(monkeypatch, oracle)
    for llm in (LLM(str(model_dir), **ENGINE, speculative_config=SPEC),
                # preemption in the middle of speculative steps
                LLM(str(model_dir), num_gpu_blocks_override=24, max_model_len=512, block_size=4,
                    max_num_batched_tokens=48, speculative_config=SPEC)):
        assert _run(llm, prompts, params) == want
        stats = llm.engine.scheduler.spec
        assert stats.num_accepted_tokens > 40 and stats.accepted_per_position[3] > 3, stats
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_rejected_positions_give_their_blocks_back(model_dir, monkeypatch):
    # Every proposal a wrong guess: each step takes blocks for 1 + 4 positions and keeps
    # only what one accepted token needs.
    _proposing(monkeypatch, lambda req, k: [0] * k)  # token 0 is never the argmax here
    llm = LLM(str(model_dir), **ENGINE, speculative_config=SPEC)
    req = llm.engine.add_request("r", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=12,
                                                                         ignore_eos=True))
    while not req.is_finished:
        llm.engine.step()
        if not req.is_finished:
            held = llm.engine.scheduler.kv.num_held_blocks(req.request_id)
            assert held == -(-(req.num_computed_tokens + 1) // 4)
    assert llm.engine.scheduler.spec.num_accepted_tokens == 0 and len(req.output_token_ids) == 12


def test_k_follows_the_acceptance(model_dir, monkeypatch):
    """A row asks for one more proposal than it last had accepted: all wrong, it asks for 1
    from the second step on; all right, it keeps asking for num_speculative_tokens."""
    want = _run(LLM(str(model_dir), **ENGINE, speculative_config=SPEC), [list(range(3, 20))],
                SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0][0]
    for right in (False, True):
        asked: list[int] = []

        def speculator(req, k: int, right=right) -> list[int]:
            asked.append(k)
            done = req.num_output_tokens
            return want[done:done + k] if right else [0] * k  # token 0 is never the argmax here
        _proposing(monkeypatch, speculator)
        llm = LLM(str(model_dir), **ENGINE, speculative_config=SPEC)
        got = _run(llm, [list(range(3, 20))], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert got[0][0] == want
        # (the last steps ask for fewer: never past max_tokens)
        assert asked[:3] == ([4, 4, 4] if right else [4, 1, 1]), asked


def test_verification_keeps_the_target_distribution():
    # One position, a proposal d: accept with p(d), else draw from p without d. Over many
    # seeds the emitted token is distributed as p (chi-square, 7 degrees of freedom; the
    # bound 40 is exceeded by chance with probability below 1e-5).
    vocab, n = 8, 20000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, 0.3])
    p = torch.softmax(logits, 0)
    for draft in (0, 3):  # the likeliest token, and an unlikely one
        rows = [SamplingRow(SamplingParams(temperature=1.0, seed=s), [1], [], frozenset()) for s in range(n)]
        out = verify_async(logits.repeat(n, 1), rows, [draft] * n).result()
        tokens = torch.tensor([draft if ok else tok for ok, tok in out])
        counts = torch.bincount(tokens, minlength=vocab).double()
        expected = p.double() * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 40, (draft, chi2, counts.tolist())
        accepted = sum(ok for ok, _ in out) / n
        assert math.isclose(accepted, float(p[draft]), abs_tol=0.015)
    # The same seeds give the same verification (deterministic).
    rows = [SamplingRow(SamplingParams(temperature=1.0, seed=s), [1], [], frozenset()) for s in range(50)]
    assert verify_async(logits.repeat(50, 1), rows, [3] * 50).result() == \
        verify_async(logits.repeat(50, 1), rows, [3] * 50).result()


def test_sampled_output_is_seeded(model_dir):
    prompts = _prompts()
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True) for i in range(len(prompts))]
    a = LLM(str(model_dir), **ENGINE, speculative_config=SPEC)
    b = LLM(str(model_dir), **ENGINE, speculative_config=SPEC)
    assert _run(a, prompts, params) == _run(b, prompts, params)


def test_configuration_is_checked(model_dir):
    assert SpeculativeConfig.parse(None) is None
    for bad, message in [('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
                         ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
                         ('{"method": "ngram"}', 'needs "method" and "num_speculative_tokens"'),
                         ('{"method": "ngram", "num_speculative_tokens": 2, "k": 3}', "unknown keys"),
                         ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                          '"prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
                         ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
                          "disable_by_batch_size must be a positive integer or null"),
                         ("{nope", "not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(model_dir), device="cpu", speculative_config=bad).create_engine_config()


def test_no_proposals_while_more_requests_run_than_disable_by_batch_size(model_dir, monkeypatch):
    """vLLM's disable_by_batch_size: while more requests run than that, steps carry no
    proposals (the speculator is not even asked); as they finish, speculation resumes."""
    assert SpeculativeConfig.parse(SPEC).disable_by_batch_size == 64  # the measured default
    assert SpeculativeConfig.parse(SPEC[:-1] + ', "disable_by_batch_size": null}').disable_by_batch_size is None
    config = SPEC[:-1] + ', "disable_by_batch_size": 2}'
    prompts = _prompts()[:3]
    running_when_asked: list[int] = []
    ngram = Speculator.from_config(SpeculativeConfig.parse(config)).propose

    def speculator(req, k):
        running_when_asked.append(len(llm.engine.scheduler.running))
        return ngram(req, k)
    _proposing(monkeypatch, speculator)
    llm = LLM(str(model_dir), **ENGINE, speculative_config=config)
    assert llm.engine.scheduler.speculator.disable_by_batch_size == 2
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 12, 30)]
    plain = LLM(str(model_dir), **ENGINE)
    assert _run(llm, prompts, lengths) == _run(plain, prompts, lengths)
    # Asked while 2 ran (not more than 2: allowed) and while 1 ran, never while 3 ran.
    assert sorted(set(running_when_asked)) == [1, 2], running_when_asked


def test_verify_steps_on_the_graph_path_give_eager_tokens(model_dir, monkeypatch):
    """Verify steps replay verify graphs (k + 1 tokens a row, a row's missing proposals
    padded with tokens that write nowhere), run eagerly on CPU over the same buffers: the
    greedy tokens are plain decoding's, with rows of every proposal count (none, one,
    all k; right and wrong) in one batch."""
    prompts = _prompts() * 2
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = _run(LLM(str(model_dir), **ENGINE), prompts, params)
    continuation = {tuple(p): toks for p, (toks, _) in zip(prompts, want)}
    proposals = iter(range(10**6))

    def oracle(req, k: int) -> list[int]:  # right, wrong, short and empty proposals in turn
        done, turn = req.num_output_tokens, next(proposals) % 4
        right = continuation[tuple(req.prompt_token_ids)][done:done + k]
        return [right, [0] * k, right[:1], []][turn]

    _proposing(monkeypatch, oracle)
    llm = LLM(str(model_dir), **ENGINE, speculative_config=SPEC, max_num_seqs=8, graphs_without_capture=True)
    graphs = llm.engine.runner.graphs
    assert graphs.verify_len == 5 and graphs.verify_sizes == [1, 2, 4, 8]
    replays = []
    replay = graphs.replay

    def counted(size, splits, query_len=1):
        replays.append(query_len)
        return replay(size, splits, query_len)

    graphs.replay = counted
    assert _run(llm, prompts, params) == want
    assert replays.count(5) > 5 and llm.engine.scheduler.spec.num_accepted_tokens > 10
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_draft_model_keeps_greedy_output(model_dir, tmp_path, graphs, monkeypatch):
    """A draft model proposes: the target itself as its own draft (every proposal right)
    and a second, different checkpoint of the same vocabulary (mostly wrong); greedy
    output is plain decoding's either way, with stop tokens, max_tokens inside an
    accepted run and preemption, and the blocks all come back."""
    graph_path = {"graphs_without_capture": True} if graphs else {}
    prompts = _prompts()
    plain = LLM(str(model_dir), **ENGINE, **graph_path)
    eos = _run(plain, prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0][0][7]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[eos]),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, repetition_penalty=1.3, min_tokens=5)]
    want = _run(plain, prompts, params)
    other = make_tiny_model(tmp_path / "draft", seed=9, num_hidden_layers=1, hidden_size=48, intermediate_size=96,
                            num_attention_heads=4, num_key_value_heads=2)
    for draft, engine in [(model_dir, ENGINE), (other, ENGINE),
                          (model_dir, dict(num_gpu_blocks_override=24, max_model_len=512, block_size=4,
                                           max_num_batched_tokens=48))]:  # preemption mid-speculation
        spec = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}' % draft
        llm = LLM(str(model_dir), **engine, speculative_config=spec, **graph_path)
        assert _run(llm, prompts, params) == want
        assert llm.engine.scheduler.spec.num_draft_tokens > 20
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
    assert llm.engine.scheduler.num_preemptions_total > 0
    # Its own draft, on plain greedy rows (no penalties to make the target choose otherwise):
    # the proposals are the target's own tokens.
    spec = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}' % model_dir
    llm = LLM(str(model_dir), **ENGINE, speculative_config=spec, **graph_path)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert _run(llm, prompts, greedy) == _run(plain, prompts, greedy)
    stats = llm.engine.scheduler.spec
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 50, stats
