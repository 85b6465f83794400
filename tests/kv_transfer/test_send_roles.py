"""Layer-wise KV send (KVSendScheduler over KVSendWorker): the engine signals each
layer of a prompt's last chunk, the prefill side's sends post layers as they come,
and the first token rides in the trailer. Real engines and a real gloo pair; the forward pass is
slowed per layer so that overlap shows in the receiver's clock."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.config import EngineArgs
from kv_transfer import KVLayout, KVReceiver, KVSender, KVTransferError
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer import KVSendScheduler, KVSendWorker

DECODE = "decode-0:1"
LAYER_S = 0.08  # added to each layer of the signalled steps


def _engine(model_dir) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), block_size=4, kv_cache_memory="4MiB",
                                                 max_num_batched_tokens=16))


def _prompt(seed: int, n: int = 37) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Recording:
    """Wraps a sink: records what the engine tells it and slows each layer."""

    def __init__(self, inner=None) -> None:
        self.inner, self.calls = inner, []

    def step_begins(self, finishing):
        self.calls.append(("begins", [(rid, list(ids)) for rid, ids in finishing]))
        signal = self.inner.step_begins(finishing) if self.inner else None
        outer = self

        class Slow:
            request_ids = signal.request_ids if signal else []

            def layer_done(self, layer: int) -> None:
                outer.calls.append(("layer", layer))
                time.sleep(LAYER_S)
                if signal:
                    signal.layer_done(layer)

            def step_ended(self) -> None:
                outer.calls.append(("ended",))
                if signal:
                    signal.step_ended()
        return Slow()


def test_engine_signals_the_last_prompt_chunk_layer_by_layer(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    sink = engine.layerwise_sink = Recording()
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("colocated", _prompt(1, 9), sp)  # samples, but never held: not signalled
    p = engine.add_prefill_request("r", _prompt(2), sp)  # 37 tokens: chunks of 16, 16, 5 (after 9)
    steps = 0
    while p.status != RequestStatus.HELD_FOR_SEND:
        engine.step()
        steps += 1
        begins = [c for c in sink.calls if c[0] == "begins"]
        assert len(begins) == (1 if p.status == RequestStatus.HELD_FOR_SEND else 0)
    num_layers = engine.config.model.num_layers
    assert steps >= 3
    blocks = engine.begin_send("r")
    assert sink.calls == [("begins", [("r", blocks)]), *[("layer", i) for i in range(num_layers)], ("ended",)]


@pytest.fixture
def pair(tiny_llama_dir):
    prefill, decode = _engine(tiny_llama_dir), _engine(tiny_llama_dir)
    layout = KVLayout.of(prefill.kv_cache, "tiny")
    senders = KVSendWorker(prefill.kv_cache, layout, "prefill-0:1", timeout=20)
    receivers = []
    for slot in (0, 1):  # two pairs to the decode side, as KVSendWorker.pair(slot=...) opens them
        receiver, port = KVReceiver.listen("127.0.0.1", layout, timeout=20)
        senders._senders[(DECODE, slot)] = KVSender.connect("127.0.0.1", port, layout, timeout=20)
        receivers.append(receiver)
    sends = KVSendScheduler(senders, layout.num_layers, pairs_per_decode=4)
    prefill.layerwise_sink = Recording(sends)
    yield prefill, decode, receivers, sends
    sends.close()  # and its worker's pairs
    for receiver in receivers:
        receiver.close()


def _receive(receiver, decode, got):
    def run():
        try:
            got["ok"] = receiver.recv(decode.kv_cache, timeout=20)
        except KVTransferError as e:
            got["err"] = e
    t = threading.Thread(target=run)
    t.start()
    return t


def test_layers_leave_during_prefill_and_land_bit_exact(pair):
    prefill, decode, (receiver, _), sends = pair
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    dst = list(range(30, 40))
    got: dict = {}
    t = _receive(receiver, decode, got)
    sends.expect("r", DECODE, dst, skip=0)
    p = prefill.add_prefill_request("r", _prompt(3), sp)
    while p.status != RequestStatus.HELD_FOR_SEND:
        prefill.step()
    src = prefill.get_block_ids("r")
    assert p.is_sending  # since its last chunk was scheduled: no begin_send
    with pytest.raises(ValueError):
        prefill.begin_send("r")
    send = sends.first_token("r", {"first_token": p.output_token_ids[0]})
    assert send is not None  # the send the engine began takes the token
    stats = send.result(timeout=30)
    t.join(30)
    rid, got_dst, rstats, meta = got["ok"]
    assert (rid, got_dst, meta) == ("r", dst, {"first_token": p.output_token_ids[0]})
    assert torch.equal(decode.kv_cache[:, dst], prefill.kv_cache[:, src])
    assert stats.num_blocks == 10
    # The header came before the forward pass had done its layers: the receiver waited for them.
    num_layers = prefill.config.model.num_layers
    assert rstats.seconds >= (num_layers - 1) * LAYER_S * 0.9
    assert prefill.release_after_send("r") is p and prefill.stats().kv_blocks_used == 0


def test_request_ending_before_its_token_aborts_the_transfer(pair):
    prefill, decode, (receiver, _), sends = pair
    sp = SamplingParams(temperature=0, max_tokens=1)
    got: dict = {}
    t = _receive(receiver, decode, got)
    sends.expect("r", DECODE, list(range(30, 40)), skip=0)
    p = prefill.add_prefill_request("r", _prompt(4), sp)
    while p.status != RequestStatus.HELD_FOR_SEND:
        prefill.step()
    sends.end("r")  # the RPC ended (cancelled) before it handed over the first token
    t.join(30)
    assert "aborted" in str(got["err"]) and got["err"].request_id == "r"
    # Aborted while its send may still read the blocks: they stay until the send is released.
    assert prefill.abort_request("r") is p and p.is_finished
    assert prefill.stats().kv_blocks_used == 10
    prefill.release_after_send("r")
    assert prefill.stats().kv_blocks_used == 0
    # The pair still works: the next request goes through.
    got.clear()
    t = _receive(receiver, decode, got)
    sends.expect("s", DECODE, list(range(40, 50)), skip=0)
    q = prefill.add_prefill_request("s", _prompt(5), sp)
    while q.status != RequestStatus.HELD_FOR_SEND:
        prefill.step()
    src = prefill.get_block_ids("s")
    sends.first_token("s", {"first_token": q.output_token_ids[0]}).result(timeout=30)
    t.join(30)
    assert got["ok"].request_id == "s"
    assert torch.equal(decode.kv_cache[:, list(range(40, 50))], prefill.kv_cache[:, src])


def test_requests_finishing_in_one_step_overlap_on_pairs_of_their_own(pair):
    """Two requests to one decode server finish their prompt in the same step: each gets its
    own pair, both transfers are open during the (slowed) forward pass, both land exactly."""
    prefill, decode, receivers, sends = pair
    sp = SamplingParams(temperature=0, max_tokens=1)
    got: dict = {}

    def receive(i):
        got[i] = receivers[i].recv(decode.kv_cache, timeout=20)
    threads = [threading.Thread(target=receive, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    dst = {"a": [30, 31], "b": [40, 41]}  # 6-token prompts: 2 blocks each, both in one 16-token step
    for rid in dst:
        sends.expect(rid, DECODE, dst[rid], skip=0)
    reqs = {rid: prefill.add_prefill_request(rid, _prompt(ord(rid), 6), sp) for rid in dst}
    while any(r.status != RequestStatus.HELD_FOR_SEND for r in reqs.values()):
        prefill.step()
    begun = [c for c in prefill.layerwise_sink.calls if c[0] == "begins"]
    assert len(begun) == 1 and sorted(rid for rid, _ in begun[0][1]) == ["a", "b"]  # one step
    for rid, r in reqs.items():
        sends.first_token(rid, {"first_token": r.output_token_ids[0]})
    for t in threads:
        t.join(30)
    assert sorted(g.request_id for g in got.values()) == ["a", "b"]
    num_layers = prefill.config.model.num_layers
    for g in got.values():  # each receiver had its header before the layers were done
        assert g.stats.seconds >= (num_layers - 1) * LAYER_S * 0.9, g.stats
    for rid in dst:
        assert torch.equal(decode.kv_cache[:, dst[rid]], prefill.kv_cache[:, prefill.get_block_ids(rid)])
        assert prefill.release_after_send(rid) is reqs[rid]
    assert prefill.stats().kv_blocks_used == 0


def test_pairs_per_decode_is_at_least_one(tiny_llama_dir):
    prefill = _engine(tiny_llama_dir)
    layout = KVLayout.of(prefill.kv_cache, "tiny")
    senders = KVSendWorker(prefill.kv_cache, layout, "prefill-0:1", timeout=20)
    with pytest.raises(ValueError, match="kv-pairs-per-decode"):
        KVSendScheduler(senders, layout.num_layers, pairs_per_decode=0)
    assert KVSendScheduler(senders, layout.num_layers, pairs_per_decode=2).pairs_per_decode == 2
