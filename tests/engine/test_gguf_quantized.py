"""The embedded default model served with its GGUF weights as the file ships them
(``--model SmolLM2-135M-Instruct-GGUF``: engine/model_files.py's packed conversion,
engine/quantization/gguf.py, kernels/cpu/gguf_gemm.cpp).

Its reference is the same weights dequantized to float32 through the plain path: the default
conversion (``SmolLM2-135M-Instruct``), whose every tensor equals the packed one dequantized
bit for bit. Both conversions happen once per machine, into the real cache.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.model_files import DEFAULT_MODEL, GGUF_MODEL, ensure_default_model, resolve_model_path
from engine.quantization.config import QuantizationConfig, resolve_quantization
from kernels import gguf_reference

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def packed_dir() -> Path:
    return ensure_default_model(packed=True)


def test_packed_conversion_is_the_float_conversion_dequantized(packed_dir: Path) -> None:
    from safetensors import safe_open

    assert resolve_model_path(GGUF_MODEL) == packed_dir
    config = json.loads((packed_dir / "config.json").read_text())
    types = config["quantization_config"]["tensor_types"]
    assert config["quantization_config"]["quant_method"] == "gguf"
    # the 30 blocks' 7 linear layers in Q4_1, the token embedding (tied to the LM head) in Q8_0
    assert len(types) == 30 * 7 + 1 and types.pop("model.embed_tokens") == "Q8_0"
    assert set(types.values()) == {"Q4_1"}
    types["model.embed_tokens"] = "Q8_0"
    float_dir = ensure_default_model()
    with safe_open(str(packed_dir / "model.safetensors"), "pt") as q, \
            safe_open(str(float_dir / "model.safetensors"), "pt") as f:
        assert set(q.keys()) == set(f.keys())
        packed_bytes = 0
        for name in q.keys():
            got, want = q.get_tensor(name), f.get_tensor(name)
            layer = name.removesuffix(".weight")
            if layer in types:
                assert got.dtype == torch.uint8
                packed_bytes += got.numel()
                got = gguf_reference.dequantize(got, types[layer], want.shape[1])
            assert torch.equal(got, want), name  # q/k rows un-permuted as transformers does
    assert packed_bytes < 100 * 2**20  # ~66 MB of linear layers and ~29 MB of table, instead of ~538 MB float32


def test_quantization_config_rules() -> None:
    qc = resolve_quantization(None, {"quantization_config": {"quant_method": "gguf",
                                                             "tensor_types": {"a.q_proj": "Q4_1"}}}, "auto")
    assert qc == QuantizationConfig("gguf", online=False) and "Q4_1" in qc.describe()
    with pytest.raises(ValueError, match="dummy"):
        resolve_quantization(None, {"quantization_config": {"quant_method": "gguf", "tensor_types": {}}}, "dummy")
    with pytest.raises(ValueError, match="Q6_K"):
        resolve_quantization(None, {"quantization_config": {"quant_method": "gguf",
                                                            "tensor_types": {"a": "Q6_K"}}}, "auto")
    with pytest.raises(ValueError, match="needs a checkpoint"):
        resolve_quantization("gguf", {}, "auto")


def test_a_packed_vocabulary_table_equals_its_dequantized_one() -> None:
    """The embedding looks up packed rows and the head multiplies by the packed table: the
    same rows and logits (up to float32 summation order) as the dequantized float table."""
    from engine.layers.embedding import LMHead, VocabEmbedding
    from engine.parallel import Shard

    vocab, hidden = 100, 64
    g = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, hidden, generator=g)
    packed = gguf_reference.quantize(table, "Q8_0")
    shard = Shard(0, 1, 1, 1, vocab)
    q = VocabEmbedding(vocab, hidden, shard, None, qtype="Q8_0")
    q.weight.data.copy_(packed)
    f = VocabEmbedding(vocab, hidden, shard, None)
    f.weight.data.copy_(gguf_reference.dequantize(packed, "Q8_0", hidden))
    ids = torch.tensor([0, 5, 99, 5])
    assert torch.equal(q(ids), f(ids))
    h = torch.randn(3, hidden, generator=g)
    got, want = LMHead(vocab, hidden, shard, None, tied=q)(h), LMHead(vocab, hidden, shard, None, tied=f)(h)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_stacked_parts_must_share_a_type() -> None:
    import kernels.reference as ops
    from engine.quantization.gguf import GgufLinearMethod
    from engine.quantization.methods import QuantMethods

    qc = QuantizationConfig("gguf", False, {"quant_method": "gguf", "tensor_types": {
        "m.l.q_proj": "Q4_1", "m.l.k_proj": "Q4_1", "m.l.v_proj": "Q8_0", "m.l.o_proj": "Q8_0"}})
    methods = QuantMethods(qc, ops)
    with pytest.raises(ValueError, match="different GGUF types"):
        methods.linear("m.l", "qkv_proj", ["q_proj", "k_proj", "v_proj"])
    assert isinstance(methods.linear("m.l", "o_proj"), GgufLinearMethod)
    assert methods.linear("m.l", "gate_up_proj", ["gate_proj", "up_proj"]) is None  # float layers


@pytest.mark.slow
def test_served_quantized_equals_its_dequantized_reference(packed_dir: Path) -> None:
    from engine import LLM
    from engine.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "List three primary colours:"]
    sp = SamplingParams(temperature=0.0, max_tokens=20)
    outputs = {}
    for model in (GGUF_MODEL, DEFAULT_MODEL):
        llm = LLM(model, device="cpu", dtype="float32", kv_cache_memory="64MiB")
        if model == GGUF_MODEL:  # every linear layer of the 30 blocks reads packed blocks
            from engine.quantization.gguf import GgufLinearMethod

            gguf_layers = [m for m in llm.engine.runner.model.modules()
                           if isinstance(getattr(m, "method", None), GgufLinearMethod)]
            assert len(gguf_layers) == 30 * 4 and all(m.weight.dtype == torch.uint8 for m in gguf_layers)
            model_ = llm.engine.runner.model  # the tied table read packed by the embedding and the head
            assert model_.model.embed_tokens.weight.dtype == torch.uint8 and model_.lm_head.qtype == "Q8_0"
        outputs[model] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
        del llm
    assert all(len(ids) == 20 for ids in outputs[GGUF_MODEL])
    assert outputs[GGUF_MODEL] == outputs[DEFAULT_MODEL]


def test_int8_activations_serve_as_their_reference(packed_dir: Path, monkeypatch) -> None:
    """--gguf-activations q8_0: every packed GEMM (the 120 linear layers and the head) quantizes
    its activations to int8 blocks. Rounding to 8 bits makes a run sensitive to float32 noise (a
    value at a rounding boundary goes either way, and the model carries it on), so two runs that
    differ only in summation order do not give the same logprobs: the check is the perplexity of a
    text (prompt logprobs) through the compiled kernel and through the reference GEMM
    (kernels.gguf_reference.linear_q8, modules unfused), within 2% of each other and of the
    float32 activations' (measured: 6.59 float32, 6.62 kernel, 6.64 reference); a kernel that
    dropped a block's min term or misread its scale is far outside."""
    from engine import LLM
    from engine.quantization.gguf import GgufLinearMethod
    from engine.sampling_params import SamplingParams
    from kernels import cpu_gemm

    text = ("The lighthouse keeper climbed the spiral stairs every evening to light the lamp. Ships passing in "
            "the night relied on its beam to avoid the rocks below. One stormy night, the lamp flickered and went "
            "out, and the keeper had to choose between fixing it and rescuing a sailor who had washed ashore. ") * 2
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(llm) -> torch.Tensor:
        return torch.tensor([lp.logprob for lp in llm.generate([text], sp)[0].prompt_logprobs[1:]])

    def perplexity(logprobs: torch.Tensor) -> float:
        return float(torch.exp(-logprobs.mean()))

    kw = dict(device="cpu", dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False)
    plain = prompt_logprobs(LLM(GGUF_MODEL, **kw))
    llm = LLM(GGUF_MODEL, gguf_activations="q8_0", **kw)
    model = llm.engine.runner.model
    methods = [m.method for m in model.modules() if isinstance(getattr(m, "method", None), GgufLinearMethod)]
    assert len(methods) == 120 and {m.activations for m in methods} == {"q8_0"}
    assert model.lm_head.activations == "q8_0"
    kernel = prompt_logprobs(llm)
    for layer in model.model.layers:  # the modules, through the reference GEMM
        layer.fused = None
    monkeypatch.setitem(cpu_gemm._gguf_state, "module", None)
    reference = prompt_logprobs(llm)
    assert len(kernel) == len(reference) == len(plain) > 100
    assert abs(perplexity(kernel) / perplexity(reference) - 1) < 0.02
    assert abs(perplexity(kernel) / perplexity(plain) - 1) < 0.02
    assert (kernel - plain).abs().mean() > 1e-3  # the flag changes the numbers


def test_int8_activations_need_gguf_weights() -> None:
    gguf = {"quantization_config": {"quant_method": "gguf", "tensor_types": {"a.q_proj": "Q4_1"}}}
    assert resolve_quantization(None, gguf, "auto", "q8_0").gguf_activations == "q8_0"
    with pytest.raises(ValueError, match="applies to GGUF weights"):
        resolve_quantization(None, {}, "auto", "q8_0")
    with pytest.raises(ValueError, match="must be one of float32, q8_0"):
        resolve_quantization(None, gguf, "auto", "int4")
