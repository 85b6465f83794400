"""docker-compose.yml and the CLI agree: every service's command parses
with pdserve's own argument parser, ports match the servers' defaults and
the published ports, health checks name modules that exist. (No Docker
engine runs here, so the file is checked rather than run.)"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
_VAR = re.compile(r"\$\{([A-Z_]+)(?::-([^}]*))?\}")


def substitute(value: str) -> str:
    """Compose interpolation with each variable's default."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def command(service: dict) -> list[str]:
    return [substitute(str(a)) for a in service["command"]]


def test_topology_has_every_service(compose):
    assert {"gateway", "prefill", "decode", "redis", "jaeger"} <= set(compose["services"])


@pytest.mark.parametrize("name", ["gateway", "prefill", "decode"])
def test_commands_parse_with_the_cli(compose, name):
    argv = command(compose["services"][name])
    assert argv[0] == "pdserve" and argv[1] == name
    args = build_parser(name).parse_args(argv[1:])
    assert args.host == "0.0.0.0"  # containers bind every interface


def test_ports_match_defaults_and_published(compose):
    from decode_service.server import DEFAULT_PORT as DECODE_PORT
    from prefill_service.server import DEFAULT_PORT as PREFILL_PORT

    s = compose["services"]
    pre = build_parser("prefill").parse_args(command(s["prefill"])[1:])
    dec = build_parser("decode").parse_args(command(s["decode"])[1:])
    gw = build_parser("gateway").parse_args(command(s["gateway"])[1:])
    assert (pre.port, dec.port) == (PREFILL_PORT, DECODE_PORT) == (50061, 50071)
    assert (gw.http_port, gw.grpc_port) == (8000, 50051)
    defaults = build_parser("gateway").parse_args(["gateway", "--decode", "x:1"])
    assert (defaults.http_port, defaults.grpc_port) == (8000, 50051)
    assert f"{PREFILL_PORT}:{PREFILL_PORT}" in s["prefill"]["ports"]
    assert f"{DECODE_PORT}:{DECODE_PORT}" in s["decode"]["ports"]
    assert {"8000:8000", "50051:50051"} <= set(s["gateway"]["ports"])
    # the gateway reaches the engines by service name on their ports
    argv = command(s["gateway"])
    assert argv[argv.index("--prefill") + 1] == f"prefill:{PREFILL_PORT}"
    assert argv[argv.index("--decode") + 1] == f"decode:{DECODE_PORT}"


def test_engine_services_reserve_a_gpu_and_check_grpc_health(compose):
    for name in ("prefill", "decode"):
        svc = compose["services"][name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        test = svc["healthcheck"]["test"]
        module = test[test.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, module
        port = build_parser(name).parse_args(command(svc)[1:]).port
        assert test[-1].endswith(f":{port}")


def test_jaeger_takes_otlp_and_services_export_to_it(compose):
    s = compose["services"]
    assert s["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "16686:16686" in s["jaeger"]["ports"] and "4317:4317" in s["jaeger"]["ports"]
    for name in ("gateway", "prefill", "decode"):
        assert s[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"


def _variables(service: dict) -> list[tuple[str, str]]:
    """(flag, variable) for every ``${VAR}`` in the service's command; the
    flag is the argument before it."""
    raw = [str(a) for a in service["command"]]
    return [(raw[i - 1] if i else "", m.group(1)) for i, a in enumerate(raw) if (m := _VAR.search(a))]


def test_environment_variables_are_named_after_flags(compose):
    s = compose["services"]
    for name in ("gateway", "prefill", "decode"):
        for flag, var in _variables(s[name]):
            assert flag.startswith("--") and var.endswith(flag[2:].upper().replace("-", "_")), (name, flag, var)
    # The knobs the file's header promises, for both engine tiers.
    for tier in ("prefill", "decode"):
        names = {var for _, var in _variables(s[tier])}
        assert {"MODEL", "DTYPE", "DEVICE", "MAX_MODEL_LEN", "BLOCK_SIZE", "GPU_MEMORY_UTILIZATION",
                f"{tier.upper()}_MAX_NUM_BATCHED_TOKENS", f"{tier.upper()}_MAX_NUM_SEQS"} <= names, (tier, names)
    assert {"MODEL", "MAX_MODEL_LEN"} <= {var for _, var in _variables(s["gateway"])}
