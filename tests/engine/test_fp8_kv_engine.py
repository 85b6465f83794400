"""The FP8 KV cache (``--kv-cache-dtype fp8``) in the engine, on a tiny float32 model.

Greedy tokens equal those of transformers' own model whose attention sees K and V
round-tripped through e4m3 with the same per-layer scales (tests/engine/fp8_kv_oracle.py):
with scales of 1.0 across chunk budgets, and with a checkpoint's scales (not 1.0, so that
dropping them shows) through chunked prefill, prefix-cache hits and preemption, and under
each checkpoint name of the scales that engine/kv_cache_dtype.py reads. A first difference
is allowed only where the oracle's top two logits tie; on these prompts there is none (the
tokens agree in full). The cache holds float8_e4m3fn (one byte a value: four times the
blocks of float32 in the same memory, twice those of bfloat16), its prefix-cache namespace
says so; bad checkpoint scales and a GPU without FP8 are clear errors at start.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.kv_cache_dtype import check_fp8_support, resolve_cache_dtype
from engine.llm_engine import LLMEngine
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, random_prompts
from tests.engine.fp8_kv_oracle import TINY_K_SCALES, TINY_V_SCALES, copy_with_kv_scales, hf_fp8_kv_model

FP8 = "float8_e4m3fn"
NUM_LAYERS = 3  # the tiny model's (tests/conftest.py)
K_SCALES, V_SCALES = TINY_K_SCALES, TINY_V_SCALES
ONES = [1.0] * NUM_LAYERS


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on two shared cores, more make these small models many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def scaled_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny model with compressed-tensors' per-layer k_scale / v_scale."""
    return copy_with_kv_scales(tiny_llama_dir, tmp_path_factory.mktemp("fp8-kv") / "scaled", K_SCALES, V_SCALES)


def engine_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], outs


def attention_scales(llm: LLM) -> tuple[list[float], list[float]]:
    from engine.layers.attention import Attention

    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
    return [m.k_scale for m in layers], [m.v_scale for m in layers]


def test_the_cache_holds_e4m3_in_a_quarter_of_float32s_bytes(tiny_llama_dir, caplog):
    budget = 6 * 2**20
    engines = {}
    with caplog.at_level(logging.INFO):
        for dtype in ("float32", "bfloat16"):
            for kv in ("auto", "fp8"):
                engines[dtype, kv] = LLMEngine.from_engine_args(EngineArgs(
                    model=str(tiny_llama_dir), device="cpu", dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=budget, block_size=4))
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    fp8_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4  # K and V, 4 tokens, 1 B
    for dtype in ("float32", "bfloat16"):
        fp8, auto = engines[dtype, "fp8"], engines[dtype, "auto"]
        assert fp8.kv_cache.dtype == torch.float8_e4m3fn and auto.kv_cache.dtype == getattr(torch, dtype)
        assert fp8.num_blocks == budget // fp8_block and fp8.kv_cache.nbytes <= budget
        assert fp8.kv_scales == (tuple(ONES), tuple(ONES)) and auto.kv_scales == ((), ())
        # The prefix cache's namespace is the KV dtype's: FP8 blocks never answer a 16-bit lookup.
        assert fp8.cache_namespace == f"{tiny_llama_dir.name}:4:{FP8}"
        assert auto.cache_namespace == f"{tiny_llama_dir.name}:4:{dtype}"
    assert engines["float32", "fp8"].num_blocks == 4 * engines["float32", "auto"].num_blocks
    assert engines["bfloat16", "fp8"].num_blocks == 2 * engines["bfloat16", "auto"].num_blocks
    log = caplog.text
    assert f"KV cache blocks: {budget // fp8_block} ({budget // fp8_block * 4} tokens, 6.0 MiB of {FP8})" in log
    assert "KV cache dtype fp8_e4m3 (float8_e4m3fn): k_scale 1, v_scale 1 (1.0: the checkpoint has none)" in log


