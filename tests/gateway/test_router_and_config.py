"""Router choices, and flag parsing/validation."""
from __future__ import annotations

import argparse
import asyncio

import pytest

from gateway.config import GatewayConfig, add_cli_args, join_host_port, parse_addresses
from gateway.errors import ErrorKind, GatewayError
from gateway.instances import InstanceRegistry
from gateway.prefix_index import MemoryPrefixIndex, prompt_block_hashes
from gateway.router import Router, in_flight
from pdserve.v1 import common_pb2, engine_pb2


def _set(inst, healthy: bool, running: int = 0, waiting: int = 0, used: int = 0, total: int = 100) -> None:
    inst.is_healthy = healthy
    inst.load = common_pb2.LoadInfo(num_running=running, num_waiting=waiting, kv_blocks_used=used,
                                    kv_blocks_total=total)


PROMPT = list(range(100, 164))  # 64 tokens: 3 blocks of 16 can be prefix hits ((64 - 1) // 16)


async def _pick(router: Router, exclude=()):
    route, _ = await router.route(PROMPT, exclude)
    return route


def test_router_picks_the_least_loaded_healthy_instance():
    async def go():
        reg = InstanceRegistry(("p1:1", "p2:2"), ("d1:1", "d2:2", "d3:3"))
        d1, d2, d3 = reg.decode
        _set(d1, True, running=5)
        _set(d2, True, running=2, waiting=1)
        _set(d3, False)
        router = Router(reg)
        assert (await _pick(router)).decode is d2
        _set(d1, True, running=3, used=10)
        _set(d2, True, running=3, used=50)
        assert (await _pick(router)).decode is d1  # equal requests: lower KV usage
        assert (await _pick(router, ["d1:1"])).decode is d2
        with in_flight(d1), in_flight(d1), in_flight(d1), in_flight(d1):
            assert d1.num_requests == 4
            assert (await _pick(router)).decode is d2  # the gateway's own count is fresher than the poll
        route = await _pick(router)
        assert route.prefill is None and route.reason == "no-prefill-server"  # none healthy: local prefill
        _set(reg.prefill[1], True)
        assert (await _pick(router)).prefill is reg.prefill[1]
        for inst in reg.decode:
            inst.is_healthy = False
        with pytest.raises(GatewayError) as e:
            await _pick(router)
        assert e.value.kind is ErrorKind.UNAVAILABLE and "d1:1, d2:2, d3:3" in e.value.message
        await reg.close()
    asyncio.run(go())


def test_a_prefill_server_feeds_only_decode_servers_with_its_draft_model():
    """A draft model's KV travels with the target's: a decode server drafting with model X
    takes prefill servers with X only; one without a draft takes those without one; with no
    such prefill server the decode server prefills (no pair that would be refused)."""
    async def go():
        reg = InstanceRegistry(("p1:1", "p2:2"), ("d1:1", "d2:2"))
        (p1, p2), (d1, d2) = reg.prefill, reg.decode
        for inst, draft in ((p1, "draft-a"), (p2, ""), (d1, "draft-a"), (d2, "")):
            _set(inst, True)
            inst.load.draft_model = draft
        router = Router(reg)
        for decode, prefill in ((d1, p1), (d2, p2)):
            route = await _pick(router, [i.address for i in reg.decode if i is not decode])
            assert (route.decode, route.prefill) == (decode, prefill)
        p1.load.draft_model = "draft-b"
        route = await _pick(router, ["d2:2"])
        assert route.decode is d1 and route.prefill is None and route.reason == "no-prefill-server"
        await reg.close()
    asyncio.run(go())


def test_local_prefill_fallbacks_are_counted_by_cause():
    """Where the router gives a request to its decode server because no prefill server is
    usable, it says why, once per decision; never with no prefill tier configured."""
    async def go():
        causes: list[str] = []
        reg = InstanceRegistry(("p1:1", "p2:2"), ("d1:1",))
        (p1, p2), (d1,) = reg.prefill, reg.decode
        for inst in (p1, p2, d1):
            _set(inst, True)
        router = Router(reg, on_local_prefill_fallback=causes.append)
        assert (await _pick(router)).prefill is not None and causes == []
        assert (await router.route(PROMPT, exclude_prefill=["p1:1", "p2:2"]))[0].prefill is None
        assert causes == ["prefill_failed"]  # both healthy, both failed this request
        d1.load.draft_model = "draft-a"
        assert (await _pick(router)).prefill is None and causes[-1] == "draft_model"
        d1.load.draft_model = ""
        _set(p1, False)
        _set(p2, False)
        assert (await _pick(router)).prefill is None and causes[-1] == "no_healthy_prefill_server"
        await reg.set_addresses("prefill", [])
        assert (await _pick(router)).prefill is None and causes[-1] == "no_prefill_server"
        assert len(causes) == 4
        quiet = Router(InstanceRegistry((), ("d1:1",)))  # no prefill tier: prefilling locally is the plan
        _set(quiet._registry.decode[0], True)
        assert (await _pick(quiet)).reason == "no-prefill-server"
        await reg.close()
    asyncio.run(go())


