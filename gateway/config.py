"""The gateway's flags and their validated, frozen form.

``add_cli_args`` declares the flags (vLLM's names where the meaning is the
same); ``GatewayConfig.from_args`` checks them and is the only place that
reads the environment (``PDSERVE_API_KEY``, vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; the ``OTEL_*`` variables are
rpc/tracing.py's).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine.config import parse_size
from engine.sampling_params import MAX_N
from gateway.reasoning_parsers import PARSERS as REASONING_PARSERS
from gateway.request_flow import DEFAULT_MIGRATION_LIMIT, DEFAULT_STREAM_IDLE_TIMEOUT
from gateway.router import HOST_HIT_CREDIT
from gateway.tool_parsers import PARSERS
from rpc import tls, tracing

API_KEY_ENV = "PDSERVE_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for /v1/load_lora_adapter
DEFAULT_MAX_REQUEST_BODY = "4MiB"
DEFAULT_MAX_QUEUED_REQUESTS = 1024


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the gateway's flags to ``parser``."""
    g = parser.add_argument_group("gateway")
    g.add_argument("--model", default=None,
                   help="Hugging Face-format model directory whose tokenizer and chat template are used "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must use (default: the model directory's name)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length: prompt + completion tokens (default: the model's "
                        "max_position_embeddings)")
    g.add_argument("--host", default="127.0.0.1", help="address the HTTP and gRPC servers bind")
    g.add_argument("--http-port", "--port", type=int, default=8000,
                   help="OpenAI-compatible HTTP port (0 = any free; --port: vLLM's name for it)")
    g.add_argument("--grpc-port", type=int, default=50051, help="pdserve.v1.Gateway gRPC port (0 = any free)")
    g.add_argument("--prefill", default="",
                   help="prefill servers, comma-separated: HOST:PORT (a fixed server), dns:NAME:PORT (every "
                        "address NAME resolves to, e.g. a Kubernetes headless Service, looked up again every "
                        "--discovery-interval) or redis (every live prefill server registered in --redis-url); "
                        "empty: decode servers prefill")
    g.add_argument("--decode", default="",
                   help="decode servers, same forms as --prefill (at least one entry)")
    g.add_argument("--discovery-interval", type=float, default=5.0,
                   help="seconds between look-ups of dns: and redis entries; servers that appear are added, "
                        "servers that disappear leave routing while their requests finish")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /cluster, and as gRPC metadata on "
                        f"pdserve.v1.Gateway (default: ${API_KEY_ENV}, which keeps the key out of ps)")
    g.add_argument("--max-request-body", default=DEFAULT_MAX_REQUEST_BODY,
                   help="largest request body (HTTP) or message (gRPC), e.g. 4MiB; larger ones get 413 / "
                        "RESOURCE_EXHAUSTED")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="deadline of a whole request in seconds (every internal RPC inherits it)")
    g.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="requests in flight at the gateway beyond which new ones get 429 with Retry-After "
                        "(gRPC: RESOURCE_EXHAUSTED)")
    g.add_argument("--max-n", type=int, default=MAX_N,
                   help=f"the most sequences one request may ask for (n, best_of; default {MAX_N}, OpenAI's "
                        "bound on n): each is a request of its own on the engine servers")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    add_chat_args(g)
    add_runtime_lora_args(g)
    r = parser.add_argument_group("KV-aware routing")
    r.add_argument("--redis-url", default=None,
                   help="read the prefix index from Redis, e.g. redis://127.0.0.1:6379/0 (the engine servers "
                        "publish to the same URL); without it the gateway follows each server's cache over gRPC")
    r.add_argument("--redis-timeout", type=float, default=0.01,
                   help="seconds a prefix-index lookup in Redis may take before routing falls back to load")
    r.add_argument("--kv-overlap-score-weight", type=float, default=1.0,
                   help="weight of the prompt tokens a prefill server would compute (not in its prefix cache) "
                        "against the tokens already queued on it; 0 routes by queued work alone")
    r.add_argument("--kv-host-hit-credit", type=float, default=HOST_HIT_CREDIT,
                   help=f"what a prefix hit in an instance's host KV tier is worth against one in its device "
                        f"cache, in [0, 1] (default {HOST_HIT_CREDIT}, loading a block against recomputing it on "
                        "CPU: bench/host_hit_cost.py; lower it where host-to-device loads are dearer)")
    r.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail",
                   help="when a request's KV hand-off from prefill to decode fails (stalls past its deadline, "
                        "is refused or breaks): fail it, or have the decode server compute the prompt itself")
    r.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="the decode server prefills a request itself when at most this many of its prompt "
                        "tokens are missing from its prefix cache (0: always use a prefill server)")
    add_migration_args(r)
    tls.add_cli_args(parser)
    tracing.add_cli_args(parser)


