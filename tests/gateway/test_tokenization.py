"""InputProcessor: chat template, token-id checks and the context-length error."""
from __future__ import annotations

import asyncio

import pytest

from gateway.errors import ErrorKind, GatewayError
from gateway.tokenization import InputProcessor


@pytest.fixture(scope="module")
def inputs(tokenizer):
    proc = InputProcessor(tokenizer, "SmolLM2-135M-Instruct", max_model_len=100, vocab_size=49152)
    yield proc
    proc.close()


def test_chat_template_matches_the_tokenizer(inputs, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ids = asyncio.run(inputs.encode_chat(messages))
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids) == expected
    assert expected == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                        "<|im_start|>assistant\n")


def test_chat_template_adds_the_default_system_prompt(inputs, tokenizer):
    ids = asyncio.run(inputs.encode_chat([{"role": "user", "content": "hi"}]))
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_text_prompt_is_tokenized_as_is(inputs, tokenizer):
    assert asyncio.run(inputs.encode_text("Hello world")) == tokenizer("Hello world")["input_ids"]


@pytest.mark.parametrize("ids, fragment", [([], "empty"), ([5, 49152], "out of range"), ([-1], "out of range")])
def test_bad_token_ids(inputs, ids, fragment):
    with pytest.raises(GatewayError) as e:
        inputs.check_token_ids(ids)
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT and fragment in e.value.message


def test_empty_chat_is_rejected(inputs):
    with pytest.raises(GatewayError) as e:
        asyncio.run(inputs.encode_chat([]))
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT


def test_context_length_error_message(inputs):
    with pytest.raises(GatewayError) as e:
        inputs.resolve_max_tokens(30, 80)
    err = e.value
    assert err.kind is ErrorKind.INVALID_ARGUMENT and err.code == "context_length_exceeded"
    assert err.message == ("This model's maximum context length is 100 tokens. However, you requested 110 tokens "
                           "(30 in the messages, 80 in the completion). Please reduce the length of the messages "
                           "or completion.")


def test_max_tokens_resolution(inputs):
    assert inputs.resolve_max_tokens(30, 70) == 70
    assert inputs.resolve_max_tokens(30, None) == 70  # the rest of the context
    with pytest.raises(GatewayError, match="maximum context length is 100"):
        inputs.resolve_max_tokens(100, None)  # no room for even one token


def test_model_name_check(inputs):
    inputs.check_model(None)
    inputs.check_model("")
    inputs.check_model("SmolLM2-135M-Instruct")
    with pytest.raises(GatewayError) as e:
        inputs.check_model("gpt-4")
    assert e.value.kind is ErrorKind.NOT_FOUND and e.value.code == "model_not_found"
    assert e.value.to_openai()["error"]["type"] == "invalid_request_error"


def test_tools_need_a_template_that_renders_them(inputs, tokenizer):
    from gateway.server import read_chat_template
    from tests.processes import REPO

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "What time is it?"}]
    with pytest.raises(GatewayError) as e:  # the model's own template never reads `tools`
        asyncio.run(inputs.encode_chat(messages, tools=tools))
    assert e.value.param == "tools" and "--chat-template" in e.value.message
    template = read_chat_template(str(REPO / "deploy" / "chat_templates" / "hermes_tools.jinja"))
    hermes = InputProcessor(tokenizer, "SmolLM2-135M-Instruct", max_model_len=1000, vocab_size=49152,
                            chat_template=template)
    try:
        history = messages + [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
            {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
        text = tokenizer.decode(asyncio.run(hermes.encode_chat(history, tools=tools)))
    finally:
        hermes.close()
    assert '<tools>\n{"type": "function", "function": {"name": "get_time"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
            "<|im_start|>tool\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template("/nonexistent/template.jinja")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        read_chat_template("{% if %}")
