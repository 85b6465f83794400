"""Setting up a pair: the handshake refuses mismatched layouts (FP8 scales, draft models)
on both sides with the same message, and every setup step is bounded by the pair's
deadline. (The HMAC proof of the shared secret: tests/reliability/test_kv_secret.py.)"""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from kv_transfer import KVLayout, KVReceiver, KVSender, KVTransferError
from tests.kv_transfer.pairs import DRAFT, SLACK_S, SMALL, PeerError, Peer, layout_for
from tests.processes import free_port


def test_layout_mismatch_raises_on_both_sides(peer: Peer) -> None:
    decode = layout_for(SMALL, "float32")
    receiver, port = KVReceiver.listen("127.0.0.1", decode, timeout=20.0)
    prefill = KVLayout("tiny", "bfloat16", block_size=8, num_layers=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(PeerError) as sender_side:
        peer.call("connect", "mismatch", port, prefill.to_dict(), SMALL, "bfloat16", "cpu", "auto", 20.0, None)
    assert sender_side.value.kind == "KVTransferError"
    with pytest.raises(KVTransferError) as receiver_side:
        receiver.wait_connected()
    for message in (sender_side.value.message, str(receiver_side.value)):
        assert message == ("KV layout mismatch between prefill and decode: "
                           "dtype 'bfloat16' != 'float32'; block_size 8 != 4")
    receiver.close()


def test_fp8_scales_that_differ_are_refused_on_both_sides(peer: Peer) -> None:
    """Two FP8 caches whose scales differ in one layer: their bytes mean other values, so the
    handshake refuses the pair on both sides, naming both sides' scales."""
    decode = layout_for(SMALL, "float8_e4m3fn")
    receiver, port = KVReceiver.listen("127.0.0.1", decode, timeout=20.0)
    prefill = KVLayout(**{**decode.to_dict(), "k_scales": (0.37, 1.25, 0.75)})
    with pytest.raises(PeerError) as sender_side:
        peer.call("connect", "fp8-scales", port, prefill.to_dict(), SMALL, "float8_e4m3fn", "cpu", "auto", 20.0,
                  None)
    assert sender_side.value.kind == "KVTransferError"
    with pytest.raises(KVTransferError) as receiver_side:
        receiver.wait_connected()
    for message in (sender_side.value.message, str(receiver_side.value)):
        assert message == ("KV layout mismatch between prefill and decode: "
                           "k_scales [0.37, 1.25, 0.75] != [0.37, 1.25, 0.5]")
    receiver.close()


@pytest.mark.parametrize("prefill_draft, decode_draft, diff", [
    (None, DRAFT, "draft model none != (tiny: 2 layers x 1 KV heads x 4, float32, blocks of 4) (speculative "
                  "decoding with a draft model needs it on both tiers: the prefill server computes the draft's "
                  "KV of the prompt)"),
    (DRAFT, None, "draft model (tiny: 2 layers x 1 KV heads x 4, float32, blocks of 4) != none (speculative "
                  "decoding with a draft model needs it on both tiers: the prefill server computes the draft's "
                  "KV of the prompt)"),
    (dict(DRAFT, num_layers=3), DRAFT, "draft.num_layers 3 != 2"),
])
def test_a_draft_model_on_one_side_only_or_another_draft_is_refused(peer: Peer, prefill_draft: Any,
                                                                    decode_draft: Any, diff: str) -> None:
    """The pair's handshake compares the drafts too: a decode server that drafts needs the
    draft's KV of every prompt, and a prefill server's draft KV is only good for its draft."""
    def layout(draft: Any) -> KVLayout:
        base = layout_for(SMALL, "float32")
        return KVLayout(**{**base.to_dict(), "draft": layout_for(draft, "float32") if draft else None})
    receiver, port = KVReceiver.listen("127.0.0.1", layout(decode_draft), timeout=20.0)
    with pytest.raises(PeerError) as sender_side:
        peer.call("connect", f"draft-mismatch-{diff[:12]}", port, layout(prefill_draft).to_dict(), SMALL,
                  "float32", "cpu", "auto", 20.0, None, prefill_draft)
    with pytest.raises(KVTransferError) as receiver_side:
        receiver.wait_connected()
    for message in (sender_side.value.message, str(receiver_side.value)):
        assert message == "KV layout mismatch between prefill and decode: " + diff
    receiver.close()


def test_connect_to_nobody_fails_within_timeout() -> None:
    layout = layout_for(SMALL, "float32")
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no KV receiver listening"):
        KVSender.connect("127.0.0.1", free_port(), layout, timeout=1.0)
    assert 1.0 <= time.monotonic() - start < 1.0 + SLACK_S


def test_listen_without_sender_times_out() -> None:
    receiver, port = KVReceiver.listen("127.0.0.1", layout_for(SMALL, "float32"), timeout=0.5)
    assert port > 0
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no prefill server connected"):
        receiver.wait_connected()
    assert time.monotonic() - start < 0.5 + SLACK_S
    receiver.close()


def test_within_returns_raises_and_bounds_a_call_without_a_deadline() -> None:
    from kv_transfer.pair import _within

    late: list[Any] = []
    assert _within(lambda: 7, 1.0, "quick", late.append) == 7
    with pytest.raises(ValueError, match="its own error"):
        _within(lambda: (_ for _ in ()).throw(ValueError("its own error")), 1.0, "failing", late.append)
    release = threading.Event()

    def stuck() -> str:  # as a blocking NCCL communicator waits for a peer that never comes
        release.wait(10)
        return "built after all"

    start = time.monotonic()
    with pytest.raises(KVTransferError, match=r"stuck step: not done within 0\.3s \(the peer never joined\)"):
        _within(stuck, 0.3, "stuck step", late.append)
    assert time.monotonic() - start < 0.3 + SLACK_S
    assert late == []
    release.set()  # it finishes late: its result is handed to on_late, not lost
    deadline = time.monotonic() + SLACK_S
    while not late and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late == ["built after all"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(), reason="needs NCCL")
def test_gpu_nccl_communicator_creation_fails_within_the_deadline_without_a_peer() -> None:
    # Rank 0 of a pair whose rank 1 never builds its end: the communicator's creation would wait
    # for it without end; the pair's setup fails within its deadline instead.
    from datetime import timedelta

    from kv_transfer.pair import _make_group

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30),
                                       wait_for_workers=False)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="NCCL communicator creation: not done within"):
        _make_group(store, 0, "nccl", timedelta(seconds=3), None, torch.device("cuda", 0))
    assert time.monotonic() - start < 3 + SLACK_S
