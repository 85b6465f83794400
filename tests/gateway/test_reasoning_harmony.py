"""gpt-oss's harmony format (``--reasoning-parser gpt_oss``) offline.

openai-harmony loads the o200k_base vocabulary from ``$TIKTOKEN_ENCODINGS_BASE`` (or the
internet) and checks its SHA-256. The tests rebuild that exact file from the o200k
vocabulary the quicktok-v1 package ships (a test dependency; no data file in the repo),
and a Hugging Face tokenizer with the same ids for the gateway's detokenizer (the
vocabulary without merges: it decodes what harmony encoded). The model is a fake engine
(tests/gateway/fake_engine.py: the real engine protocol, a scripted output) that answers
with harmony tokens: no gpt-oss weights exist at test size.

What it proves: without the vocabulary the gateway refuses to start, naming
TIKTOKEN_ENCODINGS_BASE; chats render to harmony (instructions and tools in the developer
message, an assistant's calls and their results); the output parses into reasoning
(analysis), tool calls (commentary to functions.NAME) and content (final), token by token
as a whole; through a real gateway over HTTP (the openai client, streamed and not) and
gRPC, with harmony's end-of-turn tokens and the reasoning's end sequence in the engine
request."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import grpc
import openai
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony's check
VOCAB_SIZE = 201088  # gpt-oss: o200k_base and harmony's special tokens
ANALYSIS = "<|channel|>analysis<|message|>The user greets. Answer briefly.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def _o200k_ranks() -> list[bytes]:
    """The o200k_base tokens by rank, from quicktok-v1's data (its module is not imported)."""
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("quicktok-v1 (requirements-test.txt) is not installed: no o200k vocabulary offline")
    data = (Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab").read_bytes()
    (count,), offset, tokens = struct.unpack_from("<I", data), 4, []
    for rank in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        raw = data[offset + 2:offset + 2 + length]
        (stored,) = struct.unpack_from("<I", data, offset + 2 + length)
        assert stored == rank
        tokens.append(raw)
        offset += 2 + length + 4
    return tokens


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory) -> Path:
    """A directory for TIKTOKEN_ENCODINGS_BASE holding the original o200k_base.tiktoken."""
    text = b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(_o200k_ranks()))
    assert hashlib.sha256(text).hexdigest() == O200K_SHA256
    path = tmp_path_factory.mktemp("tiktoken")
    (path / "o200k_base.tiktoken").write_bytes(text)
    return path


@pytest.fixture(scope="module")
def harmony(vocab_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(vocab_dir))
    from gateway.reasoning_parsers import HarmonyReasoningParser

    yield HarmonyReasoningParser()
    mp.undo()


def _ids(parser, text: str) -> list[int]:
    return list(parser.encoding.encode(text, allowed_special="all"))


def test_without_its_vocabulary_the_parser_names_the_variable(tmp_path, monkeypatch):
    from gateway.reasoning_parsers import HarmonyReasoningParser

    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))  # no o200k_base.tiktoken there
    with pytest.raises(ValueError, match="TIKTOKEN_ENCODINGS_BASE.*o200k_base.tiktoken"):
        HarmonyReasoningParser()
    (tmp_path / "o200k_base.tiktoken").write_bytes(b"aGk= 0\n")  # not the original: its hash differs
    with pytest.raises(ValueError, match="hash mismatch"):
        HarmonyReasoningParser()


def test_chats_render_in_the_harmony_format(harmony):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": '{"sunny": true}', "tool_call_id": "call_1"}]
    text = harmony.encoding.decode(harmony.render_chat(None, messages, True, [WEATHER], {}))
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "namespace functions" in text and "type get_weather = (_: {" in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
            '{"city": "Paris"}<|call|>') in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true}' in text
    assert text.endswith("<|start|>assistant")
    plain = harmony.encoding.decode(harmony.render_chat(None, messages[1:2], True, None, {}))
    assert "developer" not in plain and "commentary" not in plain.split("<|start|>user")[0]  # no tools


