"""docker-compose.yml alone (the CPU topology) and with docker-compose.gpu.yml,
as docker-compose itself resolves them (``docker-compose config``): both are
valid; only the override reserves GPUs, for the engine services only, and
gives them the CUDA image; the compose test's own override stays valid too.

Needs the ``docker-compose`` command (no engine): skipped where it is missing,
except under ``make compose-test``, which installs it."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from tests.compose.images import ROOT

pytestmark = pytest.mark.skipif(shutil.which("docker-compose") is None
                                and os.environ.get("PDSERVE_COMPOSE_TEST") != "1",
                                reason="docker-compose is not installed (make compose-test installs it)")
ENGINES = ("prefill", "decode")


def config(*files: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("BASE_IMAGE", "TORCH_INDEX", "CA_CERTS", "DEVICE", "MODEL")}
    out = subprocess.run(["docker-compose", *(a for f in files for a in ("-f", f)), "config"], cwd=ROOT,
                         env={**clean, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["services"]


def _gpus(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_the_default_file_runs_on_cpu():
    services = config("docker-compose.yml")
    assert {"gateway", "prefill", "decode", "redis", "jaeger"} <= set(services)
    for name, s in services.items():
        assert not _gpus(s), f"{name} reserves a device: `docker compose up` would fail on a CPU-only host"
    for name in ENGINES:
        assert services[name]["image"] == "pdserve:latest"
        assert services[name]["command"][-2:] == ["--device", "auto"]
        assert services[name]["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim", "CA_CERTS": "",
                                                   "TORCH_INDEX": "https://download.pytorch.org/whl/cpu"}


def test_the_gpu_override_reserves_a_gpu_per_engine_with_the_cuda_image():
    cpu, gpu = config("docker-compose.yml"), config("docker-compose.yml", "docker-compose.gpu.yml")
    assert set(cpu) == set(gpu)
    for name in ENGINES:
        devices = _gpus(gpu[name])
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert devices[0]["count"] == 1  # = tensor-parallel-size in the role's config file
        assert gpu[name]["image"] == "pdserve:cuda"
        assert gpu[name]["build"]["args"]["TORCH_INDEX"].startswith("https://download.pytorch.org/whl/cu")
        # Everything else is the CPU file's: command, health check, discovery names, restart policy.
        assert _rest(gpu[name]) == _rest(cpu[name])
    for name in set(gpu) - set(ENGINES):
        assert _rest(gpu[name]) == _rest(cpu[name]) and not _gpus(gpu[name])


def _rest(service: dict) -> dict:
    """A service without what the GPU override changes; lists of mounts and ports in order
    (merging files may reorder them)."""
    out = {k: v for k, v in service.items() if k not in ("deploy", "image", "build")}
    for key in ("volumes", "ports"):
        if key in out:
            out[key] = sorted(out[key], key=str)
    return out


def test_build_arguments_come_from_the_environment():
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
    args = config("docker-compose.yml", BASE_IMAGE="registry.local/python:3.11-slim", TORCH_INDEX="",
                  CA_CERTS=pem)["prefill"]["build"]["args"]
    assert args == {"BASE_IMAGE": "registry.local/python:3.11-slim", "TORCH_INDEX": "", "CA_CERTS": pem}


def test_the_compose_tests_override_is_valid():
    services = config("docker-compose.yml", "tests/compose/docker-compose.test.yml", REDIS_IMAGE="stand-in/redis")
    assert services["redis"]["image"] == "stand-in/redis"
    assert services["jaeger"]["image"] == "pdserve:latest"
    for name, metrics_port in (("prefill", 51061), ("decode", 51071)):
        # metrics on free loopback ports, so that replicas do not clash
        assert [str(p).split("/")[0] for p in services[name]["ports"]] == [f"127.0.0.1::{metrics_port}"]
