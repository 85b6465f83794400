"""LoRA adapters across the cluster, as the gateway sees them, and their load
and unload on every engine server.

The engine servers are the only source: each lists the adapters it serves in
its polled ``LoadInfo`` (``Instance.lora_adapter``). An adapter is *known*
when any routable server lists it; its name is then a model a request can
ask for (``known_adapters``; ``InputProcessor.check_model``) and an entry of
/v1/models. Routing on it is ``router.py``'s business.

Load and unload (``LoRAAdmin``) go to every routable prefill and decode
server at once, each call bounded by a timeout; each server's answer
changes its listing at once (``Instance.note_lora_change``), so the next
request sees the change without waiting for a poll, and the servers' LoadInfo
is polled again right after for the rest (slots). The answer is one ``ServerResult`` per server.
All ok: the results. Otherwise a ``GatewayError`` whose message names each
failing server and its reason (and the servers where it did succeed, since
the change stands there), its kind from the failures, the first of::

    server's gRPC status                                 kind (HTTP)
    INVALID_ARGUMENT, FAILED_PRECONDITION (no            INVALID_ARGUMENT (400)
      --enable-lora), ALREADY_EXISTS, OUT_OF_RANGE
    NOT_FOUND (unload of a name it does not hold)        NOT_FOUND (404)
    RESOURCE_EXHAUSTED                                   RESOURCE_EXHAUSTED (429)
    DEADLINE_EXCEEDED (the timeout)                      DEADLINE_EXCEEDED (504)
    anything else (unreachable, UNIMPLEMENTED, ...)      UNAVAILABLE (503)

No server known at all is UNAVAILABLE (503, code ``no_engine_server``).
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from engine.sampling_params import check_unicode
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.instances import Instance, InstanceRegistry
from pdserve.v1 import common_pb2

LORA_RPC_TIMEOUT_S = 60.0  # reading an adapter from disk and checking it; far above the usual second
MAX_LORA_NAME_CHARS = 256

# A failing server's status -> the kind of the whole answer; the first kind present wins.
_KIND_OF_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.DEADLINE_EXCEEDED,
}
_KIND_ORDER = (ErrorKind.INVALID_ARGUMENT, ErrorKind.NOT_FOUND, ErrorKind.RESOURCE_EXHAUSTED,
               ErrorKind.DEADLINE_EXCEEDED, ErrorKind.UNAVAILABLE)


def known_adapters(instances: Iterable[Instance]) -> dict[str, common_pb2.LoRAAdapter]:
    """Every adapter some server in ``instances`` lists, by name (the first
    listing of a name stands for it: pass decode servers first)."""
    out: dict[str, common_pb2.LoRAAdapter] = {}
    for inst in instances:
        if inst.load is not None:
            for adapter in inst.load.lora_adapters:
                out.setdefault(adapter.name, adapter)
    return out


def is_adapter_refusal(code: grpc.StatusCode, details: str | None) -> bool:
    """An engine server refused a request because of its adapter (it no longer
    holds it, or holds another copy): worth another server, unlike a request that
    is invalid everywhere. Told apart by the message, which names the adapter."""
    text = (details or "").lower()
    return (code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                     grpc.StatusCode.NOT_FOUND) and ("lora" in text or "adapter" in text))


@dataclass(frozen=True)
class ServerResult:
    """One engine server's answer to a load or unload."""

    address: str
    role: str  # "prefill" | "decode"
    ok: bool
    error: str = ""  # why not, when not ok
    status: grpc.StatusCode | None = None  # the server's status when not ok (None: no answer at all)

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "role": self.role, "ok": self.ok, "error": self.error}


