"""The recurrent state of a linear-attention layer (Gated DeltaNet): one slot per running
sequence, owned by the model runner (allocated beside the KV cache, engine/kv_cache_groups.py)
and handed to each layer once, as FP8 scales are. The scheduler's cache manager decides which
slot a request holds; a step's ``AttentionMetadata.state_slots`` names each row's."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LinearState:
    conv: torch.Tensor  # [num_state_slots, conv_dim, kernel - 1]: the last inputs of the short convolution
    ssm: torch.Tensor  # [num_state_slots, H_v, D_k, D_v] float32: the recurrent state


@dataclass(frozen=True)
class LinearStateShape:
    """One slot of one layer, on this rank."""
    conv: tuple[int, ...]
    ssm: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype = torch.float32

    @property
    def bytes(self) -> int:
        def size(shape, dtype):
            n = 1
            for d in shape:
                n *= d
            return n * dtype.itemsize
        return size(self.conv, self.conv_dtype) + size(self.ssm, self.ssm_dtype)
