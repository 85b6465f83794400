"""Multi-LoRA through the whole topology: a prefill server and two decode servers on a
tiny checkpoint, with one adapter from ``--lora-modules`` on the prefill server and
the first decode server only, a second adapter loaded at run time through the
gateway (every server), and the gateway in front.

What it proves: greedy tokens under each adapter and the base model, mixed in
concurrent requests over gRPC, are PEFT's own (the prompt's KV computed under the
adapter on the prefill server, the rest on the decode server); requests for an
adapter go only to servers that hold it; the prefix cache is shared within an
adapter and never across (``cached_tokens``); ``/v1/models`` lists the adapters with
their parent; unknown names are 404; a bad adapter is refused with its reason by
every server; adapters load and unload while requests run (a request under an
adapter being unloaded ends whole), and an unloaded adapter is gone; every server
ends with no blocks held."""
from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import make_tiny_model
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, random_prompts
from tests.engine.lora_adapters import make_adapter, peft_model
from tests.processes import EngineServer, GatewayProcess, running_cluster

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
FLAGS = ["--kv-cache-memory", "16MiB", "--block-size", "4", "--enable-lora", "--max-loras", "2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_dir: Path):
    root = tmp_path_factory.mktemp("lora-cluster")
    base = make_tiny_model(root / "model", seed=6)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids stay below 384)
        shutil.copy(default_model_dir / f, base / f)
    a = make_adapter(base, root / "a", seed=1, r=8, alpha=16, scale=2.0)
    b = make_adapter(base, root / "b", seed=2, r=4, alpha=4, scale=2.0, targets=["q_proj", "v_proj", "down_proj"])
    wide = make_adapter(base, root / "wide", seed=3, r=32, alpha=32)  # above --max-lora-rank 16
    return base, a, b, wide


@pytest.fixture(scope="module")
def cluster(setup):
    base, a, _, _ = setup
    with_a = [*FLAGS, "--model", str(base), "--lora-modules", f"a={a}"]
    prefill, decode_a = EngineServer("prefill", with_a), EngineServer("decode", with_a)
    decode_plain = EngineServer("decode", [*FLAGS, "--model", str(base)])
    engines = [prefill, decode_a, decode_plain]
    gw = GatewayProcess("lora", ["--model", str(base), "--prefill", prefill.address,
                                 "--decode", f"{decode_a.address},{decode_plain.address}",
                                 "--allow-runtime-lora-updating"])
    with running_cluster(engines, gw):
        gw.engines = engines  # type: ignore[attr-defined]
        yield gw
        for e in engines:
            e.wait_idle()


def _generate(address: str, prompt: list[int], model: str = "", max_tokens: int = MAX_TOKENS) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        req = gateway_pb2.GenerateRequest(
            model=model, token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return [t for m in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120) for t in m.token_ids]


def _finished(engine: EngineServer) -> int:
    return engine.load().num_requests_finished


def test_adapters_through_both_tiers(setup, cluster):
    base, a, b, wide = setup
    prefill, decode_a, decode_plain = cluster.engines
    # b is loaded at run time on every server.
    r = httpx.post(cluster.http_url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(b)},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert {s["address"] for s in r.json()["servers"] if s["ok"]} == {e.address for e in cluster.engines}
    models = {m["id"]: m for m in httpx.get(cluster.http_url + "/v1/models", timeout=10).json()["data"]}
    assert models["a"]["parent"] == models["b"]["parent"] == base.name and models["b"]["root"] == str(b)

    prompts = random_prompts([5, 13, 21, 9, 30, 17], seed=8)
    names = ["a", "b", "", "a", "b", ""]
    refs = {"": hf_model(base), "a": peft_model(base, a), "b": peft_model(base, b)}
    want = [hf_greedy(refs[n], [p], MAX_TOKENS)[0] for p, n in zip(prompts, names)]
    before = [_finished(decode_a), _finished(decode_plain)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda pn: _generate(cluster.grpc_address, *pn), zip(prompts, names)))
    for p, n, w, g in zip(prompts, names, want, got):
        assert_greedy_match(refs[n], [p], [w], [g])
    # Only decode_a holds "a": both of its requests ran there (the others may go anywhere).
    assert _finished(decode_a) - before[0] >= 2

    # The prefix cache: shared within an adapter, never across (HTTP usage.cached_tokens).
    prompt = random_prompts([40], seed=9)[0]

    def cached(model: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(cluster.http_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("a") == 0 and cached("a") > 0
    assert cached("b") == 0 and cached(base.name) == 0

    # Unknown names are 404; a bad adapter is refused by every server, with the reason.
    r = httpx.post(cluster.http_url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.post(cluster.http_url + "/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(wide)},
                   timeout=60)
    assert r.status_code == 400 and "rank 32 is above --max-lora-rank 16" in r.json()["error"]["message"], r.text
    # Loaded while requests run (a copy of a under another name: its blocks are its own), and
    # b unloaded while a request under it decodes: that request ends whole.
    with ThreadPoolExecutor(2) as pool:
        under_b = pool.submit(_generate, cluster.grpc_address, prompts[1], "b", 200)
        base_run = pool.submit(_generate, cluster.grpc_address, prompts[2], "", 200)
        while not any(e.load().num_running for e in (decode_a, decode_plain)) and not under_b.done():
            time.sleep(0.01)
        r = httpx.post(cluster.http_url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(a)},
                       timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(cluster.http_url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(under_b.result()) == 200 and len(base_run.result()) == 200
    assert _generate(cluster.grpc_address, prompts[0], "a2") == got[0]  # a's tokens under its copy
    # Unloaded, b is gone.
    assert "b" not in {m["id"] for m in httpx.get(cluster.http_url + "/v1/models", timeout=10).json()["data"]}
    r = httpx.post(cluster.http_url + "/v1/completions", json={"model": "b", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404, r.text
