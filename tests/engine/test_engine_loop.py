"""EngineLoop: commands run in the engine thread between steps, steps run
while there is work, and a failing step fails every waiting caller instead
of hanging them."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import pytest

from engine.engine_loop import EngineLoop
from engine.llm_engine import StepOutput


class _StepCounter:
    """A minimal stand-in with the methods EngineLoop calls (and what the server's
    watchdog reads)."""

    def __init__(self, steps: int, fail_at: int | None = None) -> None:
        self.left, self.fail_at, self.done = steps, fail_at, 0
        self.threads: set[str] = set()
        self.workers_alive = True  # tensor-parallel workers

    def bind_thread(self) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def step(self) -> StepOutput:
        self.threads.add(threading.current_thread().name)
        if self.fail_at is not None and self.done == self.fail_at:
            raise RuntimeError("step broke")
        self.left -= 1
        self.done += 1
        return StepOutput(updated=[self.done], num_batched_tokens=1)  # type: ignore[list-item]


def test_commands_and_steps_run_in_the_engine_thread():
    eng = _StepCounter(steps=0)
    seen: list = []
    loop = EngineLoop(eng, lambda out: seen.extend(out.updated))  # type: ignore[arg-type]
    loop.start()
    try:
        assert loop.submit(lambda e: threading.current_thread().name).result(5) == "engine-loop"

        def add_work(e):
            e.left = 3

        loop.submit(add_work).result(5)
        for _ in range(100):
            if loop.submit(lambda e: e.done).result(5) == 3:
                break
        assert seen == [1, 2, 3] and eng.threads == {"engine-loop"}
        with pytest.raises(ZeroDivisionError):  # a failing command fails its caller only
            loop.submit(lambda e: 1 / 0).result(5)
        assert loop.is_alive
    finally:
        loop.stop()


def test_the_test_step_delay_paces_every_forward_pass():
    """An engine server's hidden --test-step-delay: the loop sleeps after each forward pass, so
    that a test finds a tiny model's short stream still running."""
    eng = _StepCounter(steps=0)
    loop = EngineLoop(eng, lambda out: None)  # type: ignore[arg-type]
    loop.step_delay = 0.05
    loop.start()
    try:
        loop.submit(lambda e: setattr(e, "left", 4)).result(5)
        t0 = time.monotonic()
        while loop.submit(lambda e: e.done).result(5) < 4:
            time.sleep(0.005)
        # Sleeps follow steps 1-3 before step 4 runs; step 1 and part of its sleep may precede t0.
        assert time.monotonic() - t0 >= 2 * 0.05
    finally:
        loop.stop()


def test_a_failing_step_fails_callers_and_marks_the_loop_dead():
    eng = _StepCounter(steps=5, fail_at=2)
    loop = EngineLoop(eng, lambda updated: None)  # type: ignore[arg-type]
    loop.start()
    futures.wait([loop._running], 5)
    assert not loop.is_alive and isinstance(loop.error, RuntimeError)
    with pytest.raises(RuntimeError, match="engine loop died"):
        loop.submit(lambda e: None).result(5)


def test_server_watchdog_sees_the_dead_loop():
    import asyncio
    from types import SimpleNamespace

    from rpc.engine_server import _engine_died

    loop = EngineLoop(_StepCounter(steps=1, fail_at=0), lambda updated: None)  # type: ignore[arg-type]
    loop.start()
    service = SimpleNamespace(bridge=SimpleNamespace(loop=loop))
    err = asyncio.run(asyncio.wait_for(_engine_died(service, period=0.01), 5))  # type: ignore[arg-type]
    assert isinstance(err, RuntimeError) and "step broke" in str(err)

    idle = EngineLoop(_StepCounter(steps=0), lambda updated: None)  # type: ignore[arg-type]
    idle.start()
    idle.engine.workers_alive = False  # a tensor-parallel worker died while nothing ran
    service = SimpleNamespace(bridge=SimpleNamespace(loop=idle))
    err = asyncio.run(asyncio.wait_for(_engine_died(service, period=0.01), 5))  # type: ignore[arg-type]
    assert isinstance(err, RuntimeError) and "worker" in str(err)
    idle.stop()
