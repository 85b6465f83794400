"""Discovery end to end: real prefill and decode servers on several loopback
addresses (127.0.0.2, .3, ... with one port per tier, as pods behind a
headless Service) and a real gateway that finds them by name (``dns:``, with
the answers read from a file the test rewrites: tests/dns_gateway.py) or in
Redis (``redis``, the servers' own registrations). Servers are added and
removed while requests run: each request comes back token-exact, none is
lost, a removed server gets nothing new while its in-flight request
finishes. Also: every metric the Grafana dashboard queries is exported,
and /v1/models reports max_model_len."""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from rpc.local_redis import LocalRedis
from tests.conftest import make_tiny_model
from tests.processes import REPO, GatewayProcess, ServiceProcess, free_port, wait_for

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny"  # engines and gateways agree on it (Redis discovery matches namespaces by it)
PREFILL_NAME, DECODE_NAME = "prefill.pdserve.test", "decode.pdserve.test"
SHORT_TOKENS, LONG_TOKENS = 6, 2000
DASHBOARD = REPO / "deploy" / "grafana" / "pdserve-dashboard.json"


class Engine(ServiceProcess):
    def __init__(self, role: str, host: str, ports: dict[str, int], model: Path, redis_url: str) -> None:
        self.role, self.host = role, host
        self.address = f"{host}:{ports[role]}"
        self.metrics_url = f"http://{host}:{ports['metrics']}/metrics"
        super().__init__(f"{role}-{host}", f"{role}_service.server",
                         ["--host", host, "--port", str(ports[role]), "--metrics-port", str(ports["metrics"]),
                          "--model", str(model), "--served-model-name", MODEL_NAME, "--kv-cache-memory", "32MiB",
                          "--redis-url", redis_url],
                         f"{role} server ready", env={"OMP_NUM_THREADS": "1"})
        stub = engine_pb2_grpc.PrefillStub if role == "prefill" else engine_pb2_grpc.DecodeStub
        self.stub = stub(grpc.insecure_channel(self.address))

    def load(self) -> common_pb2.LoadInfo:
        return self.stub.GetLoad(common_pb2.LoadRequest(), timeout=10)

    @property
    def is_running(self) -> bool:
        return self.proc.poll() is None


class Cluster:
    """Engine servers started on demand, each on its own loopback address."""

    def __init__(self, model: Path, redis_url: str) -> None:
        self.model, self.redis_url = model, redis_url
        self.ports = {"prefill": free_port(), "decode": free_port(), "metrics": free_port()}
        self.engines: dict[str, Engine] = {}

    def start(self, role: str, host: str) -> Engine:
        self.engines[host] = Engine(role, host, self.ports, self.model, self.redis_url)
        return self.engines[host]

    def live(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.is_running]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-4k"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def cluster(model):
    redis = LocalRedis(port=free_port()).start()
    c = Cluster(model, redis.url)
    for role, host in (("prefill", "127.0.0.2"), ("prefill", "127.0.0.3"),
                       ("decode", "127.0.0.4"), ("decode", "127.0.0.5")):
        c.start(role, host)
    try:
        for e in c.engines.values():
            e.wait_ready()
        yield c
    finally:
        codes = {e.name: e.stop() for e in c.engines.values() if e.is_running}
        redis.stop()
    assert set(codes.values()) <= {0}, [e.logs() for e in c.engines.values()]


def _short_prompt(i: int) -> list[int]:
    return [5 + (i * 31 + j * 7) % 370 for j in range(12 + i)]


