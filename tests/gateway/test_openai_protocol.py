"""OpenAI request bodies -> SamplingParams, response/chunk shapes, SSE framing."""
from __future__ import annotations

import json

import pytest

from gateway.errors import ErrorKind, GatewayError
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai_responses import ChatFormatter, CompletionFormatter, PromptView
from gateway.output_processor import GenerationDelta, Usage
from gateway.sse import SSE_DONE, sse_event
from pdserve.v1 import common_pb2


def test_completion_request_maps_every_sampling_field():
    req = CompletionRequest(prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="END",
                            presence_penalty=0.1, frequency_penalty=0.2, logprobs=2, top_k=40, min_p=0.05,
                            repetition_penalty=1.1, min_tokens=2, ignore_eos=True, stop_token_ids=[5, 6],
                            skip_special_tokens=False, include_stop_str_in_output=True)
    p = req.to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (7, 0.5, 0.9, 3, ["END"])
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs, p.top_k, p.min_p) == (0.1, 0.2, 2, 40, 0.05)
    assert (p.repetition_penalty, p.min_tokens, p.ignore_eos, p.stop_token_ids) == (1.1, 2, True, [5, 6])
    assert p.skip_special_tokens is False and p.include_stop_str_in_output is True


def test_completion_defaults_follow_openai():
    p = CompletionRequest(prompt="hi").to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.logprobs, p.stop) == (16, 1.0, 1.0, None, [])
    assert CompletionRequest(prompt="hi", max_tokens=None).to_sampling_params().max_tokens is None


def test_chat_max_completion_tokens_wins_and_logprobs_map():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                max_completion_tokens=9, logprobs=True, top_logprobs=3)
    p = req.to_sampling_params()
    assert (p.max_tokens, p.logprobs) == (9, 3)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert chat.to_sampling_params().max_tokens is None  # chat default: the rest of the context
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True) \
        .to_sampling_params().logprobs == 0


def test_chat_content_parts_are_joined():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}])
    assert req.template_messages() == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "x", "n": 129}, "n must be in [1, 128]"),
    ({"prompt": "x", "n": 0}, "n must be in [1, 128]"),
    ({"prompt": "x", "suffix": "y"}, "fill-in-the-middle template"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of must be greater than or equal to n, got n=3 and best_of=2"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "cannot be streamed"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": ["a", "b"]}, "batched prompts"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_completion_requests_are_400(body, fragment):
    with pytest.raises(GatewayError) as e:
        req = CompletionRequest(**body)
        req.single_prompt()
        req.to_sampling_params()
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT and fragment in e.value.message


def test_prompt_forms():
    assert CompletionRequest(prompt="a").single_prompt() == "a"
    assert CompletionRequest(prompt=["a"]).single_prompt() == "a"
    assert CompletionRequest(prompt=[1, 2, 3]).single_prompt() == [1, 2, 3]
    assert CompletionRequest(prompt=[[4, 5]]).single_prompt() == [4, 5]


def test_chat_top_logprobs_needs_logprobs():
    with pytest.raises(GatewayError, match="top_logprobs requires logprobs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2).to_sampling_params()


def test_sse_framing():
    event = sse_event({"text": "a\nb", "x": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # newlines inside strings are escaped
    assert json.loads(event[len(b"data: "):]) == {"text": "a\nb", "x": "é"}
    assert SSE_DONE == b"data: [DONE]\n\n"


def _deltas() -> list[GenerationDelta]:
    lp = common_pb2.TokenLogprob(token_id=7, logprob=-0.5, rank=1, top=[common_pb2.TopLogprob(token_id=7, logprob=-0.5)])
    return [GenerationDelta([7], "Hel", [lp]),
            GenerationDelta([8], "lo", [common_pb2.TokenLogprob(token_id=8, logprob=-0.125, rank=1)], "length",
                            Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1))]


def _token_text(t: int) -> str:
    return {7: "Hel", 8: "lo"}[t]


def test_completion_response_shape():
    body = CompletionFormatter("cmpl-1", "m", _token_text, False, True).response(_deltas())
    assert body["object"] == "text_completion" and body["id"] == "cmpl-1" and body["model"] == "m"
    choice = body["choices"][0]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, "Hello", "length")
    assert choice["logprobs"] == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.125],
                                  "top_logprobs": [{"Hel": -0.5}, {}], "text_offset": [0, 3]}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}


def test_chat_stream_chunks_with_usage():
    fmt = ChatFormatter("chatcmpl-1", "m", _token_text, True, False)
    chunks = fmt.stream_start() + [c for d in _deltas() for c in fmt.stream_delta(d)] + fmt.stream_end()
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 4
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:3]] == [{"content": "Hel"}, {"content": "lo"}]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:3])
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["total_tokens"] == 5


def test_chat_logprobs_shape():
    body = ChatFormatter("c", "m", _token_text, False, True).response(_deltas())
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel"),
                          "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")}]}
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}


