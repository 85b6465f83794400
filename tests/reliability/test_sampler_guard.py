"""A bad number that reaches the sampler fails that one request, never the
engine: the sampler marks the row SAMPLE_FAILED and the scheduler ends the
request FINISHED_ABORTED with a "sampling" error while its batch companions
go on."""
from __future__ import annotations

import torch

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampler import SAMPLE_FAILED, Sampler, SamplingRow
from engine.sampling_params import SamplingParams


def _unchecked(**bad: float) -> SamplingParams:
    """Params with a value validation would refuse (as if it slipped through)."""
    p = SamplingParams(max_tokens=4, ignore_eos=True, seed=1)
    for k, v in bad.items():
        setattr(p, k, v)
    return p


def _row(p: SamplingParams) -> SamplingRow:
    return SamplingRow(p, [1, 2, 3], [3], frozenset({2}))


def test_rows_without_a_distribution_fail_alone():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[5] = float("nan")  # a broken row of logits, greedy with a penalty
    rows = [_row(SamplingParams(temperature=0.7, seed=3)),
            _row(_unchecked(temperature=float("nan"))),
            _row(_unchecked(repetition_penalty=float("nan"))),
            _row(_unchecked(temperature=0.0, repetition_penalty=float("nan"))),
            _row(_unchecked(temperature=float("inf"), logprobs=2)),
            _row(SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=1))]
    out = Sampler().sample(logits, rows)
    assert out.token_ids[1:4] == [SAMPLE_FAILED] * 3
    assert out.token_ids[5] == SAMPLE_FAILED and out.logprobs[5] is None
    assert 0 <= out.token_ids[0] < 50 and 0 <= out.token_ids[4] < 50  # inf temperature: uniform, still a draw
    assert out.logprobs[4] is not None and out.logprobs[4].token_id == out.token_ids[4]


def test_engine_ends_only_the_bad_request(tiny_llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="4MiB"))
    good = engine.add_request("good", [1, 5, 9, 13], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8,
                                                                  seed=7))
    # The engine validates too (make_request): spoil the values once the requests are queued.
    bad = engine.add_request("bad", [1, 5, 9, 14], SamplingParams(max_tokens=4))
    greedy_bad = engine.add_request("greedy-bad", [1, 5, 9, 15], SamplingParams(max_tokens=4, temperature=0.0))
    bad.sampling_params.temperature = float("nan")
    greedy_bad.sampling_params.repetition_penalty = float("nan")
    reported = []
    while engine.has_unfinished_requests():
        reported += engine.step().updated
    for r in (bad, greedy_bad):
        assert r.status == RequestStatus.FINISHED_ABORTED and r.error is not None
        assert r.error.kind == "sampling" and "not finite" in r.error.message
        assert r.output_token_ids == [] and r in reported
    assert good.status == RequestStatus.FINISHED_LENGTH and len(good.output_token_ids) == 6
    assert engine.stats().kv_blocks_used == 0
