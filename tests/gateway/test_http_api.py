"""A real gateway process in front of fake prefill + decode servers
(``--api-key`` set): the OpenAI HTTP API end to end, with raw httpx and
with the official ``openai`` client."""
from __future__ import annotations

import json
import threading

import grpc
import httpx
import openai
import pytest

from tests.gateway.conftest import API_KEY, SCRIPT_TEXT

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.main.http_url, headers=AUTH, timeout=20) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster.main.http_url + "/v1", api_key=API_KEY, max_retries=0)


def _sse(r: httpx.Response) -> list[dict]:
    events = [line for line in r.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events), r.text
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_auth(cluster):
    url = cluster.main.http_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # only /v1/* is protected
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_completion_through_prefill_and_decode(cluster, client, tokenizer):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi", "max_tokens": 5,
                                             "temperature": 0}, headers={"traceparent": "00-ab-cd-01"})
    body = r.json()
    script = cluster.fake.state.script
    assert body["choices"][0]["text"] == tokenizer.decode(script[:5])
    assert body["choices"][0]["finish_reason"] == "length"
    n_prompt = len(tokenizer.encode("Say hi"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5, "total_tokens": n_prompt + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["id"].startswith("cmpl-") and r.headers["x-request-id"] == body["id"]
    (dreq,), (preq,) = cluster.fake.state.decode_requests, cluster.fake.state.prefill_requests
    assert dreq.remote_prefill and dreq.request_id == preq.request_id
    assert preq.decode_address == cluster.fake.decode_address and list(preq.dst_block_ids) == [100]
    assert dreq.sampling.max_tokens == 5 and dreq.sampling.temperature == 0
    assert cluster.fake.state.metadata[0]["traceparent"] == "00-ab-cd-01"
    cluster.fake.wait_idle()


def test_whole_script_ends_with_eos(cluster, client):
    body = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": None}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(cluster.fake.state.script) + 1
    assert cluster.fake.state.decode_requests[0].sampling.max_tokens == 8192 - 3


def test_streaming_sse(cluster, client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == SCRIPT_TEXT
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 1


def test_stop_string_cancels_the_decode_call(cluster, client):
    # The fake's stream cannot end by itself: only the gateway's cancel, on the stop string, ends it.
    cluster.fake.state.knobs.hold_before_last = threading.Event()
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stop": ["answer"]}).json()
    assert body["choices"][0]["text"] == "Hello! I am a fake model. The "
    assert body["choices"][0]["finish_reason"] == "stop"
    cluster.fake.wait_idle()
    assert len(cluster.fake.state.cancelled) == 1  # ended early by the gateway


def test_chat_streaming_and_not(cluster, client):
    messages = [{"role": "user", "content": "Hi!"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    chunks = _sse(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        body["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs(cluster, client, tokenizer):
    # The fake engine gives each token logprob -0.25 and its k-th runner-up
    # (token id + k) logprob -1 - k; the first token's come from the prefill server.
    script = cluster.fake.state.script[:3]
    text = [tokenizer.decode([t]) for t in script]
    runner_up = [tokenizer.decode([t + 1]) for t in script]
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert cluster.fake.state.decode_requests[-1].sampling.logprobs == 2
    assert lp["tokens"] == text and lp["token_logprobs"] == [-0.25] * 3
    assert lp["top_logprobs"] == [{a: -0.25, b: -2.0} for a, b in zip(text, runner_up)]
    assert lp["text_offset"] == [0, len(text[0]), len(text[0]) + len(text[1])]
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == text and [c["logprob"] for c in content] == [-0.25] * 3
    assert [c["bytes"] for c in content] == [list(t.encode()) for t in text]
    assert [[(x["token"], x["logprob"]) for x in c["top_logprobs"]] for c in content] == \
        [[(a, -0.25), (b, -2.0)] for a, b in zip(text, runner_up)]
    # logprobs without top_logprobs: the sampled token's only.
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 3, "logprobs": True}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"], c["top_logprobs"]) for c in content] == [(t, -0.25, []) for t in text]


def test_openai_client(cluster, oai):
    c = oai.completions.create(model=MODEL, prompt="Say hi", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 6
    assert c.usage.prompt_tokens_details.cached_tokens == 0
    streamed = "".join(ch.choices[0].text for ch in oai.completions.create(
        model=MODEL, prompt="Say hi", max_tokens=6, temperature=0, stream=True))
    assert streamed == c.choices[0].text
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=60)
    assert chat.choices[0].message.content == SCRIPT_TEXT and chat.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         max_completion_tokens=60, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"top_k": 5})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == SCRIPT_TEXT
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens
    assert cluster.fake.state.decode_requests[-1].sampling.top_k == 5
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=10_000)


def test_cached_tokens_and_skipped_blocks(cluster, client):
    cluster.fake.state.knobs.num_cached_tokens = 32
    body = client.post("/v1/completions", json={"prompt": list(range(5, 60)), "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert cluster.fake.state.prefill_requests[0].num_skip_blocks == 2


def test_decode_queue_full_is_429(cluster, client, oai):
    cluster.fake.state.knobs.queue_full = True
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
    assert r.headers["retry-after"] == "1"
    with pytest.raises(openai.RateLimitError):
        oai.completions.create(model=MODEL, prompt="x")


def test_prefill_failure_is_503_and_frees_the_decode_blocks(cluster, client):
    cluster.fake.state.knobs.prefill_error = grpc.StatusCode.INTERNAL
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "prefill_failed"
    assert f"prefill server {cluster.fake.prefill_address}" in err["message"] and "KV transfer failed" in err["message"]
    cluster.fake.wait_idle()
    assert len(cluster.fake.state.cancelled) == 1


def test_error_after_the_first_token_is_an_sse_error_event(cluster, client, oai):
    cluster.fake.state.knobs.fail_after_deltas = 2
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True})
    assert r.status_code == 200
    events = _sse(r)
    assert events[0]["choices"][0]["text"] and events[-1]["error"]["type"] == "internal_error"
    assert "decode step failed" in events[-1]["error"]["message"]
    with pytest.raises(openai.APIError, match="decode step failed"):
        list(oai.completions.create(model=MODEL, prompt="x", max_tokens=50, stream=True))
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
    assert r.status_code == 500 and "decode step failed" in r.json()["error"]["message"]


def test_client_disconnect_cancels_internal_calls(cluster):
    cluster.fake.state.knobs.token_delay = 0.3
    with httpx.Client(base_url=cluster.main.http_url, headers=AUTH, timeout=20) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: ")
    cluster.fake.wait_idle()
    # Non-streaming: the client gives up while the request runs.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.main.http_url + "/v1/completions", headers=AUTH, timeout=0.5,
                   json={"prompt": "x", "max_tokens": 50})
    cluster.fake.wait_idle()
    assert len(cluster.fake.state.cancelled) == 2


def test_client_request_id_and_cluster_view(cluster, client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "my-id"})
    assert r.json()["id"] == "my-id"
    internal = cluster.fake.state.decode_requests[0].request_id
    assert internal.startswith("my-id-") and internal != "my-id"
    instances = client.get("/cluster").json()["instances"]
    assert [(i["role"], i["healthy"]) for i in instances] == [("prefill", True), ("decode", True)]
    assert instances[1]["metrics_url"] == "http://fake/metrics" and instances[1]["kv_blocks_total"] == 1000
    metrics = client.get("/metrics").text
    assert 'pdserve:request_success_total{finished_reason="length",model_name="SmolLM2-135M-Instruct"}' in metrics