def _prompt_deltas() -> list[GenerationDelta]:
    """A prompt of tokens 5, 6 ("Say", " hi") and its logprobs (token 6's, top-2), then _deltas()."""
    top = [common_pb2.TopLogprob(token_id=7, logprob=-0.25), common_pb2.TopLogprob(token_id=6, logprob=-1.5)]
    deltas = _deltas()
    deltas[0].prompt_logprobs = [common_pb2.TokenLogprob(token_id=6, logprob=-1.5, rank=2, top=top)]
    return deltas


def _prompt_text(t: int) -> str:
    return {5: "Say", 6: " hi", 7: "Hel", 8: "lo"}[t]


def test_completion_echo_and_prompt_logprobs():
    """echo: the prompt's text, and its tokens first in the logprobs (the first one's null);
    prompt_logprobs: vLLM's list, each prompt token's own entry then the top-N."""
    shown = PromptView([5, 6], "Say hi", echo_top=1, prompt_logprobs=2)
    body = CompletionFormatter("c", "m", _prompt_text, False, True, shown).response(_prompt_deltas())
    choice = body["choices"][0]
    assert choice["text"] == "Say hiHello"
    assert choice["logprobs"] == {"tokens": ["Say", " hi", "Hel", "lo"], "token_logprobs": [None, -1.5, -0.5, -0.125],
                                  "top_logprobs": [None, {"Hel": -0.25}, {"Hel": -0.5}, {}],
                                  "text_offset": [0, 3, 6, 9]}
    assert choice["prompt_logprobs"] == [None, {"6": {"logprob": -1.5, "rank": 2, "decoded_token": " hi"},
                                                "7": {"logprob": -0.25, "rank": 1, "decoded_token": "Hel"}}]
    # streamed: all of it in the first chunk
    fmt = CompletionFormatter("c", "m", _prompt_text, False, True, shown)
    chunks = [c for d in _prompt_deltas() for c in fmt.stream_delta(d)]
    first, second = (c["choices"][0] for c in chunks)
    assert first["text"] == "Say hiHel" and first["logprobs"]["tokens"] == ["Say", " hi", "Hel"]
    assert first["prompt_logprobs"] == choice["prompt_logprobs"]
    assert second["text"] == "lo" and "prompt_logprobs" not in second and second["logprobs"]["text_offset"] == [9]
    # echo alone: the text, no logprobs; nothing asked: the choice as before
    plain = CompletionFormatter("c", "m", _prompt_text, False, False, PromptView([5, 6], "Say hi"))
    assert plain.response(_prompt_deltas())["choices"][0] == {"index": 0, "text": "Say hiHello", "logprobs": None,
                                                              "finish_reason": "length"}
    assert "prompt_logprobs" not in CompletionFormatter("c", "m", _prompt_text, False, False).response(
        _prompt_deltas())["choices"][0]


def test_completion_echo_asks_the_engine_for_prompt_logprobs():
    assert CompletionRequest(prompt="x", echo=True).to_sampling_params().prompt_logprobs is None
    assert CompletionRequest(prompt="x", echo=True, logprobs=3).to_sampling_params().prompt_logprobs == 3
    assert CompletionRequest(prompt="x", echo=True, logprobs=1, prompt_logprobs=4).to_sampling_params() \
        .prompt_logprobs == 4
    assert CompletionRequest(prompt="x", logprobs=3, prompt_logprobs=0).to_sampling_params().prompt_logprobs == 0
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], prompt_logprobs=2, echo=True)
    assert chat.to_sampling_params().prompt_logprobs == 2


def test_chat_echo_and_prompt_logprobs():
    """vLLM's chat echo: the last message's text before the answer that continues it."""
    def echoed(messages, **kw):
        return ChatCompletionRequest(messages=messages, echo=True, **kw).echoed_text()

    user, partial = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}
    assert echoed([user]) == "" and echoed([user, partial]) == "Well,"
    assert echoed([user], add_generation_prompt=False) == "Hi"
    assert ChatCompletionRequest(messages=[user, partial]).echoed_text() == ""
    shown = PromptView([5, 6], "Well,", prompt_logprobs=0)
    body = ChatFormatter("c", "m", _prompt_text, False, False, shown).response(_prompt_deltas())
    assert body["choices"][0]["message"]["content"] == "Well,Hello"
    assert body["prompt_logprobs"] == [None, {"6": {"logprob": -1.5, "rank": 2, "decoded_token": " hi"}}]
    fmt = ChatFormatter("c", "m", _prompt_text, False, False, shown)
    chunks = fmt.stream_start() + [c for d in _prompt_deltas() for c in fmt.stream_delta(d)]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "Well,", "Hel", "lo"]
    assert chunks[2]["prompt_logprobs"] == body["prompt_logprobs"] and "prompt_logprobs" not in chunks[3]
