"""The requests the gateway is serving now: admission (draining, the
``--max-queued-requests`` cap), Abort by request id, and drain on shutdown."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.errors import ErrorKind, GatewayError
from gateway.request_flow import PreparedRequest, RequestFlow


@dataclass(eq=False)
class RequestHandle:
    request: PreparedRequest
    flow: RequestFlow


class ActiveRequests:
    """Owns the set of in-flight requests. Several may share a client-given
    request id; Abort aborts all of them."""

    def __init__(self, max_requests: int | None = None) -> None:
        self._max_requests = max_requests
        self._handles: set[RequestHandle] = set()
        self._empty = asyncio.Event()
        self._empty.set()
        self.is_draining = False

    def __len__(self) -> int:
        return len(self._handles)

    def check_admission(self) -> None:
        """Raise unless a new request may start (not draining, under the cap)."""
        if self.is_draining:
            raise GatewayError(ErrorKind.UNAVAILABLE, "the gateway is shutting down; retry on another gateway",
                               code="shutting_down")
        if self._max_requests is not None and len(self._handles) >= self._max_requests:
            raise GatewayError(ErrorKind.RESOURCE_EXHAUSTED,
                               f"the gateway is serving its maximum of {self._max_requests} requests; retry later",
                               code="server_overloaded")

    def add(self, request: PreparedRequest, flow: RequestFlow) -> RequestHandle:
        self.check_admission()
        handle = RequestHandle(request, flow)
        self._handles.add(handle)
        self._empty.clear()
        return handle

    def remove(self, handle: RequestHandle) -> None:
        self._handles.discard(handle)
        if not self._handles:
            self._empty.set()

    def abort(self, request_id: str) -> bool:
        """Abort every request with this id; False if there was none."""
        found = [h for h in self._handles if h.request.request_id == request_id]
        for h in found:
            h.flow.abort()
        return bool(found)

    def abort_all(self) -> int:
        handles = list(self._handles)
        for h in handles:
            h.flow.abort()
        return len(handles)

    def start_draining(self) -> None:
        """From now on new requests are refused with UNAVAILABLE."""
        self.is_draining = True

    async def wait_empty(self) -> None:
        await self._empty.wait()
