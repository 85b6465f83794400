"""Expert parallelism on CPU (gloo): each of two ranks holds half the experts whole,
attention stays tensor-parallel, and the tokens are transformers' greedy ones (a first
difference only at a tie: the ranks' partial sums add up in another order)."""
from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, make_family_model, random_prompts

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_two_ranks_give_transformers_tokens(tmp_path, name):
    d = make_family_model(tmp_path / name, name, seed=31)
    prompts = random_prompts([1, 9, 23, 40], seed=32)
    m = hf_model(d)
    want = hf_greedy(m, prompts, MAX_TOKENS)
    llm = LLM(str(d), tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_memory="8MiB", block_size=4,
              max_num_batched_tokens=16)
    try:
        moe = llm.engine.runner.model.moe_layers()
        assert moe and all(layer.num_local_experts == layer.num_experts // 2 for layer in moe)
        assert moe[0].experts.gate_up_proj.shape[1] == 2 * json.loads((d / "config.json").read_text()).get(
            "moe_intermediate_size", json.loads((d / "config.json").read_text())["intermediate_size"])
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
        load = llm.engine.expert_load()
    finally:
        llm.engine.close()
    assert_greedy_match(m, prompts, want, got, tie=1e-4)
    assert load.sum() > 0


def test_dummy_weights_are_the_same_model_with_and_without_expert_parallelism(tmp_path):
    d = make_family_model(tmp_path / "m", "qwen3-moe", seed=33)
    prompts = random_prompts([5, 17], seed=34)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(str(d), load_format="dummy", kv_cache_memory="4MiB").generate(prompts, sp)]
    llm = LLM(str(d), load_format="dummy", tensor_parallel_size=2, enable_expert_parallel=True,
              kv_cache_memory="4MiB")
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == one
    finally:
        llm.engine.close()


def test_bad_configurations_are_refused(tmp_path):
    dense = make_family_model(tmp_path / "dense", "qwen3")
    with pytest.raises(ValueError, match="--enable-expert-parallel needs a mixture-of-experts model"):
        EngineArgs(model=str(dense), device="cpu", enable_expert_parallel=True).create_engine_config()
    moe = make_family_model(tmp_path / "moe", "qwen3-moe-sparse-step")  # 4 experts
    cfg = json.loads((moe / "config.json").read_text())
    (tmp_path / "six").mkdir()
    (tmp_path / "six" / "config.json").write_text(json.dumps({**cfg, "num_experts": 6, "num_local_experts": 6}))
    with pytest.raises(ValueError, match=r"6 experts do not divide evenly over --tensor-parallel-size 4"):
        EngineArgs(model=str(tmp_path / "six"), device="cpu", tensor_parallel_size=4,
                   enable_expert_parallel=True).create_engine_config()
    # whole experts: the expert width need not divide by the ranks
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 18}))
    EngineArgs(model=str(tmp_path / "odd"), device="cpu", tensor_parallel_size=4,
               enable_expert_parallel=True).create_engine_config()
