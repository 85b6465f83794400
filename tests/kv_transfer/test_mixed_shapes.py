"""Layers of different KV shapes in the hand-off (Gemma 4: sliding layers of 2 heads x 16, full
layers of 2 x 32 or 1 x 64, so the cache groups have different block sizes over one page size).
The layout record has the widest group's shape and each group's own (block size, KV heads,
head size), and both handshakes compare them field by field; a channel whose tensor-parallel
parts would split a page by KV heads is refused at open, naming both sides; the engine signals
a layer-wise send a slot once its last writing layer has run, and a layer-wise transfer lands
bit for bit in the decode engine's reserved blocks, which then decodes the tokens a colocated
engine does. Tiny Gemma 4 checkpoints written by transformers, real engines, a real gloo pair."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer import (ChannelRequest, KVLayout, KVReceiveScheduler, KVReceiveWorker, KVReceiver, KVSender,
                         KVSendScheduler, KVSendWorker, KVTransferError, check_compatible, engine_layout)
from kv_transfer.protocol import group_shapes
from kv_transfer.tp_parts import check_page_split
from rpc.layout_convert import layout_from_proto, layout_to_proto
from tests.engine.test_gemma4 import BASE, VARIANTS, make_gemma4
from tests.kv_transfer.pairs import finish_on_decode, receive_in_background, run_to_end

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
DECODE = "decode-0:1"
LAYER_S = 0.05  # added after each signalled slot, so that a slot sent too early shows


# The dense variant with 8 layers: 2 full and 4 sliding layers keep KV (two full layers, so the
# cache has two slots: groups full [2, 5], sliding [0, 1] and [3, 4]), the last two read layers
# 4's and 5's. Slot 0 is written by layers 0, 2 and 3, slot 1 by layers 1, 4 and 5.
TWO_SLOTS = dict(num_hidden_layers=8, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                   "sliding_attention", "sliding_attention", "full_attention",
                                                   "sliding_attention", "full_attention"])


def make_two_slot_gemma4(path, seed: int = 0):
    """The dense test checkpoint of tests/engine/test_gemma4.py with ``TWO_SLOTS``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma4_text", **{**BASE, **VARIANTS["dense"], **TWO_SLOTS})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    out = {name: make_gemma4(root / name, name, seed=i) for i, name in enumerate(("dense", "moe"))}
    out["two-slots"] = make_two_slot_gemma4(root / "two-slots", seed=2)
    return out


def _engine(model_dir) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), block_size=4, kv_cache_memory="4MiB",
                                                 max_num_batched_tokens=8))


def _prompt(seed: int, n: int = 29) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name, widest", [("dense", (2, 32)), ("moe", (1, 64))])
def test_the_record_has_the_widest_groups_shape_and_each_groups_own(gemma4, name, widest) -> None:
    engine = _engine(gemma4[name])
    layout = engine_layout(engine)
    # the cache is the widest group's (the moe variant's full layers: 1 head x 64, though the model's
    # num_key_value_heads, the sliding layers', is 2)
    assert (layout.num_kv_heads, layout.head_dim, layout.block_size, layout.num_layers) == (*widest, 4, 1)
    layout.check_cache(engine.kv_cache)
    fields = dict(json.loads(layout.groups))
    assert [fields[f"group{i}.block_size"] for i in range(4)] == [4, 8, 8, 8]
    assert group_shapes(layout.groups) == [widest, (2, 16), (2, 16), (2, 16)]
    assert layout.mixed_shapes
    assert layout_from_proto(layout_to_proto(layout)) == layout
    assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def test_groups_that_differ_are_named_field_by_field(gemma4) -> None:
    layout = engine_layout(_engine(gemma4["dense"]))
    other = [[k, 64 if k == "group2.head_dim" else 16 if k == "group2.block_size" else v]
             for k, v in json.loads(layout.groups)]
    with pytest.raises(KVTransferError) as e:
        check_compatible(layout, dataclasses.replace(layout, groups=json.dumps(other)), "prefill", "decode")
    assert str(e.value) == ("KV layout mismatch between prefill and decode: groups.group2.block_size 8 != 16; "
                            "groups.group2.head_dim 16 != 64")
    with pytest.raises(KVTransferError, match=r"groups \(num_slots 1, .*group0\.kv_heads 2, group0\.head_dim 32, "
                                              r".*\) != none \(KV cache groups on one side only"):
        check_compatible(layout, dataclasses.replace(layout, groups=""))
    with pytest.raises(ValueError, match="group 1's kv_heads 0 and head_dim 16 must be positive ints"):
        dataclasses.replace(layout, groups=json.dumps([[k, 0 if k == "group1.kv_heads" else v]
                                                       for k, v in json.loads(layout.groups)]))


