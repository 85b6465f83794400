"""Priority scheduling end to end (real processes, the default model, the official openai
client and gRPC): both tiers run ``--scheduling-policy priority``, the decode server one
sequence at a time (``--max-num-seqs 1``), so it is saturated by one stream and the rest queue
there for a slot. A high-priority request sent after low-priority ones have queued finishes
before every one of them that was still queued when it came; the low-priority requests still
finish, with the text of the same request sent alone (greedy). A priority outside int32 is a
400 naming the field."""
from __future__ import annotations

import threading
import time

import grpc
import openai
import pytest

from pdserve.v1 import common_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess, running_cluster

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN), "--scheduling-policy", "priority"]
LONG, SHORT = 24, 8  # LONG: the running stream outlasts the queueing of the others by far
PROMPT = "Write a long story about a lighthouse keeper."


@pytest.fixture(scope="module")
def cluster():
    prefill = EngineServer("prefill", FLAGS, name="prefill")
    decode = EngineServer("decode", [*FLAGS, "--max-num-seqs", "1"], name="decode")
    gw = GatewayProcess("priority", ["--prefill", prefill.address, "--decode", decode.address,
                                     "--max-model-len", str(MAX_MODEL_LEN)])
    gw.decode_address = decode.address  # type: ignore[attr-defined]
    with running_cluster([prefill, decode], gw):
        yield gw


def _num_waiting(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.DecodeStub(ch).GetLoad(common_pb2.LoadRequest(), timeout=5).num_waiting


def test_a_late_high_priority_request_overtakes_the_queue(cluster):
    oai = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0)
    model = oai.models.list().data[0].id
    started: dict[str, float] = {}
    finished: dict[str, float] = {}
    texts: dict[str, str] = {}

    def stream(name: str, priority: int, max_tokens: int) -> None:
        text = ""
        for chunk in oai.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"priority": priority, "ignore_eos": True}):
            started.setdefault(name, time.monotonic())
            text += chunk.choices[0].text
        finished[name], texts[name] = time.monotonic(), text

    lows = [threading.Thread(target=stream, args=(f"low{i}", 10, LONG)) for i in range(4)]
    lows[0].start()
    while "low0" not in started:  # the first one holds the decode server's only slot
        time.sleep(0.02)
    for t in lows[1:]:
        t.start()
    deadline = time.monotonic() + 60
    while _num_waiting(cluster.decode_address) < 3:
        assert time.monotonic() < deadline, "the low-priority requests never queued on the decode server"
        time.sleep(0.02)
    queued = {f"low{i}" for i in range(1, 4) if f"low{i}" not in started}
    high = threading.Thread(target=stream, args=("high", -5, SHORT))
    high.start()
    for t in (*lows, high):
        t.join(timeout=300)
    assert len(finished) == 5, finished  # the low-priority requests finished too
    assert queued, "every low-priority request had started before the high-priority one came"
    assert all(finished["high"] < finished[name] for name in queued), (finished, queued)

    # Each stream has the text of the request served alone: queue order changes when, not what.
    alone = oai.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
    assert all(texts[f"low{i}"] == alone for i in range(4))
    assert alone.startswith(texts["high"])


def test_grpc_priority_and_its_range(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        req = gateway_pb2.GenerateRequest(text=PROMPT, priority=-1,
                                          sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert sum(len(d.token_ids) for d in stub.Generate(req, timeout=120)) == 4
    oai = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="priority"):
        oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=2,
                               extra_body={"priority": 2**31})
