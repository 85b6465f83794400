"""Quantized models through the whole topology: `pdserve up --model DIR` on an int4
(GPTQ act-order) checkpoint, and on the float model with `--quantization fp8` (both
tiers quantize at load: the same codes, so the KV they compute agrees), prompts sent
over gRPC, their KV computed on the prefill server and moved to the decode server,
the streamed tokens those of transformers on the dequantized model (for FP8 with its
activations rounded through e4m3, tests/engine/fp8_weights_oracle.py). A 16-bit peer is
refused a KV channel to a quantized decode server, the refusal naming both weights."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.v1 import engine_pb2, engine_pb2_grpc
from tests.conftest import make_tiny_model
from tests.e2e.test_model_families_cluster import _generate, start_cluster
from tests.engine.families import assert_greedy_match, hf_greedy, hf_model, random_prompts
from tests.engine.fp8_weights_oracle import assert_w8a8_match, hf_w8a8_model
from tests.engine.quant_checkpoints import write_fp8_checkpoint, write_int4_checkpoint

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["gptq-act-order", "online-fp8"])
def cluster(request, tmp_path_factory, default_model_dir: Path):
    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_model(root / "base", seed=21)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids stay below 384)
        shutil.copy(default_model_dir / f, base / f)
    if request.param == "gptq-act-order":
        served, deq = write_int4_checkpoint(base, root / "gptq", "gptq", 32, False, True)
        oracle, flags = hf_model(deq), ()
        weights = "gptq (pre-quantized checkpoint: int4 W4A16 gptq, group size 32, asymmetric, act-order)"
    else:
        _, deq = write_fp8_checkpoint(base, root / "ref", "compressed-tensors", "channel")
        served, oracle, flags = base, hf_w8a8_model(deq), ("--quantization", "fp8")
        weights = ("fp8 (quantized at load: fp8 W8A8, per-channel weight scales, dynamic per-token "
                   "activations)")
    up, ports = start_cluster(served, *flags)
    yield dict(name=request.param, oracle=oracle, ports=ports, model=served.name, weights=weights)
    up.stop()


def test_quantized_tokens_across_the_tiers(cluster):
    name, oracle, ports = cluster["name"], cluster["oracle"], cluster["ports"]
    prompts = random_prompts([3, 29, 45], seed=22)
    want = hf_greedy(oracle, prompts, MAX_TOKENS)
    with ThreadPoolExecutor(len(prompts)) as pool:  # one decode batch
        got = list(pool.map(lambda p: _generate(f"127.0.0.1:{ports['grpc']}", p), prompts))
    (assert_w8a8_match if name == "online-fp8" else assert_greedy_match)(oracle, prompts, want, got)
    for role in ("prefill", "decode"):
        text = httpx.get(f"http://127.0.0.1:{ports[role] + 1000}/metrics", timeout=10).text
        assert 'pdserve:kv_transfer_bytes_total{' in text


def test_a_16bit_peer_is_refused_naming_both_weights(cluster):
    # The decode server's own layout but for the weights: K and V of another model.
    layout = engine_pb2.KVLayout(model=cluster["model"], dtype="float32", block_size=4, num_layers=3,
                                 num_kv_heads=2, head_dim=16, model_dtype="float32")
    with grpc.insecure_channel(f"127.0.0.1:{cluster['ports']['decode']}") as ch, \
            pytest.raises(grpc.RpcError) as refused:
        engine_pb2_grpc.DecodeStub(ch).OpenKVChannel(engine_pb2.OpenKVChannelRequest(
            peer="127.0.0.1:1", layout=layout, device="cpu"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == (f"KV layout mismatch between decode and prefill: weights "
                                       f"{cluster['weights']!r} != none")
