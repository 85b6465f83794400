"""The model's own tokenizer and chat template, via transformers."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def load_tokenizer(path: Path):
    """The model's tokenizer. With a ``tokenizer.json`` we load the fast
    (tokenizers-backed) class directly: ``AutoTokenizer`` first reads the
    model config, and that imports torch, which the gateway process must not
    need. Same class, same chat template, same ids."""
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    _give_back_free_heap()
    return tokenizer


def _give_back_free_heap() -> None:
    """Loading parses tokenizer.json into Python objects and frees them; glibc keeps the freed
    heap (about 35 MiB for the default model's 3.5 MB file). ``malloc_trim`` returns it to the
    system: a server's or a local engine's resident memory stays what it uses. A no-op where
    the C library has no malloc_trim."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def apply_chat_template(tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; send a plain prompt instead")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
        ids = ids["input_ids"]
    return list(ids)


def encode_prompt(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])