def test_parts_that_would_split_a_page_are_refused(gemma4) -> None:
    layout = engine_layout(_engine(gemma4["dense"]))
    for ranks in ((1, 1), (2, 2)):  # whole pages, rank r into rank r
        check_page_split(layout, *ranks)
    for prefill, decode in ((2, 1), (1, 2)):
        with pytest.raises(ValueError) as e:
            check_page_split(layout, prefill, decode)
        assert str(e.value) == (
            f"{layout.model}: its layers store KV of different shapes, whose pages cannot be split by KV heads "
            f"between tensor-parallel ranks; prefill has {prefill} rank(s), decode {decode} (the tiers' "
            "tensor-parallel sizes differ): serve it at the same --tensor-parallel-size on both tiers (1 always "
            "works), or colocated (pdserve serve)")
    with pytest.raises(ValueError, match=r"prefill has 4 rank\(s\), decode 4 \(its 2 KV heads of the widest layers "
                                         r"are replicated over 4 ranks"):
        check_page_split(layout, 4, 4)
    one_shape = dataclasses.replace(layout, groups="")
    check_page_split(one_shape, 2, 1)  # heads split rank to rank as for any model


def test_a_channel_that_would_split_pages_is_refused_at_open(gemma4) -> None:
    engine = _engine(gemma4["dense"])
    layout = engine_layout(engine)
    receivers = KVReceiveWorker(engine, KVReceiveScheduler(None, 2.0), "127.0.0.1", 2.0)
    with pytest.raises(ValueError, match=r"^.*: its layers store KV of different shapes, whose pages cannot be split "
                                         r"by KV heads between tensor-parallel ranks; prefill has 2 rank\(s\), decode "
                                         r"1 .*serve it at the same --tensor-parallel-size on both tiers"):
        receivers.open(ChannelRequest(peer="p:1", layout=layout, device="cpu", tensor_parallel_size=2))
    assert receivers.num_pairs == 0
    offer = receivers.open(ChannelRequest(peer="p:1", layout=layout, device="cpu", tensor_parallel_size=1))
    assert not offer.in_parts
    receivers.close()


class Recording:
    """The engine's layer-wise sink around a real one: records the slots it signals between
    the decoder layers that ran (forward hooks), and sleeps after each signal."""

    def __init__(self, engine: LLMEngine, inner=None) -> None:
        self.inner, self.calls = inner, []
        for i, layer in enumerate(engine.runner.model.model.layers):
            layer.register_forward_hook(lambda *_, i=i: self.calls.append(("ran", i)) if self.signalled else None)
        self.signalled = False

    def step_begins(self, finishing):
        self.signalled = True
        self.calls.append(("begins", [rid for rid, _ in finishing]))
        signal = self.inner.step_begins(finishing) if self.inner else None
        outer = self

        class Slow:
            request_ids = signal.request_ids if signal else []

            def layer_done(self, slot: int) -> None:
                outer.calls.append(("slot", slot))
                if signal:
                    signal.layer_done(slot)
                time.sleep(LAYER_S)  # the send posts the slot now: later layers' writes would miss it

            def step_ended(self) -> None:
                outer.calls.append(("ended",))
                outer.signalled = False
                if signal:
                    signal.step_ended()
        return Slow()


@pytest.mark.parametrize("name, order", [
    # one slot: layers 0, 1, 3 (sliding) and 2 (full) write it; 4 and 5 read layers 3's and 2's KV
    ("dense", [0, 1, 2, 3, "slot 0", 4, 5]),
    ("two-slots", [0, 1, 2, 3, "slot 0", 4, 5, "slot 1", 6, 7]),
])
def test_engine_signals_a_slot_once_its_last_writing_layer_has_run(gemma4, name, order) -> None:
    engine = _engine(gemma4[name])
    sink = engine.layerwise_sink = Recording(engine)
    p = engine.add_prefill_request("r", _prompt(1), SP)  # 29 tokens in chunks of 8
    while p.status != RequestStatus.HELD_FOR_SEND:
        engine.step()
    want = [("slot", int(x.split()[1])) if isinstance(x, str) else ("ran", x) for x in order]
    assert sink.calls == [("begins", ["r"]), *want, ("ended",)]


def test_layers_leave_during_prefill_land_bit_exact_and_decode_as_colocated(gemma4) -> None:
    d = gemma4["two-slots"]  # slot 0 leaves while layers 4..7 run (chunks before the last are posted at once)
    prefill, decode, colocated = _engine(d), _engine(d), _engine(d)
    ref = colocated.add_request("r", _prompt(2, 37), SP)
    run_to_end(colocated)

    layout = engine_layout(prefill)
    assert layout == engine_layout(decode)
    decode.add_request("filler", _prompt(3, 21), SP)  # other blocks than the prefill side's
    decode.step()
    r = decode.reserve("r", _prompt(2, 37), SP)
    decode.step()
    dst = decode.get_block_ids("r")
    decode.abort_request("filler")

    senders = KVSendWorker(prefill.kv_cache, layout, "prefill-0:1", timeout=20)
    receiver, port = KVReceiver.listen("127.0.0.1", layout, timeout=20)
    senders._senders[(DECODE, 0)] = KVSender.connect("127.0.0.1", port, layout, timeout=20)
    sends = KVSendScheduler(senders, layout.num_layers, pairs_per_decode=1)
    prefill.layerwise_sink = Recording(prefill, sends)
    got, t = receive_in_background(receiver, decode.kv_cache, validate=decode.begin_kv_receive, timeout=20)
    try:
        sends.expect("r", DECODE, dst, skip=0)
        p = prefill.add_prefill_request("r", _prompt(2, 37), SP)
        while p.status != RequestStatus.HELD_FOR_SEND:
            prefill.step()
        src = prefill.get_block_ids("r")
        assert p.is_sending and len(src) == len(dst) == 20  # every group's blocks (full: 10 of 4, sliding: 2 x 5 of 8)
        send = sends.first_token("r", {"first_token": p.output_token_ids[0]})
        assert send is not None
        send.result(timeout=30)
        t.join(30)
        assert "error" not in got, got
        assert torch.equal(decode.kv_cache[:, dst], prefill.kv_cache[:, src])
    finally:
        sends.close()
        receiver.close()
    finish_on_decode(prefill, decode, "r", got["r"].meta["first_token"], r, ref)


