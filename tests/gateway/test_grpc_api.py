"""pdserve.v1.Gateway over gRPC against the real gateway process and fake
engine servers: Generate (text, chat, token ids), errors as status codes,
traceparent, Abort and client cancellation."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import API_KEY, SCRIPT_TEXT


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.main.grpc_address) as ch:
        yield ch


class _Key(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the gateway's API key to every call (the "main" gateway runs with --api-key)."""

    def _with_key(self, details):
        metadata = list(details.metadata or []) + [("authorization", f"Bearer {API_KEY}")]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready,
            details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


@pytest.fixture(scope="module")
def stub(channel):
    return gateway_pb2_grpc.GatewayStub(grpc.intercept_channel(channel, _Key()))


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer wrong")], [("authorization", API_KEY)]])
def test_gateway_methods_need_the_api_key(cluster, channel, metadata):
    """Generate and Abort answer UNAUTHENTICATED without the key; health and
    reflection (test_health_and_reflection, on the same bare channel) stay open."""
    bare = gateway_pb2_grpc.GatewayStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(bare.Generate(gateway_pb2.GenerateRequest(text="x"), timeout=10, metadata=metadata))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        bare.Abort(common_pb2.AbortRequest(request_id="x"), timeout=10, metadata=metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not cluster.fake.state.decode_requests


def _generate(stub, **kw) -> list[gateway_pb2.GenerateResponse]:
    metadata = kw.pop("metadata", None)
    return list(stub.Generate(gateway_pb2.GenerateRequest(**kw), timeout=20, metadata=metadata))


def test_text_prompt(cluster, stub, tokenizer):
    msgs = _generate(stub, text="Say hi", sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0),
                     request_id="g1", metadata=[("traceparent", "00-11-22-01")])
    assert list(msgs[0].prompt_token_ids) == tokenizer.encode("Say hi")
    assert all(not m.prompt_token_ids for m in msgs[1:])
    assert {m.request_id for m in msgs} == {"g1"}
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == cluster.fake.state.script[:5]
    assert "".join(m.text for m in msgs) == tokenizer.decode(ids)
    assert [m.finish_reason for m in msgs][-1] == "length" and all(not m.finish_reason for m in msgs[:-1])
    assert msgs[-1].usage.prompt_tokens == len(tokenizer.encode("Say hi"))
    assert msgs[-1].usage.completion_tokens == 5
    assert cluster.fake.state.metadata[0]["traceparent"] == "00-11-22-01"
    assert cluster.fake.state.prefill_requests[0].request_id.startswith("g1-")


def test_chat_and_token_ids_prompts(cluster, stub):
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="Hi")])
    msgs = _generate(stub, chat=chat, model="SmolLM2-135M-Instruct")  # max_tokens unset: rest of the context
    assert "".join(m.text for m in msgs) == SCRIPT_TEXT and msgs[-1].finish_reason == "stop"
    assert msgs[0].request_id.startswith("chatcmpl-")
    msgs = _generate(stub, token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]),
                     sampling=common_pb2.SamplingParams(max_tokens=2))
    assert list(msgs[0].prompt_token_ids) == [5, 6, 7] and msgs[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("kw, code, fragment", [
    (dict(text="x", sampling=common_pb2.SamplingParams(max_tokens=9000)), grpc.StatusCode.INVALID_ARGUMENT,
     "maximum context length is 8192"),
    (dict(text="x", sampling=common_pb2.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
     "temperature"),
    (dict(text="x", model="other"), grpc.StatusCode.NOT_FOUND, "does not exist"),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "needs a prompt"),
    (dict(token_ids=gateway_pb2.TokenIds(ids=[10**6])), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
])
def test_errors_are_status_codes(stub, kw, code, fragment):
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, **kw)
    assert e.value.code() == code and fragment in e.value.details()


def test_queue_full_is_resource_exhausted(cluster, stub):
    cluster.fake.state.knobs.queue_full = True
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, text="x")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_abort_ends_the_stream_with_abort(cluster, stub):
    cluster.fake.state.knobs.token_delay = 0.3
    stream = stub.Generate(gateway_pb2.GenerateRequest(text="x", request_id="to-abort"), timeout=20)
    first = next(stream)
    assert first.token_ids and not first.finish_reason
    assert stub.Abort(common_pb2.AbortRequest(request_id="to-abort"), timeout=5).found
    rest = list(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].usage.prompt_tokens == 1
    cluster.fake.wait_idle()
    assert len(cluster.fake.state.cancelled) == 1
    assert not stub.Abort(common_pb2.AbortRequest(request_id="to-abort"), timeout=5).found


def test_client_cancel_and_deadline_cancel_internal_calls(cluster, stub):
    cluster.fake.state.knobs.token_delay = 0.3
    stream = stub.Generate(gateway_pb2.GenerateRequest(text="x"), timeout=20)
    next(stream)
    stream.cancel()
    cluster.fake.wait_idle()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gateway_pb2.GenerateRequest(text="x"), timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.fake.wait_idle()
    assert len(cluster.fake.state.cancelled) == 2


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Gateway"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          timeout=5))
    assert "pdserve.v1.Gateway" in {s.name for s in resp.list_services_response.service}
