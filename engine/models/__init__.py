"""Model families: one short file each, wiring engine/layers/, and this registry from a
checkpoint's ``architectures[0]`` to its class (imported only when built, so reading a
config needs no torch).

    family file     architectures                                   what it adds to the shared layers
    llama.py        Llama, Mistral, Qwen2 (QKV bias), SmolLM        the plain pre-norm decoder
    qwen3.py        Qwen3                                           per-head q/k RMSNorm
    qwen3_moe.py    Qwen3-MoE                                       experts on the layers decoder_sparse_step names
    mixtral.py      Mixtral                                         experts on every layer (w1/w3/w2 names)
    gemma3.py       Gemma 3 (text)                                  (1 + w) norms around attention and MLP, GELU-tanh,
                                                                    scaled embeddings, local/global RoPE and windows
    gemma4.py       Gemma 4 (text; a multimodal                     Gemma 3's layout with plain-w norms, no attention
                    checkpoint's text model)                        scale, per-layer KV shapes, V = K on full layers,
                                                                    V norms, KV shared by the last layers, per-layer
                                                                    token inputs, experts beside the MLP
    phi3.py         Phi-3                                           fused qkv_proj / gate_up_proj checkpoints
    qwen3_next.py   Qwen3-Next                                      Gated DeltaNet linear attention beside gated full
                                                                    attention, experts with a gated shared expert
    qwen3_5.py      Qwen3.5, Qwen3.5-MoE (text; a                   Qwen3-Next with its DeltaNet projections apart
                    multimodal checkpoint's text model)
    gpt_oss.py      gpt-oss (20b, 120b; MXFP4 experts)              attention sinks, QKV/output biases, alternating
                                                                    128-key windows, YaRN, experts with biases and
                                                                    the clamped SwiGLU, a router with a bias
"""
from __future__ import annotations

import importlib

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "engine.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "engine.models.mixtral:MixtralForCausalLM",
    "Gemma3ForCausalLM": "engine.models.gemma3:Gemma3ForCausalLM",
    "Gemma4ForCausalLM": "engine.models.gemma4:Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration": "engine.models.gemma4:Gemma4ForConditionalGeneration",
    "Phi3ForCausalLM": "engine.models.phi3:Phi3ForCausalLM",
    "Qwen3NextForCausalLM": "engine.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "engine.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "engine.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "engine.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "GptOssForCausalLM": "engine.models.gpt_oss:GptOssForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "engine.models.qwen3_5:Qwen3_5ForConditionalGeneration",
}


def model_class(architecture: str) -> type:
    """The class serving ``architecture`` (ValueError when none does)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    module, name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), name)
