"""Multi-LoRA at the gateway: ``model`` -> adapter, routing on the servers that
hold it (slots, fingerprints), prefix hashes from the adapter's root, and load
/ unload fanned out to every engine server (fake engine servers on loopback,
tests/gateway/fake_engine.py), through the service and both front ends
in-process."""
from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from engine.block_hash import NONE_HASH, hash_block_tokens, hash_request_blocks
from engine.sampling_params import SamplingParams
from gateway.errors import ErrorKind, GatewayError
from gateway.grpc_servicer import GatewayServicer, add_gateway_servicer
from gateway.http_api import create_app
from gateway.instances import InstanceRegistry
from gateway.lora import LoRAAdmin, ServerResult, known_adapters, outcome_error
from gateway.metrics import GatewayMetrics
from gateway.prefix_index import MemoryPrefixIndex, prompt_block_hashes
from gateway.request_flow import PreparedRequest, RequestFlow
from gateway.router import Router
from gateway.service import GatewayService
from gateway.tokenization import InputProcessor
from pdserve.v1 import common_pb2, engine_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.fake_engine import FakeEngine, lora_adapter

MODEL = "SmolLM2-135M-Instruct"
KEY = "lora-key"
PROMPT = list(range(100, 164))  # 64 tokens: 3 blocks of 16 can be prefix hits
NS = "m:16:float32"


def _set(inst, healthy: bool = True, running: int = 0, adapters=(), max_loras: int = 2) -> None:
    inst.is_healthy = healthy
    inst.load = common_pb2.LoadInfo(num_running=running, kv_blocks_total=100, block_size=16, cache_namespace=NS,
                                    lora_adapters=list(adapters), max_loras=max_loras if adapters else 0)


def _route(router: Router, lora: str | None, **kw):
    async def go():
        return (await router.route(PROMPT, lora_name=lora, **kw))[0]
    return go()


# --- model -> adapter ------------------------------------------------------------------------------

def test_model_selects_the_base_model_or_a_listed_adapter(tokenizer):
    inputs = InputProcessor(tokenizer, MODEL, max_model_len=100, vocab_size=49152)
    try:
        adapters = {"sql": None, "chat": None}
        assert inputs.check_model(None, adapters) is None
        assert inputs.check_model("", adapters) is None
        assert inputs.check_model(MODEL, adapters) is None
        assert inputs.check_model(MODEL, {MODEL: None}) is None  # the base model wins over a same-named adapter
        assert inputs.check_model("sql", adapters) == "sql"
        with pytest.raises(GatewayError) as e:
            inputs.check_model("gpt-4", adapters)
        assert e.value.kind is ErrorKind.NOT_FOUND and e.value.code == "model_not_found"
        assert e.value.message == (f"The model `gpt-4` does not exist. This server serves `{MODEL}` and the LoRA "
                                   "adapters `chat`, `sql`.")
        with pytest.raises(GatewayError) as e:
            inputs.check_model("sql")  # no server lists it (any more)
        assert e.value.message == f"The model `sql` does not exist. This server serves `{MODEL}`."
    finally:
        inputs.close()


def test_known_adapters_are_every_servers_listings():
    async def go():
        reg = InstanceRegistry(("p:1",), ("d1:1", "d2:2"))
        p, d1, d2 = reg.prefill[0], *reg.decode
        _set(p, adapters=[lora_adapter("only-prefill")])
        _set(d1, adapters=[lora_adapter("a", "/adapters/a-on-d1")])
        _set(d2, healthy=False, adapters=[lora_adapter("a", "/adapters/a-on-d2"), lora_adapter("b")])
        found = known_adapters([*reg.decode, *reg.prefill])
        await reg.close()
        return {name: a.path for name, a in found.items()}
    assert asyncio.run(go()) == {"a": "/adapters/a-on-d1", "b": "/adapters/b",
                                 "only-prefill": "/adapters/only-prefill"}


# --- routing ---------------------------------------------------------------------------------------

