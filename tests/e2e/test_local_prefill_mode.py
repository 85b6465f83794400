"""A decode server started with `--prefill-mode local` prefills every request
itself even when the gateway has a prefill server to offer: outputs stay
exact and the prefill server does no work."""
from __future__ import annotations


import grpc
import pytest

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.processes import GatewayProcess, ServiceProcess, free_port

pytestmark = pytest.mark.slow
FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "1024"]


def test_local_mode_decode_server_ignores_the_prefill_tier():
    from engine import LLM

    questions = ["What is the capital of France?", "Name a primary colour."]
    llm = LLM(None, kv_cache_memory="64MiB", max_model_len=1024)
    sp = SamplingParams(temperature=0, max_tokens=10)
    expected = [llm.chat([{"role": "user", "content": q}], sp)[0].outputs[0].token_ids for q in questions]
    del llm

    pp, dp = str(free_port()), str(free_port())
    prefill = ServiceProcess("prefill", "prefill_service.server", ["--port", pp, "--metrics-port", "0", *FLAGS],
                             "prefill server ready", env={"OMP_NUM_THREADS": "1"})
    decode = ServiceProcess("decode", "decode_service.server",
                            ["--port", dp, "--metrics-port", "0", "--prefill-mode", "local", *FLAGS],
                            "decode server ready", env={"OMP_NUM_THREADS": "1"})
    gw = GatewayProcess("gw", ["--prefill", f"127.0.0.1:{pp}", "--decode", f"127.0.0.1:{dp}",
                               "--max-model-len", "1024"])
    procs = [gw, prefill, decode]
    try:
        for p in (prefill, decode, gw):
            p.wait_ready()
        gw.wait_healthy()
        with grpc.insecure_channel(gw.grpc_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            got = []
            for q in questions:
                req = gateway_pb2.GenerateRequest(
                    chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=q)]),
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=10))
                got.append([t for d in stub.Generate(req, timeout=120) for t in d.token_ids])
        assert got == expected
        with grpc.insecure_channel(f"127.0.0.1:{pp}") as ch:
            load = engine_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.LoadRequest(), timeout=10)
        assert load.num_requests_finished == 0
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0, 0, 0]
