"""The gateway process: the OpenAI HTTP API (uvicorn) and ``pdserve.v1.Gateway``
(grpc.aio) on one event loop, in front of the prefill and decode servers.

    main(args): load the tokenizer -> find the engine servers (discovery) -> poll them once -> start gRPC
                -> start HTTP -> health SERVING -> "gateway ready: ..." -> wait
    SIGTERM/SIGINT: health NOT_SERVING, refuse new requests, stop listening,
                let in-flight requests finish (--shutdown-timeout), abort the
                rest, close -> exit 0

Entry points for the ``pdserve`` CLI: ``add_cli_args`` and ``main``;
``python -m gateway.server --decode HOST:PORT ...`` works too.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from gateway import config as gateway_config
from gateway.config import GatewayConfig, join_host_port
from gateway.discovery import Discovery
from gateway.grpc_servicer import GatewayServicer, add_gateway_servicer
from gateway.http_api import create_app
from gateway.instances import InstanceRegistry
from gateway.metrics import GatewayMetrics
from gateway.prefix_index import MemoryPrefixIndex, PrefixIndex, RedisPrefixIndex
from gateway.redis_status import RedisStatus
from gateway.router import Router
from gateway.service import GatewayService
from gateway.reasoning_parsers import HarmonyReasoningParser, ReasoningParser, get_reasoning_parser
from gateway.tokenization import InputProcessor
from gateway.tool_parsers import get_parser
from pdserve.v1 import gateway_pb2
from rpc import ports, tls, tracing
from rpc.server import RpcServer

logger = logging.getLogger("gateway")

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
# After --shutdown-timeout, aborted requests get this long to send their last message.
_ABORT_GRACE_S = 5.0
# Each client the gateway closes after serving (discovery, the prefix index, the Redis probe, the
# engine servers' channels) gets this long; one that takes longer is named with its stack.
_CLOSE_TIMEOUT_S = 10.0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the gateway's flags (see gateway/config.py)."""
    gateway_config.add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    """Run the gateway until SIGTERM/SIGINT, then drain. Returns the exit code."""
    _setup_logging()
    try:
        cfg = GatewayConfig.from_args(args)
        tls.configure(args)  # its channels to the engine servers
        tracing.init_tracing(tracing.GATEWAY, otlp_endpoint=cfg.otlp_traces_endpoint, traces_file=cfg.traces_file)
        inputs = load_input_processor(cfg)
    except (ValueError, RuntimeError) as e:  # bad flags, model not found, default model unavailable
        logger.error("gateway: %s", e)
        return 2
    try:
        reasoning = load_reasoning_parser(cfg, inputs)
    except ValueError as e:  # the think tokens or harmony's vocabulary missing
        logger.error("gateway: %s", e)
        inputs.close()
        return 2
    try:
        return asyncio.run(_serve(cfg, inputs, reasoning))
    except ports.PortUnavailable as e:  # a port already in use: one line, the flag that changes it
        print(f"pdserve gateway: error: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:
        logger.error("gateway: %s", e)
        return 1
    finally:
        inputs.close()


def load_input_processor(cfg: GatewayConfig) -> InputProcessor:
    """Tokenizer, served model name and context length from ``--model``."""
    from engine.config import ModelConfig
    from engine.model_files import DEFAULT_MODEL, resolve_model_path
    from engine.tokenizer import load_tokenizer

    path = resolve_model_path(cfg.model)
    name = cfg.served_model_name or (DEFAULT_MODEL if cfg.model in (None, DEFAULT_MODEL) else Path(cfg.model).name)
    # vLLM serves a model under its --model string: requests may name it so too (not with --served-model-name).
    aliases = [cfg.model, cfg.model.rstrip("/")] if cfg.model and not cfg.served_model_name else []
    model = ModelConfig.from_dir(path, dtype="float32", load_format="auto", served_model_name=name)
    max_len = cfg.max_model_len or model.max_position_embeddings
    if max_len > model.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                         f"{model.max_position_embeddings}")
    template = read_chat_template(cfg.chat_template) if cfg.chat_template else None
    inputs = InputProcessor(load_tokenizer(path), name, max_len, model.vocab_size, chat_template=template,
                            model_aliases=aliases)
    also = f" (also as {', '.join(inputs.model_aliases)})" if inputs.model_aliases else ""
    logger.info("gateway: model=%s%s path=%s max_model_len=%d chat_template=%s (renders tools: %s)", name, also,
                path, max_len, cfg.chat_template or "the model's",
                "yes" if inputs.renders_tools else "no: give --chat-template FILE for tool calls")
    return inputs


