"""A fresh `pdserve up` cluster for the length of a with-block, shared by the
benchmarks that compare configurations on clusters of their own."""
from __future__ import annotations

import collections
import subprocess
import sys
import threading


class UpCluster:
    """``pdserve up`` with ``flags`` (ports included); ``pid`` is its process."""

    def __init__(self, flags: list[str]) -> None:
        self.argv = [sys.executable, "-m", "pdserve.cli", "up", *flags]

    def __enter__(self) -> "UpCluster":
        # stderr too: a server that fails at start says why there, and the error quotes the tail
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
