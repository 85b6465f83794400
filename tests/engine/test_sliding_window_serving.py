"""A sliding-window model (Mistral style) is served to its full context, not capped at
its window: the engine and the gateway take prompts longer than the window, and the
tokens are transformers' (tests/engine/test_model_families.py covers every family)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, make_family_model, random_prompts

WINDOW = 8
MAX_POSITIONS = 128


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, default_model_dir: Path) -> Path:
    d = make_family_model(tmp_path_factory.mktemp("mistral-sw"), "mistral-window", seed=4,
                          sliding_window=WINDOW, max_position_embeddings=MAX_POSITIONS)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the gateway needs a tokenizer
        shutil.copy(default_model_dir / name, d / name)
    return d


def test_engine_serves_prompts_past_the_window(mistral_dir):
    llm = LLM(str(mistral_dir), kv_cache_memory="4MiB", block_size=4)
    assert llm.engine.config.scheduler.max_model_len == MAX_POSITIONS
    prompts = random_prompts([WINDOW * 5 + 3, MAX_POSITIONS - 8], seed=5)
    m = hf_model(mistral_dir)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert_greedy_match(m, prompts, hf_greedy(m, prompts, 8),
                        [o.outputs[0].token_ids for o in llm.generate(prompts, sp)])


def test_gateway_takes_the_model_context_not_the_window(mistral_dir):
    from gateway.config import GatewayConfig
    from gateway.server import load_input_processor
    from pdserve.cli import build_parser

    args = build_parser("gateway").parse_args(["gateway", "--model", str(mistral_dir), "--decode", "127.0.0.1:1"])
    inputs = load_input_processor(GatewayConfig.from_args(args))
    try:
        assert inputs.max_model_len == MAX_POSITIONS
        ids = inputs.check_token_ids(list(range(3, 3 + WINDOW * 4)))
        assert inputs.resolve_max_tokens(len(ids), 4) == 4
    finally:
        inputs.close()