def test_host_staged_transfers_are_counted_in_metrics_and_cluster():
    """A finished request whose prefill server reported a host-staged KV hand-off counts once in
    pdserve:gateway_kv_host_staged_transfers_total and /cluster's degraded field."""
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics("m")
    assert metrics.degraded_json()["kv_host_staged_transfers"] == 0
    metrics.on_kv_host_staged()
    assert metrics.degraded_json()["kv_host_staged_transfers"] == 1
    assert 'pdserve:gateway_kv_host_staged_transfers_total{model_name="m"} 1.0' in metrics.render().decode()


def test_router_spreads_ties():
    async def go():
        reg = InstanceRegistry((), ("a:1", "b:2"))
        for inst in reg.decode:
            _set(inst, True)
        router = Router(reg)
        picks = [(await _pick(router)).decode.address for _ in range(4)]
        await reg.close()
        return picks
    assert sorted(asyncio.run(go())) == ["a:1", "a:1", "b:2", "b:2"]


class _FixedIndex:
    """A prefix index with known contents (the real backends are tested against real servers)."""

    def __init__(self, blocks: dict[str, int]) -> None:
        self.blocks, self.calls = blocks, []

    async def match(self, namespace, hashes):
        self.calls.append((namespace, len(hashes)))
        return dict(self.blocks)


def test_kv_aware_prefill_choice_weighs_cached_tokens_against_queued_work():
    async def go():
        reg = InstanceRegistry(("p1:1", "p2:2"), ("d1:1",))
        for inst in reg:
            _set(inst, True)
            inst.load.cache_namespace, inst.load.block_size = "m:16:float32", 16
        p1, p2 = reg.prefill
        index = _FixedIndex({"p2:2": 3})  # p2 holds 48 of the 64 prompt tokens
        router = Router(reg, index, overlap_weight=1.0)
        route = await _pick(router)
        assert route.prefill is p2 and route.reason == "prefix" and route.cached_tokens(p2) == 48
        assert index.calls == [("m:16:float32", 3)]
        with in_flight(p2, tokens=40):  # p2: 16 to compute + 40 queued > p1: 64 to compute
            assert (await _pick(router)).prefill is p2  # 56 < 64
        with in_flight(p2, tokens=60):
            route = await _pick(router)
            assert route.prefill is p1 and route.reason == "load"  # 76 > 64
        router.overlap_weight = 0.0  # queued work alone: a tie (nothing queued), so the one routed to less
        assert (await _pick(router)).prefill is p1
        # Conditional disaggregation: the decode server lacks at most 20 tokens -> it prefills itself.
        router.local_prefill_threshold = 20
        index.blocks = {"d1:1": 3}  # 64 - 48 = 16 missing
        route = await _pick(router)
        assert route.prefill is None and route.reason == "local"
        index.blocks = {"d1:1": 2}  # 32 missing
        assert (await _pick(router)).prefill is not None
        await reg.close()
    asyncio.run(go())


def test_decode_choice_prefers_the_server_holding_the_prompts_prefix():
    """Two decode servers with prefix data (the in-memory index, fed as the servers' watch
    streams feed it): at equal load the one holding more of the prompt wins, even against
    the round-robin tie-break and a lower KV usage; one request fewer outweighs a 3/4 hit."""
    async def go():
        reg = InstanceRegistry((), ("d1:1", "d2:2"))
        d1, d2 = reg.decode
        for inst in reg:
            _set(inst, True, running=2, used=10)
            inst.load.cache_namespace, inst.load.block_size = "m:16:float32", 16
        d1.load.kv_blocks_used = 5  # d1 is the better pick on everything but the prefix
        hashes = prompt_block_hashes(PROMPT, 16)  # 3 blocks
        index = MemoryPrefixIndex([])
        for inst, held in ((d1, hashes[:1]), (d2, hashes)):
            index.apply(inst.address, engine_pb2.CacheEventBatch(cache_namespace="m:16:float32", snapshot=True,
                                                                 hashes=held))
        router = Router(reg, index)
        picks = [await _pick(router) for _ in range(3)]
        assert [r.decode.address for r in picks] == ["d2:2"] * 3
        assert picks[0].cached_tokens(d2) == 48 and picks[0].cached_tokens(d1) == 16
        d1.load.num_running = 1
        assert (await _pick(router)).decode is d1
        index.apply("d2:2", engine_pb2.CacheEventBatch(hashes=hashes[:1], stored=[False]))  # d2 evicted it
        d1.load.num_running = 2
        assert (await _pick(router)).decode is d1  # now d1 holds more (16 tokens against none)
        await reg.close()
    asyncio.run(go())