def test_only_servers_holding_the_adapter_are_candidates():
    async def go():
        reg = InstanceRegistry(("p1:1", "p2:2"), ("d1:1", "d2:2"))
        p1, p2 = reg.prefill
        d1, d2 = reg.decode
        _set(d1, running=0)  # the least loaded, but no adapter
        _set(d2, running=5, adapters=[lora_adapter("a")])
        _set(p1)
        _set(p2, adapters=[lora_adapter("a")])
        router = Router(reg)
        route = await _route(router, "a")
        assert (route.decode, route.prefill) == (d2, p2)
        route = await _route(router, None)  # the base model: every server
        assert route.decode is d1
        # Colocated: no prefill server holds it -> the decode server prefills.
        _set(p2)
        route = await _route(router, "a")
        assert route.decode is d2 and route.prefill is None and route.reason == "no-prefill-server"
        await reg.close()
    asyncio.run(go())


def test_no_healthy_decode_server_holding_the_adapter_is_unavailable():
    async def go():
        reg = InstanceRegistry((), ("d1:1", "d2:2"))
        d1, d2 = reg.decode
        _set(d1)
        _set(d2, healthy=False, adapters=[lora_adapter("a")])
        router = Router(reg)
        errors = []
        for name in ("a", "zz"):
            with pytest.raises(GatewayError) as e:
                await _route(router, name)
            errors.append(e.value)
        await reg.close()
        return errors
    held, unknown = asyncio.run(go())
    assert held.kind is unknown.kind is ErrorKind.UNAVAILABLE
    assert held.code == "no_healthy_decode_server"
    assert held.message == ("no healthy decode server serves LoRA adapter `a`: it is listed only by decode servers "
                            "that are unhealthy or failed this request: d2:2; healthy decode servers: d1:1")
    assert "`zz`" in unknown.message and "no decode server lists it" in unknown.message


def test_adapter_in_a_slot_or_a_free_slot_beats_a_swap():
    """The slot comes first, then the usual costs: ``ready`` (in slot / free slot) decode
    and prefill servers win over less loaded ones that must evict another adapter first."""
    async def go():
        reg = InstanceRegistry(("p1:1", "p2:2"), ("d1:1", "d2:2", "d3:3"))
        d1, d2, d3 = reg.decode
        p1, p2 = reg.prefill
        other = lora_adapter("other")
        swap = [lora_adapter("a", in_slot=False), other]  # max_loras 1, taken by "other"
        _set(d1, running=5, adapters=[lora_adapter("a")])  # in slot, busy
        _set(d2, running=0, adapters=swap, max_loras=1)  # idle, needs a swap
        _set(d3, running=6, adapters=[lora_adapter("a", in_slot=False), other], max_loras=2)  # a free slot
        _set(p1, adapters=swap, max_loras=1)
        _set(p2, adapters=[lora_adapter("a")])
        router = Router(reg)
        p2.num_queued_tokens = 1000  # far more queued work than p1's
        route = await _route(router, "a")
        assert (route.decode, route.prefill) == (d1, p2)
        d1.load.num_running = 7  # among the ready ones load decides: d3 (free slot) is now the least loaded
        assert (await _route(router, "a")).decode is d3
        assert (await _route(router, None)).decode is d2  # the base model needs no slot
        for inst, running in ((d1, 3), (d2, 1), (d3, 2), (p1, 0), (p2, 0)):
            _set(inst, running=running, adapters=swap, max_loras=1)  # everyone must swap: the usual costs
        assert (await _route(router, "a")).decode is d2
        await reg.close()
    asyncio.run(go())


def test_prefill_servers_with_another_copy_are_skipped():
    async def go():
        reg = InstanceRegistry(("p1:1", "p2:2"), ("d1:1",))
        p1, p2 = reg.prefill
        _set(reg.decode[0], adapters=[lora_adapter("a", fingerprint="f1")])
        _set(p1, adapters=[lora_adapter("a", fingerprint="f2")])  # other weights under the same name
        _set(p2, running=9, adapters=[lora_adapter("a", fingerprint="f1")])
        router = Router(reg)
        assert (await _route(router, "a")).prefill is p2
        _set(p2, adapters=[lora_adapter("a", fingerprint="f3")])
        route = await _route(router, "a")
        assert route.prefill is None and route.reason == "no-prefill-server"
        await reg.close()
    asyncio.run(go())


