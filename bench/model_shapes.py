"""Named model shapes for benchmarks with random weights (--load-format
dummy): writes a Hugging Face config.json into the cache and returns its
directory. Random weights at the real shape cost the same bytes and FLOPs.

``shape_dir(name, tokenizer=True)`` adds a word-level tokenizer of the shape's
whole vocabulary (token i is the word ``t{i}``), for serving through the
gateway: every id a random model samples then streams as a non-empty chunk
(a real tokenizer of a smaller vocabulary would decode most of them to
nothing, and the gateway sends no empty deltas, which skews TTFT and ITL).
``python -m bench.model_shapes NAME [--tokenizer]`` prints the directory."""
from __future__ import annotations

import json
from pathlib import Path

from engine.model_files import cache_dir

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1000000.0,
        bos_token_id=151643, eos_token_id=151645),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_theta=100000.0, bos_token_id=1, eos_token_id=2),
}


# Gemma 3-12B (text): five windowed layers of 1,024 keys to one full layer.
SHAPES["gemma-3-12b"] = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, hidden_size=3840,
    intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True, query_pre_attn_scalar=256,
    sliding_window=1024, sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh",
    rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
    bos_token_id=2, eos_token_id=1)
# Qwen3.5-27B (text): 64 layers, three Gated DeltaNet layers to one gated full-attention layer;
# the linear-attention heads are transformers 5.23's Qwen3_5TextConfig defaults.
SHAPES["qwen3.5-27b"] = dict(
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120,
    intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, layer_types=["linear_attention", "linear_attention", "linear_attention",
                                            "full_attention"] * 16,
    bos_token_id=248044, eos_token_id=248044)

# Gemma 4 E2B (the text model of google/gemma-4-E2B-it): four windowed layers of 512 keys to one
# full layer, whose KV heads are twice as wide (512); the last 20 layers read the KV of layers 13
# (windowed) and 14 (full) and have double-wide MLPs; per-layer inputs of 256.
SHAPES["gemma-4-e2b"] = dict(
    architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=262144, hidden_size=1536,
    intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
    global_head_dim=512, attention_k_eq_v=False, rms_norm_eps=1e-6, max_position_embeddings=131072,
    tie_word_embeddings=True, sliding_window=512, hidden_activation="gelu_pytorch_tanh",
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, num_kv_shared_layers=20,
    use_double_wide_mlp=True, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
    final_logit_softcapping=30.0, enable_moe_block=False,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0}},
    bos_token_id=2, eos_token_id=1, pad_token_id=0)
# transformers 5.23's Qwen3_5TextConfig defaults (32 layers, hidden 4096): a Qwen3.5 shape whose
# float32 construction fits one 80 GB GPU (the 27B one's does not).
SHAPES["qwen3.5-text-default"] = dict(
    SHAPES["qwen3.5-27b"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, layer_types=["linear_attention", "linear_attention", "linear_attention",
                                        "full_attention"] * 8)


# A draft model's shape beside llama-3.1-8b (the same vocabulary and RoPE, a tied embedding)
SHAPES["llama-3.2-1b"] = dict(SHAPES["llama-3.1-8b"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                              head_dim=64, tie_word_embeddings=True,
                              rope_scaling=dict(SHAPES["llama-3.1-8b"]["rope_scaling"], factor=32.0))

# The 128 x 128 block-scaled FP8 checkpoints Qwen publishes (Qwen3-8B-FP8, Qwen3-30B-A3B-FP8):
# with random weights (--load-format dummy) each tile is quantized at load.
_FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# gpt-oss-120b and -20b as OpenAI ships them: MXFP4 experts (e2m1 values, an e8m0 scale per 32),
# attention, router and embeddings in bf16; windows of 128 keys on every other layer; YaRN.
SHAPES["gpt-oss-120b"] = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_local_experts=128, num_experts_per_tok=4, sliding_window=128, attention_bias=True, swiglu_limit=7.0,
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
    layer_types=["sliding_attention", "full_attention"] * 18,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    bos_token_id=199998, eos_token_id=200002, pad_token_id=199999)
SHAPES["gpt-oss-20b"] = dict(SHAPES["gpt-oss-120b"], num_hidden_layers=24, num_local_experts=32,
                             layer_types=["sliding_attention", "full_attention"] * 12)
SHAPES["qwen3-8b-fp8"] = dict(SHAPES["qwen3-8b"], quantization_config=_FP8_BLOCK)
SHAPES["qwen3-30b-a3b-fp8"] = dict(SHAPES["qwen3-30b-a3b"], quantization_config=_FP8_BLOCK)
SHAPES["llama-3.1-8b-fp8-block"] = dict(SHAPES["llama-3.1-8b"], quantization_config=_FP8_BLOCK)


def shape_dir(name: str, tokenizer: bool = False) -> Path:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    d = cache_dir() / "shapes" / (name + ("-tokenizer" if tokenizer else ""))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    if tokenizer and not (d / "tokenizer.json").exists():
        write_word_tokenizer(d, SHAPES[name])
    return d


def write_word_tokenizer(d: Path, config: dict) -> None:
    """A word-level tokenizer of the config's vocabulary ("t0" ... "tN"): every id decodes to a
    non-empty word, for serving a model that ships none."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    special = {k.replace("_id", ""): f"t{config[k]}" for k in ("bos_token_id", "eos_token_id")
               if isinstance(config.get(k), int)}
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}))


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="write a named model shape's directory and print it")
    p.add_argument("name", choices=sorted(SHAPES))
    p.add_argument("--tokenizer", action="store_true", help="with a word-level tokenizer of its vocabulary")
    a = p.parse_args()
    print(shape_dir(a.name, tokenizer=a.tokenizer))
