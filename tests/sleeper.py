"""A stand-in server for tests/test_no_leaks.py: ``python -m tests.sleeper`` prints
``sleeper ready <pids of its children>`` and sleeps. ``--children N`` starts N children that
ignore SIGTERM (as a server's workers may, and outlive it); ``--ignore-term`` has it ignore
SIGTERM too; ``--exit-before-ready CODE`` has it exit at once, never ready."""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--children", type=int, default=0)
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--exit-before-ready", type=int)
    args = ap.parse_args()
    if args.exit_before_ready is not None:
        sys.exit(args.exit_before_ready)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    children = [subprocess.Popen([sys.executable, "-c", CHILD]) for _ in range(args.children)]
    print("sleeper ready", *(c.pid for c in children), flush=True)
    time.sleep(600)
