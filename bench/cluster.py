"""A fresh `pdserve up` cluster for the length of a with-block, shared by the
benchmarks that compare configurations on clusters of their own."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
from pathlib import Path


class UpCluster:
    """``pdserve up`` with ``flags`` (ports included) and ``env`` (default: this process's);
    ``pid`` is its process."""

    def __init__(self, flags: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = [sys.executable, "-m", "pdserve.cli", "up", *flags]
        self.env = env

    def __enter__(self) -> "UpCluster":
        # stderr too: a server that fails at start says why there, and the error quotes the tail
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env)
        assert self.proc.stdout is not None
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        for line in self.proc.stdout:
            self.tail.append(line)
            if line.startswith("pdserve ready"):
                # keep reading: a full pipe would stall the servers' logging
                threading.Thread(target=self.tail.extend, args=(self.proc.stdout,), daemon=True).start()
                return self
        raise RuntimeError(f"pdserve up exited with {self.proc.wait()}: {' '.join(self.argv)}\n"
                           + "".join(self.tail))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def server_processes(pid: int) -> dict[int, str]:
    """The child processes of `pdserve up` ``pid``: pid -> its pdserve role (prefill, decode, gateway)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            argv = Path(f"/proc/{d}/cmdline").read_text().split("\0")
            out[int(d)] = next(a for a in argv if a in ("prefill", "decode", "gateway"))
        except (OSError, IndexError, ValueError, StopIteration):
            pass
    return out
