"""A PEFT LoRA adapter read from its directory (``adapter_config.json`` and
``adapter_model.safetensors``) and checked against the model it is to serve on.

Each adapted checkpoint module ``m`` (``model.layers.3.self_attn.q_proj``) has
``lora_A [r, in]`` and ``lora_B [out, r]``; its output gains
``scaling * x A^T B^T`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``; ``rank_pattern`` / ``alpha_pattern`` override both per module).
The scaling is folded into B here, once.

What is refused, each with a message naming it (``LoRAError``): a missing or
corrupt file, a PEFT type other than LoRA, DoRA, LoRA biases, modules_to_save,
a rank above ``--max-lora-rank``, target modules the model lacks (or that are
not linear layers pdserve adapts: embeddings, the LM head, MoE experts), and
tensors whose shapes do not fit the model's (an adapter of another base model).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served here; the message says why."""


class LoRANotLoaded(LoRAError):
    """A request names an adapter this engine does not hold."""


class LoRAMismatch(LoRAError):
    """Two servers of one request hold different contents under an adapter's name."""


@dataclass(frozen=True)
class ModuleShape:
    """A checkpoint module the model can adapt: its input and output widths."""

    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    """One adapter on the host: per checkpoint module, (A [r, in], B * scaling [out, r])
    in float32, and the fingerprint that names its contents."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    fingerprint: str = ""
    base_model: str | None = None

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the key that names ``module``
    (its full name or a dotted suffix of it, as a regex)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise LoRAError(f"{path}: no {CONFIG_FILE} (a PEFT LoRA adapter directory has one)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LoRAError(f"{cfg_file}: not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_file}: expected a JSON object")
    return cfg


def load_adapter(name: str, path: str | Path, modules: Mapping[str, ModuleShape], max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at ``path`` for a model whose adaptable checkpoint
    modules are ``modules``."""
    path = Path(path)
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory")
    cfg = read_config(path)
    where = f"LoRA adapter {name!r} ({path})"
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported; only LORA")
    if cfg.get("use_dora"):
        raise LoRAError(f"{where}: DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{where}: LoRA biases (bias={cfg.get('bias')!r}) are not supported; only 'none'")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"{where}: modules_to_save {cfg['modules_to_save']} is not supported")
    if cfg.get("fan_in_fan_out"):
        raise LoRAError(f"{where}: fan_in_fan_out adapters (Conv1D models) are not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"{where}: adapter_config.json needs an integer r >= 1 and a number lora_alpha")
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    _check_targets(cfg.get("target_modules"), modules, where)
    tensors = _read_tensors(path, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA weight (expected ...<module>.lora_A.weight "
                            "or .lora_B.weight)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    if not pairs:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for module, ab in sorted(pairs.items()):
        if module not in modules:
            raise LoRAError(f"{where}: the model has no adaptable module {module!r} (adaptable: "
                            f"{_describe(modules)})")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        shape = modules[module]
        rank = _pattern_value(rank_pattern, module, r)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != shape.in_features or b.shape[0] != shape.out_features \
                or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a "
                            f"[{shape.out_features} x {shape.in_features}] layer (an adapter of another base model?)")
        if a.shape[0] != rank:
            raise LoRAError(f"{where}: {module}: rank {a.shape[0]} in the tensors, {rank} in adapter_config.json")
        if rank > max_rank:
            raise LoRAError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
        mod_alpha = _pattern_value(alpha_pattern, module, alpha)
        scaling = mod_alpha / math.sqrt(rank) if cfg.get("use_rslora") else mod_alpha / rank
        weights[module] = (a.float().contiguous(), (b.float() * scaling).contiguous())
        top_rank = max(top_rank, rank)
    digest = hashlib.sha256()
    digest.update((path / CONFIG_FILE).read_bytes())
    digest.update((path / WEIGHTS_FILE).read_bytes())
    return LoRAAdapter(name, str(path), top_rank, weights, digest.hexdigest()[:16],
                       cfg.get("base_model_name_or_path"))


def _check_targets(targets: Any, modules: Mapping[str, ModuleShape], where: str) -> None:
    """target_modules given as a list must each name something the model adapts."""
    if not isinstance(targets, list):
        return  # a regex, or none: the tensors say which modules
    suffixes = {m.rsplit(".", 1)[-1] for m in modules}
    missing = [t for t in targets if t not in suffixes and t not in modules]
    if missing:
        raise LoRAError(f"{where}: target_modules {missing} are not adaptable linear layers of this model "
                        f"(adaptable: {', '.join(sorted(suffixes))})")


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        other = [p.name for p in path.glob("adapter_model.*")]
        hint = f" (found {', '.join(other)}: save it with safe_serialization=True)" if other else ""
        raise LoRAError(f"{where}: no {WEIGHTS_FILE}{hint}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} cannot be read (corrupt or truncated): {e}") from e


def _describe(modules: Mapping[str, ModuleShape]) -> str:
    return ", ".join(sorted({m.rsplit(".", 1)[-1] for m in modules}))
