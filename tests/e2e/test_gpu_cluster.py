"""`pdserve up` on one GPU: prefill and decode servers share cuda:0, so the
KV pair falls back from NCCL to host-staged gloo (and says so). Greedy
float32 outputs through the gateway equal the offline engine's on the same
GPU. Skipped without CUDA."""
from __future__ import annotations

import json
import os
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from bench.model_shapes import write_word_tokenizer
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import make_tiny_model
from tests.processes import ServiceProcess

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 24


def _base() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return min(s.getsockname()[1], 60000)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random model with a tokenizer beside it (the gateway needs one): from
    PDSERVE_TOKENIZER_DIR or the converted default model, else a word-level one of its vocabulary."""
    d = make_tiny_model(tmp_path_factory.mktemp("gpu-model"))
    src = Path(os.environ.get("PDSERVE_TOKENIZER_DIR", Path.home() / ".cache/pdserve/models/SmolLM2-135M-Instruct"))
    if not (src / "tokenizer.json").exists():
        write_word_tokenizer(d, json.loads((d / "config.json").read_text()))
        return d
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, d / name)
    return d


def test_single_gpu_disaggregated_matches_offline(model_dir):
    from engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 40, 100, 300, 17, 64, 2, 200)]
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="256MiB")
    expected = [o.outputs[0].token_ids for o in
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    del llm
    torch.cuda.empty_cache()

    b = _base()
    up = ServiceProcess("up", "pdserve.cli", [
        "up", "--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "256MiB",
        "--http-port", str(b), "--grpc-port", str(b + 1), "--prefill-port", str(b + 2), "--decode-port", str(b + 4)],
        "pdserve ready")
    try:
        up.wait_ready()

        def run(ids: list[int]) -> list[int]:
            with grpc.insecure_channel(f"127.0.0.1:{b + 1}") as ch:
                out = []
                for d in gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
                        token_ids=gateway_pb2.TokenIds(ids=ids),
                        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)),
                        timeout=120):
                    out += d.token_ids
                return out

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(run, prompts))
        assert got == expected
        logs = up.log_text()
    finally:
        code = up.stop()
    assert code == 0
    assert "host-staged" in logs  # NCCL cannot pair two ranks on one GPU: the log says what was used