def load_reasoning_parser(cfg: GatewayConfig, inputs: InputProcessor) -> ReasoningParser | None:
    """``--reasoning-parser`` on the model's tokenizer (a ValueError saying what is missing:
    the think tokens, harmony's vocabulary); gpt_oss renders the chats from then on."""
    if not cfg.reasoning_parser:
        return None
    reasoning = get_reasoning_parser(cfg.reasoning_parser, inputs.tokenizer)
    if isinstance(reasoning, HarmonyReasoningParser):
        inputs.chat_renderer = reasoning.render_chat
        inputs.renders_tools = True
    logger.info("gateway: reasoning parser %s%s", reasoning.name,
                " (chats rendered in the harmony format)" if inputs.chat_renderer is not None else "")
    return reasoning


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is a template; a
    ValueError naming the flag when it is neither or does not parse as Jinja."""
    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file (nor a Jinja template)")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {value!r} is not a valid Jinja template: line {e.lineno}: "
                         f"{e.message}") from None
    return text


def make_prefix_index(cfg: GatewayConfig, registry: InstanceRegistry,
                      redis_status: RedisStatus | None = None) -> PrefixIndex:
    """Redis when ``--redis-url`` is set, else this process's own copy."""
    if cfg.redis_url:
        logger.info("prefix index: Redis at %s", redis_status.url if redis_status else cfg.redis_url)
        return RedisPrefixIndex(cfg.redis_url, cfg.redis_timeout, redis_status)
    logger.info("prefix index: in memory, following every engine server's cache events")
    return MemoryPrefixIndex(registry)


