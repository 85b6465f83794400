"""Structured outputs in the engine, through the offline API, on a small random model
with the default model's tokenizer (49,152 tokens: a real vocabulary, with the
multi-character and byte tokens a grammar must cope with; random weights make the
model want anything, so only the constraint keeps the output in shape): every kind of
constraint holds on greedy and seeded outputs and finishes with "stop"
when the grammar completes; preemption and overlapped steps keep the matcher on the
request's own tokens; a constraint that does not compile ends its request with an
``invalid_constraint`` error naming the problem; a row no token can satisfy ends with
finish reason "error"; the matcher takes each token once, wherever it was sampled."""
from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import Request, RequestStatus
from engine.sampler import SAMPLE_FAILED, Sampler, SamplingRow
from engine.structured_outputs import GrammarState, StructuredOutputsParams
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}]


ENGINE = dict(kv_cache_memory="16MiB", max_model_len=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    d = make_tiny_model(tmp_path_factory.mktemp("so") / "model", vocab_size=49152, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / f, d / f)
    return d


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **ENGINE)


def _one(llm: LLM, so: dict, **sampling):
    sp = SamplingParams(**{"temperature": 0, "max_tokens": 80, **sampling}, structured_outputs=so)
    return llm.chat(ASK, sp)[0].outputs[0]


def test_each_kind_of_constraint_holds_and_stops_when_complete(llm):
    out = _one(llm, {"json": PERSON})
    jsonschema.validate(json.loads(out.text), PERSON)
    assert out.finish_reason == "stop"
    assert out.text == json.dumps(json.loads(out.text), ensure_ascii=False)  # no free whitespace
    obj = _one(llm, {"json_object": True})
    assert isinstance(json.loads(obj.text), dict) and obj.finish_reason == "stop"
    phone = _one(llm, {"regex": r"\+1-[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", phone.text) and phone.finish_reason == "stop"
    pick = _one(llm, {"choice": ["Paris", "Rome", "Oslo"]})
    assert pick.text in ("Paris", "Rome", "Oslo") and pick.finish_reason == "stop"
    yes_no = _one(llm, {"grammar": 'root ::= ("yes" | "no") " because " [a-z ]{3,20} "."'})
    assert re.fullmatch(r"(yes|no) because [a-z ]{3,20}\.", yes_no.text), yes_no.text
    # Unconstrained, the model does not answer in any of these forms.
    free = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))[0].outputs[0].text
    assert not free.startswith("{") and not re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}|Paris|Rome|Oslo", free)


def test_seeded_sampling_keeps_to_the_schema(llm):
    for seed in range(4):
        out = _one(llm, {"json": PERSON}, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.finish_reason == "stop"


def test_one_token_outputs(llm):
    # A grammar complete after its first token ends at once, with "stop"; max_tokens 1
    # ends an incomplete one with "length".
    single = [t for t in ("A", "B", "C")]
    out = _one(llm, {"choice": single})
    assert out.text in single and len(out.token_ids) == 1 and out.finish_reason == "stop"
    cut = _one(llm, {"json": PERSON}, max_tokens=1)
    assert cut.text.startswith("{") and len(cut.token_ids) == 1 and cut.finish_reason == "length"


def test_preemption_and_overlapped_steps_keep_the_matcher_on_the_tokens(model_dir):
    so = {"json": PERSON}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 49152, (n,), generator=g).tolist() for n in (21, 37, 45, 60)]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),  # unconstrained, beside
              SamplingParams(temperature=0.8, seed=7, max_tokens=48, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=48, structured_outputs={"regex": "[a-z]{5,40}"})]
    roomy = LLM(str(model_dir), **ENGINE)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # 12 blocks of 16 tokens: the four requests cannot all run, the newest is recomputed.
    tight = LLM(str(model_dir), num_gpu_blocks_override=12, max_model_len=512, max_num_batched_tokens=64)
    # Its grammars compiled first (a cached grammar is ready at once): otherwise the requests
    # start as their compiles end, and a slow compile lets the others finish before it runs.
    tight.generate(prompts[:1] * 2, [SamplingParams(max_tokens=1, structured_outputs=p.structured_outputs)
                                     for p in (params[0], params[3])])
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
    # Overlapped steps: the decode-graph path run eagerly; constrained rows are scheduled
    # ahead too, their masks filled once the tokens in flight are taken (while the step
    # ahead's forward runs), and the seeded row draws as it would one step at a time.
    overlapped = LLM(str(model_dir), **ENGINE, async_scheduling=True, graphs_without_capture=True)
    assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params)] == want
    assert overlapped.engine.num_steps_ahead_total > 10
    only_constrained = overlapped.generate(prompts[3], params[3])[0].outputs[0].token_ids
    assert only_constrained == want[3]
    pool = tight.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and tight.engine.grammars.num_requests == 0


