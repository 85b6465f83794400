"""A hybrid model's linear-attention state in the KV hand-off: the layout record describes
it (layers, each slot's shapes and dtypes) and both handshakes (the decode server's
``OpenKVChannel`` check and the pair's hello) refuse a mismatch field by field, naming both
sides; a transfer moves the request's slot after its blocks, bit for bit, into the slot the
decode engine reserved (and no other); a channel that would need the state in tensor-parallel
parts is refused at open. Tiny random Qwen3-Next checkpoints, real engines, a real gloo pair."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer import (ChannelRequest, KVLayout, KVReceiveScheduler, KVReceiveWorker, KVReceiver, KVSender,
                         KVSendScheduler, KVSendWorker, KVTransferError, check_compatible, engine_layout)
from kv_transfer.pair import _settle
from kv_transfer.protocol import PROTOCOL_VERSION, StateMove, describe_state, state_nbytes, state_specs
from rpc.layout_convert import layout_from_proto, layout_to_proto
from tests.engine.test_qwen3_next import make_checkpoint
from tests.kv_transfer.pairs import finish_on_decode, receive_in_background, run_to_end

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _layout(**state) -> KVLayout:
    spec = dict(dict(conv=(80, 3), conv_dtype="bfloat16", ssm=(4, 8, 12), ssm_dtype="float32"), **state)
    text = describe_state([0, 1, 2], [(spec["conv"], spec["conv_dtype"], spec["ssm"], spec["ssm_dtype"])] * 3)
    return KVLayout(model="hybrid", dtype="bfloat16", block_size=4, num_layers=1, num_kv_heads=2, head_dim=16,
                    linear_state=text)


def test_a_state_that_differs_is_refused_field_by_field_naming_both_sides() -> None:
    prefill, decode = _layout(), _layout(ssm=(2, 8, 12), conv_dtype="float32")
    want = ("KV layout mismatch between prefill and decode: linear_state.conv_dtype 'bfloat16' != 'float32'; "
            "linear_state.ssm_shape [4, 8, 12] != [2, 8, 12]")
    with pytest.raises(KVTransferError) as e:  # the decode server's check of OpenKVChannel
        check_compatible(prefill, decode, "prefill", "decode")
    assert str(e.value) == want
    hello = lambda layout: {"protocol": PROTOCOL_VERSION, "backend": "auto", "gpu": None,  # noqa: E731
                            "layout": layout.to_dict()}
    with pytest.raises(KVTransferError) as e:  # the pair's handshake, on both sides
        _settle(hello(prefill), hello(decode))
    assert str(e.value) == want
    _settle(hello(prefill), hello(_layout()))  # the same state: no complaint

    plain = dataclasses.replace(prefill, linear_state="")
    with pytest.raises(KVTransferError) as e:
        check_compatible(plain, prefill, "prefill", "decode")
    assert str(e.value) == (
        "KV layout mismatch between prefill and decode: linear_state none != (layers [0, 1, 2], conv_shape [80, 3], "
        "conv_dtype 'bfloat16', ssm_shape [4, 8, 12], ssm_dtype 'float32') (a model with linear-attention layers "
        "on one side only)")


def test_the_state_record_travels_and_names_each_layer_where_they_differ() -> None:
    layout = _layout()
    assert layout_from_proto(layout_to_proto(layout)) == layout
    assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert state_nbytes(layout.linear_state) == 3 * (80 * 3 * 2 + 4 * 8 * 12 * 4)
    assert layout.describe().endswith(", 3 linear-attention layers")
    a = describe_state([0, 2], [((80, 3), "float32", (4, 8, 12), "float32")] * 2)
    b = describe_state([0, 2], [((80, 3), "float32", (4, 8, 12), "float32"), ((80, 3), "float32", (4, 8, 8),
                                                                               "float32")])
    assert state_specs(b)[1] == ((80, 3), "float32", (4, 8, 8), "float32")
    with pytest.raises(KVTransferError, match=r"linear_state\.conv_shape \[80, 3\] != none; .*"
                                              r"linear_state\.layer2\.ssm_shape none != \[4, 8, 8\]"):
        check_compatible(dataclasses.replace(layout, linear_state=a), dataclasses.replace(layout, linear_state=b))
    with pytest.raises(ValueError, match="no ssm_dtype for layer 0"):
        dataclasses.replace(layout, linear_state=json.dumps([["layers", [0]], ["conv_shape", [1, 3]],
                                                             ["conv_dtype", "float32"], ["ssm_shape", [1, 1, 1]]]))


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hybrid") / "qwen3-next", "qwen3-next", seed=3)


def _engine(model_dir) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), block_size=4, kv_cache_memory="4MiB",
                                                 max_num_batched_tokens=8))


def _prompt(seed: int, n: int = 29) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _slot(engine: LLMEngine, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for st in engine.linear_states for t in (st.conv, st.ssm)]


def test_the_state_lands_bit_for_bit_in_the_reserved_slot_and_no_other(hybrid_dir) -> None:
    prefill, decode, colocated = _engine(hybrid_dir), _engine(hybrid_dir), _engine(hybrid_dir)
    layout = engine_layout(prefill)
    assert layout == engine_layout(decode) and [s[0] for s in state_specs(layout.linear_state)] == [(80, 3)] * 3
    ref = colocated.add_request("r", _prompt(1), SP)
    run_to_end(colocated)

    p = prefill.add_prefill_request("r", _prompt(1), SP)  # 29 tokens in chunks of 8: the state carried over 4 steps
    while p.status != RequestStatus.HELD_FOR_SEND:
        prefill.step()
    src, src_slot = prefill.begin_send("r"), prefill.state_slot("r")
    sent = _slot(prefill, src_slot)

    decode.add_request("filler", _prompt(2, 5), SP)  # holds slot 0: the reservation's slot differs from prefill's
    decode.step()
    d = decode.reserve("r", _prompt(1), SP)
    decode.step()
    dst, dst_slot = decode.get_block_ids("r"), decode.state_slot("r")
    assert dst_slot >= 0 and dst_slot != src_slot
    decode.abort_request("filler")
    before = _slot(decode, dst_slot + 1)

    receiver, port = KVReceiver.listen("127.0.0.1", layout, timeout=20)
    sender = KVSender.connect("127.0.0.1", port, layout, timeout=20)
    try:
        def transfer(to_slot: int):
            got, t = receive_in_background(receiver, decode.kv_cache, validate=decode.begin_kv_receive, timeout=20,
                                            linear_states=decode.linear_states)
            stats = sender.send("r", src, dst, prefill.kv_cache, meta={"first_token": p.output_token_ids[0]},
                                state=StateMove(prefill.linear_states, src_slot, to_slot))
            t.join(30)
            return stats, got

        # Into a slot the engine did not reserve for it: refused before any byte lands, the pair goes on.
        _, got = transfer(dst_slot + 1)
        assert str(got["error"]) == f"request r: linear-attention state sent to slot {dst_slot + 1}, reserved slot " \
                                    f"{dst_slot}"
        assert all(torch.equal(a, b) for a, b in zip(_slot(decode, dst_slot + 1), before))
        assert d.status == RequestStatus.WAITING_FOR_KV

        stats, got = transfer(dst_slot)
        assert all(torch.equal(a, b) for a, b in zip(_slot(decode, dst_slot), sent))
        assert torch.equal(decode.kv_cache[:, dst], prefill.kv_cache[:, src])
        state_bytes = state_nbytes(layout.linear_state)
        assert stats.num_bytes == got["r"].stats.num_bytes == len(src) * prefill.kv_cache[:, 0].numel() * 4 + \
            state_bytes
    finally:
        sender.close()
        receiver.close()
    finish_on_decode(prefill, decode, "r", got["r"].meta["first_token"], d, ref)


def test_a_channel_that_needs_the_state_in_parts_is_refused_at_open(hybrid_dir) -> None:
    engine = _engine(hybrid_dir)
    layout = engine_layout(engine)
    receivers = KVReceiveWorker(engine, KVReceiveScheduler(None, 2.0), "127.0.0.1", 2.0)
    with pytest.raises(ValueError) as e:
        receivers.open(ChannelRequest(peer="p:1", layout=layout, device="cpu", tensor_parallel_size=2))
    assert str(e.value) == (
        "the linear-attention state of a hybrid model is sent between tiers with one rank on each side only "
        "(--tensor-parallel-size 1): prefill has 2 rank(s), decode 1; serve it at --tensor-parallel-size 1 on both "
        "tiers, or colocated (pdserve serve)")
    assert receivers.num_pairs == 0

    asked = []  # a tensor-parallel prefill engine does not even ask
    senders = KVSendWorker(engine.kv_cache, layout, "p:1", 2.0, lambda *a: asked.append(a), SimpleNamespace(size=2),
                           linear_states=engine.linear_states)
    with pytest.raises(KVTransferError, match=r"^no KV channel to d:1: the linear-attention state of a hybrid model is "
                                              r"sent between tiers with one rank on each side only .*prefill has 2 "
                                              r"rank\(s\), decode 1"):
        senders.pair("d:1")
    assert not asked


def test_a_prefix_the_decode_engine_holds_needs_no_state_snapshot_there(hybrid_dir) -> None:
    """The decode engine computed a prompt sharing 26 tokens with this one. A computing request
    could not take them (its linear state would come from a snapshot, and there is none below
    the first boundary, 256), but a reservation can: the state after the whole prompt arrives
    with the KV. So it takes the attention blocks of 24 tokens, the layer-wise send leaves them
    out, the state lands in the reserved slot, and the tokens are a colocated engine's."""
    from pdserve.v1 import engine_pb2
    from prefill_service.servicer import _skipped

    prefill, decode, colocated = _engine(hybrid_dir), _engine(hybrid_dir), _engine(hybrid_dir)
    shared = _prompt(4, 26)
    prompt = shared + _prompt(5, 9)
    ref = colocated.add_request("r", prompt, SP)
    run_to_end(colocated)
    assert ref.num_cached_tokens == 0
    decode.add_request("earlier", shared + _prompt(6, 3), SP)
    run_to_end(decode)
    assert not decode.scheduler.kv.snapshots.by_hash  # no snapshot: a computing request would hit nothing

    r = decode.reserve("r", prompt, SP)
    decode.step()
    assert r.num_cached_tokens == 24
    dst, dst_slot = decode.get_block_ids("r"), decode.state_slot("r")
    assert len(dst) == 9  # 35 tokens, one attention group
    asked = engine_pb2.PrefillRequest(request_id="r", prompt_token_ids=prompt, dst_block_ids=dst, num_skip_blocks=6)
    skip_tokens, sent_to = _skipped(prefill, asked, len(prompt))
    assert skip_tokens == 24 and sent_to == dst[6:]

    layout = engine_layout(prefill)
    senders = KVSendWorker(prefill.kv_cache, layout, "prefill-0:1", 20, linear_states=prefill.linear_states)
    receiver, port = KVReceiver.listen("127.0.0.1", layout, timeout=20)
    senders._senders[("decode-0:1", 0)] = KVSender.connect("127.0.0.1", port, layout, timeout=20)
    sends = KVSendScheduler(senders, layout.num_layers, pairs_per_decode=1, state_slot=prefill.state_slot)
    prefill.layerwise_sink = sends
    got, t = receive_in_background(receiver, decode.kv_cache, validate=decode.begin_kv_receive, timeout=20,
                                    linear_states=decode.linear_states)
    try:
        sends.expect("r", "decode-0:1", sent_to, 0, dst_state_slot=dst_slot)
        p = prefill.add_prefill_request("r", prompt, SP, kv_skip_tokens=skip_tokens)
        while p.status != RequestStatus.HELD_FOR_SEND:
            prefill.step()
        sent_state = _slot(prefill, prefill.state_slot("r"))
        send = sends.first_token("r", {"first_token": p.output_token_ids[0]})
        assert send is not None  # layer by layer
        stats = send.result(timeout=30)
        t.join(30)
        assert "error" not in got, got
        src = prefill.scheduler.kv.send_block_ids("r")
        assert stats.num_blocks == len(src) == 3 and r.kv_skipped_blocks == 6
        assert stats.num_bytes == 3 * prefill.kv_cache[:, 0].numel() * 4 + state_nbytes(layout.linear_state)
        assert torch.equal(decode.kv_cache[:, sent_to], prefill.kv_cache[:, src])
        assert all(torch.equal(a, b) for a, b in zip(_slot(decode, dst_slot), sent_state))
    finally:
        sends.close()
        receiver.close()
    finish_on_decode(prefill, decode, "r", got["r"].meta["first_token"], r, ref)
