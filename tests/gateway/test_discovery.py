"""Discovery without engines: the registry gaining and losing instances at
run time (removed ones drain, re-listed ones come back), discovery entries
and their look-ups (a failed look-up keeps the last answer; a missing name
is empty), the in-memory prefix index following the registry, and the
Redis registrations read from a real Redis with roles asked from real gRPC
health services. Real engine servers: tests/e2e/test_discovery.py."""
from __future__ import annotations

import argparse
import asyncio
import socket
import time

import pytest

from gateway import discovery
from gateway.config import GatewayConfig, add_cli_args
from gateway.discovery import Discovery, RedisRegistrations, resolve_host
from gateway.instances import DECODE, PREFILL, InstanceRegistry
from gateway.prefix_index import MemoryPrefixIndex
from gateway.router import in_flight
from rpc.local_redis import LocalRedis
from rpc.prefix_index import NAMESPACES_KEY, alive_key
from rpc.server import RpcServer
from tests.processes import free_port


def _addresses(instances) -> list[str]:
    return [i.address for i in instances]


def test_registry_adds_drains_and_revives_instances():
    async def go():
        reg = InstanceRegistry((), ("d1:1",))
        heard: list[tuple[str, str]] = []
        reg.add_listener(lambda i: heard.append(("added", i.address)), lambda i: heard.append(("removed", i.address)))
        d1 = reg.decode[0]
        await reg.set_addresses(DECODE, ["d1:1", "d2:2"])
        assert _addresses(reg.decode) == ["d1:1", "d2:2"] and reg.decode[0] is d1  # kept, not rebuilt
        with in_flight(d1):  # a request still streaming from d1 when it is removed
            await reg.set_addresses(DECODE, ["d2:2"])
            assert _addresses(reg.decode) == ["d2:2"] and reg.draining == [d1] and d1.is_draining
            reg.drop_drained()
            assert reg.draining == [d1]  # kept while the request runs
            cluster = {e["address"]: e for e in reg.to_json()["instances"]}
            assert cluster["d1:1"]["draining"] and cluster["d1:1"]["num_in_flight"] == 1
        reg.drop_drained()
        assert reg.draining == [] and "d1:1" not in {e["address"] for e in reg.to_json()["instances"]}
        # Listed again while draining: the same instance (with its in-flight count) comes back.
        d2 = reg.decode[0]
        with in_flight(d2):
            await reg.set_addresses(DECODE, [])
            assert reg.decode == [] and reg.draining == [d2]
            await reg.set_addresses(DECODE, ["d2:2"])
            assert reg.decode == [d2] and reg.draining == [] and not d2.is_draining and d2.num_in_flight == 1
        await reg.set_addresses(PREFILL, ["p1:1"])
        assert _addresses(reg.prefill) == ["p1:1"] and reg.prefill[0].role == PREFILL
        assert heard == [("added", "d2:2"), ("removed", "d1:1"), ("removed", "d2:2"), ("added", "d2:2"),
                         ("added", "p1:1")]
        await reg.close()
    asyncio.run(go())


