"""End to end on loopback: one real prefill server, one real decode server and
the gateway as separate processes on the default model, driven through the
official ``openai`` client and gRPC ``Gateway.Generate``; a test's independent
requests go at once (the servers batch them). Greedy (and seeded)
outputs must equal the offline ``engine.LLM`` token for token, and no KV block
may stay allocated afterwards. The module runs twice (over one prefill server): as the servers start on
CPU, and with the decode server's steps overlapped (``--async-scheduling``
over the decode-graph path run eagerly, the hidden ``--graphs-without-capture``), where
stop strings and disconnects end requests whose next step is already queued."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess, free_port, running_cluster

pytestmark = pytest.mark.slow

API_KEY = "e2e-key"
MAX_MODEL_LEN = 1024
ENGINE_FLAGS = ["--kv-cache-memory", "96MiB", "--max-model-len", str(MAX_MODEL_LEN)]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 4]
MAX_TOKENS = 16


def EngineProcess(role: str, flags: list[str] = ()) -> EngineServer:
    """A prefill or decode server on a free port, metrics served."""
    return EngineServer(role, [*ENGINE_FLAGS, *flags], name=role, metrics_port=free_port())


@pytest.fixture(scope="module")
def prefill_server():
    """The prefill server of both kinds of decode server's clusters."""
    prefill = EngineProcess("prefill")
    try:
        prefill.wait_ready()
        yield prefill
    except BaseException:
        prefill.kill()
        raise
    assert prefill.stop() == 0, prefill.logs()