def test_greedy_tokens_are_the_e4m3_oracles_across_chunk_budgets(tiny_llama_dir):
    prompts = random_prompts([1, 5, 17, 33, 64, 3], seed=7)
    oracle = hf_fp8_kv_model(tiny_llama_dir, ONES, ONES)
    want = hf_greedy(oracle, prompts, 24)
    # The round trip through e4m3 changes these prompts' tokens: a cache that kept float32
    # values would fail here.
    assert want != hf_greedy(hf_model(tiny_llama_dir), prompts, 24)
    for budget, name in ((16, "fp8"), (2048, "fp8_e4m3")):  # 16: the 64-token prompt in 4 chunks
        llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_dtype=name, max_num_batched_tokens=budget,
                  kv_cache_memory="8MiB", block_size=4)
        assert llm.engine.kv_cache.dtype == torch.float8_e4m3fn
        got, _ = engine_greedy(llm, prompts, 24)
        assert_greedy_match(oracle, prompts, want, got)


def test_checkpoint_scales_through_chunks_prefix_hits_and_preemption(tiny_llama_dir, scaled_dir, caplog):
    base = random_prompts([40], seed=9)[0]
    prompts = [base + t for t in random_prompts([3, 9, 1, 14], seed=10)]
    oracle = hf_fp8_kv_model(tiny_llama_dir, K_SCALES, V_SCALES)  # the same weights as scaled_dir
    want = hf_greedy(oracle, prompts, 30)
    # With these scales the tokens are not those of scales 1.0: an engine that dropped them fails.
    assert want != hf_greedy(hf_fp8_kv_model(tiny_llama_dir, ONES, ONES), prompts, 30)
    with caplog.at_level(logging.INFO):
        # 32 blocks of 4 tokens, 32-token chunks: far too small for 4 x ~75 tokens at once.
        llm = LLM(str(scaled_dir), device="cpu", kv_cache_dtype="fp8", max_num_batched_tokens=32,
                  num_gpu_blocks_override=32, block_size=4)
    assert (f"KV cache dtype fp8_e4m3 ({FP8}): k_scale 0.0123..0.0157, v_scale 0.0112..0.0169 (from the "
            f"checkpoint, {scaled_dir.name})") in caplog.text
    assert llm.engine.kv_scales == (tuple(K_SCALES), tuple(V_SCALES))
    assert attention_scales(llm) == (K_SCALES, V_SCALES)
    got, _ = engine_greedy(llm, prompts[:1], 30)
    assert_greedy_match(oracle, prompts[:1], want[:1], got)
    got, outs = engine_greedy(llm, prompts, 30)
    assert_greedy_match(oracle, prompts, want, got)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert max(o.num_cached_tokens for o in outs) >= 40  # the shared prefix came from the cache
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked


# (checkpoint names of K's and V's scale, or one for both; does config.json name a kv_cache_scheme)
SCALE_NAMES = {
    "compressed-tensors-output-scale": (("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"), True),
    "modelopt": (("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"), False),
    "autofp8-kv-scale": (("self_attn.kv_scale",), False),
}


@pytest.mark.parametrize("fmt", list(SCALE_NAMES))
def test_every_checkpoint_name_of_the_scales_is_read(tiny_llama_dir, tmp_path, fmt):
    names, scheme = SCALE_NAMES[fmt]
    k, v = (K_SCALES, K_SCALES) if len(names) == 1 else (K_SCALES, V_SCALES)
    d = copy_with_kv_scales(tiny_llama_dir, tmp_path / fmt, k, v, names=names, kv_cache_scheme=scheme)
    llm = LLM(str(d), device="cpu", kv_cache_dtype="fp8", max_num_batched_tokens=16, kv_cache_memory="4MiB",
              block_size=4)
    assert llm.engine.kv_scales == (tuple(k), tuple(v))
    prompts = random_prompts([23, 6], seed=13)
    oracle = hf_fp8_kv_model(tiny_llama_dir, k, v)
    want = hf_greedy(oracle, prompts, 16)
    got, _ = engine_greedy(llm, prompts, 16)
    assert_greedy_match(oracle, prompts, want, got)


def _checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor], scheme: dict | None = None) -> Path:
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model-kv-scales.safetensors"))
    if scheme is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _scales(skip: tuple[str, int] | None = None, **override: torch.Tensor) -> dict[str, torch.Tensor]:
    """k_scale and v_scale of every layer (but ``skip``), ``override`` by name."""
    out = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.02)
           for i in range(NUM_LAYERS) for w in "kv" if (w, i) != skip}
    out.update({name.replace("__", "."): t for name, t in override.items()})
    return out


