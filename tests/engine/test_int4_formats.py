"""int4 checkpoints (AutoAWQ GEMM, GPTQ v1/v2 with and without act-order,
compressed-tensors pack-quantized): the engine's converters against the
formats' packing written from their definitions (tests/engine/quant_checkpoints.py)
and against compressed-tensors' own compressor; ``Int4LinearMethod`` loading,
tensor-parallel shards and its errors; the checkpoint writer against
transformers' own loading of the compressed-tensors checkpoint.

AutoAWQ, AutoGPTQ/GPTQModel and optimum do not install on a CPU-only machine
without their CUDA extensions, so AWQ's and GPTQ's layouts are checked
against the packing written in quant_checkpoints.py from the formats'
documentation (AutoAWQ's order_map, GPTQ's sequential nibbles and v1's
zero - 1), against literal words, and GPTQ's symmetric layout against
compressed-tensors', which stores the same words transposed.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tests.engine.quant_checkpoints import (
    AWQ_ORDER,
    LINEAR,
    pack_along_dim0,
    pack_awq,
    quantize_linear,
    write_int4_checkpoint,
)

from engine.quantization.int4 import (
    Int4LinearMethod,
    convert_awq,
    convert_compressed_tensors,
    convert_gptq,
    pack_nibbles,
    unpack_nibbles,
)


def random_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


def convert(fmt: str, stored: dict, group_size: int, k: int, *, sym: bool, checkpoint_format: str = "gptq"):
    g = k if group_size == -1 else group_size
    if fmt == "awq":
        return convert_awq(stored["qweight"], stored["qzeros"], stored["scales"], g)
    if fmt == "gptq":
        return convert_gptq(stored["qweight"], stored["qzeros"], stored["scales"], stored["g_idx"], g, sym=sym,
                            checkpoint_format=checkpoint_format)
    return convert_compressed_tensors(stored["weight_packed"], stored["weight_scale"], stored.get("weight_zero_point"),
                                      g, k, symmetric=sym)


# ---- the packing itself -------------------------------------------------------------------------------------


def test_packed_words_are_the_documented_ones():
    # AutoAWQ: nibble i holds column AWQ_ORDER[i] of the 8 -> column j's value j gives 0x75316420.
    q_t = torch.arange(8).repeat(3, 2)  # [K=3, N=16], q[k, 8c + j] = j
    assert pack_awq(q_t).tolist() == [[0x75316420] * 2] * 3
    # GPTQ qweight (and compressed-tensors' weight_packed, transposed): nibble i = row 8r + i.
    rows = torch.arange(16).remainder(8)[:, None].repeat(1, 2)  # [K=16, N=2], q[k] = k % 8
    assert pack_along_dim0(rows).tolist() == [[0x76543210] * 2] * 2
    # The engine's unpacking reads both back, and its packing writes the same words.
    assert torch.equal(unpack_nibbles(pack_awq(q_t), 16, dim=1, order=AWQ_ORDER), q_t.to(torch.int16))
    assert torch.equal(pack_nibbles(q_t, dim=1, order=AWQ_ORDER), pack_awq(q_t))
    assert torch.equal(pack_nibbles(rows, dim=0), pack_along_dim0(rows))
    high = torch.full((8, 1), 15)  # all bits set: the int32 word is -1
    assert pack_along_dim0(high).item() == -1 and unpack_nibbles(pack_nibbles(high, dim=0), 8, dim=0).eq(15).all()


# (fmt, group_size, sym, desc_act, checkpoint_format, N, K)
FORMAT_CASES = [
    ("awq", 32, False, False, "gptq", 48, 96),
    ("awq", 64, False, False, "gptq", 32, 128),
    ("gptq", 32, True, False, "gptq", 40, 96),
    ("gptq", 32, False, False, "gptq", 48, 96),
    ("gptq", 32, False, False, "gptq_v2", 48, 96),
    ("gptq", 32, True, True, "gptq", 40, 96),
    ("gptq", 32, False, True, "gptq", 48, 128),
    ("gptq", -1, True, False, "gptq", 24, 64),
    ("gptq", -1, False, True, "gptq_v2", 24, 64),
    ("compressed-tensors", 32, True, False, "gptq", 40, 96),
    ("compressed-tensors", 32, False, False, "gptq", 48, 96),
    ("compressed-tensors", -1, True, False, "gptq", 24, 64),
    ("compressed-tensors", -1, False, False, "gptq", 24, 100),  # K not a multiple of 8: padded words
]


@pytest.mark.parametrize("case", FORMAT_CASES, ids=lambda c: "-".join(map(str, c[:5])))
def test_converter_reproduces_the_stored_weight(case):
    fmt, g, sym, desc_act, ckpt, n, k = case
    stored, dense = quantize_linear(random_weight(n, k, seed=n + k), fmt, g, sym=sym, desc_act=desc_act,
                                    checkpoint_format=ckpt)
    w = convert(fmt, stored, g, k, sym=sym, checkpoint_format=ckpt)
    assert torch.equal(w.dequantize(torch.float32), dense)
    assert (w.zeros is None) == sym  # symmetric weights read no zeros
    # act-order: rows sorted so that groups are contiguous (one group: nothing to sort)
    assert (w.perm is not None) == (desc_act and g != -1) and w.g_idx is None
    assert w.qweight.shape == ((k + 7) // 8, n) and w.qweight.dtype == torch.int32


def test_gptq_v1_stored_fifteen_means_sixteen():
    # v1 stores zero - 1: a stored 15 is a zero of 16 (vLLM's reading), v2 reads it as 15.
    k, n = 8, 8
    q = torch.randint(0, 16, (k, n))
    qweight = pack_along_dim0(q)
    qzeros = pack_nibbles(torch.full((1, n), 15), dim=1)
    scales = torch.full((1, n), 0.5, dtype=torch.float16)
    v1 = convert_gptq(qweight, qzeros, scales, None, k, sym=False, checkpoint_format="gptq")
    v2 = convert_gptq(qweight, qzeros, scales, None, k, sym=False, checkpoint_format="gptq_v2")
    assert torch.equal(v1.dequantize(torch.float32), ((q - 16) * 0.5).t().float())
    assert torch.equal(v2.dequantize(torch.float32), ((q - 15) * 0.5).t().float())


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, -1], ids=["group32", "channel"])
def test_compressed_tensors_library_packs_and_unpacks_the_same(sym, group_size):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    n, k = 48, 96
    stored, dense = quantize_linear(random_weight(n, k, seed=3), "compressed-tensors", group_size, sym=sym)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=sym, strategy="channel" if group_size == -1 else "group",
        group_size=None if group_size == -1 else group_size))
    state = {"weight": dense, "weight_scale": stored["weight_scale"]}
    if not sym:  # the library's zero points are signed int8 [N, G]
        state["weight_zero_point"] = (unpack_nibbles(stored["weight_zero_point"], n, dim=0) - 8).to(torch.int8)
    packed = PackedQuantizationCompressor.compress(state, scheme)
    for name in ("weight_packed", "weight_scale", "weight_shape") + (() if sym else ("weight_zero_point",)):
        assert torch.equal(packed[name], stored[name]), name
    assert sym == ("weight_zero_point" not in packed)
    library = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    ours = convert("compressed-tensors", stored, group_size, k, sym=sym).dequantize(torch.float32)
    assert torch.equal(ours, library.float())


def test_gptq_symmetric_is_compressed_tensors_transposed():
    w = random_weight(40, 96, seed=4)
    gptq, dense_g = quantize_linear(w, "gptq", 32, sym=True, checkpoint_format="gptq_v2")
    ct, dense_c = quantize_linear(w, "compressed-tensors", 32, sym=True, scale_dtype=torch.float16)
    assert torch.equal(dense_g, dense_c)
    assert torch.equal(gptq["qweight"], ct["weight_packed"].t())  # both store q + 8 = unsigned q, 8 rows a word
    assert torch.equal(gptq["scales"], ct["weight_scale"].t())
    assert (gptq["qzeros"] == 0x88888888 - 2**32).all()  # v2 writes the symmetric zero 8 itself


# ---- Int4LinearMethod ---------------------------------------------------------------------------------------


class FakeLayer(nn.Module):
    """A linear layer as the method sees one: local widths, and add_param slicing each checkpoint
    tensor for one rank of a column (output) or row (input) split."""

    def __init__(self, in_full: int, out_full: int, *, rank: int = 0, size: int = 1, split: str | None = None,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.in_size = in_full // size if split == "row" else in_full
        self.out_size = out_full // size if split == "column" else out_full
        self.full_in_size = in_full
        self.rank, self.split = rank, split
        if output_sizes is not None:
            self.output_sizes = output_sizes

    def add_param(self, name, tensor, out_dim=None, in_dim=None, out_div=1, in_div=1, per_part=False,
                  keep_dtype=False):
        param = nn.Parameter(tensor[None] if per_part else tensor, requires_grad=False)  # one part
        setattr(self, name, param)

        def weight_loader(p, src, shard_id=None):
            if per_part:
                src = src[None]
            for dim, which in ((out_dim, "column"), (in_dim, "row")):
                if dim is not None and self.split == which and src.shape[dim] != p.shape[dim]:
                    src = src.narrow(dim, self.rank * p.shape[dim], p.shape[dim])
            if src.shape != p.shape:
                raise ValueError(f"loader: {tuple(src.shape)} into {tuple(p.shape)}")
            p.data.copy_(src)

        param.weight_loader = weight_loader
        return param


def load_layer(method: Int4LinearMethod, layer: FakeLayer, stored: dict) -> FakeLayer:
    method.create_weights(layer)
    for name, t in stored.items():
        param = getattr(layer, name)
        param.weight_loader(param, t)
    method.process_weights_after_loading(layer)
    return layer


def make_method(fmt: str, g: int, sym: bool, desc_act: bool, ckpt: str = "gptq", **kw) -> Int4LinearMethod:
    return Int4LinearMethod(fmt, group_size=g, sym=sym, desc_act=desc_act, checkpoint_format=ckpt,
                            prefix="model.layers.0.proj", **kw)


METHOD_CASES = [c for c in FORMAT_CASES if c[6] % 8 == 0]


@pytest.mark.parametrize("case", METHOD_CASES, ids=lambda c: "-".join(map(str, c[:5])))
def test_method_equals_the_dequantized_linear(case):
    fmt, g, sym, desc_act, ckpt, n, k = case
    stored, dense = quantize_linear(random_weight(n, k, seed=5), fmt, g, sym=sym, desc_act=desc_act,
                                    checkpoint_format=ckpt)
    layer = load_layer(make_method(fmt, g, sym, desc_act, ckpt), FakeLayer(k, n), stored)
    assert not any(name in dict(layer.named_parameters()) for name in stored)  # replaced by the internal layout
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(n)
    # The CPU path: bitwise the float32 model with the dequantized weight.
    assert torch.equal(layer_apply(layer, x, bias), F.linear(x, dense, bias))


def layer_apply(layer: FakeLayer, x, bias=None):
    return make_method("gptq", 32, True, False).apply(layer, x, bias)  # apply reads the layer's buffers only


@pytest.mark.parametrize("fmt,g,sym,desc_act", [("awq", 32, False, False), ("gptq", 32, False, True),
                                                ("compressed-tensors", 32, True, False)])
def test_method_with_the_triton_kernel(fmt, g, sym, desc_act):
    import kernels

    n, k = 48, 96
    stored, dense = quantize_linear(random_weight(n, k, seed=7), fmt, g, sym=sym, desc_act=desc_act)
    layer = load_layer(make_method(fmt, g, sym, desc_act, ops=kernels), FakeLayer(k, n), stored)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(8))
    out = make_method(fmt, g, sym, desc_act, ops=kernels).apply(layer, x, None)
    torch.testing.assert_close(out, F.linear(x, dense), atol=2e-5, rtol=2e-5)


# (fmt, group_size, sym, desc_act, split)
TP_CASES = [
    ("awq", 32, False, False, "column"),
    ("awq", 32, False, False, "row"),
    ("gptq", 32, False, False, "row"),
    ("gptq", 32, True, True, "column"),
    ("gptq", 32, False, True, "row"),  # act-order shard: groups of unequal sizes, g_idx kept
    ("gptq", -1, True, False, "row"),  # one group: every rank holds the whole scale row
    ("compressed-tensors", 32, False, False, "column"),
    ("compressed-tensors", 32, True, False, "row"),
    ("compressed-tensors", -1, False, False, "row"),
]


@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_tensor_parallel_shards(case):
    fmt, g, sym, desc_act, split = case
    n, k, size = 64, 128, 2
    stored, dense = quantize_linear(random_weight(n, k, seed=9), fmt, g, sym=sym, desc_act=desc_act)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(10))
    outs = []
    for rank in range(size):
        layer = load_layer(make_method(fmt, g, sym, desc_act), FakeLayer(k, n, rank=rank, size=size, split=split),
                           stored)
        if case == ("gptq", 32, False, True, "row"):
            assert layer.int4_g_idx is not None
        xs = x if split == "column" else x[:, rank * k // size:(rank + 1) * k // size]
        outs.append(layer_apply(layer, xs))
    full = torch.cat(outs, dim=1) if split == "column" else sum(outs)
    torch.testing.assert_close(full, F.linear(x, dense), atol=1e-5, rtol=1e-5)


# ---- errors -------------------------------------------------------------------------------------------------


def test_unsupported_configs():
    with pytest.raises(ValueError, match="8-bit GPTQ is not supported"):
        Int4LinearMethod.from_gptq_config({"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(ValueError, match="3-bit weights is not supported"):
        Int4LinearMethod.from_compressed_tensors({"num_bits": 3, "type": "int", "strategy": "group", "group_size": 32},
                                                 "pack-quantized")
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported"):
        Int4LinearMethod.from_awq_config({"bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"})
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        Int4LinearMethod.from_gptq_config({"bits": 4, "group_size": 128, "checkpoint_format": "marlin"})
    with pytest.raises(ValueError, match="format 'marlin-24' is not supported"):
        Int4LinearMethod.from_compressed_tensors({"num_bits": 4, "group_size": 32}, "marlin-24")
    m = Int4LinearMethod.from_gptq_config({"bits": 4, "group_size": 64, "desc_act": True, "sym": False,
                                           "format": "gptq_v2"})
    assert (m.fmt, m.group_size, m.desc_act, m.sym, m.checkpoint_format) == ("gptq", 64, True, False, "gptq_v2")
    m = Int4LinearMethod.from_compressed_tensors({"num_bits": 4, "type": "int", "strategy": "channel",
                                                  "symmetric": False}, "pack-quantized")
    assert (m.fmt, m.group_size, m.sym) == ("compressed-tensors", -1, False)


def test_group_size_must_divide_the_input():
    with pytest.raises(ValueError, match=r"model.layers.0.proj: group_size 64 does not divide the input width 96"):
        make_method("gptq", 64, True, False).create_weights(FakeLayer(96, 32))
    with pytest.raises(ValueError, match=r"group_size 64 does not divide this rank's input width 32 "
                                         r"\(input 128 split 4 ways\)"):
        make_method("awq", 64, False, False).create_weights(FakeLayer(128, 32, size=4, split="row"))
    with pytest.raises(ValueError, match=r"every output part must be a multiple of 8, got \[12, 4\]"):
        make_method("awq", 32, False, False).create_weights(FakeLayer(64, 16, output_sizes=[12, 4]))


@pytest.mark.parametrize("fmt,name,want", [
    ("gptq", "scales", r"model.layers.0.proj.scales: checkpoint tensor has shape \(6, 32\), but gptq int4 with "
                       r"group_size 32 for a layer of input width 96 expects \(3, 'out'\)"),
    ("awq", "qweight", r"model.layers.0.proj.qweight: checkpoint tensor has shape \(12, 32\)"),
    ("compressed-tensors", "weight_scale", r"model.layers.0.proj.weight_scale: checkpoint tensor has shape "
                                           r"\(32, 6\)"),
])
def test_checkpoint_of_another_shape_names_the_tensor(fmt, name, want):
    n, k = 32, 96
    method = make_method(fmt, 32, fmt != "awq", False)
    layer = FakeLayer(k, n)
    method.create_weights(layer)
    if fmt == "awq":  # a GPTQ-shaped qweight [K/8, N] given to an AWQ layer
        bad = quantize_linear(random_weight(n, k), "gptq", 32, sym=True)[0]["qweight"]
    else:  # quantized with group size 16
        bad = quantize_linear(random_weight(n, k), fmt, 16, sym=True)[0][name]
    param = getattr(layer, name)
    with pytest.raises(ValueError, match=want):
        param.weight_loader(param, bad)


def test_compressed_tensors_weight_shape_is_checked():
    stored, _ = quantize_linear(random_weight(32, 64), "compressed-tensors", 32, sym=True)
    stored["weight_shape"] = torch.tensor([32, 128])
    with pytest.raises(ValueError, match=r"weight_shape says \[32, 128\] \(N, K\) but the layer's input width is 64"):
        load_layer(make_method("compressed-tensors", 32, True, False), FakeLayer(64, 32), stored)


# ---- whole checkpoints --------------------------------------------------------------------------------------

# (fmt, group_size, sym, desc_act, checkpoint_format)
CHECKPOINTS = [
    ("awq", 32, False, False, "gptq"),
    ("gptq", 32, True, True, "gptq"),
    ("gptq", 32, False, True, "gptq"),
    ("gptq", -1, False, False, "gptq_v2"),
    ("compressed-tensors", 32, True, False, "gptq"),
    ("compressed-tensors", 32, False, False, "gptq"),
]


@pytest.mark.parametrize("case", CHECKPOINTS, ids=lambda c: "-".join(map(str, c)))
def test_written_checkpoint_dequantizes_to_its_float32_copy(case, tiny_llama_dir, tmp_path):
    fmt, g, sym, desc_act, ckpt = case
    dst, deq = write_int4_checkpoint(tiny_llama_dir, tmp_path / "q", fmt, g, sym, desc_act, checkpoint_format=ckpt)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert "quantization_config" not in json.loads((deq / "config.json").read_text())
    stored, dense = load_file(str(dst / "model.safetensors")), load_file(str(deq / "model.safetensors"))
    method = {"awq": Int4LinearMethod.from_awq_config, "gptq": Int4LinearMethod.from_gptq_config}.get(fmt)
    if method is not None:
        method = method(qc)
    else:
        assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
        method = Int4LinearMethod.from_compressed_tensors(qc["config_groups"]["group_0"]["weights"], qc["format"])
    linears = [LINEAR.match(name).group(1) for name in dense if LINEAR.match(name)]
    assert len(linears) == 3 * 7
    for prefix in linears:
        n, k = dense[prefix + ".weight"].shape
        parts = {name[len(prefix) + 1:]: t for name, t in stored.items() if name.startswith(prefix + ".")}
        layer = load_layer(method, FakeLayer(k, n), parts)
        assert torch.equal(method.weights(layer).dequantize(torch.float32), dense[prefix + ".weight"]), prefix
    assert torch.equal(stored["lm_head.weight"], dense["lm_head.weight"])
    assert all(not LINEAR.match(name) for name in stored)


def test_transformers_loads_the_compressed_tensors_checkpoint_as_its_float32_copy(tiny_llama_dir, tmp_path):
    # compressed-tensors' own loading path (transformers' CompressedTensorsHfQuantizer, which
    # decompresses on the first forward) gives the dequantized copy's weights and tokens.
    from transformers import AutoModelForCausalLM

    dst, deq = write_int4_checkpoint(tiny_llama_dir, tmp_path / "ct", "compressed-tensors", 32, sym=True)
    quantized = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
    dense = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 33, 100]])
    got = quantized.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, dense.generate(ids, max_new_tokens=6, do_sample=False))
    weights = load_file(str(deq / "model.safetensors"))
    state = quantized.state_dict()
    assert all(torch.equal(state[name], t) for name, t in weights.items())
