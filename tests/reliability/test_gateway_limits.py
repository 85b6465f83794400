"""Gateway limits on by default: admission is capped (--max-queued-requests,
1024) with 429 + Retry-After beyond it, request bodies are capped
(--max-request-body, 4 MiB), and the key comes from PDSERVE_API_KEY when the
flag is absent."""
from __future__ import annotations

import pytest

from gateway.active_requests import ActiveRequests
from gateway.config import GatewayConfig
from gateway.errors import ErrorKind, GatewayError
from pdserve.cli import build_parser


def _config(*flags: str) -> GatewayConfig:
    args = build_parser("gateway").parse_args(["gateway", "--decode", "127.0.0.1:1", *flags])
    return GatewayConfig.from_args(args)


def test_defaults_bound_admission_and_body(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = _config()
    assert cfg.max_queued_requests == 1024 and cfg.max_request_body == 4 * 1024 * 1024 and cfg.api_key is None
    assert _config("--max-request-body", "64KiB").max_request_body == 64 * 1024
    with pytest.raises(ValueError, match="--max-request-body"):
        _config("--max-request-body", "10")
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert _config().api_key == "from-env" and _config("--api-key", "flag").api_key == "flag"


def test_admission_cap_is_429_with_retry_after():
    active = ActiveRequests(max_requests=2)
    for _ in range(2):
        active.add(object(), object())  # type: ignore[arg-type]
    with pytest.raises(GatewayError) as e:
        active.check_admission()
    assert e.value.kind is ErrorKind.RESOURCE_EXHAUSTED and e.value.kind.http_status == 429
    assert e.value.http_headers() == {"Retry-After": "1"} and e.value.code == "server_overloaded"