# --- prefix hashes from the adapter's root ---------------------------------------------------------

def test_prompt_block_hashes_chain_from_the_adapters_root_as_the_engine_does():
    from engine.kv_cache_manager import KVCacheManager
    from engine.lora.config import LoRAInfo
    from engine.request import Request

    info = LoRAInfo("a", "/adapters/a", 8, "fp:/adapters/a", None)
    root = info.root_hash
    assert root == lora_adapter("a").root_hash  # the fake derives it as the engine does
    ours = prompt_block_hashes(PROMPT, 16, parent_hash=root)
    assert len(ours) == 3 and ours[0] == hash_block_tokens(root, PROMPT[:16])
    assert ours == hash_request_blocks(PROMPT[:48], 16, parent_hash=root)
    assert not set(ours) & set(prompt_block_hashes(PROMPT, 16))  # nothing shared with the base model
    assert prompt_block_hashes(PROMPT, 16) == hash_request_blocks(PROMPT[:48], 16, parent_hash=NONE_HASH)
    req = Request("r", PROMPT, SamplingParams())
    req.lora = info
    assert KVCacheManager(16, 16)._block_hashes(req, 3) == ours  # the engine's own prefix-cache keys


def test_prefix_match_of_an_adapter_request_uses_each_servers_root():
    async def go():
        reg = InstanceRegistry((), ("d1:1", "d2:2", "d3:3"))
        d1, d2, d3 = reg.decode
        a1, a2 = lora_adapter("a", fingerprint="f1"), lora_adapter("a", fingerprint="f2")
        _set(d1, running=1, adapters=[a1])
        _set(d2, running=1, adapters=[a2])
        _set(d3, running=1, adapters=[a1])
        base = prompt_block_hashes(PROMPT, 16)
        chain1 = prompt_block_hashes(PROMPT, 16, a1.root_hash)
        chain2 = prompt_block_hashes(PROMPT, 16, a2.root_hash)
        index = MemoryPrefixIndex([])
        for inst, held in ((d1, chain1[:2]), (d2, chain2), (d3, base + chain2)):
            index.apply(inst.address, engine_pb2.CacheEventBatch(cache_namespace=NS, snapshot=True, hashes=held))
        router = Router(reg, index)
        lora_route = await _route(router, "a")
        base_route = await _route(router, None)
        await reg.close()
        return lora_route, base_route
    lora_route, base_route = asyncio.run(go())
    # d3 holds chain2's blocks, but its copy roots chain1: not credited.
    assert lora_route.matched == {"d1:1": 32, "d2:2": 48} and lora_route.decode.address == "d2:2"
    assert base_route.matched == {"d3:3": 48} and base_route.decode.address == "d3:3"


# --- load / unload fan-out -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fakes():
    engines = [FakeEngine().start(), FakeEngine().start()]
    for e in engines:
        e.state.script = list(range(10, 30))
    yield engines
    for e in engines:
        e.stop()


@pytest.fixture(autouse=True)
def _reset(request):
    if "fakes" in request.fixturenames:
        for f in request.getfixturevalue("fakes"):
            f.reset()
            for lora in f.state.lora.values():
                lora.max_loras = 2  # --enable-lora --max-loras 2
    yield


def _registry(fakes, extra_decode: tuple[str, ...] = ()) -> InstanceRegistry:
    return InstanceRegistry([f.prefill_address for f in fakes], [f.decode_address for f in fakes] + list(extra_decode),
                            poll_timeout=0.5)


def _admin_run(fakes, body, extra_decode=()):
    async def go():
        reg = _registry(fakes, extra_decode)
        await reg.poll_once()  # polled once; no background polling: only the admin's refresh updates the view
        try:
            return await body(reg, LoRAAdmin(reg, MODEL))
        finally:
            await reg.close()
    return asyncio.run(go())


