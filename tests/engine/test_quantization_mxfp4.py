"""MXFP4 experts (gpt-oss's quantization_config): recognised and validated at start, only the
experts quantized, and Mxfp4MoEMethod in a FusedMoE layer on CPU: its loaders (stacked
tensors, tensor- and expert-parallel splits, dummy weights), packed storage, and outputs equal
to the same layer with the dequantized 16-bit experts."""
from __future__ import annotations

import json

import pytest
import torch

from engine.layers.moe import FusedMoE, MoEMethod
from engine.quantization.config import QuantizationConfig, hf_module_matches, resolve_quantization
from engine.quantization.methods import QuantMethods
from engine.quantization.mxfp4 import DUMMY_SCALE, Mxfp4MoEMethod
from kernels import reference
from kernels.mxfp4_reference import dequantize_mxfp4, quantize_mxfp4

# gpt-oss-20b's quantization_config, as shipped
GPT_OSS_QC = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def hf_config(qc: dict | None = GPT_OSS_QC) -> dict:
    return {"architectures": ["GptOssForCausalLM"], **({} if qc is None else {"quantization_config": qc})}


# ---- the config ---------------------------------------------------------------------------------------------


def test_gpt_oss_config_is_recognised_with_or_without_the_flag():
    for flag in (None, "mxfp4"):
        qc = resolve_quantization(flag, hf_config(), "auto")
        assert qc == QuantizationConfig("mxfp4", online=False) and qc.checkpoint == GPT_OSS_QC
        assert "mxfp4 W4A16 experts" in qc.describe() and "pre-quantized checkpoint" in qc.describe()
    # random weights: the experts' codes are drawn (online), with or without the checkpoint's config
    assert resolve_quantization(None, hf_config(), "dummy").online
    assert resolve_quantization("mxfp4", hf_config(None), "dummy") == QuantizationConfig("mxfp4", online=True)
    # transformers' dequantize flag changes nothing served
    assert resolve_quantization(None, hf_config({**GPT_OSS_QC, "dequantize": True}), "auto").method == "mxfp4"


