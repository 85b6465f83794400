"""One port, one server: what every listening port of pdserve shares.

grpcio sets SO_REUSEPORT on its listening sockets by default, so a second
server on a port already served would bind beside the first and the kernel
would spread connections over both. Every gRPC server here is built with
``EXCLUSIVE`` among its options, and a port that cannot be bound is a
``PortUnavailable`` error naming the address and the flag that changes it
(the servers print it and exit non-zero). ``bind_error`` asks, without
serving, whether a port could be bound now: `pdserve up` checks all of its
ports with it before it starts anything.
"""
from __future__ import annotations

import errno
import socket
from typing import Callable

# A grpc.server / grpc.aio.server option: no SO_REUSEPORT, so a port in use fails the bind.
EXCLUSIVE = ("grpc.so_reuseport", 0)


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class PortUnavailable(OSError):
    """A server could not listen on its port; ``str()`` is the whole message for the user."""

    def __init__(self, what: str, host: str, port: int, flag: str, reason: OSError | None = None,
                 hint: str = "") -> None:
        self.what, self.host, self.port, self.flag = what, host, port, flag
        in_use = reason is None or reason.errno == errno.EADDRINUSE
        why = ("the port is already in use (another server listens on it)" if in_use
               else (reason.strerror or str(reason)))
        self.message = (f"cannot serve {what} on {join(host, port)}: {why}; "
                        f"choose another port with {flag}{hint}")
        super().__init__(errno.EADDRINUSE if in_use else reason.errno, self.message)

    def __str__(self) -> str:
        return self.message


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host:port`` now (None: it could), found by binding
    as the servers do (SO_REUSEADDR, no SO_REUSEPORT) on each address ``host`` names. Only
    a hint for what a bind that failed meant, or a check before starting: the port may be
    taken (or freed) right after."""
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return OSError(errno.EADDRNOTAVAIL, f"cannot resolve {host!r}: {exc.strerror}")
    errors: list[OSError] = []
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                errors.append(exc)
    in_use = [e for e in errors if e.errno == errno.EADDRINUSE]
    if in_use:
        return in_use[0]
    return errors[0] if errors and len(errors) == len(infos) else None


def add_grpc_port(add: Callable[[str], int], address: str, what: str, flag: str) -> int:
    """``add(address)`` (a server's add_insecure_port / add_secure_port), as a ``PortUnavailable``
    when the bind fails: grpcio raises RuntimeError, or (older versions) returns 0."""
    host, _, port_text = address.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    try:
        bound = add(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise PortUnavailable(what, host, port, flag, bind_error(host, port) if port else None)
    return bound
