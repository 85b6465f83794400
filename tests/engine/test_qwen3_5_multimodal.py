"""Qwen3.5's published checkpoints, Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration, served as their text model: tiny checkpoints written by
transformers 5.23 itself (a one-block vision tower beside the text model), read from their
``text_config``, ``model.language_model.*`` loaded, ``model.visual.*`` and ``mtp.*`` left
unread. Through the offline API (engine/llm.py), greedy tokens for text prompts, image and
video placeholders among them, are transformers' float32 ``generate``'s for the same
checkpoint: dense, MoE with its experts one tensor each (as transformers writes them) or
stacked ([E, 2I, H] and [E, H, I], as the published BF16 checkpoints store them), and an LM
head tied to the embeddings; and over two tensor-parallel ranks.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.quantization.config import ignored_names
from engine.quantization.methods import QuantMethods
from kernels import reference
from tests.engine.families import assert_greedy_match, hf_greedy, random_prompts
from tests.engine.test_qwen3_next import BASE, MOE, save_with_moved_norms

TEXT = BASE  # the text model of tests/engine/test_qwen3_next.py's checkpoints
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
# the placeholders and their brackets, inside the tiny vocabulary
MEDIA = dict(image_token_id=380, video_token_id=381, vision_start_token_id=378, vision_end_token_id=379)
# name -> (MoE, text_config overrides, top-level overrides)
VARIANTS = {
    # Qwen3.5's multimodal RoPE sections, on half the head's dims
    "dense": (False, dict(intermediate_size=96, layer_types=["linear_attention", "full_attention"] * 2,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                           "mrope_section": [2, 1, 1], "mrope_interleaved": True}), {}),
    # the LM head is the embeddings (the top level's tie_word_embeddings, as transformers reads it)
    "dense-tied": (False, dict(intermediate_size=96, tie_word_embeddings=True), dict(tie_word_embeddings=True)),
    "moe": (True, dict(layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention"],
                       **MOE), {}),
}
BLOCK = 4
MAX_TOKENS = 10


def make_multimodal(path: Path, name: str, seed: int = 0) -> Path:
    """transformers' tiny multimodal model of ``name``, float32, every norm weight (and the
    DeltaNet's dt_bias) moved off its initial value so each one counts; plus a
    multi-token-prediction tensor (``mtp.*``), which the text model skips."""
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    moe, text, top = VARIANTS[name]
    config, model_class = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                           else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    cfg = config(text_config={**TEXT, **text}, vision_config=VISION, **MEDIA, **top)
    torch.manual_seed(seed)
    return save_with_moved_norms(model_class(cfg).float(), path, prefix="model.language_model.")


def stack_experts(src: Path, dst: Path) -> Path:
    """``src`` with each MoE layer's experts stacked: ``experts.gate_up_proj`` [E, 2I, H] (each
    expert's gate rows, then its up rows) and ``experts.down_proj`` [E, H, I]."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = sorted({k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k})
    for layer in layers:
        n = MOE["num_experts"]
        e = [{p: tensors[f"{layer}.mlp.experts.{i}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
             for i in range(n)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in e])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([x["down_proj"] for x in e])
    assert layers and len(out) < len(tensors)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3.5-multimodal")
    out = {name: make_multimodal(root / name, name, seed=i) for i, name in enumerate(VARIANTS)}
    out["moe-stacked"] = stack_experts(out["moe"], root / "moe-stacked")
    return out


def hf_model(path: Path):
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    moe = AutoConfig.from_pretrained(str(path)).model_type == "qwen3_5_moe"
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    return model_class.from_pretrained(str(path), dtype=torch.float32).eval()


def config(path: Path) -> ModelConfig:
    return ModelConfig.from_dir(path, dtype="float32", load_format="auto", served_model_name="m")


def text_prompts(seed: int) -> list[list[int]]:
    """A 1-token prompt, one shorter than a block, one of several blocks (an image's
    placeholders between their brackets) and one past the 64-token chunked form (a video
    placeholder, an image one)."""
    prompts = random_prompts([1, 6, 23, 67], seed=seed)
    prompts[2][4:9] = [MEDIA["vision_start_token_id"], MEDIA["image_token_id"], MEDIA["image_token_id"],
                       MEDIA["image_token_id"], MEDIA["vision_end_token_id"]]
    prompts[3][10], prompts[3][40] = MEDIA["video_token_id"], MEDIA["image_token_id"]
    return prompts


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def test_checkpoints_are_what_the_hub_ships(checkpoints):
    """The fixtures' checkpoints name what is served and what is not as published ones do."""
    for name, d in checkpoints.items():
        cfg = json.loads((d / "config.json").read_text())
        names = set(load_file(str(d / "model.safetensors")))
        assert cfg["architectures"][0] == ("Qwen3_5MoeForConditionalGeneration" if name.startswith("moe")
                                           else "Qwen3_5ForConditionalGeneration")
        assert "text_config" in cfg and "vision_config" in cfg
        assert any(n.startswith("model.visual.") for n in names) and "mtp.fc.weight" in names
        assert "model.language_model.embed_tokens.weight" in names
        assert not any(n.startswith("model.layers.") for n in names)
        assert ("lm_head.weight" in names) == (name != "dense-tied")
    stacked = set(load_file(str(checkpoints["moe-stacked"] / "model.safetensors")))
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in stacked


@pytest.mark.parametrize("name, arch, layer_types, experts", [
    ("dense", "Qwen3_5ForConditionalGeneration", ("linear_attention", "full_attention") * 2, 0),
    ("moe", "Qwen3_5MoeForConditionalGeneration", ("full_attention",) + ("linear_attention",) * 3, 4),
])
def test_text_config_is_read(checkpoints, name, arch, layer_types, experts):
    cfg = config(checkpoints[name])
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        (384, 64, 4, 4, 2, 16)
    assert cfg.layer_types == layer_types and cfg.num_experts == experts
    assert cfg.rotary_dim == (8 if name == "dense" else 4)  # partial_rotary_factor 0.5 / the default 0.25
    assert not cfg.tie_word_embeddings and config(checkpoints["dense-tied"]).tie_word_embeddings
    assert cfg.eos_token_ids == (2,)


def test_top_level_fields_as_transformers_reads_them(checkpoints, tmp_path):
    """The LM head is tied by the top level's tie_word_embeddings (absent: not tied, whatever
    text_config says); generation_config.json's eos_token_id wins; no text_config: refused."""
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((checkpoints["dense"] / "config.json").read_text())
    cfg.pop("tie_word_embeddings")
    cfg["text_config"]["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    assert not config(d).tie_word_embeddings
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert config(d).eos_token_ids == (2, 7)
    del cfg["text_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Qwen3_5ForConditionalGeneration: config.json has no text_config"):
        config(d)


def test_quantization_ignore_lists_name_the_text_model(checkpoints, tmp_path):
    """A quantized checkpoint's ignore lists name the multimodal model's modules
    (``model.language_model.*``): they leave the text model's same layers unquantized."""
    d = tmp_path / "fp8"
    d.mkdir()
    cfg = json.loads((checkpoints["dense"] / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 16],
        "modules_to_not_convert": ["lm_head", "model.visual", "model.language_model.layers.0.linear_attn.in_proj_b",
                                   "model.language_model.layers.0.linear_attn.in_proj_a", "mtp"]}
    (d / "config.json").write_text(json.dumps(cfg))
    qc = config(d).quantization
    assert ignored_names(qc) == ["lm_head", "model.visual", "model.layers.0.linear_attn.in_proj_b",
                                 "model.layers.0.linear_attn.in_proj_a", "mtp"]
    methods = QuantMethods(qc, reference)
    parts = ["in_proj_b", "in_proj_a"]
    assert methods.scheme("model.layers.0.linear_attn", "in_proj_ba", parts) is None
    assert methods.scheme("model.layers.2.linear_attn", "in_proj_ba", parts) is not None


# ---- through the offline API ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "dense-tied", "moe", "moe-stacked"])
def test_greedy_tokens_match_transformers(checkpoints, name):
    d = checkpoints[name]
    m = hf_model(d)
    prompts = text_prompts(seed=100 + list(checkpoints).index(name))
    want = hf_greedy(m, prompts, MAX_TOKENS)
    for budget in (16, 2048):  # prompts in chunks of 16 tokens beside decoding rows; every prompt at once
        llm = LLM(str(d), max_num_batched_tokens=budget, kv_cache_memory="8MiB", block_size=BLOCK)
        assert_greedy_match(m, prompts, want, _generate(llm, prompts))


@pytest.mark.slow
def test_tensor_parallel_through_the_engine(checkpoints):
    """Two ranks (gloo processes), each reading its part of the multimodal checkpoint's text
    model: its heads, and its half of every stacked expert."""
    d = checkpoints["moe-stacked"]
    m = hf_model(d)
    prompts = text_prompts(seed=7)
    want = hf_greedy(m, prompts, MAX_TOKENS)
    llm = LLM(str(d), tensor_parallel_size=2, kv_cache_memory="8MiB", block_size=BLOCK)
    try:
        got = _generate(llm, prompts)
    finally:
        llm.engine.close()
    assert_greedy_match(m, prompts, want, got, tie=1e-4)  # all-reduces sum in another order
