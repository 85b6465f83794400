"""Quantized checkpoints served exactly on CPU through the offline API.

Each tiny checkpoint (tests/engine/quant_checkpoints.py: int4 as AutoAWQ, GPTQ and
compressed-tensors store it; FP8 as compressed-tensors' compressor and the fp8 /
fine-grained format store it) is compared with transformers' own model on a float32
copy whose weights are the checkpoint's dequantized: int4 is weight-only, so that copy
is the whole oracle; for FP8 W8A8 the copy's linear layers and experts also see their
inputs rounded through e4m3 per token (tests/engine/fp8_weights_oracle.py). Greedy
tokens must be equal, a first difference allowed only where the oracle's top two
logits tie. Also: chunked prefill, prefix hits and preemption on a quantized model,
tensor parallelism over quantized shards, MoE experts in FP8, and the errors at load.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from tests.conftest import make_tiny_model
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, make_family_model, random_prompts
from tests.engine.fp8_weights_oracle import assert_w8a8_match, hf_w8a8_model
from tests.engine.quant_checkpoints import write_fp8_checkpoint, write_int4_checkpoint

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 5, 17, 33]
ENGINE = dict(kv_cache_memory="8MiB", block_size=4)


def _generate(llm: LLM, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def _match(oracle, prompts, want, got) -> None:
    """The oracle's tokens, up to a tie (of the logits; for W8A8 also of the quantizer)."""
    if hasattr(oracle, "w8a8_rounding"):
        assert_w8a8_match(oracle, prompts, want, got)
    else:
        assert_greedy_match(oracle, prompts, want, got)


def _check(oracle, model_dir: Path, prompts, **engine) -> LLM:
    llm = LLM(str(model_dir), **{**ENGINE, **engine})
    _match(oracle, prompts, hf_greedy(oracle, prompts, MAX_TOKENS), _generate(llm, prompts))
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    return llm


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("quant") / "llama")


# ---- int4 -----------------------------------------------------------------------------------------------

# (fmt, group_size, sym, desc_act, checkpoint_format)
INT4 = [
    ("awq", 32, False, False, "gptq"),
    ("gptq", 32, True, True, "gptq"),  # act-order, symmetric, v1 zeros (unread)
    ("gptq", 32, False, False, "gptq"),  # asymmetric v1: stored zero - 1
    ("gptq", -1, False, False, "gptq_v2"),  # one group per column
    ("compressed-tensors", 32, True, False, "gptq"),
    ("compressed-tensors", -1, False, False, "gptq"),  # channel, asymmetric
]


@pytest.mark.parametrize("case", INT4, ids=lambda c: "-".join(map(str, c)))
def test_int4_checkpoint_serves_its_dequantized_model(base, tmp_path, case):
    fmt, g, sym, desc_act, ckpt = case
    dst, deq = write_int4_checkpoint(base, tmp_path / "q", fmt, g, sym, desc_act, checkpoint_format=ckpt)
    llm = _check(hf_model(deq), dst, random_prompts(PROMPT_LENGTHS, seed=len(fmt) + g))
    assert llm.engine.config.model.quantization.method == fmt
    layer = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.int4_qweight.dtype == torch.int32 and not hasattr(layer, "weight")  # served packed


# ---- FP8 ------------------------------------------------------------------------------------------------

# (fmt, strategy): block scales of 32 x 32 (the tiny model's widths are multiples of 32)
FP8 = [("compressed-tensors", "channel"), ("compressed-tensors", "tensor"), ("compressed-tensors", "block"),
       ("fp8", "block"), ("fp8", "tensor")]
BLOCK = (32, 32)