FLOAT8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
BAD = {  # checkpoint tensors, kv_cache_scheme, the error
    "partial": (_scales(skip=("v", 1)), FLOAT8, r"has KV cache scales but no v_scale for layers \[1\]"),
    "per-head": (_scales(model__layers__2__self_attn__k_scale=torch.full((2,), 0.02)), FLOAT8,
                 r"model\.layers\.2\.self_attn\.k_scale has 2 values; only per-tensor KV cache scales"),
    "zero": (_scales(model__layers__0__self_attn__v_scale=torch.tensor(0.0)), FLOAT8,
             r"model\.layers\.0\.self_attn\.v_scale = 0\.0 is not a positive finite scale"),
    "int-scheme": (_scales(), dict(FLOAT8, type="int"),
                   r"kv_cache_scheme .*\"type\": \"int\".* is not supported \(per-tensor 8-bit float only\)"),
    "per-head-scheme": (_scales(), dict(FLOAT8, strategy="attn_head"),
                        r"kv_cache_scheme .*attn_head.* is not supported \(per-tensor 8-bit float only\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_scales_are_refused_at_load(tiny_llama_dir, tmp_path, case):
    tensors, scheme, error = BAD[case]
    d = _checkpoint(tiny_llama_dir, tmp_path / case, tensors, scheme)
    with pytest.raises(ValueError, match=error):
        LLMEngine.from_engine_args(EngineArgs(model=str(d), device="cpu", kv_cache_dtype="fp8",
                                              num_gpu_blocks_override=8))


def test_fp8_needs_compute_capability_8_9(tiny_llama_dir, monkeypatch):
    check_fp8_support("cpu", None)  # the CPU runs torch's casts
    for ok in ((8, 9), (9, 0), (12, 0)):
        check_fp8_support("cuda:0", ok)
    with pytest.raises(ValueError, match=r"needs a GPU of compute capability 8\.9 or newer .*cuda:1 has 8\.6"):
        check_fp8_support("cuda:1", (8, 6))
    assert resolve_cache_dtype("fp8") == resolve_cache_dtype("fp8_e4m3") == "fp8_e4m3"
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, got 'fp8_e5m2'"):
        resolve_cache_dtype("fp8_e5m2")
    # The config path on a CUDA device: an A100 (8.0) is refused at start, an H100 (9.0) is not.
    capability = (8, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def config(kv: str):
        return EngineArgs(model=str(tiny_llama_dir), device="cuda", kv_cache_dtype=kv).create_engine_config()
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 needs a GPU of compute capability 8\.9 or newer "
                                         r"\(Ada, Hopper\); cuda:0 has 8\.0: use --kv-cache-dtype auto"):
        config("fp8")
    assert config("auto").kv_dtype == "bfloat16"
    capability = (9, 0)
    c = config("fp8")
    assert (c.device, c.cache.cache_dtype, c.kv_dtype) == ("cuda:0", "fp8_e4m3", FP8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="an FP8 KV cache on CUDA needs compute capability 8.9+")
def test_cuda_fp8_cache_matches_the_oracle(tiny_llama_dir, scaled_dir):
    """The Triton kernels' FP8 path (store, paged attention for chunks and decode, CUDA graphs)
    in float32 against the oracle on the same GPU, with the checkpoint's scales."""
    prompts = random_prompts([1, 7, 33, 100, 250], seed=5)
    oracle = hf_fp8_kv_model(tiny_llama_dir, K_SCALES, V_SCALES).cuda()
    want = hf_greedy(oracle, prompts, 20)
    for budget in (16, 2048):
        llm = LLM(str(scaled_dir), device="cuda", dtype="float32", kv_cache_dtype="fp8",
                  max_num_batched_tokens=budget, kv_cache_memory="64MiB", block_size=16)
        assert llm.engine.kv_cache.dtype == torch.float8_e4m3fn
        assert llm.engine.kv_scales == (tuple(K_SCALES), tuple(V_SCALES))
        got, _ = engine_greedy(llm, prompts, 20)
        assert_greedy_match(oracle, prompts, want, got)
