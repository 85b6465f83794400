"""Exit 0 when a gRPC server's standard health service says SERVING.

    python -m rpc.health_probe HOST:PORT [--timeout S]

Used by docker-compose healthchecks (the gRPC analogue of curl /health).
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc import tls


def is_serving(address: str, timeout: float = 2.0, service: str = "") -> bool:
    try:
        with tls.channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m rpc.health_probe")
    p.add_argument("address")
    p.add_argument("--timeout", type=float, default=2.0)
    tls.add_cli_args(p)
    a = p.parse_args()
    tls.configure(a)
    ok = is_serving(a.address, a.timeout)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