@pytest.mark.parametrize("fmt,strategy", FP8)
def test_fp8_checkpoint_serves_its_dequantized_model_with_fp8_activations(base, tmp_path, fmt, strategy):
    dst, deq = write_fp8_checkpoint(base, tmp_path / "q", fmt, strategy, BLOCK)
    oracle = hf_w8a8_model(deq, BLOCK[1] if strategy == "block" else None)
    llm = _check(oracle, dst, random_prompts(PROMPT_LENGTHS, seed=7))
    layer = llm.engine.runner.model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert layer.weight_scale.shape == ((192 // 32 * 2, 96 // 32) if strategy == "block" else (384,))


def test_online_fp8_quantizes_per_channel_at_load(base, tmp_path):
    # --quantization fp8 on the 16-bit model: the same codes as compressed-tensors' per-channel
    # (min-max) checkpoint, so that checkpoint's dequantized copy is the oracle.
    _, deq = write_fp8_checkpoint(base, tmp_path / "ref", "compressed-tensors", "channel")
    prompts = random_prompts(PROMPT_LENGTHS, seed=8)
    llm = _check(hf_w8a8_model(deq), base, prompts, quantization="fp8")
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.float32  # the LM head stays unquantized
    # W8A8 changes the tokens of this model: the oracle is not the float model.
    assert _generate(llm, prompts, 24) != _generate(LLM(str(base), **ENGINE), prompts, 24)


def test_chunked_prefill_prefix_hits_and_preemption_on_quantized_models(base, tmp_path):
    dst, deq = write_int4_checkpoint(base, tmp_path / "gptq", "gptq", 32, False, True)
    fp8_dst, fp8_deq = write_fp8_checkpoint(base, tmp_path / "fp8", "fp8", "block", BLOCK)
    shared = random_prompts([40], seed=9)[0]
    prompts = [shared + t for t in random_prompts([3, 9, 1, 14], seed=10)]
    for model_dir, oracle in ((dst, hf_model(deq)), (fp8_dst, hf_w8a8_model(fp8_deq, BLOCK[1]))):
        # 32 blocks of 4 tokens: too few for 4 x ~70 tokens at once; chunks of 32 tokens
        llm = LLM(str(model_dir), max_num_batched_tokens=32, num_gpu_blocks_override=32, block_size=4)
        assert _generate(llm, prompts[:1], 30)  # the shared prefix is cached
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        outs = llm.generate(prompts, sp)
        _match(oracle, prompts, hf_greedy(oracle, prompts, 30), [o.outputs[0].token_ids for o in outs])
        assert llm.engine.scheduler.num_preemptions_total > 0
        assert max(o.num_cached_tokens for o in outs) >= 40
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("kind", ["gptq-act-order", "fp8-block"])
def test_tensor_parallel_shards_of_quantized_weights(base, tmp_path, kind):
    # Two ranks over gloo: int4 act-order rows split by group (uneven groups per rank keep
    # g_idx), FP8 block scales split by tile; the tokens are one rank's.
    if kind == "gptq-act-order":
        dst, _ = write_int4_checkpoint(base, tmp_path / "q", "gptq", 16, False, True)
    else:  # 16 x 16 tiles: each rank's 48 columns of o_proj are whole tiles
        dst, _ = write_fp8_checkpoint(base, tmp_path / "q", "compressed-tensors", "block", (16, 16))
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    want = _generate(LLM(str(dst), **ENGINE), prompts)
    llm = LLM(str(dst), tensor_parallel_size=2, dtype="float32", device="cpu", **ENGINE)
    try:
        assert _generate(llm, prompts) == want
    finally:
        llm.engine.close()


# ---- mixture of experts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,strategy,block", [("compressed-tensors", "channel", (16, 16)),
                                                ("fp8", "block", (16, 16))])
def test_fp8_experts_serve_the_dequantized_moe_model(tmp_path, fmt, strategy, block):
    src = make_family_model(tmp_path / "moe", "qwen3-moe", seed=3)
    dst, deq = write_fp8_checkpoint(src, tmp_path / "q", fmt, strategy, block)
    names = load_file(str(dst / "model.safetensors"))
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    oracle = hf_w8a8_model(deq, block[1] if strategy == "block" else None)
    llm = _check(oracle, dst, random_prompts(PROMPT_LENGTHS, seed=12))
    moe = llm.engine.runner.model.model.layers[0].mlp
    assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert moe.gate.weight.dtype == torch.float32  # the router is not quantized


def test_online_fp8_moe(tmp_path):
    src = make_family_model(tmp_path / "mixtral", "mixtral", seed=4)
    _, deq = write_fp8_checkpoint(src, tmp_path / "ref", "compressed-tensors", "channel")
    _check(hf_w8a8_model(deq), src, random_prompts(PROMPT_LENGTHS, seed=13), quantization="fp8")


# ---- errors at load ---------------------------------------------------------------------------------------


def _with_quant_config(src: Path, dst: Path, qc: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit weights are not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 0, "version": "gemm"}, "group_size must be a positive int"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     "static activation scales are not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "8-bit int weights are not supported"),
])
def test_unsupported_quantization_configs_are_refused_at_start(base, tmp_path, qc, message):
    d = _with_quant_config(base, tmp_path / "m", qc)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(d), device="cpu").create_engine_config()


def test_quantization_flag_against_the_checkpoint(base, tmp_path):
    with pytest.raises(ValueError, match="--quantization awq needs a checkpoint quantized with awq"):
        EngineArgs(model=str(base), device="cpu", quantization="awq").create_engine_config()
    dst, _ = write_int4_checkpoint(base, tmp_path / "q", "gptq", 32)
    with pytest.raises(ValueError, match="the checkpoint is quantized with gptq; --quantization fp8 does not apply"):
        EngineArgs(model=str(dst), device="cpu", quantization="fp8").create_engine_config()
    cfg = EngineArgs(model=str(dst), device="cpu", quantization="gptq").create_engine_config()
    assert "int4 W4A16 gptq, group size 32, symmetric" in cfg.model.quantization.describe()


def test_tensors_that_do_not_match_the_config_are_refused(base, tmp_path):
    # group size 32 stored, 96 declared: the scales have three times the groups
    dst, _ = write_int4_checkpoint(base, tmp_path / "q", "awq", 32)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 96
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"checkpoint tensor has shape \((3|6), \d+\), but awq int4 with group_size 96"):
        LLM(str(dst), **ENGINE)
    # an FP8 checkpoint whose block scales are per channel
    fp8, _ = write_fp8_checkpoint(base, tmp_path / "f", "fp8", "block", BLOCK)
    tensors = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[name] = torch.ones(96, 1)
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match=r"shape \(96, 1\)"):
        LLM(str(fp8), **ENGINE)
    # a weight stored in 16 bits where the config says fp8 leaves its scale unread: refused
    tensors.pop(name)
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights: model.layers.1.mlp.down_proj.weight_scale_inv"):
        LLM(str(fp8), **ENGINE)
