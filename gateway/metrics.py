"""What the gateway measures, as Prometheus metrics in a dedicated registry.

Names follow vLLM's with the ``pdserve:`` prefix (see docs/architecture.md);
every series carries ``model_name``. Only values the gateway itself observes
live here: latencies as the client sees them, token counts, and per request
the phases the prefill server reports in its answer (queue and prefill time,
KV transfer seconds and bytes; observed only for requests prefilled on a
prefill server), and requests per LoRA adapter (``pdserve:lora_requests_total``,
labelled ``lora_name``), and the prompt tokens the router expected cached on the
servers it chose, by tier (``pdserve:gateway_routed_cached_tokens_total``, labelled
``tier``: device, host; the router's own count, /cluster's ``routed_cached_tokens``).
KV usage and prefix-cache counters are the engine servers' metrics.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                    320.0, 640.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)
# 1-2-5 steps, as vLLM's token-count histograms.
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
_KV_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_KV_BYTES_BUCKETS = tuple(float(1 << p) for p in range(12, 36, 2))  # 4 KiB .. 16 GiB


class GatewayMetrics:
    """Owns the gateway's CollectorRegistry; ``render()`` is the /metrics body."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._e2e = Histogram("pdserve:e2e_request_latency_seconds",
                              "Request latency at the gateway, arrival to last token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self._ttft = Histogram("pdserve:time_to_first_token_seconds",
                               "Arrival at the gateway to the first generated token.",
                               labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram("pdserve:inter_token_latency_seconds",
                              "Time between generated tokens as the gateway receives them.",
                              labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self._prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of requests that finished.",
                                      labels, registry=r).labels(model_name)
        self._generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens streamed to clients.",
                                          labels, registry=r).labels(model_name)
        self._success = Counter("pdserve:request_success", "Requests that finished, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._errors = Counter("pdserve:request_errors", "Requests that ended in an error, by HTTP status.",
                               labels + ["status"], registry=r)
        self._in_flight = Gauge("pdserve:gateway_requests_in_flight",
                                "Requests the gateway is currently serving.", labels, registry=r).labels(model_name)
        self._lora_requests = Counter("pdserve:lora_requests", "Requests under a LoRA adapter, by adapter.",
                                      labels + ["lora_name"], registry=r)
        self._migrations = Counter("pdserve:gateway_migrations",
                                   "Requests resumed on another decode server after theirs died or its stream "
                                   "broke mid-response, by cause (the gRPC status: unavailable, cancelled, unknown; "
                                   "stream_ended: it ended without a finish reason).",
                                   labels + ["cause"], registry=r)
        # Degraded modes (also in /cluster's "degraded": ``degraded_json``).
        self._prefix_index_unreachable = Gauge(
            "pdserve:gateway_prefix_index_unreachable",
            "1 while the Redis holding the prefix index does not answer (routing by load alone), else 0.",
            labels, registry=r).labels(model_name)
        self._is_prefix_index_unreachable = False
        self._local_prefill_fallbacks = Counter(
            "pdserve:gateway_local_prefill_fallbacks",
            "Requests a decode server prefilled itself because no prefill server was usable, by cause "
            "(no_prefill_server: none found; no_healthy_prefill_server; prefill_failed: every healthy one failed "
            "the request or its KV hand-off; lora_adapter, draft_model: none holds the decode server's adapter "
            "copy or draft model). Not counted without --prefill.",
            labels + ["cause"], registry=r)

        self._routed_cached = _RoutedCachedTokens(model_name)
        r.register(self._routed_cached)

        self._kv_host_staged = Counter(
            "pdserve:gateway_kv_host_staged_transfers",
            "Requests whose KV hand-off went through host memory (gloo) though a cache was on a GPU: "
            "prefill and decode on one GPU, or NCCL not usable between them.",
            labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pdserve:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self._queue_time = histogram("request_queue_time_seconds",
                                     "Time a request waited in the prefill server's queue.", _LATENCY_BUCKETS)
        self._prefill_time = histogram("request_prefill_time_seconds",
                                       "Prefill server compute time of a request (first scheduled to first token).",
                                       _LATENCY_BUCKETS)
        self._decode_time = histogram("request_decode_time_seconds",
                                      "First to last output token of a request, at the gateway.", _LATENCY_BUCKETS)
        self._request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                                _TOKEN_BUCKETS)
        self._request_generation_tokens = histogram("request_generation_tokens",
                                                    "Generated tokens per finished request.", _TOKEN_BUCKETS)
        self._kv_seconds = histogram("request_kv_transfer_seconds",
                                     "KV transfer time of a request, as its prefill server reported it.",
                                     _KV_SECONDS_BUCKETS)
        self._kv_bytes = histogram("request_kv_transfer_bytes", "KV bytes transferred for a request.",
                                   _KV_BYTES_BUCKETS)
        self._model_name = model_name

    def on_first_token(self, seconds_since_arrival: float) -> None:
        self._ttft.observe(seconds_since_arrival)

    def on_tokens(self, num_tokens: int, seconds_since_previous: float | None) -> None:
        """``num_tokens`` arrived together, ``seconds_since_previous`` after the
        previous ones (None for the first): each gets an equal share of the gap."""
        self._generation_tokens.inc(num_tokens)
        if seconds_since_previous is not None and num_tokens > 0:
            share = seconds_since_previous / num_tokens
            for _ in range(num_tokens):
                self._itl.observe(share)

    def on_finished(self, finish_reason: str, num_prompt_tokens: int, e2e_seconds: float) -> None:
        self._prompt_tokens.inc(num_prompt_tokens)
        self._e2e.observe(e2e_seconds)
        self._success.labels(self._model_name, finish_reason).inc()

    def on_request_phases(self, num_prompt_tokens: int, num_generation_tokens: int,
                          queue_seconds: float | None = None, prefill_seconds: float | None = None,
                          decode_seconds: float | None = None, kv_seconds: float | None = None,
                          kv_bytes: int | None = None) -> None:
        """A finished request's per-phase figures (None: not measured)."""
        self._request_prompt_tokens.observe(num_prompt_tokens)
        self._request_generation_tokens.observe(num_generation_tokens)
        for hist, value in ((self._queue_time, queue_seconds), (self._prefill_time, prefill_seconds),
                            (self._decode_time, decode_seconds), (self._kv_seconds, kv_seconds),
                            (self._kv_bytes, kv_bytes)):
            if value is not None:
                hist.observe(value)

    def on_error(self, http_status: int) -> None:
        self._errors.labels(self._model_name, str(http_status)).inc()

    def on_lora_request(self, lora_name: str) -> None:
        """A request under LoRA adapter ``lora_name`` started (one series per adapter ever used)."""
        self._lora_requests.labels(self._model_name, lora_name).inc()

    def on_migration(self, cause: str) -> None:
        """A request moved to another decode server (``pdserve:gateway_migrations_total``)."""
        self._migrations.labels(self._model_name, cause).inc()

    def on_local_prefill_fallback(self, cause: str) -> None:
        """A decode server prefills a request itself: no prefill server was usable."""
        self._local_prefill_fallbacks.labels(self._model_name, cause).inc()

    def on_kv_host_staged(self) -> None:
        """A request's KV went through host memory though a cache was on a GPU."""
        self._kv_host_staged.labels(self._model_name).inc()

    def follow_routed_cached_tokens(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Report ``counts()`` (the router's ``routed_cached_tokens``: tier -> prompt tokens it
        expected cached on the servers it chose) as ``pdserve:gateway_routed_cached_tokens_total``."""
        self._routed_cached.counts = counts

    def set_prefix_index_unreachable(self, unreachable: bool) -> None:
        self._is_prefix_index_unreachable = unreachable
        self._prefix_index_unreachable.set(1 if unreachable else 0)

    def degraded_json(self) -> dict[str, Any]:
        """The degraded-mode counters as /cluster shows them (the same values as /metrics)."""
        return {"prefix_index_unreachable": self._is_prefix_index_unreachable,
                "local_prefill_fallbacks": _by_label(self._local_prefill_fallbacks, "cause"),
                "migrations": _by_label(self._migrations, "cause"),
                "kv_host_staged_transfers": sum(_by_label(self._kv_host_staged, "model_name").values())}

    def set_in_flight(self, n: int) -> None:
        self._in_flight.set(n)

    def render(self) -> bytes:
        """Prometheus text exposition of every gateway metric."""
        return generate_latest(self.registry)


class _RoutedCachedTokens(Collector):
    """The router's count of prompt tokens the prefix index credited the chosen server with,
    per tier, read when scraped (one number for /metrics and /cluster)."""

    TIERS = ("device", "host")

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.counts: Callable[[], Mapping[str, int]] | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self.counts() if self.counts is not None else {}
        c = CounterMetricFamily("pdserve:gateway_routed_cached_tokens",
                                "Prompt tokens the router expected cached on the server it chose to prefill "
                                "(the prefix index's match there), by tier: device (its KV cache) or host "
                                "(its host tier, --kv-offloading-size).", labels=["model_name", "tier"])
        for tier in (*self.TIERS, *(t for t in counts if t not in self.TIERS)):
            c.add_metric([self.model_name, tier], counts.get(tier, 0))
        yield c


def _by_label(counter: Counter, label: str) -> dict[str, int]:
    """A labelled counter's totals by one label's value (series never incremented omitted)."""
    return {sample.labels[label]: int(sample.value) for metric in counter.collect() for sample in metric.samples
            if sample.name.endswith("_total")}