def add_migration_args(g: argparse._ArgumentGroup) -> None:
    """``--migration-limit`` (vLLM/Dynamo's name) and ``--stream-idle-timeout`` (`pdserve up` passes both on)."""
    g.add_argument("--migration-limit", type=int, default=DEFAULT_MIGRATION_LIMIT, metavar="N",
                   help="times a request whose decode server dies (or whose stream breaks) mid-response is "
                        "resumed on another decode server, the tokens already streamed prefilled after its "
                        "prompt; the client sees one uninterrupted stream. Past N the request fails naming "
                        "the servers it lost (0: never migrate)")
    g.add_argument("--stream-idle-timeout", type=float, default=DEFAULT_STREAM_IDLE_TIMEOUT, metavar="SECONDS",
                   help="a decode server that sends nothing on a request's stream for this long (since its last "
                        "token, or since the call began) counts as hung: the gateway cancels the stream there and "
                        "retries the request on another decode server, or migrates it once tokens were streamed "
                        "(within --migration-limit). Not counted while a prefill server computes the request. "
                        "Raise it for prompts a decode server prefills itself slower than that (0: no deadline)")


def add_chat_args(g: argparse._ArgumentGroup) -> None:
    """The chat-template, tool-calling and reasoning flags (vLLM's names; `pdserve up` passes them on)."""
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the model's "
                        "own, e.g. deploy/chat_templates/hermes_tools.jinja for tool calls on a ChatML model")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="how the model writes tool calls: hermes (<tool_call> JSON blocks: Hermes, Qwen2.5, "
                        "Qwen3), llama3_json (Llama 3 JSON calls) or openai (gpt-oss's harmony calls, the default "
                        "with --reasoning-parser gpt_oss); needed for tool_choice required, a named function, "
                        "and auto")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the default when a request has tools): the model decides, '
                        "its calls are parsed out of its answer (needs --tool-call-parser)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="a thinking model's reasoning apart from its answer, in chat completions' "
                        "reasoning_content (gRPC: reasoning_text): qwen3 or deepseek_r1 (<think> ... </think>), "
                        "gpt_oss (the harmony format, rendered and parsed by openai-harmony); tool calls are "
                        "parsed from the answer only and structured outputs constrain the answer after the "
                        "reasoning")


def add_runtime_lora_args(g: argparse._ArgumentGroup) -> None:
    """``--allow-runtime-lora-updating`` (`pdserve up` passes it on)."""
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and their gRPC methods), "
                        f"which load and unload adapters on every engine server; also {RUNTIME_LORA_ENV}=True in "
                        "the environment, as vLLM")


