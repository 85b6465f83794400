"""What prefill and decode servers share: flags, logging, engine start-up,
and the serve-until-signal lifecycle (health NOT_SERVING while loading and
draining, SERVING in between)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import Any, Callable, Protocol, TypeVar

import grpc

from engine.config import EngineArgs
from engine.runtime_config import log_level
from engine.cpu_threads import serial_thread
from engine.engine_loop import EngineThread
from engine.llm_engine import LLMEngine
from engine.lora.adapter import LoRAError, LoRAMismatch, LoRANotLoaded
from engine.request import RequestError
from pdserve.v1 import common_pb2, engine_pb2_grpc
from rpc.convert import lora_to_proto
from rpc.cache_feed import CacheEventFeed, CacheEventsServicer
from rpc.engine_bridge import EngineBridge
from rpc.prefix_index import RedisIndexPublisher
from rpc.engine_metrics import EngineMetrics, MetricsEndpoint
from rpc import ports, tls, tracing
from rpc.server import RpcServer

logger = logging.getLogger(__name__)
T = TypeVar("T")


def configure_logging(name: str) -> None:
    logging.basicConfig(level=log_level(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    g.add_argument("--port", type=int, default=default_port, help="gRPC port")
    g.add_argument("--advertise-host", default=None,
                   help="host other servers use to reach this one (default: --host, or the hostname "
                        "when binding 0.0.0.0)")
    g.add_argument("--metrics-port", type=int, default=-1,
                   help="Prometheus /metrics port (default: gRPC port + 1000; 0 disables)")
    g.add_argument("--redis-url", default=None,
                   help="publish this server's prefix-cache blocks to the cluster's prefix index in Redis, "
                        "e.g. redis://127.0.0.1:6379/0 (without it the gateway follows them over gRPC)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish on SIGTERM")
    # Tests only, and hidden: the forward pass fails after N passes (engine/model_runner.py).
    # A flag, not an environment variable, so that nothing inherited can turn it on.
    g.add_argument("--inject-forward-fault", type=int, default=None, metavar="N", help=argparse.SUPPRESS)
    # Tests only, and hidden: steps take the CUDA-graph path run eagerly (engine/runtime_config.py).
    g.add_argument("--graphs-without-capture", action="store_true", help=argparse.SUPPRESS)
    # Tests only, and hidden: the engine thread sleeps this long after every forward pass, so
    # that a test can act while a short stream on a tiny model is still running (engine/engine_loop.py).
    g.add_argument("--test-step-delay", type=float, default=0.0, metavar="SECONDS", help=argparse.SUPPRESS)
    tls.add_cli_args(parser)
    tracing.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_host:
        return args.advertise_host
    if args.host in ("0.0.0.0", "::", ""):
        import socket

        return socket.gethostname()
    return args.host


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as a time.monotonic() instant (None: no deadline)."""
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


# A constraint that does not compile is the caller's error; one no token meets (a request
# finished with finish_reason "error") reaches a caller that cannot stream the finish as a
# failed precondition: the prefill tier's Prefill call.
_ERROR_CODES = {"deadline": grpc.StatusCode.DEADLINE_EXCEEDED, "kv_transfer": grpc.StatusCode.ABORTED,
                "invalid_constraint": grpc.StatusCode.INVALID_ARGUMENT,
                "constraint": grpc.StatusCode.FAILED_PRECONDITION, "lora": grpc.StatusCode.FAILED_PRECONDITION}


def admission_status(exc: Exception) -> grpc.StatusCode:
    """The status of a request the engine refused to admit."""
    if isinstance(exc, OverflowError):  # the waiting queue (or the engine's command queue) is full
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, LoRANotLoaded):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, LoRAMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT


def error_status(error: RequestError) -> tuple[grpc.StatusCode, str]:
    """How a request the engine ended by a failure is reported to the caller."""
    return _ERROR_CODES.get(error.kind, grpc.StatusCode.INTERNAL), error.message


