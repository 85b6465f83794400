"""Thinking models end to end: a real decode server on the default model (SmolLM2; it
prefills too: the reasoning's end token ids travel to it in the request's sampling
parameters, as they would to a prefill server; the session's ``hermes_cluster``'s decode
server) behind two gateways of this module's, one with
``--reasoning-parser qwen3``, one with ``deepseek_r1``, driven through the official
``openai`` client and gRPC.

SmolLM2 has no think tokens, so the gateways read a copy of its tokenizer in which two of
its tokens are ``<think>`` and ``</think>`` instead: `` because`` (which it writes greedily
in "The sky appears blue because of ...") is ``</think>``, `` Antim`` (which it never
writes here) ``<think>``. The model and its output are untouched: the same tokens decode
to a thinking model's answer, "The sky appears blue</think> of a process called ...", and
its reasoning ends where the model wrote `` because`` of its own accord. The chat
template is ChatML that closes the reasoning in the prompt under ``enable_thinking:
false``, as Qwen3's does.

What it proves: ``reasoning_content`` and ``content`` come apart, streamed (reasoning
deltas first) and not, and gRPC's ``reasoning_text``; the raw completion of the same prompt
is reasoning + ``</think>`` + content; ``chat_template_kwargs`` reach the template (four
more prompt tokens, no reasoning) and bad ones are 400s; structured outputs and a forced
tool call apply to the content only, after the reasoning the model wrote freely; /v1/responses
returns the reasoning as a reasoning item before the message.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.processes import GatewayProcess

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
MODEL = "SmolLM2-135M-Instruct"
END, START = "</think>", "<think>"
RENAMED = {"Ġbecause": END, "ĠAntim": START}  # byte-level BPE: Ġ is the space
ASK = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 12
TEMPLATE = """{% for m in messages %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}{% if tools %}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
    "additionalProperties": False}}}


def thinking_tokenizer(src: Path, dst: Path) -> Path:
    """``src``'s tokenizer and config in ``dst`` with the tokens of ``RENAMED`` renamed (the
    merges that made or used them dropped) and declared as added, non-special tokens (a
    thinking model's think tags are; its detokenized text keeps them)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    tok = json.loads((src / "tokenizer.json").read_text())
    model = tok["model"]
    for old, new in RENAMED.items():
        token_id = model["vocab"].pop(old)
        model["vocab"][new] = token_id
        model["merges"] = [m for m in model["merges"] if old not in (parts := (m.split(" ") if isinstance(m, str)
                                                                               else m)) and "".join(parts) != old]
        tok["added_tokens"].append({"id": token_id, "content": new, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "think.jinja").write_text(TEMPLATE)
    return dst


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory, hermes_cluster):
    think = thinking_tokenizer(default_model_dir, tmp_path_factory.mktemp("thinking") / "model")
    common = ["--model", str(think), "--served-model-name", MODEL, "--chat-template", str(think / "think.jinja"),
              "--max-model-len", str(MAX_MODEL_LEN)]
    decode = hermes_cluster.decode
    qwen3 = GatewayProcess("qwen3", ["--decode", decode.address, *common,
                                     "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                                     "--enable-auto-tool-choice"])
    r1 = GatewayProcess("r1", ["--decode", decode.address, *common, "--reasoning-parser", "deepseek_r1"])
    try:
        for gw in (qwen3, r1):
            gw.wait_ready()
            gw.wait_healthy()
        yield {"qwen3": qwen3, "deepseek_r1": r1}
    except BaseException:
        qwen3.kill()
        r1.kill()
        raise
    assert [qwen3.stop(), r1.stop()] == [0, 0], [qwen3.logs(), r1.logs()]
    decode.wait_idle()


def _client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.http_url + "/v1", api_key="unused", max_retries=0)


def _grpc_chat(gw: GatewayProcess, **chat_fields) -> list[gateway_pb2.GenerateResponse]:
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in ASK], **chat_fields)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with grpc.insecure_channel(gw.grpc_address) as ch:
        return list(gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=sampling),
                                                             timeout=60))


def _raw(gw: GatewayProcess, prompt_ids: list[int]) -> str:
    """The model's own text for these prompt tokens (a completion: no parser)."""
    r = _client(gw).completions.create(model=MODEL, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text


@pytest.fixture(scope="module")
def prompt_ids(cluster) -> list[int]:
    return list(_grpc_chat(cluster["qwen3"])[0].prompt_token_ids)


@pytest.fixture(scope="module")
def raw(cluster, prompt_ids) -> str:
    text = _raw(cluster["qwen3"], prompt_ids)
    assert END in text, f"the model no longer writes ' because' here: {text!r}"
    return text


def _stream(gw: GatewayProcess, **body) -> tuple[list[tuple[str, str]], str | None]:
    """The streamed chunks' (field, text) in order, and the finish reason."""
    pieces, finish = [], None
    for chunk in _client(gw).chat.completions.create(model=MODEL, messages=ASK, stream=True, **body):
        delta = chunk.choices[0].delta
        reasoning = getattr(delta, "reasoning_content", None)
        assert reasoning == getattr(delta, "reasoning", None)  # vLLM's newer name, the same text
        if reasoning:
            pieces.append(("reasoning", reasoning))
        if delta.content:
            pieces.append(("content", delta.content))
        finish = chunk.choices[0].finish_reason or finish
    return pieces, finish


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_and_content_come_apart_streamed_and_not(cluster, raw, parser):
    reasoning, content = raw.split(END, 1)
    gw = cluster[parser]
    r = _client(gw).chat.completions.create(model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content), raw
    assert message.reasoning == reasoning and reasoning.startswith("The sky")
    pieces, finish = _stream(gw, max_tokens=MAX_TOKENS, temperature=0)
    kinds = [k for k, _ in pieces]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index), kinds  # all reasoning first
    assert "".join(t for k, t in pieces if k == "reasoning") == reasoning
    assert "".join(t for k, t in pieces if k == "content") == content
    assert finish == r.choices[0].finish_reason == "length"


