"""Runs an ``LLMEngine`` in a dedicated thread.

The engine (scheduler, block pool, model runner) is single-threaded by
design; servers run it here and talk to it only through ``submit``: a
function executed in the engine thread between two steps. After every step
that changed something the loop calls ``on_step(step_output)`` in the
engine thread; servers use it to snapshot deltas and hand them to their
event loop.

    while running:
        run queued commands (wait up to IDLE_WAIT_S for one if the last step did nothing;
        background work that ends, such as a grammar compile, queues an empty one)
        if the engine has requests: out = engine.step(); on_step(out) unless empty

The wait bounds how late a deadline is noticed while nothing else happens.

The command queue is bounded for new work: ``submit(fn, bounded=True)`` (what
servers use for admission and other awaited calls) fails with OverflowError
once ``max_pending`` commands wait; fire-and-forget commands (aborts,
releases, transfer outcomes) are always taken, so a request is never
stranded by a full queue. The queue only grows while a step is slow and
every command queued meanwhile runs before the next step.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from engine.llm_engine import LLMEngine, StepOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.1
MAX_PENDING_COMMANDS = 4096


class EngineThread:
    """One thread for an engine's whole life: it can build the engine (``submit``) and then runs
    its loop (``EngineLoop(..., thread=)``). A server builds its engine here because the
    tensor-parallel workers die with the thread that started them (``PR_SET_PDEATHSIG`` follows
    the parent thread, not the process) and because this thread's OpenMP team is to be the
    process's only one (engine/cpu_threads.py). Not a one-worker ThreadPoolExecutor: its worker
    is joined at interpreter exit, where an engine loop still running would hold the exit; this
    thread is a daemon."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        """Run ``fn()`` on this thread after what was submitted before; the future holds its result."""
        fut: Future = Future()

        def job() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    fut.set_exception(exc)

        self._jobs.put(job)
        return fut

    def close(self) -> None:
        """End the thread once what was submitted has run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[StepOutput], None],
                 max_pending: int = MAX_PENDING_COMMANDS, thread: EngineThread | None = None) -> None:
        """``thread``: the engine's thread (the one that built it), else a thread of its own."""
        self.engine = engine
        self.on_step = on_step
        self.max_pending = max_pending
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._own_thread = thread is None
        self._thread = EngineThread() if thread is None else thread
        self._running: Future | None = None
        self.error: BaseException | None = None
        self.step_delay = 0.0  # tests only (a server's hidden --test-step-delay): seconds slept after each forward pass
        # Background work that ends (a grammar compiled) wakes an idle wait at once.
        engine.on_background_done = lambda: self.submit(lambda e: None)

    def start(self) -> None:
        self._running = self._thread.submit(self._run)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._commands.put((lambda e: None, Future()))  # wake the thread
        if self._running is not None:
            futures.wait([self._running], timeout)
        if self._own_thread:
            self._thread.close()

    @property
    def is_alive(self) -> bool:
        return self._running is not None and not self._running.done() and self.error is None

    def submit(self, fn: Callable[[LLMEngine], T], bounded: bool = False) -> "Future[T]":
        """Run ``fn(engine)`` in the engine thread; the future holds its result.
        ``bounded``: fail with OverflowError instead when the queue is full."""
        fut: Future = Future()
        if self.error is not None:
            fut.set_exception(RuntimeError(f"engine loop died: {self.error!r}"))
            return fut
        if bounded and self._commands.qsize() >= self.max_pending:
            fut.set_exception(OverflowError(f"the engine's command queue is full ({self.max_pending} "
                                            "commands waiting); retry later"))
            return fut
        self._commands.put((fn, fut))
        return fut

    def _run_commands(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # reported to the caller, the loop goes on
                    fut.set_exception(exc)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            self.engine.bind_thread()
            idle = True
            while not self._stopped.is_set():
                self._run_commands(block=idle)
                idle = True
                if self.engine.has_unfinished_requests():
                    out = self.engine.step()
                    idle = not out.did_work
                    if not out.is_empty:
                        self.on_step(out)
                    if self.step_delay and out.num_batched_tokens:
                        time.sleep(self.step_delay)
        except BaseException as exc:  # a broken step: fail every caller, never hang them
            logger.exception("engine loop failed")
            self.error = exc
            while True:
                try:
                    _, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError(f"engine loop died: {exc!r}"))