class LoRAAdmin:
    """Loads and unloads adapters on every routable server of a registry."""

    def __init__(self, registry: InstanceRegistry, served_model_name: str,
                 timeout: float = LORA_RPC_TIMEOUT_S) -> None:
        self._registry = registry
        self._served_model_name = served_model_name
        self.timeout = timeout

    async def load(self, lora_name: str, lora_path: str, timeout: float | None = None) -> list[ServerResult]:
        """``LoadLoRAAdapter`` on every server; raises GatewayError unless all succeed."""
        self._check_name(lora_name)
        if not isinstance(lora_path, str) or not lora_path.strip():
            raise invalid("lora_path must be a non-empty string: the adapter's directory on the engine servers",
                          param="lora_path")
        _check_text(lora_path, "lora_path")
        request = common_pb2.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        return await self._fan_out("load", lora_name, "LoadLoRAAdapter", request, timeout)

    async def unload(self, lora_name: str, timeout: float | None = None) -> list[ServerResult]:
        """``UnloadLoRAAdapter`` on every server; raises GatewayError unless all succeed."""
        self._check_name(lora_name)
        request = common_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name)
        return await self._fan_out("unload", lora_name, "UnloadLoRAAdapter", request, timeout)

    def _check_name(self, lora_name: Any) -> None:
        if not isinstance(lora_name, str) or not lora_name.strip():
            raise invalid("lora_name must be a non-empty string", param="lora_name")
        if len(lora_name) > MAX_LORA_NAME_CHARS:
            raise invalid(f"lora_name is longer than {MAX_LORA_NAME_CHARS} characters", param="lora_name")
        _check_text(lora_name, "lora_name")
        if lora_name == self._served_model_name:
            raise invalid(f"lora_name `{lora_name}` is the served model's name; give the adapter another name",
                          param="lora_name")

    async def _fan_out(self, action: str, lora_name: str, method: str, request: Any,
                       timeout: float | None) -> list[ServerResult]:
        instances = list(self._registry)
        if not instances:
            raise GatewayError(ErrorKind.UNAVAILABLE, f"cannot {action} LoRA adapter `{lora_name}`: the gateway "
                               "knows no engine server yet", code="no_engine_server")
        bound = self.timeout if timeout is None else min(timeout, self.timeout)
        results = list(await asyncio.gather(*(_call(i, method, request, bound) for i in instances)))
        await self._registry.poll_once(instances)  # the next request sees the change
        error = outcome_error(action, lora_name, results)
        if error is not None:
            raise error
        return results


async def _call(inst: Instance, method: str, request: Any, timeout: float) -> ServerResult:
    try:
        answer = await getattr(inst.stub, method)(request, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        return ServerResult(inst.address, inst.role, False, f"{e.code().name}: {e.details()}", e.code())
    except Exception as e:  # a closed channel (the server was removed meanwhile), ...
        return ServerResult(inst.address, inst.role, False, f"{type(e).__name__}: {e}")
    if isinstance(answer, common_pb2.LoRAAdapter):
        inst.note_lora_change(loaded=answer)
    else:
        inst.note_lora_change(unloaded=request.lora_name)
    return ServerResult(inst.address, inst.role, True)


def outcome_error(action: str, lora_name: str, results: Sequence[ServerResult]) -> GatewayError | None:
    """None when every server succeeded, else the error the client gets (module docstring)."""
    failed = [r for r in results if not r.ok]
    if not failed:
        return None
    kinds = {_KIND_OF_STATUS.get(r.status, ErrorKind.UNAVAILABLE) if r.status is not None
             else ErrorKind.UNAVAILABLE for r in failed}
    kind = next(k for k in _KIND_ORDER if k in kinds)
    reasons = "; ".join(f"{r.role} server {r.address}: {r.error}" for r in failed)
    done = [r for r in results if r.ok]
    tail = f" ({action}ed on {', '.join(r.address for r in done)})" if done else ""
    code = "lora_adapter_not_found" if kind is ErrorKind.NOT_FOUND else f"lora_{action}_failed"
    return GatewayError(kind, f"cannot {action} LoRA adapter `{lora_name}` on {len(failed)} of {len(results)} "
                        f"engine server(s): {reasons}{tail}", code=code)


def _check_text(text: str, field_name: str) -> None:
    try:
        check_unicode(text, field_name)
    except ValueError as e:
        raise invalid(str(e), param=field_name) from e
