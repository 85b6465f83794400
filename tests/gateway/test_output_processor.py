"""OutputProcessor: detokenization, stop strings (cut at the matching token),
usage, and closing the token stream when a stop string ends the request."""
from __future__ import annotations

import asyncio
import time

from engine.sampling_params import SamplingParams
from gateway.metrics import GatewayMetrics
from gateway.output_processor import OutputProcessor
from gateway.request_flow import PreparedRequest, TokenChunk

TEXT = "The quick brown fox jumps over the lazy dog. The end."


def _run(tokenizer, params: SamplingParams, chunks: list[TokenChunk]):
    closed = []

    async def source():
        try:
            for c in chunks:
                yield c
        finally:
            closed.append(True)

    async def go():
        now = time.monotonic()
        req = PreparedRequest("r", "r-1", [1, 2, 3], params, now, now + 10)
        metrics = GatewayMetrics("m")
        out = [d async for d in OutputProcessor(tokenizer, req, metrics).process(source())]
        return out, metrics

    out, metrics = asyncio.run(go())
    return out, closed, metrics.render().decode()


def _chunks(ids: list[int], size: int, reason: str) -> list[TokenChunk]:
    parts = [ids[i:i + size] for i in range(0, len(ids), size)]
    return [TokenChunk(p, finish_reason=reason if i == len(parts) - 1 else "") for i, p in enumerate(parts)]


def test_text_and_usage(tokenizer):
    ids = tokenizer.encode(TEXT)
    out, closed, metrics = _run(tokenizer, SamplingParams(), _chunks(ids, 3, "length"))
    assert "".join(d.text for d in out) == TEXT
    assert [t for d in out for t in d.token_ids] == ids
    last = out[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, len(ids))
    assert closed == [True]
    assert 'pdserve:generation_tokens_total{model_name="m"} %.1f' % len(ids) in metrics
    assert 'pdserve:request_success_total{finished_reason="length",model_name="m"} 1.0' in metrics


def test_stop_string_cuts_at_the_matching_token_and_closes_the_stream(tokenizer):
    ids = tokenizer.encode(TEXT)
    out, closed, _ = _run(tokenizer, SamplingParams(stop=["lazy"]), _chunks(ids, 4, "length"))
    assert "".join(d.text for d in out) == "The quick brown fox jumps over the "
    assert out[-1].finish_reason == "stop"
    kept = [t for d in out for t in d.token_ids]
    assert tokenizer.decode(kept).endswith("lazy")  # ends at the token completing the stop string
    assert out[-1].usage.completion_tokens == len(kept) < len(ids)
    assert closed == [True]  # the decode call is cancelled


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode(TEXT)
    out, _, _ = _run(tokenizer, SamplingParams(stop=["fox"], include_stop_str_in_output=True),
                     _chunks(ids, 5, "length"))
    assert "".join(d.text for d in out) == "The quick brown fox"


def test_held_back_text_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("Say the word")
    out, _, _ = _run(tokenizer, SamplingParams(stop=["words!"]), _chunks(ids, 1, "length"))
    assert "".join(d.text for d in out) == "Say the word" and out[-1].finish_reason == "length"


def test_eos_is_skipped_and_finish_reason_passes_through(tokenizer):
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    out, _, _ = _run(tokenizer, SamplingParams(), _chunks(ids, 2, "stop"))
    assert "".join(d.text for d in out) == "Hi there" and out[-1].finish_reason == "stop"
    assert out[-1].usage.completion_tokens == len(ids)


def test_prompt_logprobs_ride_on_the_first_delta(tokenizer):
    from pdserve.v1 import common_pb2

    ids = tokenizer.encode(TEXT)
    prompt = [common_pb2.TokenLogprob(token_id=2, logprob=-1.0), common_pb2.TokenLogprob(token_id=3, logprob=-2.0)]
    chunks = _chunks(ids, 3, "length")
    chunks[0].prompt_logprobs = prompt
    out, _, _ = _run(tokenizer, SamplingParams(prompt_logprobs=0), chunks)
    assert out[0].prompt_logprobs == prompt and all(not d.prompt_logprobs for d in out[1:])
