"""A real gateway process whose prefill and decode servers are unreachable:
/health, /cluster, error shapes, /v1/models and /metrics."""
from __future__ import annotations

import httpx
import pytest

_ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.down.http_url, timeout=10) as c:
        yield c


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == _ERROR_KEYS
    return body["error"]


def test_health_is_503_without_a_healthy_decode_server(client):
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "no healthy decode server"


def test_cluster_marks_unreachable_instances_unhealthy(client):
    instances = client.get("/cluster").json()["instances"]
    assert [(i["role"], i["address"]) for i in instances] == [
        ("prefill", "127.0.0.1:9"), ("decode", "127.0.0.1:1"), ("decode", "127.0.0.1:7")]
    for inst in instances:
        assert {"role", "address", "metrics_url", "healthy", "num_running", "num_waiting", "kv_blocks_used",
                "kv_blocks_total"} <= set(inst)
        assert inst["healthy"] is False and "UNAVAILABLE" in inst["error"]


def test_generation_is_503(client):
    err = _error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}), 503)
    assert err["type"] == "service_unavailable_error" and "no healthy decode server" in err["message"]
    err = _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "stream": True}), 503)
    assert "127.0.0.1:1, 127.0.0.1:7" in err["message"]


def test_validation_happens_before_routing(client):
    err = _error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9000}), 400)
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 8192 tokens. However, you "
                                     "requested 9001 tokens (1 in the messages, 9000 in the completion).")
    err = _error(client.post("/v1/completions", json={"prompt": "hi", "model": "nope"}), 404)
    assert err["code"] == "model_not_found"
    err = _error(client.post("/v1/completions", json={"prompt": "hi", "n": 3, "best_of": 2}), 400)
    assert err["type"] == "invalid_request_error" and "best_of must be greater than or equal to n" in err["message"]
    _error(client.post("/v1/completions", json={"prompt": "hi", "suffix": "there"}), 400)
    _error(client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    _error(client.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct"}), 400)
    _error(client.get("/v1/nothing-here"), 404)


def test_models_and_metrics(client):
    models = client.get("/v1/models").json()  # no --api-key: no auth needed
    assert models["object"] == "list" and models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    text = client.get("/metrics").text
    for name in ("pdserve:e2e_request_latency_seconds", "pdserve:time_to_first_token_seconds",
                 "pdserve:inter_token_latency_seconds", "pdserve:prompt_tokens_total",
                 "pdserve:generation_tokens_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in text
    assert 'pdserve:request_errors_total{model_name="SmolLM2-135M-Instruct",status="503"}' in text