@pytest.fixture(scope="module", params=["one-step", "overlapped"])
def servers(request, prefill_server):
    overlapped = ["--graphs-without-capture"] if request.param == "overlapped" else None
    decode = EngineProcess("decode", overlapped or [])
    gw = GatewayProcess("e2e", ["--prefill", prefill_server.address, "--decode", decode.address,
                                "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN)])
    gw.decode_address = decode.address  # type: ignore[attr-defined]
    gw.overlapped = overlapped is not None  # type: ignore[attr-defined]
    with running_cluster([decode], gw, api_key=API_KEY):
        yield gw


@pytest.fixture(scope="module")
def llm():
    from engine import LLM

    return LLM(model=None, kv_cache_memory="96MiB", max_model_len=MAX_MODEL_LEN)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw)


def _seeded() -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def refs(llm) -> dict:
    """The offline engine's outputs the tests compare with, computed once for both kinds
    of decode server: PROMPTS greedy and seeded, the chat, and PROMPTS[1] stopped at a newline."""
    return {"greedy": llm.generate(PROMPTS, _greedy()), "seeded": llm.generate(PROMPTS, _seeded()),
            "chat": llm.chat(CHAT, _greedy())[0].outputs[0],
            "stopped": llm.generate(PROMPTS[1], _greedy(stop=["\n"]))[0].outputs[0]}


@pytest.fixture(scope="module")
def oai(servers):
    return openai.OpenAI(base_url=servers.http_url + "/v1", api_key=API_KEY, max_retries=0)


def _assert_no_blocks_held(gw: GatewayProcess) -> None:
    deadline = time.monotonic() + 10
    while True:
        instances = httpx.get(gw.http_url + "/cluster",  # guarded by the key, like /v1/*
                              headers={"Authorization": f"Bearer {API_KEY}"}).json()["instances"]
        used = {i["address"]: i["kv_blocks_used"] for i in instances}
        if not any(used.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(used.values()), used
    assert all(i["healthy"] for i in instances)


def _concurrently(*calls):
    """Each of ``calls`` (no arguments) on a thread of its own, at once: the decode server
    batches them (each answer must still be its own, token for token). Their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_greedy_completions_match_offline_engine(servers, refs, oai):
    if servers.overlapped:
        pytest.skip("the overlapped decode server's HTTP answers: test_chat_and_stop_strings_match")
    model = oai.models.list().data[0].id

    def whole(prompt: str):
        return oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)

    def streamed(prompt: str) -> list:
        return list(oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True))

    got = _concurrently(*[lambda p=p: whole(p) for p in PROMPTS], *[lambda p=p: streamed(p) for p in PROMPTS])
    for ref, c, chunks in zip(refs["greedy"], got[:len(PROMPTS)], got[len(PROMPTS):]):
        out = ref.outputs[0]
        assert c.choices[0].text == out.text
        assert c.choices[0].finish_reason == out.finish_reason
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(ref.prompt_token_ids), len(out.token_ids))
        assert "".join(ch.choices[0].text for ch in chunks) == out.text
    _assert_no_blocks_held(servers)


def test_grpc_generate_matches_token_for_token(servers, refs):
    if servers.overlapped:
        pytest.skip("the overlapped decode server's greedy and seeded gRPC streams: "
                    "test_concurrent_streams_match_token_for_token")
    cases = [("greedy", common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)),
             ("seeded", common_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS))]
    work = [(sp, proto, prompt, ref) for sp, proto in cases for prompt, ref in zip(PROMPTS, refs[sp])]
    with grpc.insecure_channel(servers.grpc_address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        def generate(prompt: str, proto: common_pb2.SamplingParams) -> list:
            return list(stub.Generate(gateway_pb2.GenerateRequest(text=prompt, sampling=proto), timeout=120,
                                      metadata=[("authorization", f"Bearer {API_KEY}")]))

        got = _concurrently(*[lambda w=w: generate(w[2], w[1]) for w in work])
    for (sp, _, prompt, ref), msgs in zip(work, got):
        assert list(msgs[0].prompt_token_ids) == ref.prompt_token_ids
        assert [t for m in msgs for t in m.token_ids] == ref.outputs[0].token_ids, (prompt, sp)
        assert "".join(m.text for m in msgs) == ref.outputs[0].text
        assert msgs[-1].finish_reason == ref.outputs[0].finish_reason
    _assert_no_blocks_held(servers)


CONCURRENT_PROMPTS = [f"{p} ({i})" for i in range(4) for p in PROMPTS]
CONCURRENT_PARAMS = [(SamplingParams(temperature=0, max_tokens=MAX_TOKENS + i),
                      common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS + i)) if i % 2 else
                     (SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS - i % 5),
                      common_pb2.SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS - i % 5))
                     for i in range(len(CONCURRENT_PROMPTS))]


@pytest.fixture(scope="module")
def concurrent_refs(llm):
    """The offline engine's tokens for the concurrent requests, one batch (the servers batch
    them too), computed once for both kinds of decode server."""
    outs = llm.generate(CONCURRENT_PROMPTS, [sp for sp, _ in CONCURRENT_PARAMS])
    return [o.outputs[0].token_ids for o in outs]


def test_concurrent_streams_match_token_for_token(servers, concurrent_refs):
    """Requests arriving while others decode: on the overlapped decode server they join
    the steps scheduled ahead (their KV arrives between two steps)."""
    prompts, params, refs = CONCURRENT_PROMPTS, CONCURRENT_PARAMS, concurrent_refs

    def generate(i: int) -> list[int]:
        with grpc.insecure_channel(servers.grpc_address) as ch:
            msgs = gateway_pb2_grpc.GatewayStub(ch).Generate(
                gateway_pb2.GenerateRequest(text=prompts[i], sampling=params[i][1]), timeout=120,
                metadata=[("authorization", f"Bearer {API_KEY}")])
            return [t for m in msgs for t in m.token_ids]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(generate, range(len(prompts))))
    assert got == refs
    _assert_no_blocks_held(servers)


def test_chat_and_stop_strings_match(servers, refs, oai):
    messages = CHAT
    model = oai.models.list().data[0].id
    ref = refs["chat"]
    # Unstopped, the answer runs on past a newline within MAX_TOKENS; with stop=["\n"] it ends there.
    full, stopped = refs["greedy"][1].outputs[0], refs["stopped"]
    assert "\n" in full.text and stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index("\n")] and stopped.text
    chat, chunks, c, stop_chunks = _concurrently(
        lambda: oai.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0),
        lambda: list(oai.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})),
        lambda: oai.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                       stop=["\n"]),
        lambda: list(oai.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                            stop=["\n"], stream=True)))
    assert chat.choices[0].message.content == ref.text
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)

    assert c.choices[0].text == stopped.text
    assert c.choices[0].finish_reason == "stop"
    assert c.usage.completion_tokens < len(full.token_ids)
    assert "".join(ch.choices[0].text for ch in stop_chunks) == stopped.text
    assert stop_chunks[-1].choices[0].finish_reason == "stop"
    _assert_no_blocks_held(servers)


def test_logit_bias_and_allowed_token_ids_match_offline_engine(servers, refs, llm, oai):
    """Greedy, over both tiers (the first token is sampled on the prefill server): a +100 bias
    forces its token at every step, a -100 bias on the unbiased answer's first token bans it,
    and allowed_token_ids keeps every token inside its set; each answer is the offline engine's
    under the same controls, over HTTP and gRPC. A token id outside the vocabulary is a 400.
    (The controls are applied by the sampler alone: one kind of decode server is enough.)"""
    if servers.overlapped:
        pytest.skip("the controls are the sampler's: one kind of decode server is enough")
    model = oai.models.list().data[0].id
    first = refs["greedy"][0].outputs[0].token_ids[0]
    allowed = sorted(set(refs["greedy"][2].outputs[0].token_ids))[:6]
    cases = [dict(logit_bias={1000: 100.0}), dict(logit_bias={first: -100.0}), dict(allowed_token_ids=allowed)]
    wants = [o.outputs[0] for o in llm.generate([PROMPTS[0]] * len(cases), [_greedy(**case) for case in cases])]

    def http(case: dict):
        extra = {"allowed_token_ids": case["allowed_token_ids"]} if "allowed_token_ids" in case else {}
        bias = {str(t): b for t, b in case.get("logit_bias", {}).items()} or None
        return oai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                      logit_bias=bias, extra_body=extra)

    def grpc_tokens(case: dict) -> list[int]:
        with grpc.insecure_channel(servers.grpc_address) as ch:
            sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                 logit_bias=case.get("logit_bias", {}),
                                                 allowed_token_ids=case.get("allowed_token_ids", []))
            req = gateway_pb2.GenerateRequest(text=PROMPTS[0], sampling=sampling)
            return [t for d in gateway_pb2_grpc.GatewayStub(ch).Generate(
                req, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=120) for t in d.token_ids]

    got = _concurrently(*[lambda c=c: http(c) for c in cases], *[lambda c=c: grpc_tokens(c) for c in cases])
    for case, want, c, tokens in zip(cases, wants, got[:len(cases)], got[len(cases):]):
        assert c.choices[0].text == want.text, case
        assert tokens == want.token_ids, case
    forced, banned, kept = (w.token_ids for w in wants)
    assert forced == [1000] * MAX_TOKENS
    assert banned[0] != first
    assert kept and set(kept) <= set(allowed)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, logit_bias={"10000000": 5})
    _assert_no_blocks_held(servers)


def _close(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None) and (g is None or abs(g - w) < 1e-4), (what, i, g, w)


def test_echo_and_prompt_logprobs_match_offline_engine(servers, llm, oai):
    """Computed by the prefill server (its prefix cache holds this prompt by now: bypassed) and
    passed on by the gateway: a completion's echo with logprobs (the prompt's text first, its
    tokens first in the logprobs, the first one's null) and vLLM's prompt_logprobs equal the
    offline engine's (itself equal to transformers', tests/engine/test_prompt_logprobs.py),
    streamed and not; a chat's prompt_logprobs (the chat formatter's stream is tested in
    tests/gateway/test_openai_protocol.py) and gRPC's likewise."""
    if servers.overlapped:
        pytest.skip("the prefill server computes the prompt: one kind of decode server is enough")
    model = oai.models.list().data[0].id
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, logprobs=2, prompt_logprobs=2))[0]
    want_prompt = [None] + [lp.logprob for lp in ref.prompt_logprobs[1:]]
    want = want_prompt + [lp.logprob for lp in ref.outputs[0].logprobs]
    kw = dict(model=model, prompt=PROMPTS[0], max_tokens=2, temperature=0, echo=True, logprobs=2,
              extra_body={"prompt_logprobs": 2})
    c = oai.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in oai.completions.create(stream=True, **kw)]
    for streamed, text, tokens, values, tops, prompt_lps in [
            (False, c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, c.prompt_logprobs),
            (True, "".join(ch.text for ch in chunks), [t for ch in chunks for t in ch.logprobs.tokens],
             [v for ch in chunks for v in ch.logprobs.token_logprobs],
             [t for ch in chunks for t in ch.logprobs.top_logprobs], chunks[0].prompt_logprobs)]:
        assert text == PROMPTS[0] + ref.outputs[0].text, streamed
        assert "".join(tokens) == text and len(tokens) == len(want)
        _close(values, want, f"echo logprobs, streamed={streamed}")
        assert tops[0] is None and all(len(t) == 2 for t in tops[1:])
        assert prompt_lps[0] is None and len(prompt_lps) == len(ref.prompt_token_ids)
        for tok, entry, lp in zip(ref.prompt_token_ids[1:], prompt_lps[1:], ref.prompt_logprobs[1:]):
            assert abs(entry[str(tok)]["logprob"] - lp.logprob) < 1e-4 and entry[str(tok)]["rank"] == lp.rank
            assert {str(t) for t, _ in lp.top} <= set(entry)
    assert all(getattr(ch, "prompt_logprobs", None) is None for ch in chunks[1:])

    chat_ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    body = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    got = [None] + [next(iter(e.values()))["logprob"] for e in body.prompt_logprobs[1:]]
    _close(got, [None] + [lp.logprob for lp in chat_ref.prompt_logprobs[1:]], "chat")

    with grpc.insecure_channel(servers.grpc_address) as ch:
        req = gateway_pb2.GenerateRequest(text=PROMPTS[0], sampling=common_pb2.SamplingParams(
            temperature=0, max_tokens=2, prompt_logprobs=1))
        msgs = list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120,
                                                               metadata=[("authorization", f"Bearer {API_KEY}")]))
    assert [lp.token_id for lp in msgs[0].prompt_logprobs] == ref.prompt_token_ids[1:]
    _close([lp.logprob for lp in msgs[0].prompt_logprobs], want_prompt[1:], "gRPC")
    assert all(not m.prompt_logprobs for m in msgs[1:])
    _assert_no_blocks_held(servers)


