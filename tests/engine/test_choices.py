"""``n`` and ``best_of`` in the offline API: choice i is the single request seeded with
seed + i (vLLM's rule); the choices after the first take the prompt's full blocks from the
prefix cache; ``best_of`` returns the ``n`` sequences with the highest cumulative logprob;
an engine server's request (``make_request``) runs one sequence and refuses more."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.llm import cumulative_logprob
from tests.conftest import make_tiny_model

PROMPT = list(range(3, 40))  # 37 tokens: 9 full blocks of 4


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_tiny_model(tmp_path_factory.mktemp("choices") / "m")), kv_cache_memory="8MiB",
               block_size=4)


def _single(llm, seed: int, **kw):
    return llm.generate([PROMPT], SamplingParams(temperature=0.9, seed=seed, max_tokens=12, **kw))[0].outputs[0]


def test_seeded_choices_are_the_single_requests_and_share_the_prompt(llm):
    hits = llm.engine.stats().prefix_hits_total
    out = llm.generate([PROMPT], SamplingParams(temperature=0.9, seed=7, max_tokens=12, n=4))[0]
    assert llm.engine.stats().prefix_hits_total - hits == 3 * 36  # choices 1..3: the prompt's full blocks
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in out.outputs] == [_single(llm, 7 + i).token_ids for i in range(4)]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.engine.stats().kv_blocks_used == 0


def test_best_of_keeps_the_highest_cumulative_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0.9, seed=3, max_tokens=12, n=2, best_of=5))[0]
    singles = [_single(llm, 3 + i, logprobs=0) for i in range(5)]
    best = sorted(range(5), key=lambda i: (-cumulative_logprob(singles[i].logprobs), i))[:2]
    assert [o.token_ids for o in out.outputs] == [singles[i].token_ids for i in best]
    assert [o.index for o in out.outputs] == [0, 1] and out.outputs[0].logprobs is None


def test_choice_parameters_and_their_checks():
    sp = SamplingParams(n=3, seed=2**63 - 1, prompt_logprobs=2, best_of=4)
    assert [sp.choice(i).seed for i in range(3)] == [2**63 - 1, 0, 1]  # seed + i, wrapped in int64
    assert sp.choice(0).prompt_logprobs == 2 and sp.choice(1).prompt_logprobs is None
    assert sp.choice(1).logprobs == 0 and sp.choice(1).n == 1 and sp.choice(1).best_of is None  # ranked: logprobs
    assert SamplingParams(n=2).choice(1).logprobs is None
    assert SamplingParams(n=2, best_of=4).best([-1.0, -3.0, -1.0, -0.5]) == [3, 0]  # ties: the lower index
    with pytest.raises(ValueError, match="best_of must be greater than or equal to n, got n=3 and best_of=2"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match=r"n must be in \[1, 128\]"):
        SamplingParams(n=129)


def test_an_engine_request_is_one_sequence(llm):
    with pytest.raises(ValueError, match="one sequence per request"):
        llm.engine.make_request("r", PROMPT, SamplingParams(n=2))