def test_load_and_unload_reach_every_server_and_refresh_the_view(fakes):
    async def body(reg, admin):
        loaded = await admin.load("sql", "/adapters/sql")
        seen = {i.address: i.lora_adapter("sql") is not None for i in reg}
        unloaded = await admin.unload("sql")
        gone = {i.address: i.lora_adapter("sql") is None for i in reg}
        return loaded, seen, unloaded, gone
    loaded, seen, unloaded, gone = _admin_run(fakes, body)
    addresses = {f.prefill_address: "prefill" for f in fakes} | {f.decode_address: "decode" for f in fakes}
    for results in (loaded, unloaded):
        assert {(r.address, r.role, r.ok, r.error) for r in results} == {(a, role, True, "")
                                                                          for a, role in addresses.items()}
    assert all(seen.values()) and all(gone.values()) and set(seen) == set(addresses)
    for f in fakes:
        assert f.state.lora["decode"].calls == f.state.lora["prefill"].calls == ["load sql /adapters/sql",
                                                                                 "unload sql"]


def test_load_failures_name_each_server_and_its_reason(fakes):
    bad, good = fakes
    bad.state.lora["decode"].max_loras = 0  # not started with --enable-lora

    async def body(reg, admin):
        with pytest.raises(GatewayError) as one:
            await admin.load("sql", "/adapters/sql")
        holding = {i.address for i in reg if i.lora_adapter("sql") is not None}
        bad.state.lora["decode"].max_loras = 2
        with pytest.raises(GatewayError) as every:
            await admin.load("sql2", "/tmp/not-an-adapter")
        return one.value, every.value, holding
    one, every, holding = _admin_run(fakes, body)
    assert one.kind is ErrorKind.INVALID_ARGUMENT and one.code == "lora_load_failed"
    assert one.message == (f"cannot load LoRA adapter `sql` on 1 of 4 engine server(s): decode server "
                           f"{bad.decode_address}: FAILED_PRECONDITION: LoRA is not enabled on this server (start it "
                           f"with --enable-lora) (loaded on {bad.prefill_address}, {good.prefill_address}, "
                           f"{good.decode_address})")
    assert holding == {bad.prefill_address, good.prefill_address, good.decode_address}  # the view is fresh
    assert every.kind is ErrorKind.INVALID_ARGUMENT and "on 4 of 4 engine server(s)" in every.message
    assert every.message.count("/tmp/not-an-adapter: no adapter_config.json") == 4 and "loaded on" not in every.message


def test_unload_of_an_unknown_adapter_is_not_found(fakes):
    async def body(reg, admin):
        with pytest.raises(GatewayError) as e:
            await admin.unload("nope")
        return e.value
    error = _admin_run(fakes, body)
    assert error.kind is ErrorKind.NOT_FOUND and error.code == "lora_adapter_not_found"
    assert error.message.count("NOT_FOUND: LoRA adapter 'nope' is not loaded") == 4


def test_an_unreachable_server_fails_the_load_and_is_named(fakes):
    async def body(reg, admin):
        with pytest.raises(GatewayError) as e:
            await admin.load("sql", "/adapters/sql")
        return e.value
    error = _admin_run(fakes, body, extra_decode=("127.0.0.1:1",))
    assert error.kind is ErrorKind.UNAVAILABLE and error.kind.http_status == 503
    assert "on 1 of 5 engine server(s): decode server 127.0.0.1:1: UNAVAILABLE" in error.message
    assert all(f.state.lora["decode"].adapters.keys() == {"sql"} for f in fakes)


def test_a_slow_server_times_out(fakes):
    fakes[0].state.lora["prefill"].load_delay = 2.0

    async def body(reg, admin):
        admin.timeout = 0.3
        started = time.monotonic()
        with pytest.raises(GatewayError) as e:
            await admin.load("sql", "/adapters/sql")
        return e.value, time.monotonic() - started
    error, seconds = _admin_run(fakes, body)
    assert error.kind is ErrorKind.DEADLINE_EXCEEDED and seconds < 1.5
    assert f"prefill server {fakes[0].prefill_address}: DEADLINE_EXCEEDED" in error.message


