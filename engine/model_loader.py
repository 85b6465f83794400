"""Build a model on its device and fill its weights: safetensors from a
Hugging Face directory, or random values at the config's shape (dummy)."""
from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.mapped_checkpoint import MappedSafetensors, adopted, supported as mapping_supported
from engine.models import model_class
from engine.models.base import CausalLM
from engine.parallel import TPGroup

logger = logging.getLogger(__name__)


def iter_safetensors(path: Path, part: Callable[[str], tuple[int, int, int] | None] = lambda name: None,
                     mapped: bool = False, mappings: list[MappedSafetensors] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint; ``part(name)`` = (dim, start, stop) reads only that
    range of it from the file (a tensor-parallel rank's shard), None the whole tensor.
    ``mapped`` (CPU weights): whole tensors are views of the file mapped private
    (``engine.mapped_checkpoint``): a parameter may take one as it is; one copied instead is
    dropped from the mapping when the consumer asks for the next tensor. ``mappings`` collects
    the files' mappings (``MappedSafetensors.release_unheld`` once the weights are converted)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path} (use --load-format dummy for random weights)")
    for f in files:
        mapping = MappedSafetensors(f) if mapped else None
        if mapping is not None and mappings is not None:
            mappings.append(mapping)
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                where = part(name)
                view = mapping.view(name) if mapping is not None and where is None else None
                if view is not None:
                    yield name, view
                    if adopted(view):
                        mapping.keep(view)
                    else:
                        mapping.release(view)
                    continue
                if where is None:
                    yield name, fh.get_tensor(name)
                    continue
                dim, lo, hi = where
                index = tuple([slice(None)] * dim + [slice(lo, hi)])
                yield name, fh.get_slice(name)[index]


def load_model(cfg: ModelConfig, device: torch.device, ops: ModuleType, tp: TPGroup | None = None,
               expert_parallel: bool = False) -> CausalLM:
    torch.manual_seed(cfg.seed + (tp.rank if tp is not None else 0))
    with torch.device(device):
        model = model_class(cfg.architecture)(cfg, ops, tp, expert_parallel=expert_parallel)
    cast_parameters(model, cfg.torch_dtype)
    mappings: list[MappedSafetensors] = []
    if cfg.load_format == "dummy":
        model.load_weights(model.dummy_weights(cfg.seed, cfg.torch_dtype, device))
        logger.info("loaded random (dummy) weights")
    else:
        model.load_weights(iter_safetensors(cfg.path, model.checkpoint_slice,
                                            mapped=device.type == "cpu" and mapping_supported(), mappings=mappings))
    model.process_weights_after_loading()
    for mapping in mappings:  # pages of checkpoint tensors a method converted away
        mapping.release_unheld([*model.parameters(), *model.buffers()])
    if cfg.quantization is not None and (tp is None or tp.rank == 0):
        logger.info("quantization: %s", cfg.quantization.describe())
    return model.eval()


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters made in float32 (the default) take the model dtype, except those a method
    keeps in float32 (``keep_dtype``: FP8 scales); integer and FP8 tensors keep theirs.
    RoPE tables are no parameters: they stay float32."""
    for param in model.parameters():
        if param.dtype == torch.float32 and not getattr(param, "keep_dtype", False):
            param.data = param.data.to(dtype)
