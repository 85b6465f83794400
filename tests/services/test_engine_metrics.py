"""A decode server's Prometheus endpoint and LoadInfo.metrics_url, on a real
server process."""
from __future__ import annotations

import socket

import grpc
import httpx

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.gateway.processes import ServiceProcess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_decode_server_metrics(tiny_llama_dir):
    port, mport = _free_port(), _free_port()
    proc = ServiceProcess("decode", "decode_service.server",
                          ["--port", str(port), "--metrics-port", str(mport), "--model", str(tiny_llama_dir),
                           "--kv-cache-memory", "8MiB"], "decode server ready", env={"OMP_NUM_THREADS": "1"})
    try:
        proc.wait_ready()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = engine_pb2_grpc.DecodeStub(ch)
            sp = common_pb2.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            for _ in stub.Generate(engine_pb2.DecodeRequest(request_id="m1", prompt_token_ids=list(range(3, 23)),
                                                            sampling=sp), timeout=60):
                pass
            info = stub.GetLoad(common_pb2.LoadRequest(), timeout=10)
        assert info.metrics_url == f"http://127.0.0.1:{mport}/metrics"
        assert info.num_requests_finished == 1 and info.kv_blocks_used == 0
        text = httpx.get(info.metrics_url, timeout=10).text
        lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                 if line.startswith("pdserve:")}
        key = f'{{model_name="{tiny_llama_dir.name}",role="decode"}}'
        assert lines["pdserve:prompt_tokens_total" + key] == 20
        assert lines["pdserve:generation_tokens_total" + key] == 5
        assert lines["pdserve:prefix_cache_queries_total" + key] == 20
        assert lines["pdserve:num_requests_running" + key] == 0
        assert "pdserve:kv_cache_usage_perc" + key in lines
    finally:
        assert proc.stop() == 0
