"""Random PEFT LoRA adapters for test models, made and saved by ``peft`` itself, and
PEFT's own greedy tokens under them: the oracle the LoRA tests compare against."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, r: int = 8, alpha: float = 16, targets=None,
                 use_rslora: bool = False, scale: float = 1.0, **extra) -> Path:
    """A LoRA of ``base`` with random A and B (PEFT's ``init_lora_weights=False``, B scaled by
    ``scale`` so the adapter changes the greedy tokens without swamping the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_LINEAR, lora_dropout=0.0,
                     init_lora_weights=False, use_rslora=use_rslora, **extra)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    peft_model.save_pretrained(str(out))
    return out


def peft_model(base: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).eval()
