"""The local traces file: finished spans as JSON lines, shared by every
process of a ``pdserve up`` cluster, read back by ``pdserve trace``.

One line per span::

    {"trace_id": "<32 hex>", "span_id": "<16 hex>", "parent_id": "<16 hex>" | null,
     "name": "...", "kind": "SERVER" | "CLIENT" | "INTERNAL" | ...,
     "service": "pdserve-gateway", "start_ns": 1700000000123456789, "end_ns": ...,
     "status": "UNSET" | "OK" | "ERROR", "status_message": "..." (only when set),
     "attributes": {...}, "events": [{"name": "...", "time_ns": ..., "attributes": {...}}]}

Several processes append to the same file. Each export batch is one
``os.write`` on an ``O_APPEND`` descriptor, so lines of different processes
never interleave. The file is bounded: a writer that finds it past
``max_bytes`` renames it to ``<path>.1`` (replacing the previous one) and
starts a new one; the other writers notice the new inode on their next
batch and reopen. ``read_spans`` reads ``<path>.1`` then ``<path>``.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as its traces-file record."""
    ctx = span.context
    parent = span.parent
    out: dict[str, Any] = {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name", "") if span.resource else "",
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": _plain(span.attributes),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": _plain(e.attributes)}
                   for e in span.events],
    }
    if span.status.description:
        out["status_message"] = span.status.description
    return out


def _plain(attributes: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


class JsonlSpanExporter(SpanExporter):
    """Appends spans to ``path`` (see the module docstring for the format)."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()

    def _open(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _is_current(self) -> bool:
        """False when another writer rotated (or someone removed) the file."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self._fd).st_ino  # type: ignore[arg-type]
        except FileNotFoundError:
            return False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        blob = "".join(json.dumps(span_to_dict(s), separators=(",", ":"), default=str) + "\n"
                       for s in spans).encode()
        try:
            with self._lock:
                if self._fd is None:
                    return SpanExportResult.FAILURE
                if not self._is_current():
                    self._open()
                elif os.fstat(self._fd).st_size + len(blob) > self.max_bytes:
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                    self._open()
                view = memoryview(blob)
                while view:
                    view = view[os.write(self._fd, view):]
        except OSError as e:
            logger.warning("cannot write spans to %s: %s", self.path, e)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is written through


def read_spans(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every span record of the traces file (its rotated part first). A line
    that does not parse (one being written right now) is skipped."""
    path = Path(path)
    for part in (path.with_name(path.name + ".1"), path):
        try:
            f = part.open("rb")
        except FileNotFoundError:
            continue
        with f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "span_id" in record:
                    yield record
