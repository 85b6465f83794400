"""Multi-LoRA through the offline API: random PEFT adapters (tests/engine/lora_adapters.py)
give PEFT's own greedy tokens, in one batch mixing three adapters and the base model,
for the Llama-shaped families and Phi-3's stacked layers; more adapters than
``max_loras`` take turns; the prefix cache never shares blocks across adapters and
does within one; adapters that cannot be served are refused at load, each with its
reason."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.adapter import LoRAError
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, make_family_model, random_prompts
from tests.engine.lora_adapters import make_adapter, peft_model

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
LENGTHS = [3, 17, 9, 30]


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """Per family: its directory and three adapters of different ranks, scalings and targets."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, name in enumerate(["qwen3", "phi3"]):
        base = make_family_model(root / name, name, seed=i)
        targets = None if name == "qwen3" else ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
        adapters = [
            make_adapter(base, root / f"{name}-a", seed=10 + i, r=8, alpha=16, targets=targets, scale=2.0),
            make_adapter(base, root / f"{name}-b", seed=20 + i, r=4, alpha=8, use_rslora=True, scale=2.0,
                         targets=["q_proj", "v_proj", "down_proj"] if name == "qwen3" else ["qkv_proj"]),
            make_adapter(base, root / f"{name}-c", seed=30 + i, r=16, alpha=32, targets=targets, scale=2.0),
        ]
        out[name] = (base, adapters)
    return out


def _requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(f"ad{i}", i + 1, str(p)) for i, p in enumerate(adapters)]


@pytest.mark.parametrize("name, graphs", [("phi3", False), ("qwen3", True)], ids=["phi3", "qwen3-graph-path"])
def test_mixed_batch_matches_peft(setups, name, graphs, monkeypatch):
    """``graphs``: decode steps take the CUDA-graph path (run eagerly on CPU: the same
    buffers, the slots uploaded per replay and grouped inside the forward)."""
    base, adapters = setups[name]
    prompts = random_prompts(LENGTHS * 2, seed=7)
    loras = (_requests(adapters) + [None]) * 2  # every prompt length under each adapter and the base model
    want = []
    refs = {None: hf_model(base)} | {str(p): peft_model(base, p) for p in adapters}
    for p, lr in zip(prompts, loras):
        want.append(hf_greedy(refs[lr.lora_path if lr else None], [p], MAX_TOKENS)[0])
    assert len({tuple(w) for w in want}) > len(prompts) // 2  # the adapters change the answers
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for max_loras, budget in [(3, 2048), (2, 16)]:  # all three at once; two slots taking turns, chunked prefill
        llm = LLM(str(base), enable_lora=True, max_loras=max_loras, max_cpu_loras=3, kv_cache_memory="8MiB",
                  block_size=4, max_num_batched_tokens=budget, graphs_without_capture=graphs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=loras)]
        for p, w, g, lr in zip(prompts, want, got, loras):
            assert_greedy_match(refs[lr.lora_path if lr else None], [p], [w], [g])
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
        if graphs:
            assert llm.engine.runner.graphs.num_replays > 0
        if max_loras == 2:  # the third adapter took the slot of one whose requests had finished
            assert llm.engine.lora.num_slot_loads >= 3 and len(llm.engine.lora.held()) == 2


def test_tensor_parallel_ranks_follow_rank_zeros_slots(setups, monkeypatch):
    """TP 2 on CPU (gloo): each rank holds its share of every adapter (column layers B's
    rows, row layers A's columns), rank 0's slot fills and each step's token slots reach
    the other rank, with eager prefill steps and decode steps on the graph path; two
    slots for three adapters make the slots turn over."""
    base, adapters = setups["qwen3"]
    prompts = random_prompts(LENGTHS, seed=11)
    loras = [*_requests(adapters), None]
    refs = {None: hf_model(base)} | {str(p): peft_model(base, p) for p in adapters}
    want = [hf_greedy(refs[lr.lora_path if lr else None], [p], MAX_TOKENS)[0] for p, lr in zip(prompts, loras)]
    llm = LLM(str(base), tensor_parallel_size=2, enable_lora=True, max_loras=2, max_cpu_loras=3,
              kv_cache_memory="8MiB", block_size=4, graphs_without_capture=True)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=loras)]
    for p, w, g, lr in zip(prompts, want, got, loras):
        assert_greedy_match(refs[lr.lora_path if lr else None], [p], [w], [g])
    assert llm.engine.lora.num_slot_loads >= 3
    llm.engine.close()


def test_adapters_in_verify_steps(setups, monkeypatch):
    """n-gram speculation beside adapters, on the graph path: verify graphs carry each
    token's slot (k + 1 a row), and greedy tokens stay PEFT's."""
    base, adapters = setups["qwen3"]
    phrase = random_prompts([5], seed=13)[0]
    prompts = [phrase * 3 + p for p in random_prompts([2, 7, 4], seed=14)]
    loras = [*_requests(adapters)[:2], None]
    refs = {None: hf_model(base)} | {str(p): peft_model(base, p) for p in adapters[:2]}
    want = [hf_greedy(refs[lr.lora_path if lr else None], [p], 16)[0] for p, lr in zip(prompts, loras)]
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    llm = LLM(str(base), enable_lora=True, max_loras=2, kv_cache_memory="8MiB", block_size=4, max_num_seqs=4,
              speculative_config=spec, graphs_without_capture=True)
    replays = []
    replay = llm.engine.runner.graphs.replay
    llm.engine.runner.graphs.replay = lambda size, splits, q=1: (replays.append(q), replay(size, splits, q))[1]
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), lora_request=loras)]
    for p, w, g, lr in zip(prompts, want, got, loras):
        assert_greedy_match(refs[lr.lora_path if lr else None], [p], [w], [g])
    assert 4 in replays and llm.engine.scheduler.spec.num_drafts > 0


