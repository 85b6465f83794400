"""The one error type the gateway raises, and how it maps onto HTTP (OpenAI
shapes) and gRPC status codes.

Every failure a client can see is a ``GatewayError`` with a kind and a clear
message. The HTTP layer turns it into ``{"error": {"message", "type",
"param", "code"}}``: ``type`` is OpenAI's error type, ``code`` a short
machine-readable string (e.g. ``"context_length_exceeded"``) or null. A 429
carries ``Retry-After``; gRPC gets RESOURCE_EXHAUSTED for both 413 and 429.
"""
from __future__ import annotations

import enum
from typing import Any

import grpc


class ErrorKind(enum.Enum):
    """(HTTP status, gRPC status, OpenAI error type) of each kind of failure."""

    INVALID_ARGUMENT = (400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error")
    UNAUTHENTICATED = (401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error")
    NOT_FOUND = (404, grpc.StatusCode.NOT_FOUND, "invalid_request_error")
    PAYLOAD_TOO_LARGE = (413, grpc.StatusCode.RESOURCE_EXHAUSTED, "invalid_request_error")
    RESOURCE_EXHAUSTED = (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error")
    INTERNAL = (500, grpc.StatusCode.INTERNAL, "internal_error")
    UNAVAILABLE = (503, grpc.StatusCode.UNAVAILABLE, "service_unavailable_error")
    DEADLINE_EXCEEDED = (504, grpc.StatusCode.DEADLINE_EXCEEDED, "timeout_error")

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]

    @property
    def retry_after(self) -> int | None:
        """Seconds for HTTP's ``Retry-After``: a full queue or cap clears soon."""
        return RETRY_AFTER_S if self is ErrorKind.RESOURCE_EXHAUSTED else None


RETRY_AFTER_S = 1


class GatewayError(Exception):
    """A failure with a user-facing message; ``code`` is OpenAI's ``error.code``."""

    def __init__(self, kind: ErrorKind, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code
        self.param = param

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": _printable(self.message), "type": self.kind.openai_type,
                          "param": self.param, "code": self.code}}

    def http_headers(self) -> dict[str, str] | None:
        """Extra HTTP headers of this error's response (``Retry-After`` on 429)."""
        after = self.kind.retry_after
        return {"Retry-After": str(after)} if after is not None else None

    def __repr__(self) -> str:
        return f"GatewayError({self.kind.name}, {self.message!r}, code={self.code!r})"


def invalid(message: str, code: str | None = None, param: str | None = None) -> GatewayError:
    """Shorthand for a 400 / INVALID_ARGUMENT error."""
    return GatewayError(ErrorKind.INVALID_ARGUMENT, message, code=code, param=param)


def _printable(text: str, limit: int = 2000) -> str:
    """``text`` cut to ``limit`` characters and safe to encode as UTF-8 (a
    message may quote client input, e.g. a model name with a lone surrogate)."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
