"""A real prefill server refuses to prefill under another copy of an adapter than the one
the decode server reserved with: a prefill server and a decode server (tiny checkpoint)
both serve adapter "x" from ``--lora-modules``, from directories whose configs are the
same byte for byte and whose weights are two trainings. Driven over gRPC as the gateway
drives them (Decode.Generate reserves, Prefill fills the reservation).

What it proves: the two copies have other fingerprints (they cover the weights); the
prefill server answers FAILED_PRECONDITION naming the adapter and both fingerprints,
computes nothing and holds no block; once it loads the decode server's copy, the same
reservation completes, with PEFT's greedy tokens under that copy."""
from __future__ import annotations

import shutil

import grpc
import pytest

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.conftest import make_tiny_model
from tests.engine.families import assert_greedy_match, hf_greedy, random_prompts
from tests.engine.lora_adapters import make_adapter, peft_model
from tests.processes import EngineServer

pytestmark = pytest.mark.slow
MAX_TOKENS = 6
FLAGS = ["--kv-cache-memory", "8MiB", "--block-size", "4", "--enable-lora", "--kv-transfer-timeout", "30"]
SP = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-copies")
    base = make_tiny_model(root / "model", seed=4, num_hidden_layers=2)
    old = make_adapter(base, root / "old", seed=1, r=4, alpha=8, scale=2.0)
    new = make_adapter(base, root / "new", seed=2, r=4, alpha=8, scale=2.0)
    assert (old / "adapter_config.json").read_bytes() == (new / "adapter_config.json").read_bytes()
    prefill = EngineServer("prefill", [*FLAGS, "--model", str(base), "--lora-modules", f"x={old}"])
    decode = EngineServer("decode", [*FLAGS, "--model", str(base), "--lora-modules", f"x={new}"])
    procs = [prefill, decode]
    try:
        for p in procs:
            p.wait_ready()
        yield base, new, prefill, decode
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0, 0], [p.logs() for p in procs]


def _fingerprint(server: EngineServer) -> str:
    return next(a.fingerprint for a in server.load().lora_adapters if a.name == "x")


def test_prefill_server_refuses_another_copy_of_the_adapter(tiers):
    base, new, prefill, decode = tiers
    theirs, mine = _fingerprint(decode), _fingerprint(prefill)
    assert theirs != mine
    prompt = random_prompts([13], seed=3)[0]
    stream = engine_pb2_grpc.DecodeStub(decode.channel).Generate(engine_pb2.DecodeRequest(
        request_id="r1", prompt_token_ids=prompt, sampling=SP, remote_prefill=True, lora_name="x"), timeout=120)
    try:
        reserved = next(stream).reserved
        assert reserved.lora_fingerprint == theirs
        stub = engine_pb2_grpc.PrefillStub(prefill.channel)
        request = engine_pb2.PrefillRequest(request_id="r1", prompt_token_ids=prompt, sampling=SP,
                                            decode_address=decode.address, dst_block_ids=reserved.block_ids,
                                            lora_name="x", lora_fingerprint=reserved.lora_fingerprint)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefill(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
        assert refused.value.details() == (
            f"LoRA adapter 'x' differs between this prefill server (fingerprint {mine}) and the decode server "
            f"({theirs}): load the same files on both")
        load = prefill.load()
        assert load.num_requests_finished == 0 and not load.kv_blocks_used and not load.num_waiting

        # The decode server's copy loaded on the prefill server: the same reservation completes.
        loaded = stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name="x", lora_path=str(new)),
                                      timeout=60)
        assert loaded.fingerprint == theirs
        first = stub.Prefill(request, timeout=60)
        got = [t for m in stream if m.WhichOneof("kind") == "delta" for t in m.delta.token_ids]
    finally:
        stream.cancel()
    assert got[0] == first.first_token
    ref = peft_model(base, new)
    assert_greedy_match(ref, [prompt], hf_greedy(ref, [prompt], MAX_TOKENS), [got])
    prefill.wait_idle()
    decode.wait_idle()