def test_an_fp8_cache_of_layers_of_different_shapes_names_the_way_out(gemma4) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(gemma4["dense"]), block_size=4, kv_cache_memory="4MiB",
                                                   kv_cache_dtype="fp8"))
    with pytest.raises(ValueError) as e:  # not --disable-hybrid-kv-cache-manager: Gemma 4 cannot run without groups
        engine_layout(engine)
    assert str(e.value) == ("--kv-cache-dtype fp8 with KV cache groups is not sent between tiers yet: serve this model "
                            "with the model's KV dtype on both tiers, or colocated (pdserve serve)")


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "after-prefill"])
def test_a_prefix_the_decode_engine_holds_stays_out_of_the_send_in_every_group(gemma4, layerwise) -> None:
    """The decode engine computed a prompt that shares 33 tokens with this one: its reservation
    takes the first 32 from its cache in every group (blocks of 4 in the full group, of 8 in the
    two windowed ones, whose early blocks it had released behind the window and kept cached), the
    prefill service's translation of ``num_skip_blocks`` leaves each group's blocks of them out of
    the send, and the decode engine continues as a colocated one (no skip anywhere)."""
    from pdserve.v1 import engine_pb2
    from prefill_service.servicer import _skipped

    d = gemma4["two-slots"]
    prefill, decode, colocated = _engine(d), _engine(d), _engine(d)
    shared = _prompt(4, 33)
    prompt = shared + _prompt(5, 12)
    ref = colocated.add_request("r", prompt, SP)
    run_to_end(colocated)
    decode.add_request("earlier", shared + _prompt(6, 4), SP)
    run_to_end(decode)

    r = decode.reserve("r", prompt, SP)
    decode.step()
    assert r.num_cached_tokens == 32
    dst = decode.get_block_ids("r")
    full, w1, w2 = decode.scheduler.kv.get_block_table("r")
    assert (len(full), len(w1), len(w2)) == (12, 6, 6)  # 45 tokens
    # what the gateway sends: the hit in blocks of --block-size (4)
    asked = engine_pb2.PrefillRequest(request_id="r", prompt_token_ids=prompt, dst_block_ids=dst, num_skip_blocks=8)
    skip_tokens, sent_to = _skipped(prefill, asked, len(prompt))
    assert skip_tokens == 32 and sent_to == full[8:] + w1[4:] + w2[4:]

    layout = engine_layout(prefill)
    senders = KVSendWorker(prefill.kv_cache, layout, "prefill-0:1", timeout=20)
    receiver, port = KVReceiver.listen("127.0.0.1", layout, timeout=20)
    senders._senders[(DECODE, 0)] = KVSender.connect("127.0.0.1", port, layout, timeout=20)
    sends = KVSendScheduler(senders, layout.num_layers, pairs_per_decode=1, layerwise=layerwise)
    if layerwise:
        prefill.layerwise_sink = sends
    got, t = receive_in_background(receiver, decode.kv_cache, validate=decode.begin_kv_receive, timeout=20)
    try:
        sends.expect("r", DECODE, sent_to, 0)
        p = prefill.add_prefill_request("r", prompt, SP, kv_skip_tokens=skip_tokens)
        while p.status != RequestStatus.HELD_FOR_SEND:
            prefill.step()
        meta = {"first_token": p.output_token_ids[0]}
        send = sends.first_token("r", meta)
        assert (send is not None) == layerwise
        if send is None:
            send = sends.send_after_prefill("r", prefill.begin_send("r"))
        stats = send.result(timeout=30)
        t.join(30)
        assert "error" not in got, got
        src = prefill.scheduler.kv.send_block_ids("r")
        assert stats.num_blocks == len(src) == len(sent_to) == 4 + 2 + 2  # of 24
        assert r.kv_skipped_blocks == 16
        assert torch.equal(decode.kv_cache[:, sent_to], prefill.kv_cache[:, src])
    finally:
        sends.close()
        receiver.close()
    finish_on_decode(prefill, decode, "r", got["r"].meta["first_token"], r, ref)