async def _serve(cfg: GatewayConfig, inputs: InputProcessor, reasoning: ReasoningParser | None = None) -> int:
    registry = InstanceRegistry()
    metrics = GatewayMetrics(inputs.served_model_name)
    # One view of Redis for the prefix index and discovery: one warning line per outage, one gauge.
    redis_status = RedisStatus(cfg.redis_url, metrics.set_prefix_index_unreachable) if cfg.redis_url else None
    discovery = Discovery(registry, cfg.prefill, cfg.decode, cfg.discovery_interval, cfg.redis_url,
                          inputs.served_model_name, redis_status=redis_status)
    index = make_prefix_index(cfg, registry, redis_status)
    router = Router(registry, index, cfg.kv_overlap_score_weight, cfg.local_prefill_threshold,
                    cfg.kv_load_failure_policy, metrics.on_local_prefill_fallback if cfg.prefill else None,
                    stream_idle_timeout=cfg.stream_idle_timeout or None, host_hit_credit=cfg.kv_host_hit_credit)
    tool_parser = cfg.tool_call_parser or ("openai" if cfg.reasoning_parser == "gpt_oss" else None)
    parser = get_parser(tool_parser) if tool_parser else None
    service = GatewayService(inputs, registry, metrics, cfg.request_timeout,
                             cfg.max_queued_requests, cfg.log_requests, router, parser, cfg.enable_auto_tool_choice,
                             cfg.allow_runtime_lora_updating, reasoning_parser=reasoning,
                             migration_limit=cfg.migration_limit, max_n=cfg.max_n)
    if cfg.allow_runtime_lora_updating:
        logger.info("runtime LoRA updating on: /v1/load_lora_adapter and /v1/unload_lora_adapter act on every "
                    "engine server")
    rpc = RpcServer(join_host_port(cfg.host, cfg.grpc_port), [GATEWAY_SERVICE], internal=False,
                    port_flag="--grpc-port")
    add_gateway_servicer(GatewayServicer(service, cfg.api_key, cfg.max_request_body), rpc.server)
    sock = _bind(cfg.host, cfg.http_port)
    app = create_app(service, cfg.api_key, cfg.max_request_body)
    http = _HttpServer(uvicorn.Config(app, host=cfg.host, port=cfg.http_port,
                                      log_config=None, access_log=False, lifespan="off",
                                      timeout_graceful_shutdown=int(cfg.shutdown_timeout + _ABORT_GRACE_S) + 1))
    http_task: asyncio.Task[None] | None = None
    try:
        if redis_status is not None:
            await redis_status.start()
        await discovery.start()
        await registry.start()
        await index.start()
        await rpc.start()
        http_task = asyncio.create_task(http.serve(sockets=[sock]), name="http-server")
        while not http.started:
            if http_task.done():
                raise OSError(f"the HTTP server did not start on {join_host_port(cfg.host, cfg.http_port)}")
            await asyncio.sleep(0.02)
        await rpc.set_serving(True)
        rpc.install_signal_handlers()
        http_port = sock.getsockname()[1]
        ready = (f"gateway ready: http://{join_host_port(cfg.host, http_port)} "
                 f"grpc {join_host_port(cfg.host, rpc.port)}")
        logger.info("%s (prefill: %s; decode: %s)", ready, ", ".join(cfg.prefill) or "none", ", ".join(cfg.decode))
        print(ready, flush=True)

        async def drain() -> None:
            await _drain(service, http, cfg.shutdown_timeout)

        await rpc.wait_and_drain(drain, grace=cfg.shutdown_timeout + 2 * _ABORT_GRACE_S)
    finally:
        http.should_exit = True
        if http_task is not None:
            with contextlib.suppress(Exception):
                await http_task
        parts = [("discovery", discovery.close()), ("the prefix index", index.close())]
        if redis_status is not None:
            parts.append(("the Redis probe", redis_status.close()))
        parts.append(("the engine servers' channels", registry.close()))
        stuck = await close_all(parts, _CLOSE_TIMEOUT_S)
        sock.close()
    logger.info("gateway stopped")
    if stuck:  # a client that never closed would keep the process alive after it stopped serving
        logging.shutdown()
        os._exit(0)
    return 0


def _awaiting(coro: Any) -> str:
    """Where a suspended coroutine waits: its frame and those of what it awaits, outermost first."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "\n".join(lines) or "  (no frame)"


async def close_all(parts: list[tuple[str, Coroutine[Any, Any, Any]]], timeout: float) -> list[str]:
    """Await each (name, close coroutine) in turn, each within ``timeout`` seconds; returns the
    names of those that did not end in time, each logged once with where it waits (left running)."""
    stuck = []
    for name, coro in parts:
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if done:
            with contextlib.suppress(Exception):  # a close that fails has nothing left to close
                task.result()
            continue
        logger.warning("gateway: closing %s took over %.0f s; exiting without it. It waits in:\n%s", name,
                       timeout, _awaiting(task.get_coro()))
        stuck.append(name)
    return stuck


async def _drain(service: GatewayService, http: uvicorn.Server, timeout: float) -> None:
    """Refuse new requests, stop listening, wait for in-flight ones; abort the rest."""
    service.active.start_draining()
    http.should_exit = True
    logger.info("draining %d in-flight request(s)", len(service.active))
    try:
        await asyncio.wait_for(service.active.wait_empty(), timeout)
        return
    except asyncio.TimeoutError:
        pass
    logger.warning("aborting %d request(s) still running after %.0fs", service.active.abort_all(), timeout)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(service.active.wait_empty(), _ABORT_GRACE_S)


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway drains both servers itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket (bound here so that port 0 works and a busy port is a
    ``PortUnavailable`` naming --http-port); no SO_REUSEPORT: one port, one server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family, backlog=2048, reuse_port=False)
    except OSError as e:
        raise ports.PortUnavailable("HTTP", host.strip("[]"), port, "--http-port", e) from None


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _cli() -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    return main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(_cli())
