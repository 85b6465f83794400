"""No process the test helpers start outlives a failure, nor the session: a context whose
body raises, a server that ignores SIGTERM, a running_cluster whose start fails, a fixture
whose setup raises after starting a server, a failing test, and a test that leaves one
running (which the session-end check in tests/conftest.py kills, naming it, and fails)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.processes import REPO, ServiceProcess, pid_alive, running_cluster


def sleeper(name: str, *flags: str) -> ServiceProcess:
    return ServiceProcess(name, "tests.sleeper", list(flags), "sleeper ready")


def pids_of(proc: ServiceProcess) -> list[int]:
    """Its pid and its children's, once ready."""
    return [proc.proc.pid, *map(int, proc.wait_ready().split()[2:])]


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5  # a child SIGKILLed is gone at once; reparented, reaped soon after
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, f"still alive: {alive}"


def test_context_whose_body_raises_leaves_nothing():
    with pytest.raises(RuntimeError, match="body"):
        with sleeper("body-raises", "--children", "2") as proc:
            pids = pids_of(proc)
            raise RuntimeError("the body failed")
    assert_gone(pids)  # its children ignore SIGTERM: its group was killed


def test_stop_escalates_to_sigkill_for_the_whole_group():
    proc = sleeper("ignores-term", "--ignore-term", "--children", "1")
    pids = pids_of(proc)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.stop(timeout=0.5)
    assert_gone(pids)


def test_running_cluster_whose_start_fails_leaves_nothing():
    engines = [sleeper("engine-ok", "--children", "1"), sleeper("engine-dies", "--exit-before-ready", "3")]
    gateway = sleeper("gateway", "--children", "1")
    pids = pids_of(engines[0]) + pids_of(gateway)
    with pytest.raises(RuntimeError, match="engine-dies exited"):
        with running_cluster(engines, gateway):  # type: ignore[arg-type]
            pass
    assert_gone(pids)


INNER = '''
import os

import pytest

from tests.processes import ServiceProcess, pid_alive


def started(name):
    proc = ServiceProcess(name, "tests.sleeper", ["--children", "1"], "sleeper ready")
    pids = [proc.proc.pid, *map(int, proc.wait_ready().split()[2:])]
    with open(os.environ["PIDS_FILE"], "a") as f:
        f.write(name + " " + " ".join(map(str, pids)) + "\\n")
    return proc


def recorded(name):
    with open(os.environ["PIDS_FILE"]) as f:
        return [int(p) for line in f if line.split()[0] == name for p in line.split()[1:]]


@pytest.fixture
def setup_fails():
    proc = started("setup-fails")
    raise RuntimeError("setup failed after starting a server")
    yield proc
    proc.stop()


def test_setup_fails(setup_fails):
    pass


def test_setup_fails_left_nothing():
    assert recorded("setup-fails") and not [p for p in recorded("setup-fails") if pid_alive(p)]


def test_fails():
    started("test-fails")
    assert False, "the test failed"


def test_fails_left_nothing():
    assert recorded("test-fails") and not [p for p in recorded("test-fails") if pid_alive(p)]


def test_leaves_one_running():
    started("leaky")
'''


def test_session_end_check_kills_and_names_what_is_left(tmp_path):
    """An inner session (this conftest as a plugin) in which a fixture's setup and a test fail
    after starting servers, and a test leaves one running: the first two are gone at once, the
    last is killed at the end and named, and the session fails."""
    (tmp_path / "test_inner.py").write_text(INNER)
    pids_file = tmp_path / "pids"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(PIDS_FILE=str(pids_file), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "-c", os.devnull, "--rootdir", str(tmp_path), "-v", "-p", "no:xdist",
                          str(tmp_path / "test_inner.py")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "test_setup_fails ERROR" in out and "test_fails FAILED" in out, out
    assert "test_setup_fails_left_nothing PASSED" in out and "test_fails_left_nothing PASSED" in out, out
    assert "ERROR at teardown of test_leaves_one_running" in out, out
    assert "still alive at the end of the session" in out and "leaky: pids" in out, out
    assert "setup-fails:" not in out and "test-fails:" not in out, out  # those were gone before the end
    pids = [int(p) for line in pids_file.read_text().splitlines() for p in line.split()[1:]]
    assert len(pids) == 6, pids_file.read_text()
    assert_gone(pids)
