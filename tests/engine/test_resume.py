"""A request resumed after tokens it already generated (what a migration sends the next
server: ``resume_output_token_ids``) continues exactly as the uninterrupted request: the
same seeded draws (step k counts the resumed tokens), the same penalties (they count the
resumed tokens as output, not prompt), the same min_tokens/max_tokens, the same
structured-output state (the matcher replays the resumed tokens), through the offline API."""
from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from tests.conftest import make_tiny_model

ENGINE = dict(kv_cache_memory="16MiB", max_model_len=512)
PROMPT = [1, 305, 17, 4242, 911, 88, 3021, 64, 12, 7000]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory, default_model_dir):
    d = make_tiny_model(tmp_path_factory.mktemp("resume") / "model", vocab_size=49152, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / f, d / f)
    return LLM(str(d), **ENGINE)


def _check_resumes(llm: LLM, params: SamplingParams, cuts) -> list[int]:
    full = llm.generate([PROMPT], params)[0].outputs[0]
    assert len(full.token_ids) > max(cuts), full.token_ids
    for cut in cuts:
        done = list(full.token_ids[:cut])
        rest = llm.generate([PROMPT], params, resume_output_token_ids=[done])[0]
        out = rest.outputs[0]
        assert rest.prompt_token_ids == PROMPT
        assert list(out.token_ids) == list(full.token_ids[cut:]), f"cut at {cut}"
        assert out.finish_reason == full.finish_reason
        if params.logprobs is not None:
            for got, want in zip(out.logprobs, full.logprobs[cut:]):
                assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-4)
    return list(full.token_ids)


def test_seeded_sampling_with_penalties_continues_the_same(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, presence_penalty=0.8,
                            frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=20, logprobs=2,
                            ignore_eos=False)
    _check_resumes(llm, params, cuts=(1, 7, 19))


def test_greedy_with_penalties_counts_resumed_tokens_as_output(llm):
    # Greedy with a strong presence penalty: a resumed token counted as prompt instead of
    # output would change the next pick.
    params = SamplingParams(temperature=0, max_tokens=20, presence_penalty=2.0, frequency_penalty=2.0,
                            ignore_eos=True)
    _check_resumes(llm, params, cuts=(3, 10))


def test_structured_output_replays_the_resumed_tokens(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=60,
                            structured_outputs={"json": SCHEMA})
    full = _check_resumes(llm, params, cuts=(2, 6))
    json.loads(llm.tokenizer.decode(full))


def test_resumed_tokens_count_against_max_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    done = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    out = llm.generate([PROMPT], params, resume_output_token_ids=[done[:5]])[0].outputs[0]
    assert list(out.token_ids) == list(done[5:]) and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([PROMPT], params, resume_output_token_ids=[done])
