"""engine/cpu_threads.py: a thread that calls ``serial_thread`` runs its CPU ops without an
OpenMP team of its own, and leaves the count of every other thread as it was, including one
that runs its first parallel op afterwards (as the engine thread of a server whose KV receive
thread ran first). Checked in a fresh process with two OpenMP threads, by the count of the
process's OS threads: a team adds its workers as threads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, threading, time, torch
    from engine.cpu_threads import serial_thread

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    x = torch.randn(1 << 18)
    seen = {}

    def side():  # a KV receive thread: first to run a parallel op
        serial_thread()
        before = os_threads()
        x.mul(2.0)
        seen["side"] = (torch.get_num_threads(), os_threads() - before)

    def engine():  # its first parallel op after the side thread's
        before = os_threads()
        x.mul(3.0)
        seen["engine"] = (torch.get_num_threads(), os_threads() - before)

    for target in (side, engine):
        t = threading.Thread(target=target)
        t.start()
        t.join()
        # join returns before the OS thread is gone: one leaving while the next thread counts
        # would cancel out a worker it started
        while os.path.exists(f"/proc/self/task/{t.native_id}"):
            time.sleep(0.001)
    print(json.dumps(seen))
""")


def test_a_serial_thread_starts_no_team_and_leaves_the_engine_thread_its_own():
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["side"] == [1, 0], seen  # one thread, no worker started
    assert seen["engine"] == [2, 1], seen  # two threads: one worker


IDLE = textwrap.dedent("""
    import time
    from pdserve.cli.openmp_spin import bound_openmp_spin
    bound_openmp_spin()  # what an engine server does first
    import torch
    x = torch.randn(1 << 20)
    x.mul(2.0)
    start = time.process_time()
    for _ in range(20):
        x.mul(2.0)  # a parallel region, then the team's worker idles
        time.sleep(0.02)
    print(time.process_time() - start)
""")


def _idle_cpu_seconds(**env: str) -> float:
    env = {**{k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")},
           "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO), **env}
    done = subprocess.run([sys.executable, "-c", IDLE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_idle_openmp_workers_of_a_pdserve_process_sleep_soon_unless_told_otherwise():
    """A pdserve process's idle OpenMP worker spins briefly, then sleeps: it leaves the cores to
    the host's other servers. libgomp's default spin (300,000 pauses, set here explicitly, which
    also shows that a user's setting wins) kept the worker busy for milliseconds after every
    parallel region."""
    bounded = _idle_cpu_seconds()
    default = _idle_cpu_seconds(GOMP_SPINCOUNT="300000")
    assert bounded < default / 3, (bounded, default)
