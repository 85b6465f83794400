"""Which quantization a model is served with: ``--quantization`` (vLLM's flag) and
the checkpoint's ``quantization_config`` (config.json), resolved and validated
once at start, before any weight is read. Torch-free (engine/config.py imports
it, and the gateway imports that).

    --quantization  checkpoint's quant_method      served as
    (none)          none                           16/32-bit weights
    fp8             none                           FP8 W8A8, quantized at load: per-channel weight
                                                   scales, dynamic per-token activations
    (none) or the   fp8 (weight_block_size)        FP8 W8A8, 128x128 block weight scales, dynamic
    same name                                      per-token-group (1 x 128) activation scales
                    fp8 (no block size)            FP8 W8A8, per-tensor weight scales, dynamic per-token
                    awq (GEMM)                     int4 W4A16, asymmetric groups
                    gptq                           int4 W4A16 (desc_act, sym, v1/v2 zeros)
                    compressed-tensors             per config group: FP8 float-quantized (tensor, channel
                                                   or block weights; dynamic activations) or int4
                                                   pack-quantized
                    mxfp4 (gpt-oss)                the experts of MoE blocks in MXFP4 (e2m1 weights, an
                                                   e8m0 scale per 32), weight-only; every other layer
                                                   16-bit
    awq | gptq |    none, with --load-format dummy int4 / MXFP4 experts from the random weights (int4:
    mxfp4                                          round to nearest, groups of 128): benchmarks only
    (none) or gguf  gguf (pdserve's own: the       GGUF blocks as the file ships them (Q4_0, Q4_1, Q8_0),
                    embedded model converted       weight-only, read packed by the CPU kernel
                    packed, engine/model_files.py) (kernels/cpu/gguf_gemm.cpp); float32 activations

The LM head, the embeddings and MoE routers always stay in the model dtype.
What each method stores and runs is in engine/quantization/fp8.py, int4.py, mxfp4.py and gguf.py;
which layer gets which method is engine/quantization/methods.py.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

QUANTIZATION_CHOICES = ("fp8", "awq", "gptq", "compressed-tensors", "mxfp4", "gguf")
GGUF_WEIGHT_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # kernels/gguf_reference.py's BLOCK_LAYOUTS
_ALIASES = {"compressed_tensors": "compressed-tensors"}
ONLINE_INT4_GROUP_SIZE = 128
FP8_WEIGHT_FORMATS = ("float-quantized", "naive-quantized")
INT4_WEIGHT_FORMATS = ("pack-quantized",)


@dataclass(frozen=True)
class QuantizationConfig:
    """A resolved quantization. ``method`` is --quantization's name for it; ``online``: the
    weights are quantized at load (a 16-bit checkpoint, or random dummy weights) with the
    scheme ``checkpoint`` describes (empty: the method's default); otherwise ``checkpoint``
    is the checkpoint's ``quantization_config`` and its tensors are already quantized."""

    method: str
    online: bool
    checkpoint: dict[str, Any] = field(default_factory=dict, compare=False)
    # GGUF only (--gguf-activations): float32 (the dequantized model's numbers) or q8_0 (activations
    # quantized to int8 blocks as llama.cpp does; kernels/cpu_gemm.gguf_linear)
    gguf_activations: str = "float32"

    def describe(self) -> str:
        how = "quantized at load" if self.online else "pre-quantized checkpoint"
        return f"{self.method} ({how}: {', '.join(scheme_summaries(self))})"


def quant_method_of(hf_config: dict[str, Any]) -> str | None:
    """The checkpoint's weight quantization method, or None. A compressed-tensors config that
    only names a ``kv_cache_scheme`` (no ``config_groups``) quantizes no weight."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    method = _ALIASES.get(method, method)
    if method == "compressed-tensors" and not qc.get("config_groups"):
        return None
    return method or "(none)"


GGUF_ACTIVATIONS = ("float32", "q8_0")


def resolve_quantization(flag: str | None, hf_config: dict[str, Any], load_format: str,
                         gguf_activations: str = "float32") -> QuantizationConfig | None:
    """``--quantization`` (and ``--gguf-activations``) against the checkpoint; ValueError for every
    combination not served."""
    if gguf_activations not in GGUF_ACTIVATIONS:
        raise ValueError(f"--gguf-activations must be one of {', '.join(GGUF_ACTIVATIONS)}, got {gguf_activations!r}")
    if gguf_activations != "float32" and quant_method_of(hf_config) != "gguf":
        raise ValueError(f"--gguf-activations {gguf_activations} applies to GGUF weights (a checkpoint whose "
                         "quantization_config.quant_method is gguf), and this model has none; leave it out")
    if flag is not None:
        flag = _ALIASES.get(flag, flag)
        if flag not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {flag!r}")
    method = quant_method_of(hf_config)
    dummy = load_format == "dummy"
    if method == "gguf" and dummy:
        raise ValueError("a gguf checkpoint cannot be served with --load-format dummy (random bytes are not valid "
                         "GGUF blocks); serve its weights, or a float checkpoint with dummy weights")
    if method is not None:
        if method not in QUANTIZATION_CHOICES:
            raise ValueError(f"the checkpoint's quantization_config.quant_method {method!r} is not supported "
                             f"(supported: {', '.join(QUANTIZATION_CHOICES)})")
        if flag is not None and flag != method:
            raise ValueError(f"the checkpoint is quantized with {method}; --quantization {flag} does not apply "
                             f"(leave it out, or pass --quantization {method})")
        qc = QuantizationConfig(method, online=dummy, checkpoint=dict(hf_config["quantization_config"]),
                                gguf_activations=gguf_activations)
    elif flag is None:
        return None
    elif flag == "fp8":
        qc = QuantizationConfig("fp8", online=True)
    elif dummy and flag in ("awq", "gptq", "mxfp4"):
        qc = QuantizationConfig(flag, online=True)
    else:
        raise ValueError(f"--quantization {flag} needs a checkpoint quantized with {flag} (config.json's "
                         "quantization_config names it); only --quantization fp8 quantizes a 16-bit checkpoint "
                         "at load")
    scheme_summaries(qc)  # validates every scheme now, before the weights are read
    return qc


# ---- the schemes a config describes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Scheme:
    """One way of storing a layer's weights.

    kind "fp8": strategy tensor | channel | block (block_size (bn, bk)); activations are
    quantized dynamically per token (per token and group of bk for block weights).
    kind "int4": fmt awq | gptq | compressed-tensors with ``int4`` its arguments
    (Int4LinearMethod's keyword arguments).
    kind "mxfp4": the experts of mixture-of-experts blocks only (Mxfp4MoEMethod)."""

    kind: str
    strategy: str = ""
    block_size: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    int4: dict[str, Any] = field(default_factory=dict, compare=False)

    def summary(self) -> str:
        if self.kind == "mxfp4":
            return "mxfp4 W4A16 experts (e2m1 weights, an e8m0 scale per 32), other layers 16-bit"
        if self.kind == "gguf":
            return (f"GGUF {'/'.join(self.strategy.split(','))} blocks read packed, float32 activations; "
                    "embeddings and LM head float32")
        if self.kind == "fp8":
            if self.strategy == "block":
                bn, bk = self.block_size or (0, 0)
                return f"fp8 W8A8, {bn}x{bk} block weight scales, dynamic per-token-group activations"
            return f"fp8 W8A8, per-{self.strategy} weight scales, dynamic per-token activations"
        a = self.int4
        return (f"int4 W4A16 {a['fmt']}, group size {a['group_size']}, "
                f"{'symmetric' if a.get('sym') else 'asymmetric'}{', act-order' if a.get('desc_act') else ''}")


def scheme_summaries(qc: QuantizationConfig) -> list[str]:
    return sorted({s.summary() for s in config_schemes(qc).values()})


def config_schemes(qc: QuantizationConfig) -> dict[str, Scheme]:
    """Each scheme of the config by name ("default" when there is one; compressed-tensors
    names its config groups). ValueError naming what is not supported."""
    c = qc.checkpoint
    if qc.method == "fp8":
        return {"default": _fp8_scheme(c)}
    if qc.method == "awq":
        return {"default": _awq_scheme(c, qc.online)}
    if qc.method == "gptq":
        return {"default": _gptq_scheme(c, qc.online)}
    if qc.method == "mxfp4":
        return {"default": _mxfp4_scheme(c)}
    if qc.method == "gguf":
        return {"default": _gguf_scheme(c)}
    return _compressed_tensors_schemes(c)


def uses_fp8(qc: QuantizationConfig) -> bool:
    """Whether any layer gets FP8 weights (they need FP8 hardware on CUDA)."""
    return any(s.kind == "fp8" for s in config_schemes(qc).values())


def ignored_names(qc: QuantizationConfig) -> list[str]:
    """Module names (or compressed-tensors "re:" patterns) the checkpoint left unquantized."""
    c = qc.checkpoint
    out = c.get("ignore") or c.get("modules_to_not_convert") or c.get("ignored_layers") or []
    return [str(x) for x in out]


def _fp8_scheme(c: dict[str, Any]) -> Scheme:
    """quant_method fp8 (transformers' FP8 and fine-grained FP8 formats), or online fp8."""
    if not c:
        return Scheme("fp8", "channel")
    fmt = str(c.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint: fmt {fmt!r} is not supported (only e4m3)")
    act = str(c.get("activation_scheme", "dynamic")).lower()
    if act != "dynamic":
        raise ValueError(f"fp8 checkpoint: activation_scheme {act!r} is not supported (only dynamic: activations "
                         "are quantized per token at run time)")
    block = c.get("weight_block_size")
    if block is None:
        return Scheme("fp8", "tensor")
    return Scheme("fp8", "block", block_size=_block_size(block, "fp8 checkpoint: weight_block_size"),
                  scale_name="weight_scale_inv")


def _block_size(block: Any, where: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{where} must be two positive ints [rows, columns], got {json.dumps(block)}")
    return int(block[0]), int(block[1])


def _positive_group(value: Any, where: str, allow_channel: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and not (allow_channel and value == -1)):
        raise ValueError(f"{where}: group_size must be a positive int{' or -1' if allow_channel else ''}, "
                         f"got {value!r}")
    return value


def _bits(c: dict[str, Any], where: str, key: str = "bits") -> None:
    bits = c.get(key, 4)
    if bits != 4:
        raise ValueError(f"{where}: {bits}-bit weights are not supported (only 4-bit)")


def _awq_scheme(c: dict[str, Any], online: bool) -> Scheme:
    if online and not c:
        return Scheme("int4", int4={"fmt": "awq", "group_size": ONLINE_INT4_GROUP_SIZE, "sym": False})
    where = "awq checkpoint"
    _bits(c, where)
    version = str(c.get("version", c.get("format", "gemm"))).lower()
    if version != "gemm":
        raise ValueError(f"{where}: AWQ version {version!r} is not supported (only gemm)")
    if not c.get("zero_point", True):
        raise ValueError(f"{where}: zero_point: false is not supported")
    group = _positive_group(c.get("group_size", 128), where, allow_channel=False)
    return Scheme("int4", int4={"fmt": "awq", "group_size": group, "sym": False})


def _gptq_scheme(c: dict[str, Any], online: bool) -> Scheme:
    if online and not c:
        return Scheme("int4", int4={"fmt": "gptq", "group_size": ONLINE_INT4_GROUP_SIZE, "sym": True})
    where = "gptq checkpoint"
    _bits(c, where)
    if c.get("dynamic"):
        raise ValueError(f"{where}: per-module overrides (dynamic) are not supported")
    if c.get("lm_head"):
        raise ValueError(f"{where}: a quantized lm_head is not supported")
    fmt = str(c.get("checkpoint_format") or c.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: checkpoint_format {fmt!r} is not supported (gptq or gptq_v2; marlin-repacked "
                         "and other layouts are not)")
    group = _positive_group(c.get("group_size", 128), where, allow_channel=True)
    return Scheme("int4", int4={"fmt": "gptq", "group_size": group, "sym": bool(c.get("sym", True)),
                                "desc_act": bool(c.get("desc_act", False)), "checkpoint_format": fmt})


MXFP4_KEYS = ("quant_method", "modules_to_not_convert", "dequantize")


def _mxfp4_scheme(c: dict[str, Any]) -> Scheme:
    """quant_method mxfp4 (transformers' Mxfp4Config, as gpt-oss ships): only the experts of
    mixture-of-experts blocks are MXFP4, the rest of the model 16-bit. ``modules_to_not_convert``
    (transformers' patterns: a regex matched from the start of a module's name up to a dot, or a
    suffix) leaves matching experts 16-bit too; ``dequantize`` (transformers dequantizes the experts
    to bf16 at load) changes nothing served: the kernels compute with the same values. Any other
    field asks for something not served."""
    where = "mxfp4 checkpoint"
    unknown = sorted(set(c) - set(MXFP4_KEYS))
    if unknown:
        raise ValueError(f"{where}: quantization_config field(s) {', '.join(unknown)} are not supported (MXFP4 "
                         f"experts take only {', '.join(MXFP4_KEYS)}; linear layers stay 16-bit)")
    skip = c.get("modules_to_not_convert")
    if skip is not None and (not isinstance(skip, list) or not all(isinstance(x, str) for x in skip)):
        raise ValueError(f"{where}: modules_to_not_convert must be a list of module names, got {json.dumps(skip)}")
    for pattern in skip or []:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: modules_to_not_convert pattern {pattern!r} is not a valid regex "
                             f"({e})") from None
    if not isinstance(c.get("dequantize", False), bool):
        raise ValueError(f"{where}: dequantize must be true or false, got {json.dumps(c.get('dequantize'))}")
    return Scheme("mxfp4")


GGUF_KEYS = ("quant_method", "tensor_types", "source")


def _gguf_scheme(c: dict[str, Any]) -> Scheme:
    """quant_method gguf: pdserve's conversion of a GGUF file that keeps its quantized tensors
    (engine/model_files.py). ``tensor_types`` maps each quantized linear layer's checkpoint name
    ("model.layers.0.self_attn.q_proj") to its GGUF type; its tensor ``<name>.weight`` is the
    packed blocks, uint8 [out, in / 32 * block bytes]. Layers it does not name are float."""
    where = "gguf checkpoint"
    unknown = sorted(set(c) - set(GGUF_KEYS))
    if unknown:
        raise ValueError(f"{where}: quantization_config field(s) {', '.join(unknown)} are not supported")
    types = c.get("tensor_types")
    if not isinstance(types, dict) or not all(isinstance(k, str) for k in types):
        raise ValueError(f"{where}: tensor_types must map layer names to GGUF types, got {json.dumps(types)[:200]}")
    bad = sorted({str(t) for t in types.values()} - set(GGUF_WEIGHT_TYPES))
    if bad:
        raise ValueError(f"{where}: GGUF weight type(s) {', '.join(bad)} are not supported "
                         f"({', '.join(GGUF_WEIGHT_TYPES)})")
    return Scheme("gguf", ",".join(sorted(set(types.values()))))


def hf_module_matches(pattern: str, name: str) -> bool:
    """transformers' ``should_convert_module`` test of one ``modules_to_not_convert`` pattern: a regex
    matched from the start of ``name`` up to a module boundary ("layer.1" matches "layer.1.attn",
    not "layer.11.attn"; "model.layers.*.mlp.router" matches every layer's router), or a suffix."""
    return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name) is not None or name.endswith(pattern)


def _compressed_tensors_schemes(c: dict[str, Any]) -> dict[str, Scheme]:
    for key in ("sparsity_config", "transform_config"):
        if c.get(key):
            raise ValueError(f"compressed-tensors checkpoint: {key} is not supported")
    groups = c.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors checkpoint: config_groups is missing")
    out = {}
    for name, group in groups.items():
        where = f"compressed-tensors config group {name!r}"
        if not isinstance(group, dict) or not group.get("targets"):
            raise ValueError(f"{where}: needs targets")
        if group.get("output_activations"):
            raise ValueError(f"{where}: output_activations quantization is not supported")
        fmt = group.get("format") or c.get("format")
        out[name] = _ct_scheme(group.get("weights") or {}, group.get("input_activations"), fmt, where)
    return out


def _ct_scheme(w: dict[str, Any], act: dict[str, Any] | None, fmt: Any, where: str) -> Scheme:
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy", "tensor")
    if w.get("dynamic"):
        raise ValueError(f"{where}: dynamic weight quantization is not supported")
    if kind == "float" and bits == 8:
        if fmt not in FP8_WEIGHT_FORMATS:
            raise ValueError(f"{where}: fp8 weights in format {fmt!r} are not supported ({', '.join(FP8_WEIGHT_FORMATS)})")
        if w.get("symmetric", True) is False:
            raise ValueError(f"{where}: asymmetric fp8 weights are not supported")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}: fp8 weight strategy {strategy!r} is not supported (tensor, channel or block)")
        block = _block_size(w.get("block_structure"), f"{where}: block_structure") if strategy == "block" else None
        if not act:
            raise ValueError(f"{where}: fp8 weights without input_activations (weight-only fp8) are not supported; "
                             "W8A8 checkpoints quantize activations dynamically (FP8_DYNAMIC, FP8_BLOCK)")
        if act.get("type", "float") != "float" or act.get("num_bits") != 8:
            raise ValueError(f"{where}: input_activations must be 8-bit float, got {json.dumps(act)}")
        if not act.get("dynamic"):
            raise ValueError(f"{where}: static activation scales are not supported (only dynamic: FP8_DYNAMIC or "
                             "FP8_BLOCK schemes)")
        act_strategy = act.get("strategy", "token")
        want = "group" if block else "token"
        if act_strategy != want or (block and act.get("group_size") != block[1]):
            raise ValueError(f"{where}: {strategy} fp8 weights need dynamic per-{want} activations"
                             f"{f' in groups of {block[1]}' if block else ''}, got {json.dumps(act)}")
        return Scheme("fp8", strategy, block_size=block)
    if kind == "int" and bits == 4:
        if fmt not in INT4_WEIGHT_FORMATS:
            raise ValueError(f"{where}: int4 weights in format {fmt!r} are not supported ({', '.join(INT4_WEIGHT_FORMATS)})")
        if act:
            raise ValueError(f"{where}: int4 weights with quantized activations are not supported (W4A16 only)")
        if strategy == "group":
            group = _positive_group(w.get("group_size"), where, allow_channel=False)
        elif strategy == "channel":
            group = -1
        else:
            raise ValueError(f"{where}: int4 weight strategy {strategy!r} is not supported (group or channel)")
        actorder = w.get("actorder")
        if actorder not in (None, "static", "weight", "group", "dynamic"):
            raise ValueError(f"{where}: actorder {actorder!r} is not supported")
        return Scheme("int4", int4={"fmt": "compressed-tensors", "group_size": group,
                                    "sym": bool(w.get("symmetric", True)), "desc_act": actorder in ("group", "dynamic")})
    raise ValueError(f"{where}: {bits}-bit {kind} weights are not supported (fp8 float-quantized or int4 pack-quantized)")