def test_no_known_server_and_bad_names():
    async def go():
        reg = InstanceRegistry()
        admin = LoRAAdmin(reg, MODEL)
        errors = []
        for call in (admin.load("sql", "/adapters/sql"), admin.load("", "/x"), admin.load("sql", " "),
                     admin.unload(MODEL), admin.unload("\ud800")):
            with pytest.raises(GatewayError) as e:
                await call
            errors.append(e.value)
        await reg.close()
        return errors
    none, empty_name, empty_path, base, surrogate = asyncio.run(go())
    assert none.kind is ErrorKind.UNAVAILABLE and none.code == "no_engine_server" and "`sql`" in none.message
    assert (empty_name.kind, empty_name.param) == (ErrorKind.INVALID_ARGUMENT, "lora_name")
    assert (empty_path.kind, empty_path.param) == (ErrorKind.INVALID_ARGUMENT, "lora_path")
    assert base.kind is ErrorKind.INVALID_ARGUMENT and "served model's name" in base.message
    assert (surrogate.kind, surrogate.param) == (ErrorKind.INVALID_ARGUMENT, "lora_name")  # JSON's \ud800


@pytest.mark.parametrize("statuses, kind", [
    ((grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT), ErrorKind.INVALID_ARGUMENT),
    ((grpc.StatusCode.NOT_FOUND, None), ErrorKind.NOT_FOUND),
    ((grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), ErrorKind.DEADLINE_EXCEEDED),
    ((grpc.StatusCode.UNIMPLEMENTED,), ErrorKind.UNAVAILABLE),
    ((None,), ErrorKind.UNAVAILABLE),
])
def test_the_answers_kind_is_the_first_failure_kind(statuses, kind):
    results = [ServerResult(f"h:{i}", "decode", False, "x", s) for i, s in enumerate(statuses)]
    assert outcome_error("load", "a", results + [ServerResult("ok:1", "prefill", True)]).kind is kind
    assert outcome_error("load", "a", [ServerResult("ok:1", "prefill", True)]) is None


# --- requests under an adapter ---------------------------------------------------------------------

def _request(lora: str | None, max_tokens: int = 4) -> PreparedRequest:
    now = time.monotonic()
    return PreparedRequest("r", "r-1", [1, 2, 3], SamplingParams(max_tokens=max_tokens), now, now + 10,
                           lora_name=lora)


def _flow_run(fakes, body, decodes=None, prefill=True):
    async def go():
        reg = InstanceRegistry([fakes[0].prefill_address] if prefill else [],
                               decodes if decodes is not None else [fakes[0].decode_address])
        await reg.poll_once()
        try:
            return await body(reg, Router(reg))
        finally:
            await reg.close()
    return asyncio.run(go())


async def _collect(flow: RequestFlow):
    return [c async for c in flow.stream()]


def test_adapter_name_and_fingerprint_reach_both_servers(fakes):
    fake = fakes[0]
    for lora in fake.state.lora.values():
        lora.add(lora_adapter("sql"))

    async def body(reg, router):
        return await _collect(RequestFlow(_request("sql"), router))
    chunks = _flow_run(fakes, body)
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13]
    (d,), (p,) = fake.state.decode_requests, fake.state.prefill_requests
    assert d.lora_name == "sql" and d.remote_prefill
    assert (p.lora_name, p.lora_fingerprint) == ("sql", "fp:/adapters/sql")
    _flow_run(fakes, lambda reg, router: _collect(RequestFlow(_request(None), router)))
    assert fake.state.decode_requests[-1].lora_name == "" and fake.state.prefill_requests[-1].lora_name == ""


