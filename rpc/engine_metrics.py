"""Prometheus metrics of an engine server (vLLM's names, `pdserve:` prefix).

Gauges and scheduler counters are read from the engine when scraped (plain
int reads under the GIL, no locks in the step loop); token and KV-transfer
counts are recorded by the server as they happen.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kv_transfer import TransferStats
from engine.llm_engine import LLMEngine
from rpc.ports import PortUnavailable, join

# Where a prefix hit's KV was (vLLM's CacheHitSource values that apply here).
CACHE_HIT_SOURCES = ("device", "host", "disk")
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _SchedulerCollector(Collector):
    def __init__(self, engine: LLMEngine, labels: dict[str, str]) -> None:
        self.engine, self.labels = engine, labels

    def collect(self) -> Iterator:
        s = self.engine.stats()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pdserve:{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to run (or for their KV).", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by live requests.", s.kv_cache_usage)
        # Prefix-cache hits as vLLM counts them (a request's first admission; tokens): prefix_cache_*
        # the device cache's, external_prefix_cache_* those of the tiers behind it (vLLM's counters
        # of its KV connectors, where its CPU offloading reports), prompt_tokens_cached all of them,
        # prompt_tokens_cached_by_source per tier (vLLM's sources device, host, disk).
        by_source = {src: s.prefix_hits_by_source.get(src, 0) for src in CACHE_HIT_SOURCES}
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries_total)
        yield counter("prefix_cache_hits", "Prompt tokens found in the device prefix cache.", by_source["device"])
        yield counter("prompt_tokens_cached", "Prompt tokens found cached (device + host + disk tiers).",
                      s.prefix_hits_total)
        c = CounterMetricFamily("pdserve:prompt_tokens_cached_by_source", "Prompt tokens found cached, by the tier "
                                "their KV came from (device; host: --kv-offloading-size; disk: "
                                "--kv-offloading-path).", labels=names + ["source"])
        for src, n in by_source.items():
            c.add_metric(values + [src], n)
        yield c
        if s.host_kv_blocks_total:
            yield counter("external_prefix_cache_queries", "Prompt tokens looked up in the prefix cache, the host "
                          "and disk tiers included.", s.prefix_queries_total)
            yield counter("external_prefix_cache_hits", "Prompt tokens found in the host or disk tier (not on "
                          "the device).", by_source["host"] + by_source["disk"])
        yield counter("num_preemptions", "Requests preempted (recomputed later).", s.num_preemptions_total)
        yield counter("engine_steps", "Engine steps that ran (or queued) a forward pass.", s.num_steps_total)
        yield counter("engine_steps_ahead", "Of those, decode steps scheduled and queued while the step before "
                      "still ran (--async-scheduling).", s.num_steps_ahead_total)
        if s.host_kv_blocks_total:  # the host tier (--kv-offloading-size; engine/kv_offload.py)
            yield gauge("kv_offload_host_usage_perc", "Fraction of the host KV tier's blocks in use.",
                        s.host_kv_blocks_used / s.host_kv_blocks_total)
            yield gauge("kv_offload_host_blocks", "Blocks the host KV tier holds at most.", s.host_kv_blocks_total)
            yield counter("kv_offload_stored_blocks", "KV blocks evicted from the device cache and copied to the "
                          "host tier.", s.host_kv_stored_total)
            yield counter("kv_offload_loaded_blocks", "KV blocks loaded back from the host tier (prefix hits "
                          "there).", s.host_kv_loaded_total)
            yield counter("kv_offload_dropped_blocks", "Host tier blocks dropped (least recently used) to make "
                          "room for others.", s.host_kv_dropped_total)
            yield counter("kv_offload_hit_tokens", "Prompt tokens of prefix hits in the host tier, disk hits "
                          "included (every load, a preempted request's again too: external_prefix_cache_hits "
                          "counts a request's first admission).", s.host_kv_hit_tokens_total)
        d = s.disk_kv
        if d is not None:  # the disk tier (--kv-offloading-path; engine/kv_disk_tier.py)
            yield gauge("kv_offload_disk_usage_bytes", "Bytes in the disk tier's directory (every server's files, "
                        "as this one last saw them).", d.used_bytes)
            yield gauge("kv_offload_disk_size_bytes", "The most the disk tier's directory holds.", d.size_bytes)
            yield counter("kv_offload_disk_stored_blocks", "KV blocks dropped by the host tier and written to "
                          "disk.", d.stored_blocks_total)
            yield counter("kv_offload_disk_loaded_blocks", "KV blocks read from disk into the host tier (prefix hits "
                          "there; then loaded like host hits).", d.loaded_blocks_total)
            yield counter("kv_offload_disk_hit_tokens", "Prompt tokens of prefix hits read from disk (also counted "
                          "in kv_offload_hit_tokens).", d.loaded_blocks_total * self.engine.config.cache.block_size)
            yield counter("kv_offload_disk_read_bytes", "Bytes of KV block files read.", d.read_bytes_total)
            yield counter("kv_offload_disk_written_bytes", "Bytes of KV block files written.", d.written_bytes_total)
            yield counter("kv_offload_disk_dropped_spills", "Blocks not written to disk because the writer's queue "
                          "was full.", d.dropped_spills_total)
            yield counter("kv_offload_disk_removed_files", "Files removed (least recently used) to keep the "
                          "directory under its bound.", d.removed_files_total)
            c = CounterMetricFamily("pdserve:kv_offload_disk_errors", "KV block files refused or not written, by "
                                    "cause (the block is recomputed).", labels=names + ["cause"])
            for cause, n in d.errors.items():
                c.add_metric(values + [cause], n)
            yield c
        spec = self.engine.scheduler.spec if self.engine.config.speculative is not None else None
        if spec is not None:  # vLLM's speculative-decoding counters
            yield counter("spec_decode_num_drafts", "Decode steps of a request that verified proposals.",
                          spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Tokens proposed.", spec.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens)
            c = CounterMetricFamily("pdserve:spec_decode_num_accepted_tokens_per_pos",
                                    "Proposed tokens accepted, by their position in the proposal (0: first).",
                                    labels=names + ["position"])
            k = self.engine.config.speculative.num_speculative_tokens
            per_pos = spec.accepted_per_position + [0] * (k - len(spec.accepted_per_position))
            for pos, n in enumerate(per_pos[:k]):
                c.add_metric(values + [str(pos)], n)
            yield c
        if self.engine.drafter is not None:
            yield counter("spec_decode_draft_prompt_tokens", "Prompt tokens the draft model computed here (on a "
                          "prefill server, every prompt's; on a decode server, those whose draft KV did not "
                          "come with the prompt's KV).", self.engine.drafter.num_prompt_tokens_computed)
        lora = self.engine.lora
        if lora is not None:  # vLLM's: the adapters of running and waiting requests, in labels
            running, waiting = self.engine.lora_requests()
            g = GaugeMetricFamily("pdserve:lora_requests_info", "LoRA adapters of running and waiting requests "
                                  "(value: when sampled, Unix seconds).",
                                  labels=names + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric(values + [str(lora.max_loras), ",".join(running), ",".join(waiting)], time.time())
            yield g
        load = self.engine.expert_load()
        if load.numel():  # mixture-of-experts models: one series per (layer, expert)
            c = CounterMetricFamily("pdserve:moe_expert_tokens", "Tokens routed to each expert of each MoE layer.",
                                    labels=names + ["layer", "expert"])
            for layer, row in zip(self.engine.moe_layer_indices, load.tolist()):
                for expert, tokens in enumerate(row):
                    c.add_metric(values + [str(layer), str(expert)], tokens)
            yield c
            ranks = self.engine.config.tensor_parallel_size
            if self.engine.config.enable_expert_parallel and ranks > 1:  # rank r holds experts [r E/N, (r+1) E/N)
                c = CounterMetricFamily("pdserve:moe_rank_tokens", "Expert parallelism: (token, expert) pairs "
                                        "routed to each rank's experts, all MoE layers.", labels=names + ["rank"])
                per_rank = load.sum(dim=0).view(ranks, -1).sum(dim=1).tolist()
                for rank, tokens in enumerate(per_rank):
                    c.add_metric(values + [str(rank)], tokens)
                yield c


class EngineMetrics:
    def __init__(self, engine: LLMEngine, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "model_name": engine.config.model.served_model_name}
        self.registry.register(_SchedulerCollector(engine, labels))
        names = list(labels)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of admitted requests.", names,
                                     registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens.", names,
                                         registry=self.registry).labels(**labels)
        self.kv_bytes = Counter("pdserve:kv_transfer_bytes", "KV cache bytes sent or received.",
                                names + ["backend"], registry=self.registry)
        self.kv_seconds = Histogram("pdserve:kv_transfer_seconds", "Duration of one request's KV transfer.",
                                    names + ["backend"], buckets=_TRANSFER_BUCKETS, registry=self.registry)
        self.kv_wait = Histogram("pdserve:kv_transfer_wait_after_first_token_seconds",
                                 "Prefill tier: how long a request's KV send still ran after its first token "
                                 "was sampled (what the transfer adds to time to first token).",
                                 names, buckets=_TRANSFER_BUCKETS, registry=self.registry).labels(**labels)
        # decode tier: transfers whose sampled blocks landed other than sent (kv_transfer/canary.py)
        self.kv_checksum_mismatches = Counter(
            "pdserve:kv_transfer_checksum_mismatches", "KV transfers (parts of one) whose sampled blocks landed "
            "other than the prefill server sent them (the transfer canary): each failed its request's hand-off.",
            names, registry=self.registry).labels(**labels) if role == "decode" else None
        c = engine.config
        info = Gauge("pdserve:engine_config_info", "The engine's configuration (value 1).",
                     names + ["tensor_parallel_size", "block_size", "dtype", "kv_cache_dtype", "device",
                              "num_gpu_blocks"], registry=self.registry)
        info.labels(**labels, tensor_parallel_size=str(c.tensor_parallel_size), block_size=str(c.cache.block_size),
                    dtype=c.model.dtype, kv_cache_dtype=c.kv_dtype, device=c.device,
                    num_gpu_blocks=str(engine.num_blocks)).set(1)
        self._labels = labels
        self.url = ""

    def record_checksum_mismatch(self) -> None:
        if self.kv_checksum_mismatches is not None:
            self.kv_checksum_mismatches.inc()

    def record_transfer(self, stats: TransferStats) -> None:
        self.kv_bytes.labels(**self._labels, backend=stats.backend).inc(stats.num_bytes)
        self.kv_seconds.labels(**self._labels, backend=stats.backend).observe(stats.seconds)



class _Forward(Collector):
    """Another registry's metrics, as one collector of the endpoint's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator:
        return self.registry.collect()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no access log
        pass


class MetricsEndpoint:
    """An engine server's Prometheus /metrics HTTP endpoint. It listens from the server's
    start, before the model loads, so that a port in use fails the start at once (a
    ``PortUnavailable`` naming --metrics-port), and serves an empty page until ``attach``."""

    def __init__(self, host: str, port: int, advertise_host: str) -> None:
        self.registry = CollectorRegistry()
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

            class Server(ThreadingWSGIServer):
                address_family = family
                allow_reuse_port = False  # one port, one server (newer Pythons' HTTPServer sets it)

            self._server = make_server(host, port, make_wsgi_app(self.registry), Server,
                                       handler_class=_QuietHandler)
        except OSError as exc:
            raise PortUnavailable("metrics", host, port, "--metrics-port", exc,
                                  hint=" (0 turns the metrics endpoint off)") from None
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()
        self.url = f"http://{join(advertise_host, self._server.server_port)}/metrics"

    def attach(self, metrics: EngineMetrics) -> str:
        """Serve ``metrics`` from now on; returns the URL."""
        self.registry.register(_Forward(metrics.registry))
        metrics.url = self.url
        return self.url

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
