"""pdserve.v1.Gateway/Generate fuzzed with hypothesis against the real gateway
process (fake engine servers behind it): messages with any prompt kind and
any sampling values (NaN, infinities, int32/int64 extremes, unknown roles),
and serialized bytes that are corrupted (flipped, truncated, spliced, random).
The answer is a stream or INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED
with a message; never UNKNOWN or INTERNAL, and the gateway still serves.
Bounded in examples (well under a minute)."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import API_KEY

METADATA = [("authorization", f"Bearer {API_KEY}")]
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
SAMPLING_FIELDS = {
    "temperature": FLOAT32, "top_p": FLOAT32, "top_k": INT32, "min_p": FLOAT32, "seed": INT64,
    "presence_penalty": FLOAT32, "frequency_penalty": FLOAT32, "repetition_penalty": FLOAT32,
    "max_tokens": st.one_of(st.integers(1, 40), INT32), "min_tokens": st.one_of(st.integers(0, 3), INT32),
    "logprobs": st.one_of(st.integers(0, 20), INT32), "skip_special_tokens": st.booleans(),
    "stop_token_ids": st.lists(INT32, max_size=4), "stop": st.lists(st.text(max_size=8), max_size=20),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
}


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    chosen = draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), unique=True, max_size=6))
    return common_pb2.SamplingParams(**{name: draw(SAMPLING_FIELDS[name]) for name in chosen})


ROLES = st.sampled_from(["user", "system", "assistant", "developer", "tool", "", "wizard"])
PROMPTS = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=40)),
    st.builds(lambda ms: {"chat": gateway_pb2.ChatMessages(messages=ms)},
              st.lists(st.builds(gateway_pb2.ChatMessage, role=ROLES, content=st.text(max_size=20)), max_size=4)),
    st.builds(lambda ids: {"token_ids": gateway_pb2.TokenIds(ids=ids)}, st.lists(INT32, max_size=6)),
    st.just({}),
)
MESSAGES = st.builds(lambda p, s, rid, model: gateway_pb2.GenerateRequest(**p, sampling=s, request_id=rid, model=model),
                     PROMPTS, sampling_params(), st.text(max_size=12),
                     st.sampled_from(["", "SmolLM2-135M-Instruct", "other"]))


@st.composite
def corrupted(draw) -> bytes:
    data = bytearray(draw(MESSAGES).SerializeToString())
    how = draw(st.sampled_from(["flip", "truncate", "splice", "random"]))
    if how == "random" or not data:
        return draw(st.binary(min_size=1, max_size=64))
    if how == "flip":
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
    elif how == "truncate":
        data = data[:draw(st.integers(0, len(data) - 1))]
    else:
        i = draw(st.integers(0, len(data)))
        data[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


@pytest.fixture(scope="module")
def generate(cluster):
    with grpc.insecure_channel(cluster.main.grpc_address) as channel:
        yield channel.unary_stream("/pdserve.v1.Gateway/Generate", request_serializer=None,
                                   response_deserializer=gateway_pb2.GenerateResponse.FromString)


def _send(generate, data: bytes) -> None:
    try:
        out = list(generate(data, timeout=20, metadata=METADATA))
    except grpc.RpcError as e:
        assert e.code() in ALLOWED and e.details(), (data[:200], e.code(), e.details())
        return
    assert out and out[-1].finish_reason, data[:200]


def _still_serves(cluster, generate) -> None:
    _send(generate, gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
        max_tokens=2)).SerializeToString())
    cluster.fake.wait_idle()


def test_generated_messages(cluster, generate):
    @FUZZ
    @given(message=MESSAGES)
    def fuzz(message: gateway_pb2.GenerateRequest) -> None:
        _send(generate, message.SerializeToString())

    fuzz()
    _still_serves(cluster, generate)


def test_corrupted_bytes(cluster, generate):
    @FUZZ
    @given(data=corrupted())
    def fuzz(data: bytes) -> None:
        _send(generate, data)

    fuzz()
    _still_serves(cluster, generate)


@pytest.mark.parametrize("data", [
    b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # request_id whose length varint overflows
    b"\x22\x03\x08\xff\xff",  # token_ids with a truncated varint
    b"\x2a\x05\x0d\x00\x00\xc0\x7f",  # sampling.temperature = NaN (float bits 0x7fc00000)
    b"\x2a\x02\x18\xff",  # sampling.top_k truncated
    b"\x12\x01\x80",  # text that is not UTF-8
])
def test_found_cases(cluster, generate, data):
    _send(generate, data)
    _still_serves(cluster, generate)
