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


# A draft model's shape beside llama-3.1-8b (the same vocabulary and RoPE, a tied embedding)
SHAPES["llama-3.2-1b"] = dict(SHAPES["llama-3.1-8b"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                              head_dim=64, tie_word_embeddings=True,
                              rope_scaling=dict(SHAPES["llama-3.1-8b"]["rope_scaling"], factor=32.0))

# The 128 x 128 block-scaled FP8 checkpoints Qwen publishes (Qwen3-8B-FP8, Qwen3-30B-A3B-FP8):
# with random weights (--load-format dummy) each tile is quantized at load.
_FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
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
