"""Runs an ``LLMEngine`` in a dedicated thread.

The engine (scheduler, block pool, model runner) is single-threaded by
design; servers run it here and talk to it only through ``submit``: a
function executed in the engine thread between two steps. After every step
the loop calls ``on_step(updated_requests)`` in the engine thread; servers
use it to snapshot deltas and hand them to their event loop.

    while running:
        run queued commands (block while idle)
        if work: updated = engine.step(); on_step(updated)
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from engine.llm_engine import LLMEngine
from engine.request import Request

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[Request]], None],
                 idle_hook: Callable[[], bool] | None = None) -> None:
        """``idle_hook`` runs in the engine thread after commands and steps;
        return True if it did work (the loop then does not block)."""
        self.engine = engine
        self.on_step = on_step
        self.idle_hook = idle_hook
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._commands.put((lambda e: None, Future()))  # wake the thread
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, fn: Callable[[LLMEngine], T]) -> "Future[T]":
        """Run ``fn(engine)`` in the engine thread; the future holds its result."""
        fut: Future = Future()
        if self.error is not None:
            fut.set_exception(RuntimeError(f"engine loop died: {self.error!r}"))
            return fut
        self._commands.put((fn, fut))
        return fut

    def _run_commands(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
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
            while not self._stopped.is_set():
                busy = self.engine.has_unfinished_requests()
                self._run_commands(block=not busy)
                if self.engine.has_unfinished_requests():
                    self.on_step(self.engine.step())
                if self.idle_hook is not None:
                    self.idle_hook()
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