def test_reasoning_effort_reaches_the_harmony_system_message(harmony):
    """The chat's reasoning_effort (OpenAI's field, carried as the template's variable) sets
    harmony's "Reasoning: ..." line; without it harmony's default, medium."""
    from gateway.openai_protocol import ChatCompletionRequest

    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    for effort in ("low", "high"):
        kwargs = ChatCompletionRequest.model_validate({"messages": ask, "reasoning_effort": effort}).chat_template_kwargs
        text = harmony.encoding.decode(harmony.render_chat(None, ask, True, None, kwargs))
        assert f"Reasoning: {effort}" in text
    assert "Reasoning: medium" in harmony.encoding.decode(harmony.render_chat(None, ask, True, None, {}))
    with pytest.raises(ValueError, match="reasoning_effort"):
        harmony.render_chat(None, ask, True, None, {"reasoning_effort": "extreme"})


def _parse(harmony, text: str, per_token: bool):
    from gateway.reasoning_parsers import HarmonyChatStream

    stream = HarmonyChatStream(harmony.encoding)
    ids = _ids(harmony, text)
    if not per_token:
        answer = stream.whole(ids, "")
        return answer.reasoning, answer.content, [(c.name, c.arguments) for c in answer.tool_calls]
    reasoning, content, calls = "", "", {}
    for i, token in enumerate(ids):
        d = stream.feed([token], "", final=i == len(ids) - 1)
        reasoning, content = reasoning + d.reasoning, content + d.content
        for c in d.tool_calls:
            calls.setdefault(c.index, [c.name, ""])[1] += c.arguments
    return reasoning or None, content or None, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("text, expected", [
    (ANALYSIS + FINAL, ("The user greets. Answer briefly.", "Hello there!", [])),
    (ANALYSIS + CALL, ("The user greets. Answer briefly.", None, [("get_weather", '{"city": "Paris"}')])),
    (ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL,
     ("The user greets. Answer briefly.\nMore.", "Hello there!", [])),
    ("<|channel|>analysis<|message|>cut sh", ("cut sh", None, [])),
    ("<|channel|>final<|message|>At once.<|return|>", (None, "At once.", [])),
])
def test_the_output_parses_token_by_token_as_a_whole(harmony, text, expected):
    assert _parse(harmony, text, per_token=False) == expected
    assert _parse(harmony, text, per_token=True) == expected


# ---- through a gateway ----------------------------------------------------------------------------

def _model_dir(path: Path, tokens: list[bytes]) -> Path:
    """config.json (gpt-oss's vocabulary size) and a tokenizer.json with o200k's ids, byte
    level, no merges (enough to decode), and harmony's special tokens at their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB_SIZE, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "eos_token_id": 200002}))
    chars = _byte_level_chars()
    tok = Tokenizer(models.BPE(vocab={"".join(chars[b] for b in t): i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    named = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
             200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
    tok.add_special_tokens([AddedToken(named.get(i, f"<|reserved_{i}|>"), special=True)
                            for i in range(len(tokens), VOCAB_SIZE)])
    assert tok.token_to_id("<|call|>") == 200012
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|return|>"}))
    return path


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character standing for it."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-tiny", _o200k_ranks())


# ---- forced tool calls: the constraint over harmony's tokens ------------------------------------------

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL_ONLY = CALL.removeprefix("<|start|>assistant")


def _forced(choice: str, function: str | None = None) -> str:
    from gateway.openai_protocol import tool_plan
    from gateway.tool_parsers import get_parser

    tool_choice = {"type": "function", "function": {"name": function}} if function else choice
    plan = tool_plan([WEATHER, TIME], tool_choice, True, get_parser("openai"), True)
    return plan.structured_outputs().structural_tag


@pytest.fixture(scope="module")
def compiler(model_dir):
    """xgrammar over the gpt-oss vocabulary, as an engine builds it (engine/grammar.py)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE,
                                                                  stop_token_ids=[200002]))


