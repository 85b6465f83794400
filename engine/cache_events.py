"""The prefix index feed of one KV tier: the block hashes stored and dropped since the consumer
last took them, in order. Nothing is recorded until ``restart`` (a snapshot) is called, and at
most ``max_events`` are kept: past that the buffer is marked lost and the consumer resynchronises
from a new snapshot. Only ``take`` and ``restart`` clear the buffer and the mark. Owned by the
tier whose hashes it records (the device block pool, the host tier)."""
from __future__ import annotations

Event = tuple[bool, int]  # (stored?, block hash)
DEFAULT_MAX_EVENTS = 65536


class CacheEvents:
    def __init__(self) -> None:
        self._events: list[Event] | None = None  # None: not recording
        self._max_events = 0
        self._lost = False

    @property
    def is_recording(self) -> bool:
        return self._events is not None

    def restart(self, max_events: int | None = None) -> None:
        """Record from now on (again): what was buffered and the lost mark are dropped.
        ``max_events``: the bound (None: the one set before, else 65,536)."""
        if max_events is None:
            max_events = self._max_events or DEFAULT_MAX_EVENTS
        if max_events < 1:
            raise ValueError("max_events must be at least 1")
        self._events, self._max_events, self._lost = [], max_events, False

    def record(self, stored: bool, block_hash: int) -> None:
        if self._events is None:
            return
        if len(self._events) >= self._max_events:
            self._events.clear()
            self._lost = True
        self._events.append((stored, block_hash))

    def take(self) -> tuple[list[Event], bool]:
        """(the events in order since the last take or restart, lost): lost when the buffer
        overflowed meanwhile (the events are only the latest). Empty while not recording."""
        if self._events is None:
            return [], False
        events, self._events = self._events, []
        lost, self._lost = self._lost, False
        return events, lost
