"""KV layout <-> protobuf, for the engine servers' KV channel set-up."""
from __future__ import annotations

from kv_transfer import KVLayout
from pdserve.v1 import engine_pb2


def layout_to_proto(layout: KVLayout) -> engine_pb2.KVLayout:
    return engine_pb2.KVLayout(model=layout.model, dtype=layout.dtype, block_size=layout.block_size,
                               num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, k_scales=layout.k_scales, v_scales=layout.v_scales,
                               model_dtype=layout.model_dtype, weights=layout.weights,
                               draft=layout_to_proto(layout.draft) if layout.draft is not None else None)


def layout_from_proto(msg: engine_pb2.KVLayout) -> KVLayout:
    return KVLayout(model=msg.model, dtype=msg.dtype, block_size=msg.block_size, num_layers=msg.num_layers,
                    num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, k_scales=tuple(msg.k_scales),
                    v_scales=tuple(msg.v_scales), model_dtype=msg.model_dtype, weights=msg.weights,
                    draft=layout_from_proto(msg.draft) if msg.HasField("draft") else None)
