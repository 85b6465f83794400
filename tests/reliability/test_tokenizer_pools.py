"""The gateway's tokenizer pools: a huge prompt is tokenized on its own pool
and never delays short ones; a prompt longer than the context could hold is
refused without tokenizing; a full pool answers RESOURCE_EXHAUSTED."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gateway.errors import ErrorKind, GatewayError
from gateway.tokenization import InputProcessor


class _SlowTokenizer:
    """Stands in for a fast tokenizer: one id per character; texts of more
    than 100 characters take ``slow_s`` (a 20 MB prompt, scaled down)."""

    def __init__(self, slow_s: float = 1.0) -> None:
        self.slow_s = slow_s
        self.calls: list[int] = []
        self.busy = threading.Event()

    def __deepcopy__(self, memo: dict) -> "_SlowTokenizer":
        return self  # thread-safe, unlike a real one: both pools may share it (and its records)

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bb": 1, "ccc": 2}  # longest entry: 3 characters

    def __call__(self, text: str) -> dict[str, list[int]]:
        self.calls.append(len(text))
        if len(text) > 100:
            self.busy.set()
            time.sleep(self.slow_s)
        return {"input_ids": [1] * len(text)}


def _inputs(tok: _SlowTokenizer) -> InputProcessor:
    return InputProcessor(tok, "m", max_model_len=10_000, vocab_size=10, long_prompt_chars=100)


def test_a_huge_prompt_does_not_stall_short_ones():
    tok = _SlowTokenizer(slow_s=2.0)
    inputs = _inputs(tok)

    async def run() -> tuple[float, list[int]]:
        long = asyncio.ensure_future(inputs.encode_text("x" * 5000))
        while not tok.busy.is_set():  # the long pool is busy with it
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        short = await asyncio.gather(*(inputs.encode_text("hello") for _ in range(20)))
        elapsed = time.monotonic() - t0
        await long
        return elapsed, [len(s) for s in short]

    try:
        elapsed, lengths = asyncio.run(run())
    finally:
        inputs.close()
    assert lengths == [5] * 20 and elapsed < 1.0


def test_longer_than_the_context_can_hold_is_refused_without_tokenizing():
    tok = _SlowTokenizer()
    inputs = _inputs(tok)
    try:
        assert inputs.max_prompt_chars == 10_000 * 3 * 2
        with pytest.raises(GatewayError) as e:
            asyncio.run(inputs.encode_text("x" * (inputs.max_prompt_chars + 1)))
        assert e.value.code == "context_length_exceeded" and e.value.kind is ErrorKind.INVALID_ARGUMENT
        with pytest.raises(GatewayError):
            asyncio.run(inputs.encode_chat([{"role": "user", "content": "y" * (inputs.max_prompt_chars + 1)}]))
    finally:
        inputs.close()
    assert tok.calls == []


def test_a_full_pool_is_resource_exhausted():
    tok = _SlowTokenizer(slow_s=0.2)
    inputs = _inputs(tok)

    async def run() -> list:
        return await asyncio.gather(*(inputs.encode_text("z" * 200) for _ in range(12)), return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        inputs.close()
    refused = [r for r in results if isinstance(r, GatewayError)]
    assert len(refused) == 12 - 8  # MAX_PENDING_LONG wait, the rest are refused at once
    assert all(r.kind is ErrorKind.RESOURCE_EXHAUSTED and "tokenizer queue" in r.message for r in refused)
    assert refused[0].http_headers() == {"Retry-After": "1"}


@pytest.mark.parametrize("message, fragment", [
    ({"role": "wizard", "content": "x"}, "role 'wizard' is not supported"),
    ({"role": "user", "content": 5}, "content must be a string"),
    ({"role": "user", "content": "\ud800"}, "not valid Unicode"),
    ({"role": "user", "content": "x", "name": ["n"]}, "name must be a string"),
    ("just text", "must be an object"),
])
def test_chat_messages_are_checked_before_the_template(message, fragment):
    inputs = _inputs(_SlowTokenizer())
    try:
        with pytest.raises(GatewayError) as e:
            asyncio.run(inputs.encode_chat([message]))
    finally:
        inputs.close()
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT and fragment in e.value.message