class EngineServicerBase:
    """What both tiers' servicers share: the bridge once attached, the
    loading/draining gate, and drain = wait for open streams."""

    role = "engine"

    def __init__(self) -> None:
        self.bridge: EngineBridge | None = None
        self.engine_thread: EngineThread | None = None  # serve_engine's: built the engine, runs its loop
        self.draining = False

    async def _ready(self, context: grpc.aio.ServicerContext) -> EngineBridge:
        if self.bridge is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.role} server is loading")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.role} server is draining")
        return self.bridge  # type: ignore[return-value]

    async def drain(self) -> None:
        self.draining = True
        while self.bridge is not None and self.bridge.num_streams:
            await asyncio.sleep(0.05)

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.stop()

    # ---- LoRA adapters (both tiers) ----------------------------------------
    async def LoadLoRAAdapter(self, request: common_pb2.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.LoRAAdapter:
        """Read, check and serve an adapter; the files are read off the engine loop."""
        lora = await self._lora(context)
        if not request.lora_name or not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoadLoRAAdapter needs lora_name and lora_path")
        try:
            info = await asyncio.get_running_loop().run_in_executor(None, _serially, lora.register,
                                                                    request.lora_name, request.lora_path)
        except LoRAError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return lora_to_proto(info, info.name in lora.held())

    async def UnloadLoRAAdapter(self, request: common_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.UnloadLoRAAdapterResponse:
        """New requests can no longer name it; running ones finish under it."""
        lora = await self._lora(context)
        try:
            lora.unregister(request.lora_name)
        except LoRAError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return common_pb2.UnloadLoRAAdapterResponse()

    async def _lora(self, context: grpc.aio.ServicerContext):
        lora = (await self._ready(context)).engine.lora
        if lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this {self.role} server was not started with --enable-lora")
        return lora


class EngineService(Protocol):
    """What a tier plugs into the shared lifecycle."""

    name: str  # full gRPC service name, e.g. pdserve.v1.Decode

    engine_thread: EngineThread | None  # set before attach: the thread that built the engine runs its loop

    def register(self, server: grpc.aio.Server) -> None: ...  # before the server starts
    def attach(self, engine: LLMEngine, address: str, metrics: EngineMetrics) -> None: ...  # once loaded
    async def drain(self) -> None: ...
    def close(self) -> None: ...


async def serve_engine(args: argparse.Namespace, role: str, service: EngineService) -> int:
    """Bind, load the engine (health NOT_SERVING meanwhile), attach it to the
    tier's service, serve until SIGTERM/SIGINT, drain, stop."""
    address = f"{advertise_host(args)}:{args.port}"
    tls.configure(args)
    tracing.init_tracing(f"pdserve-{role}", otlp_endpoint=getattr(args, "otlp_traces_endpoint", None),
                         traces_file=getattr(args, "traces_file", None))
    cache_events = CacheEventsServicer()
    try:  # both ports first, before anything slow: a port in use fails the start at once
        rpc = RpcServer(ports.join(args.host, args.port), [service.name, cache_events.name], port_flag="--port")
        endpoint = _metrics_endpoint(args, rpc.port)
    except ports.PortUnavailable as exc:
        print(f"pdserve {role}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    service.register(rpc.server)
    engine_pb2_grpc.add_CacheEventsServicer_to_server(cache_events, rpc.server)
    rpc.install_signal_handlers()
    await rpc.start()  # health answers NOT_SERVING while the model loads
    t0 = time.time()
    if args.inject_forward_fault is not None:
        from engine.model_runner import arm_forward_fault

        arm_forward_fault(args.inject_forward_fault)
    try:
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.prefill_only = role == "prefill"
        service.engine_thread = EngineThread()
        engine = await asyncio.wrap_future(service.engine_thread.submit(
            lambda: LLMEngine.from_engine_args(engine_args)))
    except BaseException:  # a bad flag or a failed load: stop the server inside its loop, then report
        if service.engine_thread is not None:
            service.engine_thread.close()
        await rpc.server.stop(grace=None)
        if endpoint is not None:
            endpoint.close()
        raise
    metrics = EngineMetrics(engine, role)
    if endpoint is not None:
        logger.info("metrics on %s", endpoint.attach(metrics))
    service.attach(engine, address, metrics)
    service.bridge.loop.step_delay = getattr(args, "test_step_delay", 0.0)  # type: ignore[attr-defined]
    publisher = _start_cache_feed(service, cache_events, engine, address, getattr(args, "redis_url", None))
    await rpc.set_serving(True)
    print(f"{role} server ready on {address} (loaded in {time.time() - t0:.1f}s)", flush=True)
    serving = asyncio.ensure_future(rpc.wait_and_drain(service.drain, grace=args.drain_timeout))
    watchdog = asyncio.ensure_future(_engine_died(service))
    try:
        done, _ = await asyncio.wait({serving, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        if watchdog in done:  # nothing can be served: say so and exit, so a supervisor restarts us
            logger.error("engine loop died (%r); stopping the %s server", watchdog.result(), role)
            serving.cancel()
            await rpc.set_serving(False)
            await rpc.server.stop(grace=1.0)
            return 1
        watchdog.cancel()
        return 0
    finally:
        if publisher is not None:
            publisher.stop()
        service.close()
        engine.close()  # tensor-parallel workers
        service.engine_thread.close()
        if endpoint is not None:
            endpoint.close()


def _serially(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with this (executor) thread's CPU ops on itself alone: a second OpenMP team
    in the process slows every step of the engine thread's (engine/cpu_threads.py)."""
    serial_thread()
    return fn(*args)


def _metrics_endpoint(args: argparse.Namespace, grpc_port: int) -> MetricsEndpoint | None:
    """The /metrics endpoint on --metrics-port (default: the gRPC port + 1000; 0: none)."""
    if args.metrics_port == 0:
        return None
    port = grpc_port + 1000 if args.metrics_port < 0 else args.metrics_port
    if not 0 < port <= 65535:
        raise ValueError(f"--metrics-port {port} is not a port (the default is the gRPC port + 1000; "
                         "0 turns the endpoint off)")
    return MetricsEndpoint(args.host, port, advertise_host(args))


def _start_cache_feed(service: EngineService, cache_events: CacheEventsServicer, engine: LLMEngine,
                      address: str, redis_url: str | None) -> RedisIndexPublisher | None:
    """The prefix-cache feed: drained after every engine step, watched over
    gRPC, and mirrored into Redis when ``redis_url`` is set."""
    bridge: EngineBridge = service.bridge  # type: ignore[attr-defined]
    feed = CacheEventFeed(address, engine.cache_namespace)
    bridge.after_step = feed.publish
    bridge.instance_id, bridge.cache_namespace = feed.instance_id, feed.namespace
    cache_events.attach(feed, bridge.loop.submit)
    if not redis_url:
        return None
    publisher = RedisIndexPublisher(redis_url, feed, bridge.loop.submit)
    publisher.start()
    logger.info("prefix index: publishing to %s (namespace %s)", redis_url, feed.namespace)
    return publisher


async def _engine_died(service: EngineService, period: float = 0.5) -> BaseException | None:
    """Resolves with the engine loop's error once it has died, or once a tensor-parallel
    worker has (the next step would fail in a collective; an idle server would not notice)."""
    while True:
        bridge = getattr(service, "bridge", None)
        if bridge is not None and not bridge.loop.is_alive:
            return bridge.loop.error
        if bridge is not None and not bridge.loop.engine.workers_alive:
            return RuntimeError("a tensor-parallel worker process died")
        await asyncio.sleep(period)