def test_grpc_carries_the_reasoning_apart(cluster, raw):
    msgs = _grpc_chat(cluster["qwen3"])
    assert "".join(m.reasoning_text for m in msgs) + END + "".join(m.text for m in msgs) == raw
    assert any(m.reasoning_text for m in msgs) and any(m.text for m in msgs)


def test_chat_template_kwargs_reach_the_template(cluster, prompt_ids):
    """enable_thinking false: the template closes the reasoning in the prompt (four more
    tokens: <think> \\n\\n </think> \\n\\n), so the whole answer is content, for both parsers
    (qwen3 reads enable_thinking itself too; deepseek_r1 sees the prompt's </think>)."""
    gw = cluster["qwen3"]
    msgs = _grpc_chat(gw, chat_template_kwargs_json=json.dumps({"enable_thinking": False}))
    closed = list(msgs[0].prompt_token_ids)
    assert closed[:len(prompt_ids)] == prompt_ids and len(closed) == len(prompt_ids) + 4
    assert not any(m.reasoning_text for m in msgs) and "".join(m.text for m in msgs) == _raw(gw, closed)
    for parser in ("qwen3", "deepseek_r1"):
        r = _client(cluster[parser]).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.usage.prompt_tokens == len(closed)
        assert r.choices[0].message.reasoning_content is None
        assert r.choices[0].message.content == "".join(m.text for m in msgs)


@pytest.mark.parametrize("kwargs, named", [("off", "chat_template_kwargs"),
                                           ({"enable_thinking": "no"}, "enable_thinking"),
                                           ({"tokenize": True}, "'tokenize'")])
def test_bad_chat_template_kwargs_are_400(cluster, kwargs, named):
    r = httpx.post(cluster["qwen3"].http_url + "/v1/chat/completions", timeout=30,
                   json={"messages": ASK, "max_tokens": 2, "chat_template_kwargs": kwargs})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert named in r.json()["error"]["message"], r.text


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"],
          "additionalProperties": False}


def test_structured_output_constrains_the_content_after_the_reasoning(cluster, raw):
    """The reasoning is what the model wrote unconstrained (the same as without a
    constraint; "The sky ..." is no JSON), the content after </think> the schema's JSON.
    With the reasoning closed in the prompt the JSON starts at once."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}}
    r = _client(cluster["qwen3"]).chat.completions.create(model=MODEL, messages=ASK, max_tokens=48, temperature=0,
                                                          response_format=fmt)
    message = r.choices[0].message
    assert message.reasoning_content == raw.split(END, 1)[0]
    assert set(json.loads(message.content)) == {"answer"}, message.content
    assert r.choices[0].finish_reason == "stop"
    r = _client(cluster["deepseek_r1"]).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=48, temperature=0, response_format=fmt,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.reasoning_content is None
    assert set(json.loads(r.choices[0].message.content)) == {"answer"}, r.choices[0].message.content


def test_a_tool_call_after_the_thinking_block(cluster, raw):
    """tool_choice required: the call is forced after the reasoning, and parsed from the
    content (streamed: tests/gateway/test_reasoning.py)."""
    reasoning = raw.split(END, 1)[0]
    body = dict(model=MODEL, messages=ASK, max_tokens=64, temperature=0, tools=[WEATHER], tool_choice="required",
                parallel_tool_calls=False)
    r = _client(cluster["qwen3"]).chat.completions.create(**body)
    message = r.choices[0].message
    assert message.reasoning_content == reasoning
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert r.choices[0].finish_reason == "tool_calls", (call, r.usage.completion_tokens)


def test_responses_carry_the_reasoning_as_a_reasoning_item(cluster, raw):
    """/v1/responses (gateway/responses_output.py): the reasoning is a reasoning item before
    the message, streamed as reasoning_text deltas; the cut answer is incomplete."""
    reasoning, content = raw.split(END, 1)
    client = _client(cluster["qwen3"])
    body = dict(model=MODEL, instructions=ASK[0]["content"], input=ASK[1]["content"], max_output_tokens=MAX_TOKENS,
                temperature=0)
    r = client.responses.create(**body)
    item, message = r.output
    assert (item.type, [c.text for c in item.content], item.summary) == ("reasoning", [reasoning], [])
    assert r.output_text == content and (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(**body, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    assert events[-1].type == "response.incomplete"
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