def _decode_load(gw: GatewayProcess) -> common_pb2.LoadInfo:
    """The decode server's load, asked now (the gateway's /cluster is up to a poll old)."""
    with grpc.insecure_channel(gw.decode_address) as ch:  # type: ignore[attr-defined]
        return engine_pb2_grpc.DecodeStub(ch).GetLoad(common_pb2.LoadRequest(), timeout=10)


def _decode_counter(gw: GatewayProcess, name: str) -> float:
    """A counter of the decode server's metrics (summed over its labels)."""
    text = httpx.get(_decode_load(gw).metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _decode_generation_tokens(gw: GatewayProcess) -> float:
    return _decode_counter(gw, "pdserve:generation_tokens_total")


# A request far longer than the disconnect takes to reach the decode server; how long it would
# run depends on the machine, so the test waits for its blocks to come back (HANG_S only
# bounds a hang) and then checks that it was cut short rather than run to its end.
DISCONNECT_TOKENS = 900
HANG_S = 120.0


def test_disconnect_frees_blocks(servers):
    before = _decode_generation_tokens(servers)
    with httpx.stream("POST", servers.http_url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": PROMPTS[2], "max_tokens": DISCONNECT_TOKENS, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines):  # the first event: the request is decoding
            pass
        assert _decode_load(servers).kv_blocks_used > 0
    deadline = time.monotonic() + HANG_S
    while (load := _decode_load(servers)).kv_blocks_used or load.num_running:
        assert time.monotonic() < deadline, f"blocks still held {HANG_S}s after the disconnect: {load}"
        time.sleep(0.05)
    # Cut short: the decode server made fewer than the DISCONNECT_TOKENS - 1 it would have
    # (the prefill server samples the first).
    generated = _decode_generation_tokens(servers) - before
    assert generated < DISCONNECT_TOKENS - 1, generated
    _assert_no_blocks_held(servers)


def test_decode_steps_go_ahead_only_when_overlapped(servers, oai):
    """One more request decodes alone (after whatever the tests above ran): the decode
    server's step counters say how many steps it took, and how many of them were queued
    while the one before ran."""
    model = oai.models.list().data[0].id
    _assert_no_blocks_held(servers)  # nothing else runs there
    before = (_decode_counter(servers, "pdserve:engine_steps_total"),
              _decode_counter(servers, "pdserve:engine_steps_ahead_total"))
    oai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                           extra_body={"ignore_eos": True})
    steps = _decode_counter(servers, "pdserve:engine_steps_total") - before[0]
    ahead = _decode_counter(servers, "pdserve:engine_steps_ahead_total") - before[1]
    # The prefill server samples the first token; the decode server one per step after it.
    # Overlapped, every step but the first is queued ahead, and the one queued behind the
    # last token is computed and thrown away.
    if servers.overlapped:
        assert (steps, ahead) == (MAX_TOKENS, MAX_TOKENS - 1)
    else:
        assert (steps, ahead) == (MAX_TOKENS - 1, 0)