def test_mixed_step_graphs_keep_the_matcher_on_the_tokens(model_dir, monkeypatch):
    """Steps with prefill chunks on their graph path (run eagerly here: the buffers, padding and
    gathered rows of the CUDA path), overlapped: constrained rows beside chunks get their masks
    and give the tokens of plain eager steps."""
    so = {"json": PERSON}
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(100, 49152, (n,), generator=g).tolist() for n in (21, 37, 45, 60)]
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[a-z]{5,40}"})]
    kw = dict(**ENGINE, max_num_batched_tokens=32, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir), **kw).generate(prompts, params)]
    monkeypatch.setenv("PDSERVE_MIXED_GRAPHS", "8,16,32")
    llm = LLM(str(model_dir), **kw, async_scheduling=True, graphs_without_capture=True, overlap_mixed_steps=True)
    runner = llm.engine.runner
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert runner.graphs.num_mixed_replays > 0 and llm.engine.num_steps_ahead_total > 5
    assert llm.engine.grammars.num_requests == 0


@pytest.mark.parametrize("so,message", [
    ({"regex": "(unclosed"}, "invalid regex: Regex parsing error at position"),
    ({"grammar": "root ::= missing_rule"}, "invalid grammar:"),
    ({"json": '{"type": "object", "properties": {"a": {"type": "strin"}}}'}, "invalid json:"),
])
def test_a_constraint_that_does_not_compile_ends_its_request(llm, so, message):
    engine = llm.engine
    req = engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=so))
    while engine.has_unfinished_requests():
        engine.step()
    assert req.status == RequestStatus.FINISHED_ABORTED and req.output_token_ids == []
    assert req.error.kind == "invalid_constraint" and message in req.error.message, req.error


def test_unsupported_schema_keywords_are_named():
    for schema, named in [({"type": "array", "uniqueItems": True}, "'uniqueItems' at #"),
                          ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
                           "'not' at #/properties/a"),
                          ({"type": "string", "format": "phone"}, "format 'phone' at #")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            SamplingParams(structured_outputs={"json": schema})
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="is not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_a_row_no_token_meets_fails_alone():
    # The sampler: an all-zero bitmask leaves only -inf, greedy or sampled: SAMPLE_FAILED.
    logits = torch.randn(3, 64)
    free = SamplingParams(temperature=0)
    none_allowed = torch.zeros(2, dtype=torch.int32)
    one_allowed = torch.zeros(2, dtype=torch.int32)
    one_allowed[1] = 1 << 5  # token 37
    rows = [SamplingRow(free, [1], [], frozenset(), bitmask=none_allowed),
            SamplingRow(SamplingParams(temperature=1.0, seed=3), [1], [], frozenset(), bitmask=none_allowed),
            SamplingRow(free, [1], [], frozenset(), bitmask=one_allowed)]
    assert Sampler().sample(logits, rows).token_ids == [SAMPLE_FAILED, SAMPLE_FAILED, 37]


