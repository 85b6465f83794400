from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_TIER_DEVICE: _ClassVar[CacheTier]
    CACHE_TIER_HOST: _ClassVar[CacheTier]
CACHE_TIER_DEVICE: CacheTier
CACHE_TIER_HOST: CacheTier

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "k_scales", "v_scales", "model_dtype", "weights", "draft", "groups", "linear_state")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LINEAR_STATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_scales: _containers.RepeatedScalarFieldContainer[float]
    v_scales: _containers.RepeatedScalarFieldContainer[float]
    model_dtype: str
    weights: str
    draft: KVLayout
    groups: str
    linear_state: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., k_scales: _Optional[_Iterable[float]] = ..., v_scales: _Optional[_Iterable[float]] = ..., model_dtype: _Optional[str] = ..., weights: _Optional[str] = ..., draft: _Optional[_Union[KVLayout, _Mapping]] = ..., groups: _Optional[str] = ..., linear_state: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "dst_block_ids", "num_skip_blocks", "lora_name", "lora_fingerprint", "dst_state_slot", "resume_output_token_ids", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DST_STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    decode_address: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_skip_blocks: int
    lora_name: str
    lora_fingerprint: str
    dst_state_slot: int
    resume_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., num_skip_blocks: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_fingerprint: _Optional[str] = ..., dst_state_slot: _Optional[int] = ..., resume_output_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ...) -> None: ...

class KVTransferStats(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "seconds", "backend", "seconds_after_first_token", "host_staged")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SECONDS_AFTER_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOST_STAGED_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str
    seconds_after_first_token: float
    host_staged: bool
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., backend: _Optional[str] = ..., seconds_after_first_token: _Optional[float] = ..., host_staged: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "logprob", "num_cached_tokens", "transfer", "queue_seconds", "prefill_seconds", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    transfer: KVTransferStats
    queue_seconds: float
    prefill_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., transfer: _Optional[_Union[KVTransferStats, _Mapping]] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "remote_prefill", "lora_name", "resume_output_token_ids", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    remote_prefill: bool
    lora_name: str
    resume_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., remote_prefill: _Optional[bool] = ..., lora_name: _Optional[str] = ..., resume_output_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ...) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("block_ids", "num_cached_tokens", "lora_fingerprint", "state_slot")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    lora_fingerprint: str
    state_slot: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., lora_fingerprint: _Optional[str] = ..., state_slot: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_cached_tokens", "finish_message", "num_draft_tokens", "num_accepted_draft_tokens", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: str
    num_cached_tokens: int
    finish_message: str
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., finish_message: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("reserved", "delta")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    delta: TokenDelta
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ...) -> None: ...

class OpenKVChannelRequest(_message.Message):
    __slots__ = ("peer", "layout", "device", "tensor_parallel_size")
    PEER_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    peer: str
    layout: KVLayout
    device: str
    tensor_parallel_size: int
    def __init__(self, peer: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., device: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class KVRankEndpoint(_message.Message):
    __slots__ = ("src_rank", "src_head_start", "src_head_end", "port")
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    SRC_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    SRC_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    src_rank: int
    src_head_start: int
    src_head_end: int
    port: int
    def __init__(self, src_rank: _Optional[int] = ..., src_head_start: _Optional[int] = ..., src_head_end: _Optional[int] = ..., port: _Optional[int] = ...) -> None: ...

class OpenKVChannelResponse(_message.Message):
    __slots__ = ("host", "port", "layout", "backend", "pair_name", "parts")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PAIR_NAME_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    layout: KVLayout
    backend: str
    pair_name: str
    parts: _containers.RepeatedCompositeFieldContainer[KVRankEndpoint]
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., backend: _Optional[str] = ..., pair_name: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[KVRankEndpoint, _Mapping]]] = ...) -> None: ...

class PrefillStartedRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class PrefillStartedResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WatchCacheEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEventBatch(_message.Message):
    __slots__ = ("instance_id", "cache_namespace", "snapshot", "hashes", "stored", "tiers")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    cache_namespace: str
    snapshot: bool
    hashes: _containers.RepeatedScalarFieldContainer[int]
    stored: _containers.RepeatedScalarFieldContainer[bool]
    tiers: _containers.RepeatedScalarFieldContainer[CacheTier]
    def __init__(self, instance_id: _Optional[str] = ..., cache_namespace: _Optional[str] = ..., snapshot: _Optional[bool] = ..., hashes: _Optional[_Iterable[int]] = ..., stored: _Optional[_Iterable[bool]] = ..., tiers: _Optional[_Iterable[_Union[CacheTier, str]]] = ...) -> None: ...