def test_a_copy_that_changed_since_the_poll_is_prefilled_by_the_decode_server(fakes):
    """The gateway saw equal copies; by reservation time the decode server holds another
    one: the prefill server is not called and the decode server prefills (a fresh
    attempt). The same when the prefill server's own copy changed (it refuses)."""
    fake = fakes[0]
    for lora in fake.state.lora.values():
        lora.add(lora_adapter("sql"))

    async def body(reg, router):
        fake.state.lora["decode"].add(lora_adapter("sql", fingerprint="new"))  # after the poll
        return await _collect(RequestFlow(_request("sql"), router))
    chunks = _flow_run(fakes, body)
    assert chunks[-1].finish_reason == "length" and not fake.state.prefill_requests
    assert [d.remote_prefill for d in fake.state.decode_requests] == [True, False]
    fake.reset()
    for lora in fake.state.lora.values():
        lora.add(lora_adapter("sql"))

    async def body2(reg, router):
        fake.state.lora["prefill"].add(lora_adapter("sql", fingerprint="new"))
        return await _collect(RequestFlow(_request("sql"), router))
    chunks = _flow_run(fakes, body2)
    assert chunks[-1].finish_reason == "length" and len(fake.state.prefill_requests) == 1
    assert [d.remote_prefill for d in fake.state.decode_requests] == [True, False]


def test_a_decode_server_that_lost_the_adapter_is_skipped(fakes):
    gone, kept = fakes
    for f in fakes:
        f.state.lora["decode"].add(lora_adapter("sql"))

    async def body(reg, router):
        gone.state.lora["decode"].adapters.clear()  # unloaded behind the gateway's back
        reg.decode[1].load.num_running = 5  # so that the stale one is tried first
        return await _collect(RequestFlow(_request("sql"), router))
    chunks = _flow_run(fakes, body, decodes=[gone.decode_address, kept.decode_address], prefill=False)
    assert chunks[-1].finish_reason == "length"
    assert len(gone.state.decode_requests) == 1 and len(kept.state.decode_requests) == 1


# --- the front ends --------------------------------------------------------------------------------

