"""What the runner's helpers (graph_setup, memory_profile, warm_up, tp_wire) read of it: a
structural type, so that they need not import the runner that imports them."""
from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.cache_spec import CacheSpec
    from engine.kv_cache_groups import KVCacheLayout
    from engine.config import EngineConfig
    from engine.cuda_graphs import DecodeGraphs
    from engine.layers.attention import AttentionMetadata
    from engine.lora.manager import LoRAManager
    from engine.parallel import TPGroup
    from engine.runtime_config import RuntimeConfig


class RunnerParts(Protocol):
    config: EngineConfig
    runtime: RuntimeConfig
    device: torch.device
    ops: ModuleType  # kernels or kernels.reference
    model: torch.nn.Module
    tp: TPGroup | None
    lora: LoRAManager | None
    graphs: DecodeGraphs | None
    kv_cache: torch.Tensor  # [slots, blocks, 2, block_size, kv_heads, head_dim] (engine/cache_spec.py)
    cache_spec: CacheSpec
    layout: KVCacheLayout
    block_size: int
    kv_heads: int  # this rank's share
    kv_dtype: torch.dtype
    extra_block_bytes: int
    use_cuda_graphs: bool

    @property
    def block_bytes(self) -> int: ...

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor: ...

    def forward_rows_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                            meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor: ...