def _takes(compiler, harmony, structural_tag: str, text: str) -> bool:
    """The grammar takes the tokens of ``text`` one by one and is then complete."""
    return _takes_ids(compiler, structural_tag, _ids(harmony, text))


def _takes_ids(compiler, structural_tag: str, ids: list[int]) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(structural_tag))
    if not all(matcher.accept_token(t) for t in ids):
        return False
    return matcher.is_terminated() or matcher.accept_token(200002)  # may end here (<|return|>: a stop token)


def test_forced_calls_are_one_call_after_an_optional_analysis(compiler, harmony):
    """tool_choice required: harmony's analysis message may come first, then exactly one call of
    a given function with arguments under its schema, the control tokens as tokens; nothing else
    (a final answer, another function, arguments off the schema). A named function: only it."""
    required = _forced("required")
    assert _takes(compiler, harmony, required, ANALYSIS + CALL)
    assert _takes(compiler, harmony, required, CALL_ONLY)
    assert _takes(compiler, harmony, required, CALL_ONLY.replace("get_weather", "get_time").replace(
        '{"city": "Paris"}', "{}"))
    assert not _takes(compiler, harmony, required, ANALYSIS + FINAL)
    assert not _takes(compiler, harmony, required, FINAL.removeprefix("<|start|>assistant"))
    assert not _takes(compiler, harmony, required, CALL_ONLY.replace("get_weather", "set_alarm"))
    assert not _takes(compiler, harmony, required, CALL_ONLY.replace('"city"', '"town"'))
    assert not _takes(compiler, harmony, required, CALL_ONLY.removesuffix("<|call|>"))  # the call must end
    # the control tokens are tokens: the same characters as text are refused
    spelt = [t for i in _ids(harmony, CALL_ONLY) for t in (
        list(harmony.encoding.encode(harmony.encoding.decode([i]), disallowed_special=())) if i >= 200000 else [i])]
    assert len(spelt) > len(_ids(harmony, CALL_ONLY))
    assert not _takes_ids(compiler, required, spelt)
    named = _forced("function", "get_time")
    assert _takes(compiler, harmony, named, ANALYSIS + CALL.replace("get_weather", "get_time").replace(
        '{"city": "Paris"}', "{}"))
    assert not _takes(compiler, harmony, named, ANALYSIS + CALL)


@pytest.fixture(scope="module")
def served(harmony, vocab_dir, model_dir):
    from tests.gateway.fake_engine import FakeEngine
    from tests.processes import GatewayProcess

    model = model_dir
    fake = FakeEngine().start()
    fake.state.eos = 199999
    gw = GatewayProcess("gpt-oss", ["--model", str(model), "--prefill", fake.prefill_address, "--decode",
                                    fake.decode_address, "--reasoning-parser", "gpt_oss", "--enable-auto-tool-choice"],
                        env={"TIKTOKEN_ENCODINGS_BASE": str(vocab_dir)})
    try:
        gw.wait_ready()
        gw.wait_healthy()
        yield gw, fake
        gw.terminate()
        assert gw.stop() == 0, gw.logs()
    finally:
        gw.kill()
        fake.stop()


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.http_url + "/v1", api_key="unused", max_retries=0)


ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_reasoning_and_content_over_http_streamed_and_not(served, harmony):
    gw, fake = served
    fake.state.script = _ids(harmony, ANALYSIS + FINAL)
    r = _client(gw).chat.completions.create(model="gpt-oss-tiny", messages=ASK)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user greets. Answer briefly.", "Hello there!")
    assert r.choices[0].finish_reason == "stop"
    sent = fake.state.decode_requests[-1]
    prompt = harmony.encoding.decode(list(sent.prompt_token_ids))
    assert "# Instructions\n\nBe brief." in prompt and prompt.endswith("<|start|>assistant")
    assert {200002, 200012} <= set(sent.sampling.stop_token_ids)  # harmony's ends of a turn
    pieces = []
    for chunk in _client(gw).chat.completions.create(model="gpt-oss-tiny", messages=ASK, stream=True):
        delta = chunk.choices[0].delta
        pieces += [("r", delta.reasoning_content)] if getattr(delta, "reasoning_content", None) else []
        pieces += [("c", delta.content)] if delta.content else []
    assert [k for k, _ in pieces] == sorted(k for k, _ in pieces)[::-1]  # reasoning ("r") before content ("c")
    assert "".join(t for k, t in pieces if k == "r") == message.reasoning_content
    assert "".join(t for k, t in pieces if k == "c") == message.content


