"""Mutual TLS for the gRPC traffic between pdserve processes.

With ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` every engine server (and
the gateway's engine-facing clients) speaks TLS: servers present their
certificate and require a client certificate signed by the CA; clients
present theirs and check the server's against the same CA. One certificate
per process, good for both server and client use, is the simple setup.

Like the tracer provider, this is process-wide and set once at start-up
(``configure``) before any server or channel exists; every place that opens
a channel or a port asks this module, so no caller can forget it. Without
the flags everything stays plaintext, as before. The gateway's own
client-facing ports (OpenAI HTTP, pdserve.v1.Gateway) are not covered: put
them behind the usual HTTPS front.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def load(cls, cert: str, key: str, ca: str) -> "TlsFiles":
        try:
            return cls(Path(cert).read_bytes(), Path(key).read_bytes(), Path(ca).read_bytes())
        except OSError as exc:
            raise ValueError(f"cannot read a TLS file: {exc}") from exc


_files: TlsFiles | None = None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("TLS between pdserve processes")
    g.add_argument("--tls-cert", default=None, help="PEM certificate this process presents (server and client)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None, help="PEM CA bundle that peers' certificates must chain to")


def configure(args: argparse.Namespace) -> None:
    """Turn mutual TLS on from the flags (all three or none)."""
    global _files
    given = [getattr(args, name, None) for name in ("tls_cert", "tls_key", "tls_ca")]
    if not any(given):
        _files = None
        return
    if not all(given):
        raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
    _files = TlsFiles.load(*given)  # type: ignore[arg-type]


def enabled() -> bool:
    return _files is not None


def tls_flags(args: argparse.Namespace) -> list[str]:
    """The same flags, for a child process (``pdserve up``)."""
    out: list[str] = []
    for name in ("tls_cert", "tls_key", "tls_ca"):
        value = getattr(args, name, None)
        if value:
            out += ["--" + name.replace("_", "-"), str(Path(value).resolve())]
    return out


def _client_credentials() -> grpc.ChannelCredentials:
    assert _files is not None
    return grpc.ssl_channel_credentials(root_certificates=_files.ca, private_key=_files.key,
                                        certificate_chain=_files.cert)


def aio_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    if _files is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, _client_credentials(), options=list(options))


def channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if _files is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, _client_credentials(), options=list(options))


def add_port(server: grpc.aio.Server, address: str) -> int:
    if _files is None:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials([(_files.key, _files.cert)], root_certificates=_files.ca,
                                        require_client_auth=True)
    return server.add_secure_port(address, creds)
