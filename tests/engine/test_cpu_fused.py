"""The Llama-family decoder layer on the CPU as direct kernel calls (engine/models/llama_cpu.py)
computes what the layer's modules compute, bit for bit: the embedded default model, served
packed (GGUF) and as its float32 conversion, generates the same tokens with the same logprobs
(sampled and prompt) with its layers fused and through the modules. Where a layer is not covered
(an FP8 cache, LoRA), none is fused."""
from __future__ import annotations

import pytest

from engine import LLM
from engine.model_files import DEFAULT_MODEL, GGUF_MODEL
from engine.sampling_params import SamplingParams

PROMPTS = ["Write a short story about a lighthouse keeper.", "The capital of France is",
           "List three colours:"]


def _generate(llm: LLM) -> list[tuple]:
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 5 * i, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2) for i in range(len(PROMPTS))]
    out = llm.generate(PROMPTS, params)  # one batch: prefill chunks and decode rows in its steps
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs) for c in o.outputs]) for o in out]


@pytest.mark.parametrize("model", [GGUF_MODEL, DEFAULT_MODEL])
def test_fused_layers_equal_the_modules(model: str) -> None:
    if model == GGUF_MODEL:
        pytest.importorskip("gguf")
    llm = LLM(model, device="cpu", dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False)
    layers = llm.engine.runner.model.model.layers
    fused = [layer.fused for layer in layers]
    assert all(f is not None for f in fused), "every layer of the default model is covered"
    got = _generate(llm)
    for layer in layers:
        layer.fused = None
    want = _generate(llm)
    assert got == want  # tokens, and every logprob to the bit
    for layer, f in zip(layers, fused):
        layer.fused = f
    assert _generate(llm) == want


@pytest.mark.parametrize("args", [{"kv_cache_dtype": "fp8"}, {"enable_lora": True, "max_lora_rank": 8}],
                         ids=["fp8 cache", "lora"])
def test_layers_it_does_not_cover_run_their_modules(args: dict) -> None:
    llm = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", kv_cache_memory="32MiB", **args)
    assert all(layer.fused is None for layer in llm.engine.runner.model.model.layers)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
