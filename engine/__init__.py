"""pdserve engine core: the model, the paged KV cache, the scheduler and the
offline API that both serving tiers run.

``from engine import LLM, SamplingParams`` is the offline entry point. Heavy
modules (torch, transformers) load on first use so that light users of the
package (the gateway's block hashing, config parsing) stay cheap to import.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "EngineArgs", "LLMEngine", "RequestOutput", "CompletionOutput", "LoRARequest"]

_LAZY = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "EngineArgs": "engine.config",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "LoRARequest": "engine.lora.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