@pytest.mark.parametrize("flag,qc,message", [
    ("mxfp4", None, "--quantization mxfp4 needs a checkpoint quantized with mxfp4"),
    ("fp8", GPT_OSS_QC, "the checkpoint is quantized with mxfp4; --quantization fp8 does not apply"),
    ("awq", GPT_OSS_QC, "the checkpoint is quantized with mxfp4; --quantization awq does not apply"),
    (None, {**GPT_OSS_QC, "targets": ["Linear"]}, r"field\(s\) targets are not supported .*linear layers stay 16-bit"),
    (None, {"quant_method": "mxfp4", "group_size": 64, "bits": 4}, r"field\(s\) bits, group_size are not supported"),
    (None, {"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "must be a list of module names"),
    (None, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.(layers"]}, "is not a valid regex"),
    (None, {"quant_method": "mxfp4", "dequantize": "yes"}, "dequantize must be true or false"),
])
def test_unsupported_mxfp4_configs_are_refused(flag, qc, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(flag, hf_config(qc), "auto")


def test_engine_args_take_the_flag_and_refuse_a_mismatch(tmp_path):
    from engine.config import EngineArgs
    from tests.conftest import make_tiny_model

    d = make_tiny_model(tmp_path / "m")
    with pytest.raises(ValueError, match="--quantization mxfp4 needs a checkpoint quantized with mxfp4"):
        EngineArgs(model=str(d), device="cpu", quantization="mxfp4").create_engine_config()
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": GPT_OSS_QC}))
    config = EngineArgs(model=str(d), device="cpu", quantization="mxfp4").create_engine_config()
    assert config.model.quantization.method == "mxfp4" and "quantization=mxfp4" in config.describe()
    with pytest.raises(ValueError, match="quantized with mxfp4; --quantization gptq does not apply"):
        EngineArgs(model=str(d), device="cpu", quantization="gptq").create_engine_config()


def test_only_the_experts_are_mxfp4():
    methods = QuantMethods(resolve_quantization(None, hf_config(), "auto"), reference)
    for prefix, module, parts in (("model.layers.0.self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                  ("model.layers.17.self_attn", "o_proj", ()), ("model.layers.3.mlp", "router", ())):
        assert methods.linear(prefix, module, parts) is None
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj: .* MXFP4 linear layers are not supported"):
        methods.linear("model.layers.1.mlp", "down_proj")  # a dense MLP gpt-oss's patterns do not name
    moe = methods.moe("model.layers.5.mlp", 32, ["gate", "up", "down"])
    assert isinstance(moe, Mxfp4MoEMethod) and not moe.online and moe.prefix == "model.layers.5.mlp.experts"
    # experts named by modules_to_not_convert stay 16-bit (transformers' pattern rules)
    qc = {**GPT_OSS_QC, "modules_to_not_convert": GPT_OSS_QC["modules_to_not_convert"] + ["model.layers.1.mlp.experts"]}
    methods = QuantMethods(resolve_quantization(None, hf_config(qc), "auto"), reference)
    assert methods.moe("model.layers.1.mlp", 32, []) is None
    assert isinstance(methods.moe("model.layers.11.mlp", 32, []), Mxfp4MoEMethod)
    # a config whose patterns leave a linear layer to be converted asks for MXFP4 linear layers: refused
    methods = QuantMethods(resolve_quantization(None, hf_config({"quant_method": "mxfp4",
                                                                 "modules_to_not_convert": ["lm_head"]}), "auto"),
                           reference)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj: the mxfp4 checkpoint's .* MXFP4 linear "
                                         "layers are not supported"):
        methods.linear("model.layers.0.self_attn", "o_proj")


def test_transformers_module_patterns():
    assert hf_module_matches("model.layers.*.self_attn", "model.layers.17.self_attn")
    assert hf_module_matches("model.layers.*.mlp.router", "model.layers.0.mlp.router")
    assert not hf_module_matches("model.layers.*.mlp.router", "model.layers.0.mlp.experts")
    assert not hf_module_matches("model.layers.1", "model.layers.11.mlp.experts")
    assert hf_module_matches("experts", "model.layers.2.mlp.experts")  # a suffix
    from transformers.quantizers.quantizers_utils import should_convert_module

    for pattern in GPT_OSS_QC["modules_to_not_convert"] + ["model.layers.1", "experts", "mlp.gate"]:
        for name in ("model.layers.1.mlp.experts", "model.layers.12.self_attn", "model.layers.1.mlp.gate_proj",
                     "lm_head", "model.embed_tokens"):
            assert hf_module_matches(pattern, name) == (not should_convert_module(name, [pattern])), (pattern, name)


# ---- the method in a FusedMoE layer ------------------------------------------------------------------------------

E, K, H, I = 8, 2, 64, 64


class _Rank:
    """A tensor-parallel rank without communication: the test adds up the ranks' outputs."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def checkpoint(seed: int = 0, inter: int = I) -> dict[str, torch.Tensor]:
    """A gpt-oss MoE block's tensors in pdserve's names and order (gate rows then up rows)."""
    gen = torch.Generator().manual_seed(seed)
    b13, s13 = quantize_mxfp4(torch.randn(E, 2 * inter, H, generator=gen) * H**-0.5)
    b2, s2 = quantize_mxfp4(torch.randn(E, H, inter, generator=gen) * inter**-0.5)
    return {"gate.weight": torch.randn(E, H, generator=gen), "gate.bias": torch.randn(E, generator=gen),
            "experts.gate_up_proj_blocks": b13, "experts.gate_up_proj_scales": s13,
            "experts.down_proj_blocks": b2, "experts.down_proj_scales": s2,
            "experts.gate_up_proj_bias": torch.randn(E, 2 * inter, generator=gen),
            "experts.down_proj_bias": torch.randn(E, H, generator=gen)}


def dequantized(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in ckpt.items() if "_blocks" not in k and "_scales" not in k}
    out["experts.gate_up_proj"] = dequantize_mxfp4(ckpt["experts.gate_up_proj_blocks"],
                                                   ckpt["experts.gate_up_proj_scales"])
    out["experts.down_proj"] = dequantize_mxfp4(ckpt["experts.down_proj_blocks"], ckpt["experts.down_proj_scales"])
    return out


def layer(method: MoEMethod | None, tp=None, expert_parallel: bool = False, inter: int = I) -> FusedMoE:
    return FusedMoE(E, K, H, inter, renormalize=True, activation="swigluoai", ops=reference, tp=tp,
                    expert_parallel=expert_parallel, method=method, bias=True, router_bias=True, swiglu_limit=2.0)


def mxfp4_method(online: bool = False) -> Mxfp4MoEMethod:
    return Mxfp4MoEMethod(online=online, ops=reference, prefix="model.layers.0.mlp.experts")


def load(m: FusedMoE, ckpt: dict[str, torch.Tensor]) -> FusedMoE:
    params = dict(m.named_parameters())
    assert set(params) == set(ckpt)
    for name, t in ckpt.items():
        loader = getattr(params[name], "weight_loader", None)
        params[name].data.copy_(t) if loader is None else loader(params[name], t, None)
    m.method.process_weights_after_loading(m)
    return m


def test_layer_keeps_the_experts_packed_and_equals_the_dequantized_layer():
    ckpt = checkpoint()
    q = load(layer(mxfp4_method()), ckpt)
    ex = q.experts
    assert ex.gate_up_proj_blocks.shape == (E, 2 * I, H // 32, 16) and ex.down_proj_scales.shape == (E, H, I // 32)
    # no 16-bit copy of the experts: every float parameter is a router or bias
    assert all(p.dtype == torch.uint8 or p.numel() <= E * max(H, 2 * I) for p in q.parameters())
    w13, w2 = q.method.kernel_weights(q)
    assert w13.shape == (E, 2 * I, H // 2) and w13.data_ptr() == ex.gate_up_proj_blocks.data_ptr()  # a view
    plain = load(layer(None), dequantized(ckpt))
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(1))
    assert torch.equal(q(x), plain(x))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor_parallel", "expert_parallel"])
def test_two_ranks_add_up_to_one(expert_parallel):
    ckpt = checkpoint(2)
    one = load(layer(mxfp4_method()), ckpt)
    ranks = [load(layer(mxfp4_method(), _Rank(r, 2), expert_parallel), ckpt) for r in range(2)]
    r1 = ranks[1].experts
    if expert_parallel:
        assert torch.equal(r1.down_proj_blocks, ckpt["experts.down_proj_blocks"][E // 2:])
    else:  # rank 1: rows [32, 64) of the gate and of the up half; the down projection's second block of 32
        rows = torch.cat([torch.arange(32, 64), torch.arange(96, 128)])
        assert torch.equal(r1.gate_up_proj_blocks, ckpt["experts.gate_up_proj_blocks"][:, rows])
        assert torch.equal(r1.gate_up_proj_scales, ckpt["experts.gate_up_proj_scales"][:, rows])
        assert torch.equal(r1.down_proj_blocks, ckpt["experts.down_proj_blocks"][:, :, 1:])
        assert torch.equal(r1.down_proj_scales, ckpt["experts.down_proj_scales"][:, :, 1:])
    assert r1.down_proj_blocks.full_shape == (E, H, I // 32, 16)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ranks[0](x) + ranks[1](x), one(x), atol=1e-5, rtol=1e-5)


def test_shapes_and_tensors_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="3 blocks do not split evenly"):  # I = 96 over two ranks
        layer(mxfp4_method(), _Rank(0, 2), inter=96)
    with pytest.raises(ValueError, match=r"intermediate size \(48\) to be a multiple of 32"):
        layer(mxfp4_method(), inter=48)
    with pytest.raises(ValueError, match=r"hidden size \(40\)"):
        FusedMoE(E, K, 40, I, renormalize=True, activation="silu", ops=reference, tp=None, method=mxfp4_method())
    m = layer(mxfp4_method())
    p = m.experts.gate_up_proj_blocks
    with pytest.raises(ValueError, match="expected the checkpoint's uint8 MXFP4 blocks, got torch.bfloat16"):
        p.weight_loader(p, torch.zeros(p.full_shape, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match=r"shape \(8, 128, 4, 16\) where \[8, 128, 2, 16\] is expected"):
        p.weight_loader(p, torch.zeros(E, 2 * I, 4, 16, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="stacked tensors only"):
        p.weight_loader(p, torch.zeros(2 * I, 2, 16, dtype=torch.uint8), ("gate", 0))
    assert p.shard_ids == (None,) and p.checkpoint_slice(None) is None
    ep = layer(mxfp4_method(), _Rank(1, 2), expert_parallel=True)
    assert ep.experts.down_proj_blocks.checkpoint_slice(None) == (0, 4, 8)  # the reader may take its experts
    tp = layer(mxfp4_method(), _Rank(1, 2))
    assert tp.experts.down_proj_blocks.checkpoint_slice(None) is None  # the loader takes its blocks


def test_dummy_weights_become_random_codes_the_same_at_every_tensor_parallel_size():
    gen = torch.Generator().manual_seed(4)
    floats = {name: torch.randn(*shape, generator=gen) * 0.02
              for name, shape in (("experts.gate_up_proj_blocks", (E, 2 * I, H // 32, 16)),
                                  ("experts.gate_up_proj_scales", (E, 2 * I, H // 32)),
                                  ("experts.down_proj_blocks", (E, H, I // 32, 16)),
                                  ("experts.down_proj_scales", (E, H, I // 32)))}
    ckpt = {**checkpoint(5), **floats}
    one = load(layer(mxfp4_method(online=True)), ckpt)
    ex = one.experts
    assert (ex.gate_up_proj_scales == DUMMY_SCALE).all() and (ex.down_proj_scales == DUMMY_SCALE).all()
    assert len(torch.unique(ex.gate_up_proj_blocks)) > 200  # bytes spread over the codes
    w = dequantize_mxfp4(ex.gate_up_proj_blocks, ex.gate_up_proj_scales)
    assert 0.01 < float(w.std()) < 0.04
    ranks = [load(layer(mxfp4_method(online=True), _Rank(r, 2)), ckpt) for r in range(2)]
    x = torch.randn(5, H, generator=gen)
    torch.testing.assert_close(ranks[0](x) + ranks[1](x), one(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="got torch.float32"):  # floats are only dummies
        load(layer(mxfp4_method(online=False)), ckpt)


def test_tuned_tiles_are_keyed_by_mxfp4_and_the_model_dtype(monkeypatch, tmp_path):
    from engine import moe_configs

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    tiles = {"block_m": 16, "gemm1": {"block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 4},
             "gemm2": {"block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 4}}
    calls = []

    def tune(*args, **kw):
        calls.append((args, kw))
        return {1: tiles}

    import importlib

    monkeypatch.setattr(importlib.import_module("kernels.fused_moe"), "tune", tune)
    m = layer(mxfp4_method(), _Rank(1, 2))  # a rank's I: 32
    m.gate.weight.data = m.gate.weight.data.bfloat16()
    assert m.method.tuned_tiles(m, torch.device("cuda:0")) == {1: tiles}
    assert calls == [((E, H, I // 2, K, torch.uint8, torch.device("cuda:0")), {"x_dtype": torch.bfloat16})]
    names = [p.name for p in (tmp_path / "moe_configs").iterdir()]
    assert len(names) == 1 and names[0].startswith(f"E{E}_H{H}_I{I // 2}_K{K}_mxfp4-bfloat16_NVIDIA-H200_")
    assert m.method.tuned_tiles(m, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="x_dtype"):
        moe_configs.moe_kernel_config(E, H, I, K, torch.uint8, "cuda:0", tune_fn=tune)