def _front_ends(fakes, tokenizer, body):
    """``body(http, grpc_stub, service)`` against a service in front of the first fake engine
    (its prefill and decode server: the fake hands KV over only within one engine): the HTTP
    app (--api-key KEY) over ASGI, the gRPC servicer on a loopback port."""
    async def go():
        reg = _registry(fakes[:1])
        await reg.poll_once()
        inputs = InputProcessor(tokenizer, MODEL, max_model_len=2048, vocab_size=49152)
        service = GatewayService(inputs, reg, GatewayMetrics(MODEL), request_timeout=10, log_requests=False,
                                 allow_runtime_lora_updating=True)
        server = grpc.aio.server()
        add_gateway_servicer(GatewayServicer(service, KEY), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        transport = httpx.ASGITransport(app=create_app(service, KEY))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as http, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await body(http, gateway_pb2_grpc.GatewayStub(channel), service)
        finally:
            await server.stop(0)
            await reg.close()
            inputs.close()
    return asyncio.run(go())


def test_http_adapter_endpoints_models_and_requests(fakes, tokenizer):
    async def body(http, _, service):
        out = {}
        out["no_key"] = (await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x"},
                                         headers={"Authorization": "Bearer wrong"})).status_code
        out["load"] = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql",
                                                                     "lora_path": "/adapters/sql"})
        out["models"] = (await http.get("/v1/models")).json()
        out["model"] = (await http.get("/v1/models/sql")).json()
        out["completion"] = await http.post("/v1/completions", json={"model": "sql", "prompt": "hi",
                                                                     "max_tokens": 3})
        out["chat"] = await http.post("/v1/chat/completions", json={
            "model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        out["unknown"] = await http.post("/v1/completions", json={"model": "nosuch", "prompt": "hi"})
        out["bad_path"] = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp/x"})
        out["bad_body"] = await http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        out["unload_unknown"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
        out["metrics"] = (await http.get("/metrics")).text
        out["unload"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        out["models_after"] = (await http.get("/v1/models")).json()
        return out
    out = _front_ends(fakes, tokenizer, body)
    assert out["no_key"] == 401
    assert out["load"].status_code == 200
    load = out["load"].json()
    assert load["lora_name"] == "sql" and len(load["servers"]) == 2
    assert all(s["ok"] and s["error"] == "" and s["role"] in ("prefill", "decode") for s in load["servers"])
    base, sql = out["models"]["data"]
    assert base["id"] == MODEL and base["parent"] is None and base["root"] == MODEL and "max_model_len" in base
    assert {k: v for k, v in sql.items() if k != "created"} == {"id": "sql", "object": "model", "owned_by": "pdserve",
                                                                "root": "/adapters/sql", "parent": MODEL}
    assert out["model"]["id"] == "sql" and out["model"]["parent"] == MODEL
    for key in ("completion", "chat"):
        assert out[key].status_code == 200 and out[key].json()["model"] == "sql"
    assert [d.lora_name for d in fakes[0].state.decode_requests] == ["sql", "sql"]
    assert [p.lora_fingerprint for p in fakes[0].state.prefill_requests] == ["fp:/adapters/sql"] * 2
    unknown = out["unknown"].json()["error"]
    assert out["unknown"].status_code == 404 and unknown["code"] == "model_not_found"
    assert "the LoRA adapters `sql`" in unknown["message"]
    assert out["bad_path"].status_code == 400
    bad = out["bad_path"].json()["error"]
    assert bad["type"] == "invalid_request_error" and bad["message"].count("no adapter_config.json") == 2
    assert fakes[0].decode_address in bad["message"] and fakes[0].prefill_address in bad["message"]
    assert out["bad_body"].status_code == 400 and "lora_path" in out["bad_body"].json()["error"]["message"]
    assert out["unload_unknown"].status_code == 404
    assert out["unload_unknown"].json()["error"]["code"] == "lora_adapter_not_found"
    assert f'pdserve:lora_requests_total{{lora_name="sql",model_name="{MODEL}"}} 2.0' in out["metrics"]
    assert out["unload"].status_code == 200 and [m["id"] for m in out["models_after"]["data"]] == [MODEL]


def test_grpc_adapter_methods_and_generate(fakes, tokenizer):
    auth = [("authorization", f"Bearer {KEY}")]

    async def body(_, stub, service):
        out = {}
        for name, call in (("no_key", lambda: stub.ListModels(gateway_pb2.ListModelsRequest())),
                           ("bad", lambda: stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
                               lora_name="x", lora_path="/tmp/x"), metadata=auth)),
                           ("unknown", lambda: stub.UnloadLoRAAdapter(
                               common_pb2.UnloadLoRAAdapterRequest(lora_name="nope"), metadata=auth))):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call()
            out[name] = e.value
        out["load"] = await stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
            lora_name="sql", lora_path="/adapters/sql"), metadata=auth)
        out["models"] = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=auth)
        out["generate"] = [m async for m in stub.Generate(gateway_pb2.GenerateRequest(
            model="sql", text="hi", sampling=common_pb2.SamplingParams(max_tokens=3)), metadata=auth)]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(gateway_pb2.GenerateRequest(model="other", text="hi"), metadata=auth).read()
        out["generate_unknown"] = e.value
        out["unload"] = await stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="sql"),
                                                     metadata=auth)
        return out
    out = _front_ends(fakes, tokenizer, body)
    assert out["no_key"].code() == grpc.StatusCode.UNAUTHENTICATED
    assert out["bad"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert out["bad"].details().startswith("cannot load LoRA adapter `x` on 2 of 2 engine server(s): ")
    assert out["unknown"].code() == grpc.StatusCode.NOT_FOUND
    assert len(out["load"].servers) == 2 and all(s.ok and not s.error for s in out["load"].servers)
    assert [(m.id, m.parent, m.root) for m in out["models"].models] == [(MODEL, "", MODEL),
                                                                        ("sql", MODEL, "/adapters/sql")]
    assert out["generate"][-1].finish_reason == "length"
    assert [d.lora_name for d in fakes[0].state.decode_requests] == ["sql"]
    assert out["generate_unknown"].code() == grpc.StatusCode.NOT_FOUND
    assert "`other` does not exist" in out["generate_unknown"].details()
    assert len(out["unload"].servers) == 2