def runtime_lora_updating_from_env(environ: dict[str, str] | None = None) -> bool:
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: "1" or "true" (any case) turn it on."""
    value = (os.environ if environ is None else environ).get(RUNTIME_LORA_ENV, "")
    return value.strip().lower() in ("1", "true")


@dataclass(frozen=True)
class GatewayConfig:
    """Validated gateway settings. Model-derived values (the context length)
    are resolved later, when the tokenizer is loaded."""

    model: str | None
    served_model_name: str | None
    max_model_len: int | None
    host: str
    http_port: int
    grpc_port: int
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    api_key: str | None
    log_requests: bool
    request_timeout: float
    max_queued_requests: int | None
    shutdown_timeout: float
    otlp_traces_endpoint: str | None = None
    traces_file: str | None = None
    redis_url: str | None = None
    redis_timeout: float = 0.01
    discovery_interval: float = 5.0
    kv_overlap_score_weight: float = 1.0
    kv_host_hit_credit: float = HOST_HIT_CREDIT
    local_prefill_threshold: int = 0
    kv_load_failure_policy: str = "fail"
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    max_n: int = MAX_N
    stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT  # 0: none
    max_request_body: int = 4 * 1024 * 1024  # bytes
    chat_template: str | None = None  # a file, or the template itself
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    allow_runtime_lora_updating: bool = False  # --allow-runtime-lora-updating or vLLM's variable

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("--decode needs at least one decode server address (host:port)")
        for port, flag in ((self.http_port, "--http-port"), (self.grpc_port, "--grpc-port")):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be in [0, 65535], got {port}")
        if self.http_port == self.grpc_port and self.http_port != 0:
            raise ValueError(f"--http-port and --grpc-port must differ (both are {self.http_port})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.request_timeout <= 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be at least 1, got {self.max_queued_requests}")
        if self.max_request_body < 1024:
            raise ValueError(f"--max-request-body must be at least 1KiB, got {self.max_request_body} bytes")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be non-negative, got {self.shutdown_timeout}")
        if self.redis_timeout <= 0:
            raise ValueError(f"--redis-timeout must be positive, got {self.redis_timeout}")
        if self.discovery_interval <= 0:
            raise ValueError(f"--discovery-interval must be positive, got {self.discovery_interval}")
        for flag, entries in (("--prefill", self.prefill), ("--decode", self.decode)):
            if REDIS_ENTRY in entries and not self.redis_url:
                raise ValueError(f"{flag} {REDIS_ENTRY} reads the servers registered in Redis: give --redis-url")
        if not 0.0 <= self.kv_host_hit_credit <= 1.0:
            raise ValueError(f"--kv-host-hit-credit must be within [0, 1], got {self.kv_host_hit_credit}")
        if self.kv_overlap_score_weight < 0:
            raise ValueError(f"--kv-overlap-score-weight must be non-negative, got {self.kv_overlap_score_weight}")
        if self.local_prefill_threshold < 0:
            raise ValueError(f"--local-prefill-threshold must be non-negative, got {self.local_prefill_threshold}")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"--max-n must be in [1, {MAX_N}], got {self.max_n}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be non-negative, got {self.migration_limit}")
        if not self.stream_idle_timeout >= 0:
            raise ValueError(f"--stream-idle-timeout must be non-negative (0: none), got {self.stream_idle_timeout}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not known; choose one of "
                             f"{', '.join(PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not known; choose one of "
                             f"{', '.join(REASONING_PARSERS)}")
        harmony = self.reasoning_parser == "gpt_oss"
        if self.tool_call_parser == "openai" and not harmony:
            raise ValueError("--tool-call-parser openai (harmony calls) needs --reasoning-parser gpt_oss")
        if harmony and self.tool_call_parser not in (None, "openai"):
            raise ValueError(f"--reasoning-parser gpt_oss parses gpt-oss's own (harmony) tool calls: "
                             f"--tool-call-parser {self.tool_call_parser} does not apply (leave it out, or give openai)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None and not harmony:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (how the model writes tool calls)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "GatewayConfig":
        """Build from parsed flags; raises ValueError with the flag's name."""
        api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
        return cls(model=args.model, served_model_name=args.served_model_name,
                   max_model_len=args.max_model_len, host=args.host, http_port=args.http_port,
                   grpc_port=args.grpc_port, prefill=parse_addresses(args.prefill, "--prefill"),
                   decode=parse_addresses(args.decode, "--decode"), api_key=api_key or None,
                   log_requests=not args.disable_log_requests, request_timeout=args.request_timeout,
                   max_queued_requests=args.max_queued_requests, shutdown_timeout=args.shutdown_timeout,
                   otlp_traces_endpoint=args.otlp_traces_endpoint, traces_file=args.traces_file,
                   redis_url=args.redis_url, redis_timeout=args.redis_timeout,
                   discovery_interval=args.discovery_interval,
                   kv_overlap_score_weight=args.kv_overlap_score_weight,
                   kv_host_hit_credit=getattr(args, "kv_host_hit_credit", HOST_HIT_CREDIT),
                   local_prefill_threshold=args.local_prefill_threshold,
                   kv_load_failure_policy=args.kv_load_failure_policy,
                   migration_limit=getattr(args, "migration_limit", DEFAULT_MIGRATION_LIMIT),
                   max_n=getattr(args, "max_n", MAX_N),
                   stream_idle_timeout=getattr(args, "stream_idle_timeout", DEFAULT_STREAM_IDLE_TIMEOUT),
                   max_request_body=parse_size(getattr(args, "max_request_body", DEFAULT_MAX_REQUEST_BODY)),
                   chat_template=getattr(args, "chat_template", None),
                   tool_call_parser=getattr(args, "tool_call_parser", None),
                   enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                   reasoning_parser=getattr(args, "reasoning_parser", None),
                   allow_runtime_lora_updating=(getattr(args, "allow_runtime_lora_updating", False)
                                                or runtime_lora_updating_from_env()))


DNS_PREFIX = "dns:"  # dns:NAME:PORT, every address NAME resolves to
REDIS_ENTRY = "redis"  # every live server of the role registered in --redis-url


def parse_addresses(text: str | None, flag: str) -> tuple[str, ...]:
    """'a:1, dns:b:2, redis' -> ('a:1', 'dns:b:2', 'redis') (the discovery
    entries of gateway/discovery.py); rejects entries without a valid port
    and duplicates."""
    out: list[str] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        body = item[len(DNS_PREFIX):] if item.startswith(DNS_PREFIX) else item
        host, sep, port = body.rpartition(":")
        if item != REDIS_ENTRY and (not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535):
            raise ValueError(f"{flag}: {item!r} is not a host:port address, dns:NAME:PORT or {REDIS_ENTRY}")
        if item in out:
            raise ValueError(f"{flag}: {item!r} is listed twice")
        out.append(item)
    return tuple(out)


def join_host_port(host: str, port: int) -> str:
    """host:port, with brackets around an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