def test_default_model_under_an_adapter_matches_peft(default_model_dir, tmp_path):
    """The embedded default model (SmolLM2-135M, Llama family, tied embeddings) with a PEFT
    adapter on every projection: greedy tokens are PEFT's."""
    adapter = make_adapter(default_model_dir, tmp_path / "smol", seed=5, r=8, alpha=16, scale=0.5)
    ref = peft_model(default_model_dir, adapter)
    prompts = random_prompts([6, 19], vocab=49152, seed=12)
    want = hf_greedy(ref, prompts, MAX_TOKENS)
    assert want != hf_greedy(hf_model(default_model_dir), prompts, MAX_TOKENS)  # the adapter matters
    llm = LLM(None, enable_lora=True, kv_cache_memory="32MiB", max_model_len=256)
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        lora_request=LoRARequest("smol", 1, str(adapter)))]
    assert_greedy_match(ref, prompts, want, got)


def test_prefix_cache_is_per_adapter(setups):
    base, adapters = setups["qwen3"]
    llm = LLM(str(base), enable_lora=True, max_loras=2, kv_cache_memory="8MiB", block_size=4)
    a, b = _requests(adapters)[:2]
    prompt = random_prompts([40], seed=3)[0]
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def cached(lr):
        return llm.generate([prompt], sp, lora_request=lr)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(a) == 36  # the same adapter: every full block but the last token's
    assert cached(b) == 0  # another adapter: nothing shared
    assert cached(None) == 0  # nor the base model
    assert cached(None) == 36 and cached(b) == 36


def _copy(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_with_the_reason(setups, tmp_path):
    base, adapters = setups["qwen3"]
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, kv_cache_memory="8MiB")
    lora = llm.engine.lora
    other = make_family_model(tmp_path / "wide", "qwen3", hidden_size=96, head_dim=24)
    truncated = _copy(adapters[0], tmp_path / "truncated")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    cases = [
        (adapters[2], "rank 16 is above --max-lora-rank 8"),
        (_copy(adapters[0], tmp_path / "missing", lambda c: c.update(target_modules=["q_proj", "w9"])),
         "target_modules ['w9'] are not adaptable"),
        (make_adapter(other, tmp_path / "other", seed=1, r=4), "do not fit a"),
        (truncated, "cannot be read (corrupt or truncated)"),
        (_copy(adapters[0], tmp_path / "dora", lambda c: c.update(use_dora=True)), "DoRA"),
        (tmp_path / "nowhere", "is not a directory"),
    ]
    for path, reason in cases:
        with pytest.raises(LoRAError, match=reason.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            lora.register("bad", str(path))
    assert lora.list() == []
    with pytest.raises(ValueError, match="'nope' is not loaded and the request has no lora_path"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("nope"))
    with pytest.raises(LoRAError, match="'nope' is not loaded here"):
        llm.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="nope")
    plain = LLM(str(base), kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=_requests(adapters)[0])


def test_moe_attention_adapts_and_experts_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    base = make_family_model(tmp_path / "moe", "qwen3-moe")
    attention_only = make_adapter(base, tmp_path / "moe-a", seed=2, r=4, targets=["q_proj", "o_proj"])
    llm = LLM(str(base), enable_lora=True, kv_cache_memory="8MiB")
    prompts = random_prompts([9, 14], seed=4)
    ref = peft_model(base, attention_only)
    want = hf_greedy(ref, prompts, MAX_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        lora_request=LoRARequest("attn", 1, str(attention_only)))]
    assert_greedy_match(ref, prompts, want, got)
    experts = _copy(attention_only, tmp_path / "moe-experts")
    tensors = load_file(str(experts / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    tensors |= {f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(32, 4)}
    save_file(tensors, str(experts / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="no adaptable module 'model.layers.0.mlp.experts.0.gate_proj'"):
        llm.engine.lora.register("moe", str(experts))


def test_lora_flags_parse_and_travel(tmp_path):
    """vLLM's flag forms, the errors of bad ones, and `pdserve up` handing them to the servers."""
    import argparse

    from engine.config import EngineArgs
    from engine.lora.config import parse_lora_module
    from pdserve.cli.up import engine_flags

    assert parse_lora_module("sql=/models/sql-lora") == ("sql", "/models/sql-lora")
    assert parse_lora_module('{"name": "sql", "path": "/m/sql", "base_model_name": "x"}') == ("sql", "/m/sql")
    for bad, reason in [("sql", "expected name=path"), ("=x", "needs a name and a path"), ("{bad", "not valid JSON")]:
        with pytest.raises(ValueError, match=reason):
            parse_lora_module(bad)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "4"])
    assert ns.lora_modules == ["a=/x", "b=/y"]
    assert engine_flags(ns) == ["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "4"]
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        EngineArgs(model=None, lora_modules=["a=/x"], device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        EngineArgs(model=None, enable_lora=True, max_loras=4, max_cpu_loras=2, device="cpu").create_engine_config()
