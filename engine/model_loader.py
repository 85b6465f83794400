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
from engine.models.llama import LlamaForCausalLM
from engine.parallel import TPGroup

logger = logging.getLogger(__name__)

_ARCHS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # QKV bias via config.attention_bias
}


def iter_safetensors(path: Path, part: Callable[[str], tuple[int, int, int] | None] = lambda name: None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint; ``part(name)`` = (dim, start, stop) reads only that
    range of it from the file (a tensor-parallel rank's shard), None the whole tensor."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path} (use --load-format dummy for random weights)")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                where = part(name)
                if where is None:
                    yield name, fh.get_tensor(name)
                    continue
                dim, lo, hi = where
                index = tuple([slice(None)] * dim + [slice(lo, hi)])
                yield name, fh.get_slice(name)[index]


def dummy_checkpoint(cfg: ModelConfig, model: LlamaForCausalLM, device: torch.device
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights as a checkpoint: norms 1, biases 0, the rest N(0, 0.02).
    Every tensor is drawn whole from one seeded generator, and each rank keeps
    its part (as from a file), so a model is the same at every TP size."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    for name, shape in model.checkpoint_shapes():
        t = torch.empty(shape, dtype=cfg.torch_dtype, device=device)
        if "norm" in name:
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
        yield name, t


def load_model(cfg: ModelConfig, device: torch.device, ops: ModuleType, tp: TPGroup | None = None
               ) -> LlamaForCausalLM:
    torch.manual_seed(cfg.seed + (tp.rank if tp is not None else 0))
    with torch.device(device):
        model = _ARCHS[cfg.architecture](cfg, ops, tp)
    model = model.to(dtype=cfg.torch_dtype)
    model.cos_sin = model.cos_sin.float()  # RoPE table stays float32 (cast per use, like HF)
    if cfg.load_format == "dummy":
        model.load_weights(dummy_checkpoint(cfg, model, device))
        logger.info("loaded random (dummy) weights")
    else:
        model.load_weights(iter_safetensors(cfg.path, model.checkpoint_slice))
    return model.eval()
