"""KV layout and KV channel set-up <-> protobuf, for the engine servers' ``OpenKVChannel``."""
from __future__ import annotations

from kv_transfer import ChannelOffer, ChannelRequest, KVLayout, RankEndpoint
from pdserve.v1 import engine_pb2


def layout_to_proto(layout: KVLayout) -> engine_pb2.KVLayout:
    return engine_pb2.KVLayout(model=layout.model, dtype=layout.dtype, block_size=layout.block_size,
                               num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, k_scales=layout.k_scales, v_scales=layout.v_scales,
                               model_dtype=layout.model_dtype, weights=layout.weights, groups=layout.groups,
                               linear_state=layout.linear_state,
                               draft=layout_to_proto(layout.draft) if layout.draft is not None else None)


def layout_from_proto(msg: engine_pb2.KVLayout) -> KVLayout:
    return KVLayout(model=msg.model, dtype=msg.dtype, block_size=msg.block_size, num_layers=msg.num_layers,
                    num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, k_scales=tuple(msg.k_scales),
                    v_scales=tuple(msg.v_scales), model_dtype=msg.model_dtype, weights=msg.weights,
                    groups=msg.groups, linear_state=msg.linear_state,
                    draft=layout_from_proto(msg.draft) if msg.HasField("draft") else None)


def channel_request_to_proto(request: ChannelRequest) -> engine_pb2.OpenKVChannelRequest:
    return engine_pb2.OpenKVChannelRequest(peer=request.peer, layout=layout_to_proto(request.layout),
                                           device=request.device,
                                           tensor_parallel_size=request.tensor_parallel_size)


def channel_request_from_proto(msg: engine_pb2.OpenKVChannelRequest) -> ChannelRequest:
    """Raises ValueError for a layout that is not one (``KVLayout``'s checks)."""
    return ChannelRequest(peer=msg.peer, layout=layout_from_proto(msg.layout), device=msg.device,
                          tensor_parallel_size=msg.tensor_parallel_size)


def channel_offer_to_proto(offer: ChannelOffer) -> engine_pb2.OpenKVChannelResponse:
    return engine_pb2.OpenKVChannelResponse(
        host=offer.host, port=offer.port, backend=offer.backend,
        layout=layout_to_proto(offer.layout) if offer.layout is not None else None,
        parts=[engine_pb2.KVRankEndpoint(src_rank=p.src_rank, src_head_start=p.src_heads[0],
                                         src_head_end=p.src_heads[1], port=p.port) for p in offer.parts])


def channel_offer_from_proto(msg: engine_pb2.OpenKVChannelResponse) -> ChannelOffer:
    layout = layout_from_proto(msg.layout) if msg.HasField("layout") else None
    return ChannelOffer(host=msg.host, port=msg.port, layout=layout, backend=msg.backend,
                        parts=tuple(RankEndpoint(p.src_rank, (p.src_head_start, p.src_head_end), p.port)
                                    for p in msg.parts))
