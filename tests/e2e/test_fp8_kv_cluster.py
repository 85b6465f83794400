"""The FP8 KV cache through the whole topology: `pdserve up --kv-cache-dtype fp8` (gateway,
a prefill and a decode server, the prefix index in Redis) on a tiny float32 checkpoint
that carries per-layer k_scale / v_scale (not 1.0), beside a prefill server of the same
model with a 16-bit (bfloat16) cache publishing to the same Redis.

- The streamed greedy tokens are those of transformers' model whose attention sees K and V
  round-tripped through e4m3 with the checkpoint's scales (the prefill server computed the
  KV, the decode server read it after the transfer; no tie on these prompts: they agree
  in full); the transfer counted one byte a value on both servers (half of bfloat16's).
- The 16-bit prefill server and the FP8 decode server refuse to pair, the refusal naming
  both sides' KV dtypes and scales; so does the FP8 decode server for FP8 scales that differ.
- The prefix index, in Redis and in memory, credits the FP8 servers' blocks to FP8 lookups
  only and the 16-bit server's to 16-bit lookups only, for the same prompt's blocks.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.instances import DECODE, PREFILL, Instance
from gateway.prefix_index import MemoryPrefixIndex, RedisPrefixIndex, prompt_block_hashes
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from rpc.local_redis import LocalRedis
from tests.e2e.test_model_families_cluster import MAX_TOKENS, _generate, start_cluster
from tests.engine.families import assert_greedy_match, hf_greedy, random_prompts
from tests.engine.fp8_kv_oracle import TINY_K_SCALES, TINY_V_SCALES, copy_with_kv_scales, hf_fp8_kv_model
from tests.processes import EngineServer, free_port

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4  # start_cluster's
K_SCALES, V_SCALES = TINY_K_SCALES, TINY_V_SCALES
FP8, BF16 = "float8_e4m3fn", "bfloat16"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory, default_model_dir: Path):
    d = copy_with_kv_scales(tiny_llama_dir, tmp_path_factory.mktemp("fp8-kv") / "tiny-fp8", K_SCALES, V_SCALES)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids stay below 384)
        shutil.copy(default_model_dir / f, d / f)
    redis = LocalRedis(port=free_port()).start()
    # Started first, it loads while the cluster does.
    bf16 = EngineServer("prefill", ["--model", str(d), "--dtype", BF16, "--block-size", str(BLOCK_SIZE),
                                    "--num-gpu-blocks-override", "64", "--kv-transfer-timeout", "20",
                                    "--redis-url", redis.url], name="prefill-bf16")
    up = None
    try:
        up, ports = start_cluster(d, "--kv-cache-dtype", "fp8", "--redis-url", redis.url)
        bf16.wait_ready()
        yield dict(ports=ports, bf16=bf16, redis=redis.url, prefill=f"127.0.0.1:{ports['prefill']}",
                   decode=f"127.0.0.1:{ports['decode']}")
    finally:
        codes = [bf16.stop()] + ([up.stop()] if up is not None else [])
        redis.stop()
    assert codes == [0] * len(codes), bf16.logs()


def _metrics(port: int) -> list[str]:
    return httpx.get(f"http://127.0.0.1:{port + 1000}/metrics", timeout=10).text.splitlines()


def _kv_bytes(port: int) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in _metrics(port)
               if line.startswith("pdserve:kv_transfer_bytes_total{"))


def _load(address: str, role: str) -> common_pb2.LoadInfo:
    stub = engine_pb2_grpc.PrefillStub if role == PREFILL else engine_pb2_grpc.DecodeStub
    with grpc.insecure_channel(address) as ch:
        return stub(ch).GetLoad(common_pb2.LoadRequest(), timeout=10)


def _kv_shape(model_dir: Path) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the model."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return (cfg["num_hidden_layers"], cfg["num_key_value_heads"],
            cfg["hidden_size"] // cfg["num_attention_heads"])


def test_disaggregated_tokens_are_the_e4m3_oracles_and_the_transfer_moves_fp8_bytes(cluster, tiny_llama_dir):
    layers, kv_heads, head_dim = _kv_shape(tiny_llama_dir)
    ports, block_bytes = cluster["ports"], 2 * layers * BLOCK_SIZE * kv_heads * head_dim  # one byte a value
    for role in ("prefill", "decode"):
        info = [line for line in _metrics(ports[role]) if line.startswith("pdserve:engine_config_info{")]
        assert len(info) == 1 and f'kv_cache_dtype="{FP8}"' in info[0] and ',dtype="float32",' in info[0], info
        assert f'num_gpu_blocks="{16 * 2**20 // block_bytes}"' in info[0], info  # --kv-cache-memory 16MiB
    before = {role: _kv_bytes(ports[role]) for role in ("prefill", "decode")}
    prompts = random_prompts([3, 29, 45], seed=12)
    with ThreadPoolExecutor(len(prompts)) as pool:  # one decode batch
        got = list(pool.map(lambda p: _generate(f"127.0.0.1:{ports['grpc']}", p), prompts))
    oracle = hf_fp8_kv_model(tiny_llama_dir, K_SCALES, V_SCALES)  # the checkpoint's weights and scales
    assert_greedy_match(oracle, prompts, hf_greedy(oracle, prompts, MAX_TOKENS), got)
    # Every prompt block went over (fresh prompts: nothing cached on the decode server), one byte a value.
    want = sum(-(-len(p) // BLOCK_SIZE) for p in prompts) * block_bytes
    for role in ("prefill", "decode"):
        assert _kv_bytes(ports[role]) - before[role] == want, role
    for role, address in (("prefill", cluster["prefill"]), ("decode", cluster["decode"])):
        _wait_idle(address, role)


def _wait_idle(address: str, role: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (info := _load(address, role)).kv_blocks_used or info.num_running or info.num_waiting:
        assert time.monotonic() < deadline, (address, info)
        time.sleep(0.05)


def _refused_prefill(cluster, rid: str, prompt: list[int]) -> grpc.RpcError:
    """The 16-bit prefill server asked to prefill into blocks reserved on the FP8 decode server."""
    sp = common_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with grpc.insecure_channel(cluster["decode"]) as ch:
        stream = engine_pb2_grpc.DecodeStub(ch).Generate(engine_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sp, remote_prefill=True), timeout=60)
        reserved = next(stream).reserved
        try:
            engine_pb2_grpc.PrefillStub(cluster["bf16"].channel).Prefill(engine_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sp, decode_address=cluster["decode"],
                dst_block_ids=reserved.block_ids), timeout=60)
        except grpc.RpcError as exc:
            return exc
        finally:
            stream.cancel()
    raise AssertionError("the 16-bit prefill server paired with the FP8 decode server")


def _listed(xs: list[float]) -> str:
    return "[" + ", ".join(repr(x) for x in xs) + "]"


def test_16bit_prefill_and_fp8_decode_refuse_to_pair_naming_both(cluster, tiny_llama_dir):
    prompt = random_prompts([21], seed=21)[0]
    err = _refused_prefill(cluster, "mixed-kv", prompt)
    assert err.code() == grpc.StatusCode.ABORTED
    assert (f"refused the KV channel: KV layout mismatch between decode and prefill: dtype '{FP8}' != '{BF16}'; "
            f"k_scales {_listed(K_SCALES)} != none; v_scales {_listed(V_SCALES)} != none; "
            f"model_dtype 'float32' != '{BF16}'") in err.details(), err.details()
    _wait_idle(cluster["decode"], DECODE)
    _wait_idle(cluster["bf16"].address, PREFILL)
    # FP8 on both sides but other scales: the same bytes would mean other values.
    theirs = list(K_SCALES)
    theirs[1] *= 2
    layers, kv_heads, head_dim = _kv_shape(tiny_llama_dir)
    layout = engine_pb2.KVLayout(model="tiny-fp8", dtype=FP8, block_size=BLOCK_SIZE, num_layers=layers,
                                 num_kv_heads=kv_heads, head_dim=head_dim, k_scales=theirs, v_scales=V_SCALES,
                                 model_dtype="float32")
    with grpc.insecure_channel(cluster["decode"]) as ch, pytest.raises(grpc.RpcError) as refused:
        engine_pb2_grpc.DecodeStub(ch).OpenKVChannel(engine_pb2.OpenKVChannelRequest(
            peer="127.0.0.1:1", layout=layout, device="cpu"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Only the scales differ: everything else of the record matched.
    assert refused.value.details() == (f"KV layout mismatch between decode and prefill: k_scales "
                                       f"{_listed(K_SCALES)} != {_listed(theirs)}")


def test_the_prefix_index_keeps_fp8_and_16bit_blocks_apart(cluster):
    """The same prompt cached by the FP8 servers (through the gateway) and by the 16-bit
    prefill server (which prefilled it before the pair was refused): the same block hashes,
    in two namespaces."""
    prompt = random_prompts([23], seed=23)[0]  # 5 full blocks, all matchable
    _generate(f"127.0.0.1:{cluster['ports']['grpc']}", prompt)
    _refused_prefill(cluster, "cache-bf16", prompt)
    fp8_ns = _load(cluster["prefill"], PREFILL).cache_namespace
    bf16_ns = _load(cluster["bf16"].address, PREFILL).cache_namespace
    assert _load(cluster["decode"], DECODE).cache_namespace == fp8_ns
    assert (fp8_ns, bf16_ns) == ("tiny-fp8:4:" + FP8, "tiny-fp8:4:" + BF16)
    hashes = prompt_block_hashes(prompt, BLOCK_SIZE)
    n = len(hashes)
    want = {fp8_ns: {cluster["prefill"]: n, cluster["decode"]: n}, bf16_ns: {cluster["bf16"].address: n}}

    async def matches(index) -> dict[str, dict[str, int]]:
        return {ns: await index.match(ns, hashes) for ns in want}

    async def poll(index) -> dict[str, dict[str, int]]:
        deadline = time.monotonic() + 20
        while (got := await matches(index)) != want and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return got

    async def both() -> tuple[dict, dict]:
        redis_index = RedisPrefixIndex(cluster["redis"], timeout_s=1.0)
        memory = MemoryPrefixIndex([Instance(PREFILL, cluster["prefill"]), Instance(DECODE, cluster["decode"]),
                                    Instance(PREFILL, cluster["bf16"].address)], retry_s=0.1)
        await memory.start()
        try:
            return await poll(redis_index), await poll(memory)
        finally:
            await redis_index.close()
            await memory.close()
    in_redis, in_memory = asyncio.run(both())
    assert in_redis == want
    assert in_memory == want