def _parse(*argv: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return GatewayConfig.from_args(parser.parse_args(list(argv)))


def test_flags_and_defaults(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = _parse("--decode", "a:1, b:2", "--prefill", "")
    assert cfg.decode == ("a:1", "b:2") and cfg.prefill == ()
    assert (cfg.host, cfg.http_port, cfg.grpc_port, cfg.request_timeout) == ("127.0.0.1", 8000, 50051, 600.0)
    assert cfg.api_key is None and cfg.log_requests and cfg.max_model_len is None
    assert (cfg.kv_host_hit_credit, cfg.max_n) == (0.99, 128)
    assert (_parse("--decode", "a:1", "--kv-host-hit-credit", "0.8").kv_host_hit_credit, _parse(
        "--decode", "a:1", "--max-n", "4").max_n) == (0.8, 4)
    monkeypatch.setenv("PDSERVE_API_KEY", "k")
    assert _parse("--decode", "a:1").api_key == "k"
    assert _parse("--decode", "a:1", "--api-key", "x").api_key == "x"


@pytest.mark.parametrize("argv, fragment", [
    ((), "--decode needs at least one"),
    (("--decode", "nohost"), "not a host:port"),
    (("--decode", "a:1,a:1"), "listed twice"),
    (("--decode", "a:1", "--request-timeout", "0"), "--request-timeout"),
    (("--decode", "a:1", "--http-port", "9", "--grpc-port", "9"), "must differ"),
    (("--decode", "a:1", "--enable-auto-tool-choice"), "needs --tool-call-parser"),
    (("--decode", "a:1", "--kv-host-hit-credit", "1.5"), "--kv-host-hit-credit must be within"),
    (("--decode", "a:1", "--max-n", "0"), "--max-n must be in"),
])
def test_bad_flags(argv, fragment, monkeypatch):
    with pytest.raises(ValueError, match=fragment):
        _parse(*argv)


def test_chat_and_tool_flags_reach_the_gateway_through_pdserve_up():
    from pdserve.cli import build_parser
    from pdserve.cli.up import Cluster

    flags = ["--chat-template", "t.jinja", "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"]
    argv = Cluster(build_parser("up").parse_args(["up", *flags])).gateway_argv()
    cfg = _parse(*argv[1:])
    assert (cfg.chat_template, cfg.tool_call_parser, cfg.enable_auto_tool_choice) == ("t.jinja", "llama3_json", True)
    assert "--enable-auto-tool-choice" not in Cluster(build_parser("up").parse_args(["up"])).gateway_argv()
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        Cluster(build_parser("up").parse_args(["up", "--enable-auto-tool-choice"]))


def test_address_helpers():
    assert parse_addresses("[::1]:5, h:6", "--x") == ("[::1]:5", "h:6")
    assert join_host_port("::1", 5) == "[::1]:5" and join_host_port("h", 6) == "h:6"


def test_a_busy_server_is_not_dropped_for_one_late_poll():
    """Polls that run past their deadline count only several in a row; a
    refused connection counts at once."""
    import grpc

    async def go():
        reg = InstanceRegistry((), ("d1:1",))
        inst = reg.decode[0]
        _set(inst, True)

        def failing(code):
            async def call(*args, **kwargs):
                raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")
            return call

        class Stub:
            GetLoad = staticmethod(failing(grpc.StatusCode.DEADLINE_EXCEEDED))

        inst.stub, inst._health = Stub(), Stub()
        Stub.Check = Stub.GetLoad
        healthy = []
        for _ in range(3):
            await inst.poll(0.01)
            healthy.append(inst.is_healthy)
        assert healthy == [True, True, False]
        _set(inst, True)
        inst.num_late_polls = 0
        Stub.GetLoad = Stub.Check = staticmethod(failing(grpc.StatusCode.UNAVAILABLE))
        await inst.poll(0.01)
        assert not inst.is_healthy
        await reg.close()
    asyncio.run(go())


def test_routing_and_choice_flags_reach_the_gateway_through_pdserve_up():
    from pdserve.cli import build_parser
    from pdserve.cli.up import Cluster

    argv = Cluster(build_parser("up").parse_args(["up", "--kv-host-hit-credit", "0.5", "--max-n", "4"])).gateway_argv()
    cfg = _parse(*argv[1:])
    assert (cfg.kv_host_hit_credit, cfg.max_n) == (0.5, 4)


@pytest.mark.parametrize("flags, credit", [
    (["--device", "cpu"], 0.99),
    (["--device", "cuda"], 0.79),
    (["--devices", "cuda:0,cuda:1"], 0.79),
    (["--device", "cuda:1", "--kv-host-hit-credit", "0.3"], 0.3),
])
def test_pdserve_up_credits_host_hits_by_its_servers_device(flags, credit):
    """A host-tier hit is worth 0.99 of a device hit on CPU and 0.79 on a GPU (measured:
    bench/host_hit_cost.py); the gateway gets the credit of the device its servers run on."""
    from pdserve.cli import build_parser
    from pdserve.cli.up import Cluster

    argv = Cluster(build_parser("up").parse_args(["up", *flags])).gateway_argv()
    assert _parse(*argv[1:]).kv_host_hit_credit == credit
