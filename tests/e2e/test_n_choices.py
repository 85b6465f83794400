"""``n`` and ``best_of`` end to end (the session's ``hermes_cluster``: one prefill and one
decode server on the default model; the official openai client, and gRPC): seeded choices are
the single requests with seed + index; the prompt is prefilled, and its KV transferred, once
(the prefill server's counters, the decode server's transfers); streamed choices interleave by
index, each ending with its own finish_reason; ``best_of`` returns the sequences with the
highest cumulative logprob; each choice holds to a structured-output constraint; a stream
cancelled midway leaves no KV block held."""
from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import HERMES_API_KEY
from tests.processes import metric_total

pytestmark = pytest.mark.slow

PROMPT = ("You are a painter who keeps a notebook of the colours of the sea at every hour of the day. "
          "Write the notebook's entry for a windy autumn morning, then list three colours and say why you like each:")
BLOCK_SIZE = 16  # the engine servers' default
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def oai(hermes_cluster):
    return openai.OpenAI(base_url=hermes_cluster.http_url + "/v1", api_key=HERMES_API_KEY, max_retries=0)


def _metric(engine, name: str) -> float:
    """A counter of an engine server, summed over its labels."""
    return metric_total(engine.load().metrics_url, name)


def _single(oai, seed: int, **kw):
    return oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=1.0, seed=seed, extra_body={"ignore_eos": True}, **kw).choices[0]


def test_n_seeded_choices_are_the_single_requests_and_the_prompt_is_prefilled_once(oai, hermes_cluster):
    prefill, decode = hermes_cluster.prefill, hermes_cluster.decode
    before = (_metric(prefill, "pdserve:prompt_tokens_total"), _metric(prefill, "pdserve:generation_tokens_total"),
              _metric(decode, "pdserve:kv_transfer_seconds_count"), _metric(decode, "pdserve:prefix_cache_hits_total"))
    r = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS, n=4,
                               temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    after = (_metric(prefill, "pdserve:prompt_tokens_total"), _metric(prefill, "pdserve:generation_tokens_total"),
             _metric(decode, "pdserve:kv_transfer_seconds_count"), _metric(decode, "pdserve:prefix_cache_hits_total"))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # one prompt prefilled (its first token sampled once) and one KV transfer, for four choices
    assert after[0] - before[0] == r.usage.prompt_tokens
    assert after[1] - before[1] == 1
    assert after[2] - before[2] == 1
    # the other three choices took the prompt's full blocks on the decode server as prefix hits
    full = (r.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert full >= 2 * BLOCK_SIZE and after[3] - before[3] >= 3 * full
    assert r.usage.completion_tokens == 4 * MAX_TOKENS  # the prompt counted once
    singles = [_single(oai, 11 + i) for i in range(4)]
    assert [c.text for c in r.choices] == [s.text for s in singles]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert len({c.text for c in r.choices}) > 1  # seeds 11..14 are four samples, not one


def test_n_streamed_chat_interleaves_choices_that_equal_the_whole_response(oai):
    model = oai.models.list().data[0].id
    kw = dict(model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=MAX_TOKENS,
              n=3, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(**kw)
    texts, finishes, order, usage = {}, {}, [], None
    for chunk in oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            order.append(c.index)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert order[:3] == [0, 1, 2]  # each choice's role chunk first, as OpenAI streams them
    assert usage.completion_tokens == 3 * MAX_TOKENS and usage.prompt_tokens == whole.usage.prompt_tokens


def test_best_of_returns_the_sequences_with_the_highest_cumulative_logprob(oai):
    model = oai.models.list().data[0].id
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, n=2, temperature=1.0, seed=21,
                               extra_body={"ignore_eos": True, "best_of": 4})
    singles = [_single(oai, 21 + i, logprobs=0) for i in range(4)]
    score = [sum(s.logprobs.token_logprobs) for s in singles]
    best = sorted(range(4), key=lambda i: (-score[i], i))[:2]
    assert [c.text for c in r.choices] == [singles[i].text for i in best]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].logprobs is None  # ranked by logprobs the client did not ask to see
    assert r.usage.completion_tokens == 4 * MAX_TOKENS  # every sequence generated counts
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=1, stream=True,
                               extra_body={"best_of": 2})
    with pytest.raises(openai.BadRequestError, match=r"n must be in \[1, 128\], got 129"):
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=129)


def _grpc(hermes_cluster, sampling) -> list[gateway_pb2.GenerateResponse]:
    with grpc.insecure_channel(hermes_cluster.grpc_address) as ch:
        return list(gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(text=PROMPT, sampling=sampling), timeout=60,
            metadata=[("authorization", f"Bearer {HERMES_API_KEY}")]))


def test_n_over_grpc_tags_each_message_with_its_choice(hermes_cluster):
    def sampling(seed: int, **kw):
        return common_pb2.SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)

    msgs = _grpc(hermes_cluster, sampling(31, n=2))
    tokens = {i: [t for m in msgs if m.index == i for t in m.token_ids] for i in range(2)}
    finishes = {m.index: m.finish_reason for m in msgs if m.finish_reason}
    singles = [[t for m in _grpc(hermes_cluster, sampling(31 + i)) for t in m.token_ids] for i in range(2)]
    assert [tokens[0], tokens[1]] == singles
    assert finishes == {0: "length", 1: "length"}
    assert msgs[-1].usage.completion_tokens == 2 * MAX_TOKENS


def test_a_cancelled_n_stream_leaves_no_block_held(oai, hermes_cluster):
    stream = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=400, n=4,
                                    temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    seen: set[int] = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices if c.text)
        if len(seen) == 4:
            break
    stream.close()
    hermes_cluster.decode.wait_idle()
    hermes_cluster.prefill.wait_idle()


def test_each_choice_holds_to_the_structured_output_constraint(oai):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"],
              "additionalProperties": False}
    r = oai.chat.completions.create(model=oai.models.list().data[0].id, n=3, temperature=1.0, seed=41, max_tokens=40,
                                    messages=[{"role": "user", "content": "Give a colour as JSON."}],
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "c", "schema": schema}})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)
