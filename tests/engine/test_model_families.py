"""Every supported family, served exactly: tiny random checkpoints written by
transformers (tests/engine/families.py) give transformers' greedy tokens through the
offline API, across chunked-prefill budgets and mixed batches, with prompts longer
than the sliding window, prefix-cache hits, forced preemption and tensor parallelism
on CPU; checkpoints in either expert layout load; configs naming what pdserve does
not implement are refused at load."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from tests.engine.families import (FAMILIES, WINDOW, assert_greedy_match, greedy_references, hf_greedy, hf_model,
                                   make_family_model, random_prompts)

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
# Longer than the window (8) several times over, odd lengths, one single token.
PROMPT_LENGTHS = [1, 5, 17, 33, 41]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: make_family_model(root / name, name, seed=i) for i, name in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def references(models):
    """(transformers model, prompts, greedy tokens) per family, computed once."""
    return greedy_references(models, PROMPT_LENGTHS, 100, MAX_TOKENS)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(models, references, name):
    m, prompts, want = references[name]
    for budget in (16, 2048):  # chunks of 16 tokens cross the window and block edges; one chunk
        llm = LLM(str(models[name]), max_num_batched_tokens=budget, kv_cache_memory="8MiB", block_size=4)
        assert_greedy_match(m, prompts, want, _generate(llm, prompts))
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("name", ["gemma3", "qwen3-moe", "phi3-window"])
def test_prefix_hits_and_preemption(models, name):
    """A shared prefix longer than the window comes from the cache; too few blocks for
    the batch forces recompute (or, windowed on every layer, waiting); tokens stay
    transformers'."""
    d = models[name]
    base = random_prompts([30], seed=7)[0]
    prompts = [base + t for t in random_prompts([3, 9, 1, 14], seed=8)]
    m = hf_model(d)
    want = hf_greedy(m, prompts, MAX_TOKENS)
    # Too few blocks for the batch; a model windowed on every layer holds far fewer per request.
    # Gemma 3: a block is one layer's page (three groups of one layer; 72 would be 24 blocks' memory).
    blocks = {"phi3-window": 13, "gemma3": 36}.get(name, 24)
    llm = LLM(str(d), max_num_batched_tokens=32, num_gpu_blocks_override=blocks, block_size=4)
    assert_greedy_match(m, prompts[:1], want[:1], _generate(llm, prompts[:1]))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_greedy_match(m, prompts, want, [o.outputs[0].token_ids for o in outs])
    if name != "phi3-window":  # windowed everywhere: decoding rows release as they take, none is preempted
        assert llm.engine.scheduler.num_preemptions_total > 0
    assert max(o.num_cached_tokens for o in outs) >= 28  # the shared prefix's full blocks
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("name", ["qwen3-moe", "gemma3", "phi3-window"])
def test_tensor_parallel_on_cpu(models, references, name):
    """Two ranks (gloo): heads, the MLP's and every expert's intermediate dimension split."""
    m, prompts, want = references[name]
    llm = LLM(str(models[name]), tensor_parallel_size=2, kv_cache_memory="8MiB", block_size=4)
    try:
        got = _generate(llm, prompts)
    finally:
        llm.engine.close()
    assert_greedy_match(m, prompts, want, got, tie=1e-4)  # all-reduces sum in another order


def test_stacked_expert_checkpoint_loads_alike(models, references, tmp_path):
    """transformers 5's stacked expert tensors (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) load into the same model as one tensor per expert."""
    src = models["qwen3-moe"]
    d = tmp_path / "stacked"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts"
        if f"{pre}.0.gate_proj.weight" not in tensors:
            continue  # a dense layer (mlp_only_layers)
        pop = lambda e, w: tensors.pop(f"{pre}.{e}.{w}.weight")  # noqa: E731
        gate_up = [torch.cat([pop(e, "gate_proj"), pop(e, "up_proj")]) for e in range(num_experts)]
        tensors[f"{pre}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{pre}.down_proj"] = torch.stack([pop(e, "down_proj") for e in range(num_experts)])
    save_file(tensors, str(d / "model.safetensors"))
    m, prompts, want = references["qwen3-moe"]
    llm = LLM(str(d), kv_cache_memory="8MiB", block_size=4)
    assert_greedy_match(m, prompts, want, _generate(llm, prompts))


