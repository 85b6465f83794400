"""gpt-oss served exactly: tiny random checkpoints written by transformers 5.23 itself, with
every part of the family live: attention sinks (drawn large enough to move the softmax), QKV
and output biases, sliding-window layers of 8 keys (far shorter than the prompts) alternating
with full ones, YaRN, four experts (top 2) with biases, the clamped SwiGLU with a limit the
activations reach, a router with a bias. Compared with transformers' float32 logits directly
(a whole prompt, and in chunks over the paged cache), then through the offline API with its
greedy tokens: chunked prefill, prefix hits, preemption, two tensor-parallel ranks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineArgs, ModelConfig
from engine.kv_cache_groups import model_layout
from engine.models.gpt_oss import to_checkpoint_layout, to_engine_layout
from tests.engine.families import (assert_gpu_greedy_match, assert_greedy_match, assert_grouped_logits_match,
                                   assert_prefix_hits_and_preemption, greedy_references, hf_greedy, hf_model,
                                   random_prompts)

pytestmark = pytest.mark.slow
WINDOW = 8
MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 5, 17, 33, 41]
BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW,
            num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.4, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 10000.0})


def make_gpt_oss(path: Path, seed: int = 0, **change) -> Path:
    """A tiny gpt-oss checkpoint; the biases and sinks (which transformers initialises to 0 or
    small) drawn so each one changes the tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_oss", **{**BASE, **change})
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 2.0)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    m.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "m", seed=1)


@pytest.fixture(scope="module")
def references(model_dir):
    """(transformers model, prompts, greedy tokens), computed once."""
    return greedy_references({"m": model_dir}, PROMPT_LENGTHS, 300, MAX_TOKENS)["m"]


def _config(d: Path) -> ModelConfig:
    return ModelConfig.from_dir(d, dtype="float32", load_format="auto", served_model_name="m")


def _generate(llm: LLM, prompts) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def test_config_and_cache_layout(model_dir):
    cfg = _config(model_dir)
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.rope["full_attention"]["rope_type"] == "yarn" and cfg.attention_bias
    kinds = sorted(g.kind for g in model_layout(cfg, 4).groups)
    assert kinds == ["full", "sliding"]  # the windowed layers keep only their window's blocks


def test_expert_layouts_round_trip():
    """Interleaved gate/up columns and the [E, in, out] storage become gate rows then up rows,
    [E, out, in]; the inverse gives the checkpoint back."""
    e, h, i = 3, 5, 4
    gate_up = torch.randn(e, h, 2 * i)
    got = to_engine_layout("model.layers.0.mlp.experts.gate_up_proj", gate_up)
    assert torch.equal(got[:, :i], gate_up[:, :, 0::2].transpose(1, 2))
    assert torch.equal(got[:, i:], gate_up[:, :, 1::2].transpose(1, 2))
    for name, t in [("gate_up_proj", gate_up), ("gate_up_proj_bias", torch.randn(e, 2 * i)),
                    ("down_proj", torch.randn(e, i, h)), ("down_proj_bias", torch.randn(e, h))]:
        full = f"model.layers.1.mlp.experts.{name}"
        assert torch.equal(to_checkpoint_layout(full, to_engine_layout(full, t)), t)
    other = torch.randn(4, 4)
    assert to_engine_layout("model.layers.0.self_attn.o_proj.weight", other) is other


def test_forward_matches_transformers_logits(model_dir):
    """A prompt five windows long in one call, then in chunks of 5, 1, 13 and 18 tokens: every
    position's logits are transformers' (float32)."""
    assert_grouped_logits_match(model_dir, torch.tensor(random_prompts([37], seed=5)[0]), (5, 6, 19, 37))


def test_every_part_matters(model_dir):
    """The fixture is a fair test: without the sinks, the biases or the clamp, transformers'
    own logits move by far more than the tolerance above."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([random_prompts([37], seed=5)[0]])
    with torch.no_grad():
        base = hf_model(model_dir)(ids).logits
        for part in ("sinks", "router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias",
                     "self_attn.o_proj.bias"):
            m = hf_model(model_dir)
            for name, p in m.named_parameters():
                if name.endswith(part):
                    p.zero_()
            assert (m(ids).logits - base).abs().max() > 1e-2, part
        unclamped = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, swiglu_limit=1e9)
        assert (unclamped(ids).logits - base).abs().max() > 1e-2


def test_greedy_matches_transformers(model_dir, references):
    """Through the offline API: chunks of 16 tokens (across window and block edges) and whole
    prompts; every block back in the pool at the end."""
    m, prompts, want = references
    for budget in (16, 2048):
        llm = LLM(str(model_dir), max_num_batched_tokens=budget, kv_cache_memory="8MiB", block_size=4)
        assert_greedy_match(m, prompts, want, _generate(llm, prompts))
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("blocks, caching, preempts", [
    pytest.param(24, False, True, id="preemption"),
    pytest.param(28, True, True, id="prefix-hits-and-preemption"),
])
def test_prefix_hits_and_preemption(model_dir, blocks, caching, preempts):
    assert_prefix_hits_and_preemption(model_dir, blocks, caching, preempts, MAX_TOKENS)


def test_tensor_parallel_on_cpu(model_dir, references):
    """Two ranks (gloo): heads and their sinks, the experts' intermediate slices and their
    biases split; the output and down biases added once."""
    m, prompts, want = references
    llm = LLM(str(model_dir), tensor_parallel_size=2, kv_cache_memory="8MiB", block_size=4)
    try:
        got = _generate(llm, prompts)
    finally:
        llm.engine.close()
    assert_greedy_match(m, prompts, want, got, tie=1e-4)  # all-reduces sum in another order


def test_random_weights_at_the_shape(model_dir):
    """`--load-format dummy` draws the experts in the engine's layout and hands them over in the
    checkpoint's: the model builds and generates."""
    llm = LLM(str(model_dir), load_format="dummy", kv_cache_memory="8MiB", block_size=4)
    assert len(_generate(llm, [[5, 6, 7]])[0]) == MAX_TOKENS


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters={"rope_type": "su", "rope_theta": 1e4}), "unsupported rope_type 'su'"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]),
     "unsupported layer_types"),
])
def test_unsupported_config_fields_are_refused_at_load(model_dir, tmp_path, change, message):
    d = tmp_path / "cfg"
    d.mkdir()
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(d), device="cpu").create_engine_config()


