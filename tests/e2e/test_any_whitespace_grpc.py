"""``StructuredOutputs.any_whitespace`` over the gateway's gRPC API, through a real prefill
server, a real decode server and the gateway, on a tiny checkpoint made to prefer a single
space above every other token wherever its constraint lets it (the default model's
tokenizer; the rest of the weights random).

What it proves: with the flag off, JSON output has no free whitespace, though the model
wants nothing more (only xgrammar's fixed separators ", " and ": ": ``json.dumps``'s form);
with it on, the same schema's output has the longest run of blanks the engines allow
(``MAX_WHITESPACE``) wherever the grammar allows blanks, and still parses and matches the
schema. Both requests are prefilled on the prefill server (their first token, ``{``, is the
same either way); the blanks come from the decode server."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import grpc
import jsonschema
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.structured_outputs import MAX_WHITESPACE
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import make_tiny_model
from tests.processes import EngineServer, GatewayProcess, running_cluster

pytestmark = pytest.mark.slow
SPACE = 216  # " " in the default model's tokenizer
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "y"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
FLAGS = ["--kv-cache-memory", "16MiB", "--max-model-len", "256"]


def make_space_loving_model(path: Path, default_model_dir: Path) -> Path:
    """A tiny Llama whose logits put ``SPACE`` far above every other token at every position:
    hidden dimension 0 is a constant 4.0 (every embedding's, and no layer writes to it), and
    only the space token's LM-head row reads it."""
    make_tiny_model(path, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, path / f)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.embed_tokens.weight"][:, 0] = 4.0
    for name, w in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[0, :] = 0.0
    head = weights["lm_head.weight"]
    head[:, 0] = 0.0
    head[SPACE, 0] = 10.0
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    model = make_space_loving_model(tmp_path_factory.mktemp("any-ws") / "model", default_model_dir)
    prefill = EngineServer("prefill", [*FLAGS, "--model", str(model)])
    decode = EngineServer("decode", [*FLAGS, "--model", str(model)])
    gw = GatewayProcess("any-ws", ["--model", str(model), "--prefill", prefill.address, "--decode", decode.address])
    with running_cluster([prefill, decode], gw):
        gw.prefill = prefill  # type: ignore[attr-defined]
        yield gw
        decode.wait_idle()
        prefill.wait_idle()


def _generate(cluster, any_whitespace: bool, structured: bool = True) -> tuple[str, str]:
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=64)
    if structured:
        sampling.structured_outputs.CopyFrom(common_pb2.StructuredOutputs(json=json.dumps(SCHEMA),
                                                                          any_whitespace=any_whitespace))
    req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 5, 9, 14]), sampling=sampling)
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        msgs = list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120))
    return "".join(m.text for m in msgs), msgs[-1].finish_reason


def test_any_whitespace_over_grpc(cluster):
    text, finish = _generate(cluster, any_whitespace=False, structured=False)
    assert text == " " * 64 and finish == "length"  # unconstrained, the model writes nothing but spaces

    before = cluster.prefill.load().num_requests_finished
    compact, finish = _generate(cluster, any_whitespace=False)
    assert finish == "stop", compact
    jsonschema.validate(json.loads(compact), SCHEMA)
    assert compact == json.dumps(json.loads(compact)), compact  # fixed separators ", " and ": ", no other blank

    spaced, finish = _generate(cluster, any_whitespace=True)
    assert finish == "stop", spaced
    jsonschema.validate(json.loads(spaced), SCHEMA)
    # Where the grammar allows blanks (around most of {"ok": ..., "tag": ...}'s tokens), the longest
    # run the engines allow, each time: '{"ok"    :    true    ,    "tag"    :"y"    }'.
    gaps = re.findall(r"\s+", spaced)
    assert len(gaps) >= 4 and set(gaps) == {" " * MAX_WHITESPACE}, repr(spaced)
    assert re.sub(r"\s", "", spaced) in {json.dumps({"ok": ok, "tag": t}, separators=(",", ":"))
                                         for ok in (True, False) for t in ("x", "y")}
    assert cluster.prefill.load().num_requests_finished - before == 2  # both prefilled on the prefill tier