def test_no_token_meeting_the_constraint_finishes_with_error(llm):
    # The scheduler's side of it: a failed sample of a constrained request ends it alone
    # with finish reason "error" and the reason.
    engine = llm.engine
    so = SamplingParams(max_tokens=8, structured_outputs={"choice": ["A"]})
    req = engine.add_request("stuck", [1, 2, 3], so)
    other = engine.add_request("fine", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.grammars.poll(req)[0] == GrammarState.WAIT:  # compiled before the step that samples it
        pass
    out = engine.scheduler.schedule()
    assert [s.request for s in out.scheduled] == [req, other]
    engine.scheduler.update_from_output(out, [SAMPLE_FAILED, 100])
    assert req.status == RequestStatus.FINISHED_ERROR and req.finish_reason == "error"
    assert req.error.kind == "constraint" and "no token meets the structured-output constraint" in req.error.message
    while engine.has_unfinished_requests():
        engine.step()
    assert other.status == RequestStatus.FINISHED_LENGTH and len(other.output_token_ids) == 3


def test_grammars_load_nothing_until_a_constraint_is_compiled(tmp_path):
    """The engine hands its grammar manager to the scheduler at start, and neither loads a
    tokenizer nor xgrammar then: a model without a tokenizer serves unconstrained requests,
    and refuses a constrained one at admission."""
    llm = LLM(str(make_tiny_model(tmp_path / "model")), **ENGINE)
    grammars = llm.engine.grammars
    assert llm.engine.scheduler.grammars is grammars and grammars._compiler is None
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    assert grammars._compiler is None and grammars.num_requests == 0
    with pytest.raises(ValueError, match="structured outputs need the model's tokenizer"):
        llm.engine.add_request("c", [1, 2, 3], SamplingParams(structured_outputs={"choice": ["A"]}))
    assert not llm.engine.has_unfinished_requests()


def test_the_matcher_takes_each_token_once(llm):
    # The decode tier appends the prefill tier's first token itself; polling twice, or after
    # more tokens came, accepts every token exactly once.
    grammars = llm.engine.grammars
    req = Request("m", [1, 2, 3], SamplingParams(structured_outputs={"choice": ["Paris is nice", "Rome"]}))
    tok = llm.tokenizer
    ids = tok.encode("Paris is nice", add_special_tokens=False)
    grammars.register(req)
    state = GrammarState.WAIT
    while state == GrammarState.WAIT:
        state, _ = grammars.poll(req)
    for i, t in enumerate(ids):
        req.append_output_token(t)
        assert grammars.poll(req)[0] == (GrammarState.DONE if i == len(ids) - 1 else GrammarState.READY)
        assert grammars.poll(req)[0] == (GrammarState.DONE if i == len(ids) - 1 else GrammarState.READY)  # nothing new
    grammars.free(req.request_id)
    late = Request("late", [1, 2, 3], SamplingParams(structured_outputs={"choice": ["Paris is nice", "Rome"]}))
    for t in ids:  # tokens that arrived before the grammar was looked at: taken in one go
        late.append_output_token(t)
    grammars.register(late)
    while (state := grammars.poll(late)[0]) == GrammarState.WAIT:
        pass
    assert state == GrammarState.DONE
    wrong = Request("wrong", [1, 2, 3], SamplingParams(structured_outputs={"choice": ["Rome"]}))
    wrong.append_output_token(ids[0])
    grammars.register(wrong)
    while (result := grammars.poll(wrong))[0] == GrammarState.WAIT:
        pass
    assert result[0] == GrammarState.ERROR and "does not match the constraint" in result[1]
    for r in (late, wrong):
        grammars.free(r.request_id)


def test_only_stop_tokens_is_read_from_the_bits():
    """The vectorised check of "this mask allows stop tokens and nothing else" against a
    naive one, on random masks with stop tokens at word edges (bit 31 is the sign bit)."""
    from pathlib import Path

    from engine.grammar import GrammarManager

    vocab, stops = 200, (31, 32, 63, 199)
    gm = GrammarManager(Path("."), vocab, stops)
    g = torch.Generator().manual_seed(0)
    words = -(-vocab // 32)
    masks = torch.zeros(64, words, dtype=torch.int32)
    for i in range(64):
        allowed = {t for t in stops if torch.rand(1, generator=g) < 0.5}
        if i % 3 == 0:
            allowed.add(int(torch.randint(0, vocab, (1,), generator=g)))
        for t in allowed:
            masks[i, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    got = gm._only_stop_tokens(masks).tolist()
    for row, have in zip(masks, got):
        allowed = {t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1}
        assert have == (bool(allowed) and allowed <= set(stops)), (allowed, have)
    gm.close()
