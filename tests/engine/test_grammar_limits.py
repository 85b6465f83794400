"""Structured-output limits, through the engine on a small random model with the default
model's tokenizer (49,152 tokens): a constraint that compiles longer than
``--max-grammar-compile-seconds`` fails its request with an error naming the flag, while
the compile still runs in the background (the request does not wait for it); and a step of
70 constrained rows, each with a constraint of its own, fills their next-token masks in one
batch on xgrammar's threads (64 rows or more: engine/grammar.py) with each row's mask its
own."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from engine import LLM, SamplingParams
from engine.request import RequestStatus
from tests.conftest import make_tiny_model
from tests.engine.families import random_prompts

pytestmark = pytest.mark.slow
ENGINE = dict(kv_cache_memory="16MiB", max_model_len=256)

# Takes seconds to compile against a 49,152-token vocabulary (about 2 s on the test machine,
# against a limit of 0.05 s): 80 required string properties, each with a pattern of its own.
SLOW_SCHEMA = {"type": "object",
               "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i},{i + 5}}}"} for i in range(80)},
               "required": [f"p{i}" for i in range(80)], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    d = make_tiny_model(tmp_path_factory.mktemp("grammar-limits") / "model", vocab_size=49152, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, d / f)
    return d


def test_a_constraint_slower_than_the_limit_fails_its_request(model_dir):
    llm = LLM(str(model_dir), max_grammar_compile_seconds=0.05, **ENGINE)
    engine = llm.engine
    so = {"json": json.dumps(SLOW_SCHEMA)}
    slow = engine.add_request("slow", [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=so))
    plain = engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    deadline = time.monotonic() + 60  # a wait for the compile would still end; a hang would not
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine never finished the slow constraint's request"
        if not engine.step().did_work:
            engine.wait_for_background(0.05)
    assert slow.status == RequestStatus.FINISHED_ABORTED and slow.output_token_ids == []
    assert slow.error.kind == "invalid_constraint"  # INVALID_ARGUMENT / HTTP 400 on the servers
    assert slow.error.message == ("request slow: compiling the json constraint took longer than "
                                  "--max-grammar-compile-seconds 0.05")
    # It failed at the limit, not after the compile: that still runs (its result is cached).
    assert not engine.grammars._cache[slow.sampling_params.structured_outputs.key].done()
    assert plain.status == RequestStatus.FINISHED_LENGTH and len(plain.output_token_ids) == 4
    assert engine.grammars.num_requests == 0
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_seventy_rows_each_keep_their_own_constraint(model_dir):
    """One step samples all 70 rows; from their second token on, their masks are filled
    together. Each constraint is one string of several tokens, its characters unlike the
    others' from the second on: a row given another row's mask writes a token its own
    constraint refuses (the request then ends with an error)."""
    llm = LLM(str(model_dir), **ENGINE)
    words = [f"w{i:02d}{chr(97 + i % 26)}{chr(97 + (i * 7) % 26)}end" for i in range(70)]
    assert len(set(words)) == 70
    params = [SamplingParams(temperature=0, max_tokens=16, structured_outputs={"choice": [w]}) for w in words]
    outs = llm.generate(random_prompts([3] * 70, vocab=49152, seed=1), params)
    assert [o.outputs[0].text for o in outs] == words
    assert {o.outputs[0].finish_reason for o in outs} == {"stop"}
    assert llm.engine.grammars._batch_matcher is not None  # the batched fill ran
