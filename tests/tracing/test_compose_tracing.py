"""docker-compose.yml sends every pdserve service's spans to its Jaeger over
OTLP: each service's environment, resolved the way rpc/tracing.py resolves
it, names Jaeger's OTLP gRPC port, the service's own name and a valid
sampler; Jaeger accepts OTLP there and serves its query API (what
``pdserve trace --jaeger-url`` reads)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rpc.tracing import TracingConfig

ROOT = Path(__file__).resolve().parents[2]
_VAR = re.compile(r"\$\{([A-Z_]+)(?::-([^}]*))?\}")
SAMPLERS = {"always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio"}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


@pytest.mark.parametrize("name", ["gateway", "prefill", "decode"])
def test_each_service_exports_to_jaeger_under_its_name(services, name):
    env = {k: _VAR.sub(lambda m: m.group(2) or "", str(v)) for k, v in services[name]["environment"].items()}
    cfg = TracingConfig.from_env(f"pdserve-{name}", environ=env)
    # Jaeger answers under its service name and its network aliases (the names Kubernetes uses too).
    jaeger = services["jaeger"]
    names = {"jaeger", *(a for net in (jaeger.get("networks") or {}).values() for a in (net or {}).get("aliases", []))}
    host = cfg.otlp_endpoint.removeprefix("http://").rsplit(":", 1)[0]
    assert (cfg.service_name, cfg.otlp_protocol) == (f"pdserve-{name}", "grpc")
    assert host in names and cfg.otlp_endpoint.endswith(":4317"), (cfg.otlp_endpoint, names)
    assert env["OTEL_TRACES_SAMPLER"] in SAMPLERS and 0.0 <= float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1.0


def test_jaeger_takes_otlp_and_serves_its_query_api(services):
    jaeger = services["jaeger"]
    assert str(jaeger["environment"]["COLLECTOR_OTLP_ENABLED"]).lower() == "true"
    assert {"4317:4317", "16686:16686"} <= set(jaeger["ports"])
