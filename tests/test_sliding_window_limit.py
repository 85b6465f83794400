"""A sliding-window model (Mistral v0.1 style) is served up to its window
only, since attention here always spans the whole context: a prompt that
does not leave room for one token inside the window is refused with a clear
error by the engine (offline API and servers alike go through
``LLMEngine.make_request``) and by the gateway, and a longer --max-model-len
is refused at start-up."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.conftest import make_tiny_model

WINDOW = 32


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, default_model_dir: Path) -> Path:
    d = make_tiny_model(tmp_path_factory.mktemp("mistral-sw"), arch="mistral", seed=4, sliding_window=WINDOW,
                        max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the gateway needs a tokenizer
        shutil.copy(default_model_dir / name, d / name)
    return d


def test_engine_refuses_a_prompt_past_the_window(mistral_dir):
    llm = LLM(str(mistral_dir), kv_cache_memory="4MiB", block_size=4)
    assert llm.engine.config.scheduler.max_model_len == WINDOW
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for n in (WINDOW, WINDOW + 9):
        with pytest.raises(ValueError, match=f"maximum context length is {WINDOW} tokens. However, the prompt "
                                             f"has {n} tokens"):
            llm.generate([list(range(3, 3 + n))], sp)
    # One token short of the window: generation stops at the window.
    out = llm.generate([list(range(3, 3 + WINDOW - 1))], sp)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(ValueError, match=f"--max-model-len {WINDOW + 1} exceeds"):
        LLM(str(mistral_dir), kv_cache_memory="4MiB", max_model_len=WINDOW + 1)


def test_gateway_refuses_a_prompt_past_the_window(mistral_dir):
    from gateway.config import GatewayConfig
    from gateway.errors import GatewayError
    from gateway.server import load_input_processor
    from pdserve.cli import build_parser

    args = build_parser("gateway").parse_args(["gateway", "--model", str(mistral_dir), "--decode", "127.0.0.1:1"])
    inputs = load_input_processor(GatewayConfig.from_args(args))
    try:
        assert inputs.max_model_len == WINDOW
        ids = inputs.check_token_ids(list(range(3, 3 + WINDOW + 5)))
        with pytest.raises(GatewayError, match=f"maximum context length is {WINDOW} tokens") as info:
            inputs.resolve_max_tokens(len(ids), 4)
        assert info.value.kind.http_status == 400
        assert inputs.resolve_max_tokens(WINDOW - 4, None) == 4  # the default budget ends at the window
    finally:
        inputs.close()
    args = build_parser("gateway").parse_args(["gateway", "--model", str(mistral_dir), "--decode", "127.0.0.1:1",
                                               "--max-model-len", str(WINDOW + 1)])
    with pytest.raises(ValueError, match=f"--max-model-len {WINDOW + 1} exceeds"):
        load_input_processor(GatewayConfig.from_args(args))
