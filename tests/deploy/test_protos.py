"""The committed gRPC stubs are what grpcio-tools generates from protos/
today (regenerate with `make protos`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_fresh(tmp_path):
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *map(str, protos)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*") if p.is_file())
    assert generated
    stale = [str(rel) for rel in generated
             if not (ROOT / rel).exists() or (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"stale gRPC stubs (run `make protos`): {stale}"


def test_every_service_is_in_package_pdserve_v1():
    from pdserve.v1 import engine_pb2, gateway_pb2

    names = {s.full_name for m in (engine_pb2, gateway_pb2) for s in m.DESCRIPTOR.services_by_name.values()}
    assert names == {"pdserve.v1.Gateway", "pdserve.v1.Prefill", "pdserve.v1.Decode", "pdserve.v1.CacheEvents"}
    gw = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    assert gw.methods_by_name["Generate"].server_streaming and "Abort" in gw.methods_by_name
