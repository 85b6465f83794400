"""Build and load pdserve's own C++ CPU extensions (``kernels/cpu/*.cpp``) with
``torch.utils.cpp_extension.load``, shared by ``kernels/cpu_attention.py`` and ``kernels/cpu_gemm.py``.

``load_extension(name, sources, timeout, what=..., timeout_env=...)`` builds into torch's
extension cache (``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``) under ``name``
(each caller names it after the torch version and a hash of where its source and that torch
are, so two checkouts or environments never rebuild over each other); later processes load the
cached library after ninja's up-to-date check (a changed source rebuilds). It returns
``(module, None)`` or ``(None, reason)``: no C++ compiler (``$CXX``, else ``c++``), no ninja, a
failed build, or a build or load that has not ended within ``timeout`` seconds.

torch serializes builds with a lock file in the build folder and waits for it without bound; a
build killed midway leaves it behind. pdserve's processes build or load one at a time (an
``flock`` beside it, dropped by the kernel when its holder dies), and the one holding it removes
torch's lock file when no live process has it open (older than ``STALE_LOCK_AGE_S`` where /proc
cannot tell), with a log line.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from typing import Any, Sequence

try:
    import fcntl
except ImportError:  # not on POSIX: no build lock of our own, no stale-lock check
    fcntl = None  # type: ignore[assignment]

import torch

DEFAULT_BUILD_TIMEOUT_S = 900.0  # a build takes about half a minute on two busy cores

logger = logging.getLogger(__name__)

STALE_LOCK_AGE_S = 600.0  # where no /proc shows who holds torch's lock: older than this is stale
# Built for the machine that runs them: the vector loops take the CPU's own width (AVX-512, AVX2,
# or narrower), so a build is named after the CPU's feature flags too (``build_name``).
DEFAULT_CFLAGS = ("-O3", "-fopenmp", "-march=native")


def cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them (the machine's name for its processor
    where there is no /proc)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return os.uname().machine


def build_name(prefix: str, sources: Sequence[str], cflags: Sequence[str]) -> str:
    """The extension's name in torch's cache: ``prefix``, the torch version and a hash of the
    sources' paths, that torch's folder, this CPU's flags and the compiler flags. Two checkouts or
    environments never rebuild over each other (ninja's build file records the paths), and a
    cache shared by machines of other CPUs keeps a build for each."""
    key = "\0".join([*sources, os.path.dirname(torch.__file__), cpu_flags(), " ".join(cflags)])
    return (prefix + "_torch_" + "".join(c if c.isalnum() else "_" for c in torch.__version__) + "_"
            + hashlib.sha256(key.encode()).hexdigest()[:12])


def _on_path(program: str) -> bool:
    if os.path.isabs(program):
        return os.access(program, os.X_OK)
    return any(os.access(os.path.join(d, program), os.X_OK) for d in os.get_exec_path())


def load_extension(name: str, sources: Sequence[str], timeout: float, *, what: str, timeout_env: str,
                   extra_cflags: Sequence[str] = DEFAULT_CFLAGS) -> tuple[Any, str | None]:
    """Build (or find) and load the extension; ``what`` names it in log lines ("compiled CPU
    attention"), ``timeout_env`` is the variable that sets ``timeout`` (named in reasons)."""
    compiler = os.environ.get("CXX", "c++")
    if not _on_path(compiler.split()[0]):
        return None, f"no C++ compiler: {compiler!r} is not on PATH"
    # torch runs `ninja` from PATH; pip's ninja (the Makefile installs it where the
    # system has none) sits in the environment's bin folder, which is not on PATH
    # when the environment's python is run directly.
    env_bin = os.path.normpath(os.path.join(os.path.dirname(torch.__file__), *[os.pardir] * 4, "bin"))
    if not _on_path("ninja") and _on_path(os.path.join(env_bin, "ninja")):
        os.environ["PATH"] = env_bin + os.pathsep + os.environ.get("PATH", "")
    if not _on_path("ninja"):
        return None, "ninja is not on PATH (pip install ninja)"
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    try:  # torch's own folder for the name (and the place of its lock file)
        build_dir = cpp_extension._get_build_directory(name, verbose=False)
    except Exception:  # a torch without it: torch picks the folder, no stale-lock check
        build_dir = None
    serial = _BuildLock(build_dir, what)
    if not serial.acquire(t0 + timeout):
        return None, (f"another process has been building or loading it for over {timeout:g} s "
                      f"({serial.path}; ${timeout_env} sets the limit)")
    outcome: dict = {}

    def build() -> None:
        try:
            _remove_stale_lock(build_dir, what)
            outcome["module"] = cpp_extension.load(name=name, sources=list(sources), extra_cflags=list(extra_cflags),
                                                   extra_ldflags=["-fopenmp"], build_directory=build_dir,
                                                   verbose=False)
        except BaseException as e:
            outcome["error"] = e
        finally:
            serial.release()  # with the build, not when we stop waiting: no second build beside it

    # In a thread of its own, so that a wait the stale-lock check cannot end (a lock held by a
    # live process outside pdserve's builds, a hung compiler) has a bound: past it the
    # references run; the thread goes on to its end in the background, its result unused.
    worker = threading.Thread(target=build, name=f"{name[:40]}-build", daemon=True)
    worker.start()
    worker.join(max(0.0, t0 + timeout - time.perf_counter()))
    if worker.is_alive():
        lock = os.path.join(build_dir, "lock") if build_dir else "torch's build lock"
        held = ""
        if build_dir and os.path.exists(lock):
            pids = _processes_holding(lock)
            held = f", waiting on {lock}" + (f" (held open by pid {', '.join(map(str, pids))})" if pids else "")
        return None, f"the build or load did not end within {timeout:g} s{held} (${timeout_env} sets the limit)"
    e = outcome.get("error")
    if e is not None:  # a failed build or load: the compiler's output is in the message
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        first_error = next((ln for ln in lines if ": error:" in ln or ln.startswith("error")), lines[-1])
        return None, f"the build failed: {first_error[:300]}"
    logger.debug("%s loaded in %.1f s", what, time.perf_counter() - t0)
    return outcome["module"], None


class _BuildLock:
    """pdserve's processes build or load the extension one at a time: an ``flock`` on a file
    beside torch's lock, which the kernel drops when its holder dies however it dies. Held,
    a torch lock file that no live process has open is one a killed build left."""

    def __init__(self, build_dir: str | None, what: str) -> None:
        self.what = what
        self.path = os.path.join(build_dir, "pdserve-build.lock") if build_dir else None
        self._fd: int | None = None

    def acquire(self, deadline: float) -> bool:
        """Wait for it until ``deadline`` (time.perf_counter()); True once held (or where
        there is nothing to hold: no folder, no fcntl)."""
        if self.path is None or fcntl is None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # a folder we cannot write: torch's build fails there with its own message
            return True
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return True
            except OSError:
                pass
            if time.perf_counter() >= deadline:
                os.close(fd)
                return False
            if not said:
                logger.info("%s: another process builds or loads it; waiting (%s)", self.what, self.path)
                said = True
            time.sleep(0.1)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


def _remove_stale_lock(build_dir: str | None, what: str) -> None:
    """Remove torch's lock file when a build that no longer runs left it (torch would wait for
    it forever). Called holding ``_BuildLock``, so no pdserve build is under way: the lock is
    stale unless a live process holds it open (torch keeps it open while it builds); where
    that cannot be seen (no /proc), unless it is younger than ``STALE_LOCK_AGE_S``."""
    if build_dir is None or fcntl is None:
        return
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return
    holders = _processes_holding(lock)
    if holders or (holders is None and age < STALE_LOCK_AGE_S):
        return
    try:
        os.remove(lock)
    except FileNotFoundError:
        return
    logger.warning("%s: removed the stale build lock %s (%.0f s old, no process holds it: a "
                   "build was killed)", what, lock, age)


def _processes_holding(path: str) -> list[int] | None:
    """Pids of the processes with ``path`` open (those /proc lets us see); None without /proc."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.path.realpath(path)
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") == target:
                    pids.append(int(entry))
                    break
            except OSError:
                continue
    return pids


def prebuild_main(what: str, build: Any, unavailable_reason: Any) -> None:
    """``python -m kernels.<module>``: build (or find) one extension ahead of use, with
    ``--build-timeout``, and say in one line whether it is ready (``build(timeout)`` returns
    the module or None, ``unavailable_reason()`` says why None)."""
    import argparse

    cli = argparse.ArgumentParser(description=f"build the {what} ahead of use")
    cli.add_argument("--build-timeout", type=float, default=DEFAULT_BUILD_TIMEOUT_S,
                     help=f"seconds to wait for the build (and torch's build lock) before giving up "
                          f"(default {DEFAULT_BUILD_TIMEOUT_S:g})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    ready = build(cli.parse_args().build_timeout) is not None
    print(f"{what}: ready ({time.perf_counter() - t0:.1f} s)" if ready
          else f"{what}: not built ({unavailable_reason()}); the PyTorch reference serves")