def test_a_tool_call_over_http_and_grpc(served, harmony):
    gw, fake = served
    fake.state.script = _ids(harmony, ANALYSIS + CALL)
    r = _client(gw).chat.completions.create(model="gpt-oss-tiny", messages=ASK, tools=[WEATHER])
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert "type get_weather" in harmony.encoding.decode(list(fake.state.decode_requests[-1].prompt_token_ids))
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in ASK],
                                    tools=[gateway_pb2.FunctionTool(name="get_weather", parameters_json=json.dumps(
                                        WEATHER["function"]["parameters"]))])
    with grpc.insecure_channel(gw.grpc_address) as ch:
        msgs = list(gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(chat=chat), timeout=30))
    assert "".join(m.reasoning_text for m in msgs) == "The user greets. Answer briefly."
    pieces = [c for m in msgs for c in m.tool_calls]  # the name on the first, the arguments in pieces
    assert {c.index for c in pieces} == {0} and pieces[0].name == "get_weather" and pieces[0].id
    assert "".join(c.arguments for c in pieces) == '{"city": "Paris"}'
    assert msgs[-1].finish_reason == "tool_calls" and not "".join(m.text for m in msgs)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_reach_the_engine_as_a_constraint_from_the_first_token(served, harmony, tool_choice):
    """A forced call's request carries the harmony constraint (the one the test above checks)
    with no reasoning end to wait for: it spans the analysis message too. Streamed and not."""
    gw, fake = served
    fake.state.script = _ids(harmony, ANALYSIS + CALL)
    for stream in (False, True):
        r = _client(gw).chat.completions.create(model="gpt-oss-tiny", messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice=tool_choice, stream=stream)
        if stream:
            chunks = list(r)
            calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
            assert (calls[0].function.name, "".join(c.function.arguments for c in calls)) == (
                "get_weather", '{"city": "Paris"}')
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            (call,) = r.choices[0].message.tool_calls
            assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
            assert r.choices[0].message.reasoning_content == "The user greets. Answer briefly."
        so = fake.state.decode_requests[-1].sampling.structured_outputs
        function = tool_choice if isinstance(tool_choice, str) else "function"
        assert so.structural_tag == _forced(function, None if function == "required" else "get_weather")
        assert list(so.reasoning_end_token_ids) == []
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        _client(gw).chat.completions.create(model="gpt-oss-tiny", messages=ASK, tools=[WEATHER],
                                            tool_choice="required", response_format={"type": "json_object"})


def test_structured_outputs_wait_for_the_final_channel(served, harmony):
    gw, fake = served
    fake.state.script = _ids(harmony, ANALYSIS + '<|start|>assistant<|channel|>final<|message|>{"a": 1}<|return|>')
    r = _client(gw).chat.completions.create(model="gpt-oss-tiny", messages=ASK,
                                            response_format={"type": "json_object"})
    assert json.loads(r.choices[0].message.content) == {"a": 1}
    so = fake.state.decode_requests[-1].sampling.structured_outputs
    assert so.json_object and list(so.reasoning_end_token_ids) == _ids(harmony, "<|channel|>final<|message|>")
    sampling = common_pb2.SamplingParams(structured_outputs=common_pb2.StructuredOutputs(json_object=True))
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in ASK])
    with grpc.insecure_channel(gw.grpc_address) as ch:
        msgs = list(gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=sampling),
                                                             timeout=30))
    assert "".join(m.text for m in msgs) == '{"a": 1}'
    assert list(fake.state.decode_requests[-1].sampling.structured_outputs.reasoning_end_token_ids) == list(
        so.reasoning_end_token_ids)
