"""Speculation beside rows that must not speculate, through the offline API on CPU: in
one batch, a plain greedy row gets proposals (n-gram, and a draft model: the target as
its own draft) while a JSON-schema row, a regex row, a choice row and a logprobs row get
none. The constrained rows' outputs hold their constraint and end without error, the
logprobs row has one entry per token, and every row's tokens (and the logprobs) are
those of the same batch run without speculation."""
from __future__ import annotations

import json
import math
import re
import shutil

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.slow

ENGINE = dict(kv_cache_memory="16MiB", max_model_len=512, block_size=4)
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
REGEX = "[a-z]{5,30}"
CHOICES = ["Paris is nice", "Rome", "Oslo in winter"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    # A real tokenizer (a grammar needs one); random weights, so only the constraint
    # keeps the output in shape, and greedy output repeats itself (n-gram proposals).
    d = make_tiny_model(tmp_path_factory.mktemp("spec-so") / "model", seed=3, vocab_size=49152, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / f, d / f)
    return d


def _batch():
    g = torch.Generator().manual_seed(1)
    phrase = torch.randint(3, 4000, (6,), generator=g).tolist()
    prompts = [phrase * 3 + torch.randint(3, 4000, (n,), generator=g).tolist() for n in (1, 4, 9, 2)]
    prompts.append(prompts[0])  # the logprobs row: the plain row's prompt (n-gram proposals for it)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),  # plain: speculates
              SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": PERSON}),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": REGEX}),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": CHOICES}),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)]
    return prompts, params


def _check_rows(outs) -> None:
    plain, js, rx, ch, lp = (o.outputs[0] for o in outs)
    assert plain.finish_reason == "length" and len(plain.token_ids) == 40
    assert js.finish_reason == "stop", (js.finish_reason, js.text)
    jsonschema.validate(json.loads(js.text), PERSON)
    assert rx.finish_reason != "error" and re.fullmatch(REGEX, rx.text), (rx.finish_reason, rx.text)
    assert ch.finish_reason == "stop" and ch.text in CHOICES, (ch.finish_reason, ch.text)
    assert lp.finish_reason == "length" and len(lp.token_ids) == 30
    assert lp.logprobs is not None and len(lp.logprobs) == len(lp.token_ids)
    assert [e.token_id for e in lp.logprobs] == lp.token_ids


def _same_logprobs(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4), (a, b)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(math.isclose(x, y, abs_tol=1e-4) for (_, x), (_, y) in zip(a.top, b.top)), (a.top, b.top)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_and_logprob_rows_beside_speculating_rows(model_dir, method):
    prompts, params = _batch()
    want = LLM(str(model_dir), **ENGINE).generate(prompts, params)
    _check_rows(want)
    spec = NGRAM if method == "ngram" else \
        '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}' % model_dir
    llm = LLM(str(model_dir), **ENGINE, speculative_config=spec)
    got = llm.generate(prompts, params)
    _check_rows(got)
    stats = llm.engine.scheduler.spec
    assert stats.num_draft_tokens > 0, stats  # the plain row speculated
    for g, w in zip(got, want):
        assert (g.outputs[0].token_ids, g.outputs[0].finish_reason) == \
            (w.outputs[0].token_ids, w.outputs[0].finish_reason)
    _same_logprobs(got[4].outputs[0].logprobs, want[4].outputs[0].logprobs)
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
