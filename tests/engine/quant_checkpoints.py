"""Write int4 checkpoints of a tiny float model, as AutoAWQ (GEMM), GPTQ
(AutoGPTQ / GPTQModel, v1 or v2 zeros, act-order) and compressed-tensors
(``pack-quantized``) lay them out, and the same model with those weights
dequantized to float32: the oracle of the quantized serving tests.

The packing here is written from each format's definition (the docstring of
``engine/quantization/int4.py`` states them), independently of the engine's
converters, so that a test comparing the two compares two implementations.
The quantizers (min/max, round to nearest) stand in for AWQ's and GPTQ's
searches, which change the values stored, not how they are stored.

    write_int4_checkpoint(src_dir, dst_dir, "gptq", group_size=32, sym=False, desc_act=True)
        -> (dst_dir, dequantized_dir)
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i of a word holds column AWQ_ORDER[i] of its 8
# The decoder's linear layers (not embeddings, norms, the LM head or MoE experts).
# (prefix, layer, block, projection); Gated DeltaNet's as (..., "linear_attn", "in_proj_qkv") and so on
LINEAR = re.compile(r"^(model\.layers\.(\d+)\.(?:(self_attn|mlp)\.(q|k|v|o|qkv|gate|up|down|gate_up)_proj"
                    r"|(linear_attn)\.(in_proj_\w+|out_proj)))\.weight$")
FORMATS = ("awq", "gptq", "compressed-tensors")


# ---- packing, from each format's definition ---------------------------------------------------------------


def _word(nibbles: list[torch.Tensor]) -> torch.Tensor:
    """8 tensors of values in [0, 15] -> int32 words, the i-th in bits 4i .. 4i+3."""
    word = torch.zeros_like(nibbles[0], dtype=torch.int64)
    for i, v in enumerate(nibbles):
        word |= (v.to(torch.int64) & 0xF) << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_awq(q_t: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [K, N/8]: word [k, c] nibble i = q_t[k, 8c + AWQ_ORDER[i]] (AutoAWQ's WQLinear_GEMM)."""
    k, n = q_t.shape
    cols = q_t.reshape(k, n // 8, 8)
    return _word([cols[:, :, AWQ_ORDER[i]] for i in range(8)])


def pack_along_dim0(v: torch.Tensor) -> torch.Tensor:
    """[R, C] -> [ceil(R/8), C]: word [r, c] nibble i = v[8r + i, c] (pads with 0).
    GPTQ's qweight (R = K) and compressed-tensors' zero point (R = N)."""
    r = v.shape[0]
    padded = torch.cat([v, v.new_zeros((-r) % 8, v.shape[1])]) if r % 8 else v
    rows = padded.reshape(-1, 8, v.shape[1])
    return _word([rows[:, i] for i in range(8)])


def pack_along_dim1(v: torch.Tensor) -> torch.Tensor:
    """[R, C] -> [R, ceil(C/8)]: word [r, c] nibble i = v[r, 8c + i] (pads with 0).
    GPTQ's qzeros (C = N) and compressed-tensors' weight_packed (C = K)."""
    return pack_along_dim0(v.t()).t().contiguous()


# ---- quantizing one weight --------------------------------------------------------------------------------


def quantize_linear(w: torch.Tensor, fmt: str, group_size: int, *, sym: bool, desc_act: bool = False,
                    checkpoint_format: str = "gptq", perm: torch.Tensor | None = None,
                    scale_dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Quantize W [N, K] (min/max per group, round to nearest) and store it as ``fmt`` does.
    Returns ({checkpoint suffix: tensor}, the dequantized W [N, K] float32 of what is stored).

    group_size -1: one group (GPTQ) / ``channel`` (compressed-tensors). desc_act (GPTQ): the
    groups follow ``perm`` (act-order: g_idx[perm[i]] = i // group_size), random if None."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if k % g:
        raise ValueError(f"group_size {g} does not divide K = {k}")
    if desc_act:
        perm = perm if perm is not None else torch.randperm(k)
        groups = torch.empty(k, dtype=torch.int64)
        groups[perm] = torch.arange(k) // g
    else:
        groups = torch.arange(k) // g
    num_groups = k // g
    if scale_dtype is None:
        scale_dtype = torch.float16 if fmt in ("awq", "gptq") else w.dtype
    w = w.float()
    q = torch.empty(n, k, dtype=torch.int64)
    z = torch.empty(n, num_groups, dtype=torch.int64)  # the zero each format's reader applies
    s = torch.empty(n, num_groups, dtype=scale_dtype)
    for j in range(num_groups):
        cols = groups == j
        wj = w[:, cols]
        lo = wj.min(1).values.clamp(max=0)
        hi = wj.max(1).values.clamp(min=0)
        if sym:
            scale = (torch.maximum(-lo, hi) * 2 / 15).clamp(min=1e-6)
            zero = torch.full((n,), 8, dtype=torch.int64)
        else:
            scale = ((hi - lo) / 15).clamp(min=1e-6)
            zero = torch.round(-lo / scale).clamp(0, 15).long()
            if fmt == "gptq" and checkpoint_format == "gptq":
                zero = zero.clamp(min=1)  # v1 stores zero - 1 in 4 bits: a zero of 0 cannot be written
        stored = scale.to(scale_dtype)
        q[:, cols] = (torch.round(wj / stored.float()[:, None]) + zero[:, None]).clamp(0, 15).long()
        z[:, j], s[:, j] = zero, stored
    dense = (q - z[:, groups]).float() * s.float()[:, groups]
    if fmt == "awq":
        if sym:
            raise ValueError("AutoAWQ GEMM checkpoints are asymmetric (zero_point: true)")
        out = {"qweight": pack_awq(q.t()), "qzeros": pack_awq(z.t()), "scales": s.t().contiguous()}
    elif fmt == "gptq":
        stored_z = z - 1 if checkpoint_format == "gptq" else z
        out = {"qweight": pack_along_dim0(q.t()), "qzeros": pack_along_dim1(stored_z.t()),
               "scales": s.t().contiguous(), "g_idx": groups.to(torch.int32)}
    elif fmt == "compressed-tensors":
        if desc_act:
            raise ValueError("compressed-tensors act-order (actorder: group) is not written here")
        # signed values q - 8 and zero points z - 8, stored with the offset 8 added back
        out = {"weight_packed": pack_along_dim1(q), "weight_scale": s.contiguous(),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if not sym:
            out["weight_zero_point"] = pack_along_dim0(z)
    else:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return out, dense


# ---- whole checkpoints ------------------------------------------------------------------------------------


def quantization_config(fmt: str, group_size: int, *, sym: bool, desc_act: bool, checkpoint_format: str) -> dict:
    """config.json's ``quantization_config`` as each tool writes it."""
    if fmt == "awq":  # AutoAWQ's save_quantized
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "gptq":  # optimum / AutoGPTQ, with GPTQModel's checkpoint_format
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "static_groups": False,
                "true_sequential": True}
    raise ValueError(fmt)


def _compressed_tensors_config(dst: Path, group_size: int, sym: bool) -> None:
    """Add the compressed-tensors quantization_config to dst/config.json the way the library
    serializes it when llm-compressor saves (``ModelCompressor.update_config``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=sym,
                               strategy="channel" if group_size == -1 else "group",
                               group_size=None if group_size == -1 else group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                format="pack-quantized", quantization_status="compressed", ignore=["lm_head"])
    ModelCompressor(quantization_config=config).update_config(str(dst))


def write_int4_checkpoint(src_dir: str | Path, dst_dir: str | Path, fmt: str, group_size: int, sym: bool | None = None,
                          desc_act: bool = False, *, dequant_dir: str | Path | None = None,
                          checkpoint_format: str = "gptq", seed: int = 0) -> tuple[Path, Path]:
    """Quantize every decoder linear layer (q/k/v/o/gate/up/down projections) of the float
    model in ``src_dir`` to ``fmt`` ("awq", "gptq", "compressed-tensors") and write it to
    ``dst_dir`` (safetensors + config.json with its quantization_config + the other files);
    write the same model with those weights dequantized (all floats float32, no
    quantization_config) to ``dequant_dir`` (default: ``<dst_dir>-dequant``).

    sym: None = the format's usual (AWQ asymmetric, GPTQ and compressed-tensors symmetric).
    desc_act: GPTQ act-order, one random order per layer input (q/k/v share one, gate/up one).
    checkpoint_format: GPTQ "gptq" (v1, zeros stored minus one) or "gptq_v2".
    group_size must divide every layer's input width (-1: one group; not for AWQ).
    Returns (dst_dir, dequant_dir)."""
    src, dst = Path(src_dir), Path(dst_dir)
    deq = Path(dequant_dir) if dequant_dir is not None else dst.with_name(dst.name + "-dequant")
    if sym is None:
        sym = fmt != "awq"
    gen = torch.Generator().manual_seed(seed)
    tensors = _read_checkpoint(src)
    quant: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    orders: dict[tuple[str, str], torch.Tensor] = {}
    for name, t in tensors.items():
        m = LINEAR.match(name)
        if m is None:
            quant[name] = t
            dense[name] = t.float() if t.is_floating_point() else t
            continue
        prefix, layer, block, proj = (g for g in m.groups() if g is not None)
        perm = None
        if desc_act:
            # layers reading the same input share GPTQ's act order (the same Hessian)
            key = (layer, "o" if proj == "o" else "down" if proj == "down" else block)
            if key not in orders:
                orders[key] = torch.randperm(t.shape[1], generator=gen)
            perm = orders[key]
        stored, w = quantize_linear(t, fmt, group_size, sym=sym, desc_act=desc_act,
                                    checkpoint_format=checkpoint_format, perm=perm)
        quant.update({f"{prefix}.{suffix}": v for suffix, v in stored.items()})
        dense[name] = w
    if fmt == "compressed-tensors":
        _write_pair(src, dst, deq, quant, dense, lambda d: _compressed_tensors_config(d, group_size, sym))
    else:
        _write_pair(src, dst, deq, quant, dense, quantization_config(fmt, group_size, sym=sym, desc_act=desc_act,
                                                                     checkpoint_format=checkpoint_format))
    return dst, deq


def _read_checkpoint(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _write_pair(src: Path, dst: Path, deq: Path, quant: dict[str, torch.Tensor], dense: dict[str, torch.Tensor],
                quantization: dict | Callable[[Path], None]) -> None:
    """Write the quantized checkpoint to ``dst`` and its dequantized float32 copy to ``deq``:
    each its safetensors and ``src``'s other files; config.json float32 and without a
    quantization_config for the copy, with ``quantization`` for ``dst`` (a dict, or a function
    that adds it to dst/config.json the way a library writes it)."""
    for out, state in ((dst, quant), (deq, dense)):
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, out / f.name)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = "float32"
    (deq / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if isinstance(quantization, dict):
        config["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if callable(quantization):
        quantization(dst)


# ---- FP8 (W8A8) checkpoints -------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
FP8_FORMATS = ("compressed-tensors", "fp8")  # llm-compressor's float-quantized; transformers' / Qwen's fp8
# transformers 5 stacks each MoE layer's experts in memory (gate_up_proj [E, 2I, H], down_proj
# [E, H, I]) and saves them either so or one by one, as FP8 checkpoints name them
STACKED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3))"
                    r"\.weight$")


def fp8_scales(w: torch.Tensor, strategy: str, block: tuple[int, int]) -> torch.Tensor:
    """Min-max scales of W [N, K] as an observer computes them: amax / 448 per tensor ([1]),
    per row ([N, 1]) or per block ([cdiv(N, bn), cdiv(K, bk)])."""
    a = w.float().abs()
    if strategy == "tensor":
        return (a.amax() / 448).reshape(1)
    if strategy == "channel":
        return a.amax(dim=1, keepdim=True) / 448
    bn, bk = block
    n, k = w.shape
    tiles = torch.nn.functional.pad(a, (0, -k % bk, 0, -n % bn)).view(-(-n // bn), bn, -(-k // bk), bk)
    return tiles.amax(dim=(1, 3)) / 448


def _expand(scales: torch.Tensor, shape: torch.Size, strategy: str, block: tuple[int, int]) -> torch.Tensor:
    if strategy != "block":
        return scales.reshape(-1, 1) if scales.numel() > 1 else scales.reshape(1, 1)
    return scales.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def _ct_fp8_scheme(strategy: str, block: tuple[int, int]):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                               block_structure=list(block) if strategy == "block" else None)
    acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True,
                            strategy="group" if strategy == "block" else "token",
                            group_size=block[1] if strategy == "block" else None)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def quantize_fp8_weight(w: torch.Tensor, fmt: str, strategy: str, block: tuple[int, int] = (128, 128)
                        ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Quantize W [N, K] to e4m3 with min-max scales and store it as ``fmt`` does; returns
    ({checkpoint suffix: tensor}, the dequantized W float32 of what is stored).

    compressed-tensors: the library's FloatQuantizationCompressor writes ``weight`` and
    ``weight_scale`` and its decompress gives the dequantized weight. fp8: written from the
    format's definition, ``weight`` = e4m3(W / s) and ``weight_scale_inv`` = s per 128x128
    block (``weight_scale`` per tensor without a block size)."""
    s = fp8_scales(w, strategy, block)
    if fmt == "compressed-tensors":
        from compressed_tensors.compressors import FloatQuantizationCompressor

        scheme = _ct_fp8_scheme(strategy, block)
        stored = FloatQuantizationCompressor.compress({"weight": w.float(), "weight_scale": s,
                                                       "weight_zero_point": torch.zeros_like(s)}, scheme)
        dense = FloatQuantizationCompressor.decompress(dict(stored), scheme)["weight"].float()
        return {"weight": stored["weight"], "weight_scale": stored["weight_scale"]}, dense
    if fmt != "fp8" or strategy not in ("tensor", "block"):
        raise ValueError(f"no fp8 writer for {fmt} / {strategy}")
    scale = _expand(s, w.shape, strategy, block)
    q = (w.float() / scale).clamp(-448, 448).to(FP8)
    name = "weight_scale_inv" if strategy == "block" else "weight_scale"
    return {"weight": q, name: s if strategy == "block" else s.reshape(())}, q.float() * scale


def fp8_quantization_config(fmt: str, strategy: str, block: tuple[int, int], moe: bool,
                            keep: tuple[str, ...] = ()) -> dict:
    if fmt == "fp8":
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "modules_to_not_convert": ["lm_head"] + (["mlp.gate"] if moe else []) + list(keep)}
        if strategy == "block":
            config["weight_block_size"] = list(block)
        return config
    raise ValueError(fmt)


def _ct_fp8_config(dst: Path, strategy: str, block: tuple[int, int], moe: bool, keep: tuple[str, ...] = ()) -> None:
    """Add the compressed-tensors quantization_config to dst/config.json as the library writes it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    ignore = ["lm_head"] + (["re:.*mlp\\.gate$"] if moe else []) + [f"re:.*\\.{k}$" for k in keep]
    config = QuantizationConfig(config_groups={"group_0": _ct_fp8_scheme(strategy, block)}, format="float-quantized",
                                quantization_status="compressed", ignore=ignore)
    ModelCompressor(quantization_config=config).update_config(str(dst))


def write_fp8_checkpoint(src_dir: str | Path, dst_dir: str | Path, fmt: str, strategy: str,
                         block: tuple[int, int] = (128, 128), *, dequant_dir: str | Path | None = None,
                         keep: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Quantize every decoder linear layer and every MoE expert of the float model in
    ``src_dir`` to FP8 as ``fmt`` stores it ("compressed-tensors" float-quantized, strategy
    tensor | channel | block; "fp8", strategy tensor | block) and write it to ``dst_dir``,
    but for the layers named ``keep`` (the last part of their names), which the config
    lists as not converted and the file holds in float;
    write the same model with those weights dequantized (float32, no quantization_config)
    to ``dequant_dir`` (default ``<dst_dir>-dequant``). Experts stacked by transformers 5
    are written one by one (``experts.<e>.gate_proj.weight`` ...), as FP8 checkpoints name
    them. Returns (dst_dir, dequant_dir)."""
    src, dst = Path(src_dir), Path(dst_dir)
    deq = Path(dequant_dir) if dequant_dir is not None else dst.with_name(dst.name + "-dequant")
    tensors = _read_checkpoint(src)
    quant: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    moe = False
    for name, t in tensors.items():
        m, e = LINEAR.match(name) or EXPERT.match(name), STACKED_EXPERTS.match(name)
        moe = moe or EXPERT.match(name) is not None
        if m is not None and m.group(1).rsplit(".", 1)[-1] in keep:
            m = None
        if m is None and e is None:
            quant[name] = t
            dense[name] = t.float() if t.is_floating_point() else t
            continue
        if m is not None:
            stored, w = quantize_fp8_weight(t, fmt, strategy, block)
            quant.update({f"{m.group(1)}.{suffix}": v for suffix, v in stored.items()})
            dense[name] = w
            continue
        moe = True
        prefix, which = e.groups()
        out = []
        for j in range(t.shape[0]):
            halves = t[j].chunk(2) if which == "gate_up_proj" else (t[j],)
            names = ("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",)
            rows = []
            for proj, w in zip(names, halves):
                stored, wd = quantize_fp8_weight(w.contiguous(), fmt, strategy, block)
                quant.update({f"{prefix}.{j}.{proj}.{suffix}": v for suffix, v in stored.items()})
                rows.append(wd)
            out.append(torch.cat(rows))
        dense[name] = torch.stack(out)
    if fmt == "compressed-tensors":
        _write_pair(src, dst, deq, quant, dense, lambda d: _ct_fp8_config(d, strategy, block, moe, keep))
    else:
        _write_pair(src, dst, deq, quant, dense, fp8_quantization_config(fmt, strategy, block, moe, keep))
    return dst, deq
