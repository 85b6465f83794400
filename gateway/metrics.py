"""What the gateway measures, as Prometheus metrics in a dedicated registry.

Names follow vLLM's with the ``pdserve:`` prefix (see docs/architecture.md);
every series carries ``model_name``. Only values the gateway itself observes
live here: latencies as the client sees them and token counts. Queue times,
KV usage and prefix-cache counters are the engine servers' metrics.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                    320.0, 640.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)


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

    def on_error(self, http_status: int) -> None:
        self._errors.labels(self._model_name, str(http_status)).inc()

    def set_in_flight(self, n: int) -> None:
        self._in_flight.set(n)

    def render(self) -> bytes:
        """Prometheus text exposition of every gateway metric."""
        return generate_latest(self.registry)