LONG_PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def references(model) -> dict[tuple[int, ...], list[int]]:
    """Greedy output of the same model run in this process, per prompt."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model), kv_cache_memory="32MiB"))
    out = {}
    for prompt, n in [(_short_prompt(i), SHORT_TOKENS) for i in range(8)] + [(LONG_PROMPT, LONG_TOKENS)]:
        req = engine.add_request(str(len(out)), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        out[tuple(prompt)] = list(req.output_token_ids)
    return out


def _request(prompt: list[int], max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


class Load:
    """Short requests sent back to back from a few threads until ``stop``;
    each must come back whole and token-exact (failures are collected)."""

    def __init__(self, grpc_address: str, references: dict, threads: int = 2) -> None:
        self._stop = threading.Event()
        self.errors: list[str] = []
        self.num_ok = [0] * threads
        self._threads = [threading.Thread(target=self._run, args=(grpc_address, references, k), daemon=True)
                         for k in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, grpc_address: str, references: dict, k: int) -> None:
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(grpc_address))
        i = k
        while not self._stop.is_set():
            prompt = _short_prompt(i % 8)
            try:
                deltas = list(stub.Generate(_request(prompt, SHORT_TOKENS), timeout=60))
                tokens = [t for d in deltas for t in d.token_ids]
                if tokens != references[tuple(prompt)] or deltas[-1].finish_reason != "length":
                    self.errors.append(f"prompt {i % 8}: {tokens} ({deltas[-1].finish_reason})")
                else:
                    self.num_ok[k] += 1
            except grpc.RpcError as e:
                self.errors.append(f"prompt {i % 8}: {e.code().name}: {e.details()}")
            i += len(self.num_ok)

    def wait_each(self, more: int) -> None:
        """Until every thread has finished ``more`` further requests (so
        whatever any thread had in flight before has ended)."""
        target = [n + more for n in self.num_ok]
        _wait_for(lambda: all(n >= t for n, t in zip(self.num_ok, target)) or self.errors,
                  f"{more} more requests per thread")
        assert not self.errors, self.errors

    def stop(self) -> int:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        return sum(self.num_ok)


class LongRequest(threading.Thread):
    """One streaming request read to its end in the background."""

    def __init__(self, grpc_address: str) -> None:
        super().__init__(daemon=True)
        self._call = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(grpc_address)).Generate(
            _request(LONG_PROMPT, LONG_TOKENS), timeout=120)
        self.first = threading.Event()
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            for delta in self._call:
                self.tokens += delta.token_ids
                self.finish_reason = delta.finish_reason or self.finish_reason
                self.first.set()
        except grpc.RpcError as e:
            self.error = e
        self.first.set()


def _wait_for(condition, what: str, timeout: float = 90.0):
    return wait_for(condition, what, timeout)


def _instances(gw: GatewayProcess) -> dict[str, dict]:
    return {i["address"]: i for i in httpx.get(gw.http_url + "/cluster", timeout=10).json()["instances"]}


def _routable(gw: GatewayProcess) -> set[tuple[str, str]]:
    return {(i["role"], a) for a, i in _instances(gw).items() if i["healthy"] and not i["draining"]}


def _set_hosts(path: Path, hosts: dict[str, list[str]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(hosts))
    os.replace(tmp, path)  # the gateway reads whole files only


class FileDnsGateway(GatewayProcess):
    """The real gateway (``pdserve gateway``) resolving names from a file."""

    def __init__(self, name: str, flags: list[str], hosts: Path) -> None:
        ServiceProcess.__init__(self, name, "tests.dns_gateway", ["--http-port", "0", "--grpc-port", "0", *flags],
                                "gateway ready: ", env={"PDSERVE_TEST_HOSTS": str(hosts)})
        self.http_url = self.grpc_address = ""


def test_dns_names_add_and_drain_servers_while_requests_run(cluster, references, tmp_path):
    p1, p2, d1, d2 = (cluster.engines[h] for h in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"))
    hosts = tmp_path / "hosts.json"
    _set_hosts(hosts, {PREFILL_NAME: [p1.host], DECODE_NAME: [d1.host]})
    config = tmp_path / "gateway.yaml"  # the discovery settings come from a --config file, as in Kubernetes
    config.write_text(yaml.safe_dump({"prefill": f"dns:{PREFILL_NAME}:{cluster.ports['prefill']}",
                                      "decode": f"dns:{DECODE_NAME}:{cluster.ports['decode']}",
                                      "discovery-interval": 0.2, "max-model-len": 4096,
                                      "served-model-name": MODEL_NAME}))
    gw = FileDnsGateway("gw-dns", ["--config", str(config)], hosts)
    gw.wait_ready()
    _wait_for(lambda: _routable(gw) == {("prefill", p1.address), ("decode", d1.address)}, "p1 and d1 routable")
    load = Load(gw.grpc_address, references)
    try:
        load.wait_each(2)
        # Scale up: the name now resolves to two servers per tier; both new ones get work.
        _set_hosts(hosts, {PREFILL_NAME: [p1.host, p2.host], DECODE_NAME: [d1.host, d2.host]})
        _wait_for(lambda: _routable(gw) == {(e.role, e.address) for e in (p1, p2, d1, d2)}, "all four routable")
        _wait_for(lambda: p2.load().num_requests_finished > 0 and d2.load().num_requests_finished > 0,
                  "the new servers serving")
        load.stop()
        assert not load.errors, load.errors
        # Scale down while a long request streams from the decode server that goes.
        long = LongRequest(gw.grpc_address)
        assert long.first.wait(60) and long.error is None
        serving = _wait_for(lambda: [d for d in (d1, d2) if d.load().num_running == 1], "the long request's server")
        gone, kept = serving[0], d2 if serving[0] is d1 else d1
        load = Load(gw.grpc_address, references)
        _set_hosts(hosts, {PREFILL_NAME: [p2.host], DECODE_NAME: [kept.host]})
        draining = _wait_for(lambda: _instances(gw).get(gone.address, {}).get("draining") and
                             _instances(gw)[gone.address], "the removed decode server draining")
        # Out of routing, still streaming; short requests routed there before the change may be too.
        assert 1 <= draining["num_in_flight"] <= 1 + len(load.num_ok) and long.is_alive(), draining
        assert _routable(gw) == {("prefill", p2.address), ("decode", kept.address)}
        long.join(120)
        assert long.error is None and long.finish_reason == "length"
        assert long.tokens == references[tuple(LONG_PROMPT)]
        _wait_for(lambda: not {gone.address, p1.address} & set(_instances(gw)), "the removed servers drained")
        load.wait_each(2)  # requests started before the removal have ended
        before = gone.load().num_requests_finished, p1.load().num_requests_finished
        load.wait_each(3)
        assert (gone.load().num_requests_finished, p1.load().num_requests_finished) == before  # nothing new
    finally:
        total = load.stop()
        assert gw.stop() == 0, gw.logs()
    assert not load.errors and total > 0, load.errors


def test_redis_registrations_add_and_drain_servers_while_requests_run(cluster, references):
    gw = GatewayProcess("gw-redis", ["--prefill", "redis", "--decode", "redis", "--redis-url", cluster.redis_url,
                                     "--discovery-interval", "0.2", "--max-model-len", "4096",
                                     "--served-model-name", MODEL_NAME])
    gw.wait_ready()
    _wait_for(lambda: _routable(gw) == {(e.role, e.address) for e in cluster.live()}, "every registered server")
    load = Load(gw.grpc_address, references)
    try:
        load.wait_each(2)
        # A new decode server registers itself and gets work.
        d3 = cluster.start("decode", "127.0.0.6")
        d3.wait_ready()
        _wait_for(lambda: ("decode", d3.address) in _routable(gw), "the new decode server routable")
        _wait_for(lambda: d3.load().num_requests_finished > 0, "the new decode server serving")
        # A decode server stops (SIGTERM: it finishes its requests, then leaves Redis) while requests run.
        victim = next(e for e in cluster.live() if e.role == "decode" and e is not d3)
        assert victim.stop() == 0, victim.logs()
        _wait_for(lambda: victim.address not in _instances(gw), "the stopped server gone from routing")
        load.wait_each(3)
    finally:
        total = load.stop()
        assert gw.stop() == 0, gw.logs()
    assert not load.errors and total > 0, load.errors


def _dashboard_metrics() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    return {name for e in exprs for name in re.findall(r"pdserve:[a-z0-9_]+", e)}


def _exported(url: str) -> set[str]:
    text = httpx.get(url, timeout=10).text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_dashboard_metric_is_exported(cluster, references):
    """Each series the dashboard queries (histograms by their _bucket
    samples, counters by _total) is in the gateway's or an engine server's
    /metrics after one disaggregated request."""
    live = cluster.live()
    gw = GatewayProcess("gw-metrics", ["--prefill", next(e.address for e in live if e.role == "prefill"),
                                       "--decode", next(e.address for e in live if e.role == "decode"),
                                       "--max-model-len", "4096", "--served-model-name", MODEL_NAME])
    gw.wait_ready()
    try:
        _wait_for(lambda: httpx.get(gw.http_url + "/health").status_code == 200, "the gateway healthy")
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))
        deltas = list(stub.Generate(_request(_short_prompt(0), SHORT_TOKENS), timeout=60))
        assert [t for d in deltas for t in d.token_ids] == references[tuple(_short_prompt(0))]
        # /v1/models reports the context length, as vLLM's does
        card = httpx.get(gw.http_url + "/v1/models", timeout=10).json()["data"][0]
        assert (card["id"], card["max_model_len"]) == (MODEL_NAME, 4096)
        # and one that fails (unknown model: 404), so the error counter has a series
        assert httpx.post(gw.http_url + "/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        exported = _exported(gw.http_url + "/metrics").union(*(_exported(e.metrics_url) for e in live))
    finally:
        assert gw.stop() == 0, gw.logs()
    wanted = _dashboard_metrics()
    assert len(wanted) >= 10, wanted
    assert wanted <= exported, sorted(wanted - exported)