def _config(*argv: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return GatewayConfig.from_args(parser.parse_args(list(argv)))


def test_entries_are_validated():
    cfg = _config("--decode", "dns:decode.svc:50071, 10.0.0.7:50071", "--prefill", "redis",
                  "--redis-url", "redis://r:6379/0", "--discovery-interval", "0.5")
    assert cfg.decode == ("dns:decode.svc:50071", "10.0.0.7:50071") and cfg.prefill == ("redis",)
    assert cfg.discovery_interval == 0.5
    assert _config("--decode", "a:1").discovery_interval == 5.0
    for argv, fragment in [(("--decode", "dns:decode.svc"), "dns:NAME:PORT"),
                           (("--decode", "dns::50071"), "dns:NAME:PORT"),
                           (("--decode", "redis"), "--decode redis reads the servers registered in Redis"),
                           (("--decode", "a:1", "--prefill", "redis"), "--prefill redis"),
                           (("--decode", "a:1", "--discovery-interval", "0"), "--discovery-interval")]:
        with pytest.raises(ValueError, match=fragment):
            _config(*argv)


def test_resolve_host_with_the_system_resolver():
    assert resolve_host("localhost", 5) in (["127.0.0.1:5"], ["127.0.0.1:5", "[::1]:5"], ["[::1]:5"])
    assert resolve_host("127.0.0.9", 50071) == ["127.0.0.9:50071"]
    assert resolve_host("no-such-name.invalid", 1) == []  # NXDOMAIN: nothing, not an error


def test_discovery_follows_dns_answers_and_keeps_the_last_one_on_failure(monkeypatch):
    answers: dict[str, object] = {"decode.svc": ["127.0.0.2", "127.0.0.3"], "prefill.svc": ["127.0.0.4"]}

    def resolve(name: str, port: int) -> list[str]:
        answer = answers[name]
        if isinstance(answer, Exception):
            raise answer
        return [f"{host}:{port}" for host in answer]

    monkeypatch.setattr(discovery, "resolve_host", resolve)

    async def go():
        reg = InstanceRegistry()
        disc = Discovery(reg, ["dns:prefill.svc:50061", "10.0.0.9:50061"], ["dns:decode.svc:50071"])
        assert disc.is_dynamic
        await disc.refresh()
        assert _addresses(reg.decode) == ["127.0.0.2:50071", "127.0.0.3:50071"]
        assert _addresses(reg.prefill) == ["127.0.0.4:50061", "10.0.0.9:50061"]
        answers["decode.svc"] = ["127.0.0.3", "127.0.0.5"]
        await disc.refresh()
        assert _addresses(reg.decode) == ["127.0.0.3:50071", "127.0.0.5:50071"]
        assert _addresses(reg.draining) == ["127.0.0.2:50071"]
        answers["decode.svc"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        await disc.refresh()  # a failed look-up changes nothing
        assert _addresses(reg.decode) == ["127.0.0.3:50071", "127.0.0.5:50071"]
        answers["decode.svc"] = []  # a name with no addresses (no ready pods): every server leaves
        await disc.refresh()
        assert reg.decode == []
        await disc.close()
        await reg.close()
        assert not Discovery(InstanceRegistry(), [], ["a:1"]).is_dynamic
    asyncio.run(go())


def test_memory_prefix_index_follows_the_registry():
    async def go():
        reg = InstanceRegistry((), ("127.0.0.1:1",))
        index = MemoryPrefixIndex(reg, retry_s=0.05)
        await index.start()
        assert set(index._tasks) == {"127.0.0.1:1"}
        await reg.set_addresses(DECODE, ["127.0.0.1:2"])
        assert set(index._tasks) == {"127.0.0.1:2"}
        index._blocks["127.0.0.1:2"], index._namespace["127.0.0.1:2"] = {7}, "m:16:float32"
        assert await index.match("m:16:float32", [7]) == {"127.0.0.1:2": 1}
        await reg.set_addresses(DECODE, [])
        assert index._tasks == {} and await index.match("m:16:float32", [7]) == {}  # credited with nothing
        await index.close()
        await reg.close()
    asyncio.run(go())


@pytest.fixture
def redis():
    server = LocalRedis(port=free_port()).start()
    yield server
    server.stop()


def test_redis_registrations_by_role(redis):
    """Fresh ids of this model's namespaces, each server's tier asked from
    its own health service; stale ids, other models and servers that do not
    answer are left out."""
    import redis as sync_redis

    async def go():
        servers, rpcs = {}, []
        for role in ("pdserve.v1.Prefill", "pdserve.v1.Decode", "pdserve.v1.Gateway", "other model"):
            rpcs.append(RpcServer("127.0.0.1:0", ["pdserve.v1.Decode" if role == "other model" else role]))
            await rpcs[-1].start()  # health NOT_SERVING: the tier is known all the same
            servers[role] = f"127.0.0.1:{rpcs[-1].port}"
        r = sync_redis.Redis.from_url(redis.url)
        now = time.time()
        r.zadd(NAMESPACES_KEY, {"tiny:16:float32": now, "other:16:float32": now, "tiny:32:float32": now - 60})
        r.zadd(alive_key("tiny:16:float32"), {
            f"{servers['pdserve.v1.Prefill']}#a": now, f"{servers['pdserve.v1.Decode']}#b": now,
            f"{servers['pdserve.v1.Decode']}#c": now,  # the same server restarted: one address
            f"{servers['pdserve.v1.Gateway']}#d": now,  # neither tier
            "127.0.0.1:1#e": now,  # does not answer
            "127.0.0.1:2#f": now - 60})  # stale heartbeat
        r.zadd(alive_key("other:16:float32"), {f"{servers['other model']}#g": now})
        r.zadd(alive_key("tiny:32:float32"), {"127.0.0.1:4#h": now})
        reg = RedisRegistrations(redis.url, "tiny", timeout_s=0.5)
        try:
            found = await reg.lookup()
            assert found == {"prefill": [servers["pdserve.v1.Prefill"]], "decode": [servers["pdserve.v1.Decode"]]}
            r.zrem(alive_key("tiny:16:float32"), f"{servers['pdserve.v1.Prefill']}#a")
            assert (await reg.lookup())["prefill"] == []
        finally:
            await reg.close()
            for rpc in rpcs:
                await rpc.server.stop(None)
    asyncio.run(go())