def test_expert_load_counts_every_routed_token(models):
    """Each MoE layer counts top-k experts per token: prompt and generated tokens alike."""
    llm = LLM(str(models["qwen3-moe"]), kv_cache_memory="8MiB", block_size=4)
    prompts = random_prompts([5, 9], seed=3)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    load = llm.engine.expert_load()
    num_moe_layers = 2  # of 3 layers, mlp_only_layers=[1] is dense
    # every token but each request's last sampled one goes through the model
    tokens = sum(len(p) + 4 - 1 for p in prompts)
    assert load.shape == (num_moe_layers, 8)
    assert load.sum(dim=1).tolist() == [tokens * 2] * num_moe_layers


def test_missing_and_unexpected_weights_are_named(models, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(models["mixtral"], d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight")
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.experts\.down_proj\[\('down', 3\)\]"):
        LLM(str(d), kv_cache_memory="8MiB")
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"] = torch.zeros(64, 96)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.extra.weight'"):
        LLM(str(d), kv_cache_memory="8MiB")


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters={"rope_type": "su", "rope_theta": 10000.0}), "unsupported rope_type 'su'"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping is not supported"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "unsupported layer_types"),
    (dict(hidden_activation="relu"), "unsupported activation 'relu'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention is not supported"),
    (dict(architectures=["Gemma2ForCausalLM"]), "unsupported architecture 'Gemma2ForCausalLM'"),
])
def test_unsupported_config_fields_are_refused_at_load(models, tmp_path, change, message):
    d = tmp_path / "cfg"
    d.mkdir()
    cfg = json.loads((models["gemma3"] / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(d), device="cpu").create_engine_config()


def test_tensor_parallel_size_must_divide_the_expert_width(models, tmp_path):
    cfg = json.loads((models["qwen3-moe"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 18}))
    with pytest.raises(ValueError, match=r"does not divide the model's expert intermediate size \(18\)"):
        EngineArgs(model=str(tmp_path), device="cpu", tensor_parallel_size=4).create_engine_config()


def test_window_layers_follow_the_config(models):
    from engine.config import ModelConfig

    cfg = ModelConfig.from_dir(models["gemma3"], dtype="float32", load_format="auto", served_model_name="m")
    assert cfg.layer_windows == (WINDOW, None, WINDOW)
    assert cfg.rope["full_attention"]["rope_type"] == "linear"
    assert cfg.rope["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.max_position_embeddings == 512  # a window no longer caps the context
    cfg = ModelConfig.from_dir(models["phi3-window"], dtype="float32", load_format="auto", served_model_name="m")
    assert cfg.layer_windows == (WINDOW,) * 3
    cfg = ModelConfig.from_dir(models["qwen3"], dtype="float32", load_format="auto", served_model_name="m")
    assert cfg.layer_windows == (None,) * 3


@pytest.mark.parametrize("caching", [True, False])
def test_all_window_models_release_blocks_behind_the_window(models, caching):
    """Every layer windowed (Mistral style): a request holds about window / block_size + 2
    blocks however long it runs, its tokens stay transformers', and nothing leaks. A model
    with a full-attention layer (Gemma 3) keeps every block."""
    d = models["mistral-window"]
    prompt = random_prompts([30], seed=21)[0]
    m = hf_model(d)
    want = hf_greedy(m, [prompt], 40)
    # Few blocks: a block released too early is soon handed out again and overwritten.
    llm = LLM(str(d), num_gpu_blocks_override=10, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=caching)
    e, kv = llm.engine, llm.engine.scheduler.kv
    (group,) = kv.groups  # one group of every layer, windowed
    assert group.group.sliding_window == WINDOW
    req = e.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    most = 0
    while e.has_unfinished_requests():
        e.step()
        most = max(most, kv.num_held_blocks("r"))
        if not req.is_finished:  # what the pool holds is what the live request holds
            assert kv.pool.num_used_blocks == kv.num_held_blocks("r")
            # the next query (position n) sees keys n - WINDOW + 1 .. n: every block from
            # there on is held, every one before it released
            blocks, live_from = group.req_blocks["r"], max(0, req.num_computed_tokens - WINDOW + 1) // 4
            assert all(b.ref_cnt > 0 for b in blocks[live_from:])
            assert group.num_dead_blocks.get("r", 0) == min(live_from, len(blocks) - 1)
    assert_greedy_match(m, [prompt], want, [req.output_token_ids])
    assert most <= WINDOW // 4 + 2 + 4  # + one 16-token prefill chunk in flight
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_free_blocks == kv.pool.num_blocks
    gemma = LLM(str(models["gemma3"]), kv_cache_memory="8MiB", block_size=4)
    # Gemma 3: its full layers' group keeps every block, its windowed ones' groups release theirs
    assert [g.kind for g in gemma.engine.scheduler.kv.layout.groups][0] == "full"
    assert "sliding" in {g.kind for g in gemma.engine.scheduler.kv.layout.groups}