# ---- MXFP4 experts, as gpt-oss ships them ------------------------------------------------
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def make_mxfp4_pair(src: Path, quantized: Path, dequantized: Path) -> None:
    """From a float checkpoint: ``quantized`` with its experts in MXFP4 as gpt-oss ships them
    (``*_blocks`` [E, out, in/32, 16] and ``*_scales`` [E, out, in/32], the gate/up rows
    interleaved, ``quantization_config`` mxfp4), and ``dequantized``, the same model with those
    MXFP4 values written back as float32 (what the quantized one must serve exactly)."""
    from safetensors.torch import load_file, save_file

    from kernels.mxfp4_reference import dequantize_mxfp4, quantize_mxfp4

    tensors = load_file(str(src / "model.safetensors"))
    packed, plain = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2).contiguous())  # [E, out, in]: rows interleaved as stored
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            plain[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            packed[name] = plain[name] = t
    for d, ts in ((quantized, packed), (dequantized, plain)):
        d.mkdir(parents=True)
        cfg = json.loads((src / "config.json").read_text())
        if d == quantized:
            cfg["quantization_config"] = MXFP4_CONFIG
        (d / "config.json").write_text(json.dumps(cfg))
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mxfp4_pair(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    make_mxfp4_pair(model_dir, root / "q", root / "f")
    return root / "q", root / "f"


def test_mxfp4_checkpoint_serves_its_dequantized_model(mxfp4_pair):
    """The experts stay packed (uint8 blocks, no 16-bit copy) and the tokens are those of the
    same model with the MXFP4 values in float32, which are transformers' for it; chunked
    prefill and whole prompts."""
    q, f = mxfp4_pair
    m = hf_model(f)
    prompts = random_prompts(PROMPT_LENGTHS, seed=31)
    want = hf_greedy(m, prompts, MAX_TOKENS)
    for budget in (16, 2048):
        llm = LLM(str(q), max_num_batched_tokens=budget, kv_cache_memory="8MiB", block_size=4)
        experts = llm.engine.runner.model.model.layers[0].mlp.experts
        assert {n: p.dtype for n, p in experts.named_parameters() if "bias" not in n} == {
            "gate_up_proj_blocks": torch.uint8, "gate_up_proj_scales": torch.uint8,
            "down_proj_blocks": torch.uint8, "down_proj_scales": torch.uint8}
        assert_greedy_match(m, prompts, want, _generate(llm, prompts))


def test_mxfp4_quantization_is_not_a_no_op(model_dir, mxfp4_pair):
    """The dequantized experts differ from the float ones (so the test above tests MXFP4)."""
    from safetensors.torch import load_file

    a = load_file(str(model_dir / "model.safetensors"))
    b = load_file(str(mxfp4_pair[1] / "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert (a[name] - b[name]).abs().max() > 1e-3


@pytest.mark.parametrize("change, message", [
    (dict(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": []}), "mxfp4"),
    (dict(quantization_config={**MXFP4_CONFIG, "weight_block_size": [1, 64]}), "weight_block_size"),
])
def test_mxfp4_variants_not_supported_are_refused(mxfp4_pair, tmp_path, change, message):
    d = tmp_path / "cfg"
    d.mkdir()
    cfg = json.loads((mxfp4_pair[0] / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(d), kv_cache_memory="8MiB", block_size=4)


# ---- on a GPU: the Triton kernels with sinks, the fused MoE with biases, MXFP4 experts ----
GPU_SHAPE = dict(hidden_size=256, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 num_local_experts=8, num_experts_per_tok=2, sliding_window=32, initializer_range=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tie, relative", [("float32", 1e-4, 0.0), ("bfloat16", 0.02, 0.01)])
@pytest.mark.parametrize("experts", ["float", "mxfp4"])
def test_gpt_oss_on_gpu(tmp_path, quick_moe_tuning, experts, dtype, tie, relative):
    """Through CUDA graphs, chunked prefill and prompts far past the 32-key window: float32
    within float32 rounding of transformers; bf16 within bf16 rounding of transformers' own
    bf16, up to where its bf16 tokens leave its float32 ones. MXFP4 experts are held against
    the same model with the MXFP4 values written back as floats."""
    d = make_gpt_oss(tmp_path / "m", seed=7, **GPU_SHAPE)
    if experts == "mxfp4":
        make_mxfp4_pair(d, tmp_path / "q", tmp_path / "f")
        served, d = tmp_path / "q", tmp_path / "f"
    else:
        served = d
    assert_gpu_greedy_match(d, served, random_prompts([1, 7, 33, 65, 130], seed=8), dtype, tie, relative)
