"""Prompts in, validated token ids out: the model's tokenizer and chat
template, the served-model-name check and the context-length check.

Encoding runs on one dedicated worker thread, so a long prompt or a chat
template does not stall the event loop (one thread: Hugging Face fast
tokenizers must not be mutated from two threads at once).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from engine.tokenizer import apply_chat_template, encode_prompt
from gateway.errors import ErrorKind, GatewayError, invalid


class InputProcessor:
    """Owns the tokenizer (encode side) and the limits a prompt must respect."""

    def __init__(self, tokenizer: Any, served_model_name: str, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> None:
        """Raise NOT_FOUND unless ``model`` is empty or the served model name."""
        if model and model != self.served_model_name:
            raise GatewayError(ErrorKind.NOT_FOUND,
                               f"The model `{model}` does not exist. This server serves "
                               f"`{self.served_model_name}`.", code="model_not_found", param="model")

    async def encode_text(self, text: str) -> list[int]:
        """Tokenize a raw prompt as is (special tokens the tokenizer adds included)."""
        if not isinstance(text, str):
            raise invalid("prompt must be a string", param="prompt")
        ids = await self._run(encode_prompt, self.tokenizer, text)
        return self.check_token_ids(ids)

    async def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Render ``messages`` with the model's chat template and tokenize."""
        if not messages:
            raise invalid("messages must not be empty", param="messages")
        try:
            ids = await self._run(apply_chat_template, self.tokenizer, list(messages), add_generation_prompt)
        except ValueError as e:
            raise invalid(str(e), param="messages") from e
        except Exception as e:  # jinja errors: the template rejected the conversation
            raise invalid(f"cannot apply the chat template to these messages: {e}", param="messages") from e
        return self.check_token_ids(ids)

    def check_token_ids(self, ids: Sequence[int]) -> list[int]:
        """A non-empty list of ids inside the vocabulary, else INVALID_ARGUMENT."""
        ids = list(ids)
        if not ids:
            raise invalid("the prompt is empty (0 tokens); send at least one token", param="prompt")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"token id {bad!r} is out of range: the vocabulary has {self.vocab_size} tokens",
                          param="prompt")
        return ids

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The completion budget: ``max_tokens`` if it fits the context, the
        rest of the context if None; raises ``context_length_exceeded``."""
        room = self.max_model_len - num_prompt_tokens
        requested = max_tokens if max_tokens is not None else max(room, 1)
        if room < 1 or requested > room:
            raise invalid(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or completion.",
                code="context_length_exceeded", param="max_tokens" if room >= 1 else "messages")
        return requested

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
