"""Transfers between two real processes over gloo: every plan lands bit for bit, a rejected
transfer is drained and the pair stays in step, a draft model's cache travels in the same
transfer, and closing or killing either side ends the other's wait within the deadline."""
from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch

from kv_transfer import KVChannelClosed, KVTransferError, merge_runs
from tests.kv_transfer.pairs import assert_broken_after_death, DRAFT, SLACK_S, SMALL, Pair, Peer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_transfers_land_exactly(pairs: Any, dtype: str) -> None:
    """Bit for bit, and the bytes counted are the cache's: 4, 2 and 1 a value."""
    pair = pairs(dtype)
    rng = random.Random(dtype)
    requests = [
        ("contiguous", [0, 1, 2, 3, 4], [10, 11, 12, 13, 14]),
        ("shuffled", rng.sample(range(20), 7), rng.sample(range(20), 7)),
        ("src-runs-dst-gap", [5, 6, 7, 8], [2, 3, 9, 10]),
        ("single", [19], [0]),
        ("empty", [], []),
        ("all", list(range(20)), rng.sample(range(20), 20)),
    ]
    block_bytes = 2 * 4 * 2 * 8 * pair.sent.element_size()
    for (rid, src, dst), (rstats, sstats) in zip(requests, pair.transfer(requests)):
        runs = len(merge_runs(src, dst))
        assert rstats.num_messages == sstats["num_messages"] == 3 * runs
        assert rstats.num_blocks == sstats["num_blocks"] == len(dst)
        assert rstats.num_bytes == sstats["num_bytes"] == 3 * len(dst) * block_bytes
        assert rstats.backend == sstats["backend"] == "gloo"
        names = [name for name, _ in rstats.marks]
        assert names[0] == "header received" and names[-1] == "landed"
        assert [t for _, t in rstats.marks] == sorted(t for _, t in rstats.marks)
    assert [r[1]["num_messages"] for r in pair.transfer(requests[:1])] == [3]  # one merged run


@pytest.mark.parametrize("plan, messages", [((True, 1), lambda runs: 3), ((True, 2), lambda runs: 2),
                                            ((False, 3), lambda runs: 3 * runs)])
@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_every_plan_lands_exactly(pairs: Any, plan: tuple[bool, int], messages: Any, dtype: str) -> None:
    """Packed (gathered, then scattered) in chunks of 1 and 2 of the 3 layers; in place with all
    layers in one batch. The header tells the receiver which."""
    pair = pairs(dtype)
    rng = random.Random(str(plan))
    requests = [("shuffled", rng.sample(range(20), 7), rng.sample(range(20), 7)),
                ("runs", [5, 6, 7, 8], [2, 3, 9, 10]), ("empty", [], [])]
    for (_, src, dst), (rstats, sstats) in zip(requests, pair.transfer(requests, plan)):
        want = messages(len(merge_runs(src, dst))) if src else 0
        assert rstats.num_messages == sstats["num_messages"] == want


@pytest.mark.parametrize("plan", [None, (True, 2), (False, 3)])
def test_rejected_transfer_is_drained_and_pair_stays_usable(pairs: Any, plan: tuple[bool, int] | None) -> None:
    pair = pairs("float32")
    requests = [("bad", [0, 1, 2], [5, 6, 7]), ("out-of-range", [3], [25]), ("good", [3, 9], [6, 1])]
    pair.peer.post("send", pair.name, requests, plan)
    before = pair.cache.clone()

    def validate(request_id: str, dst: list[int]) -> None:
        if request_id == "bad":
            raise ValueError(f"blocks {dst} are not reserved for {request_id}")
    with pytest.raises(ValueError, match="not reserved for bad"):
        pair.receiver.recv(pair.cache, validate, timeout=20.0)
    with pytest.raises(KVTransferError, match="out of range"):
        pair.receiver.recv(pair.cache, validate, timeout=20.0)
    assert torch.equal(pair.cache, before)
    rid, dst, _, _ = pair.receiver.recv(pair.cache, validate, timeout=20.0)
    assert (rid, dst) == ("good", [6, 1])
    before[:, [6, 1]] = pair.sent[:, [3, 9]]
    assert torch.equal(pair.cache, before)
    assert len(pair.peer.reply()) == 3


def test_concurrent_sends_do_not_interleave(pairs: Any) -> None:
    pair = pairs("bfloat16")
    rng = random.Random(3)
    requests = [(f"r{i}", rng.sample(range(20), 6), rng.sample(range(20), 6)) for i in range(6)]
    pair.peer.post("send_concurrent", pair.name, requests)
    by_id = {rid: (src, dst) for rid, src, dst in requests}
    for _ in requests:
        expected = pair.cache.clone()
        rid, dst, _, _ = pair.receiver.recv(pair.cache, timeout=20.0)
        src, want_dst = by_id.pop(rid)
        assert dst == want_dst
        expected[:, dst] = pair.sent[:, src]
        assert torch.equal(pair.cache, expected)
    pair.peer.reply()


def test_sender_failing_midway_is_reported_and_pair_stays_usable(pairs: Any) -> None:
    pair = pairs("float32")
    pair.peer.post("abort_midway", pair.name, ("doomed", [0, 1], [2, 3]))
    with pytest.raises(KVTransferError, match="aborted"):
        pair.receiver.recv(pair.cache, timeout=20.0)
    assert pair.peer.reply() == "prefill failed"
    # Blocks 2 and 3 now hold whatever was sent; the decode server frees them with the request.
    pair.transfer([("after", [4, 5], [2, 3])])


@pytest.mark.parametrize("plan", [None, (True, 1), (True, 2), (False, 3)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_draft_models_blocks_travel_in_the_same_transfer(peer: Peer, plan: tuple[bool, int] | None,
                                                           dtype: str) -> None:
    """Speculative decoding with a draft model: every transfer moves the same blocks of the
    draft's cache (other layers, heads and head size) after the target's, in the one
    transfer whose trailer ends it; both land exactly and the bytes count both."""
    pair = Pair(peer, f"draft-{dtype}-{plan}", SMALL, dtype, draft_spec=DRAFT)
    try:
        rng = random.Random(f"{dtype}{plan}")
        requests = [("shuffled", rng.sample(range(20), 7), rng.sample(range(20), 7)),
                    ("runs", [5, 6, 7, 8], [2, 3, 9, 10]), ("empty", [], [])]
        size = torch.finfo(getattr(torch, dtype)).bits // 8
        per_block = 3 * 2 * 4 * 2 * 8 * size + 2 * 2 * 4 * 1 * 4 * size
        for (_, src, _), (rstats, sstats) in zip(requests, pair.transfer(requests, plan)):
            assert rstats.num_bytes == sstats["num_bytes"] == len(src) * per_block
    finally:
        pair.receiver.close()


def test_a_rejected_or_aborted_transfer_with_a_draft_keeps_the_pair_in_step(peer: Peer) -> None:
    """Refused by the decode side: neither cache changes; aborted by the prefill side midway:
    the receiver hears it; either way the next transfer lands in both caches."""
    pair = Pair(peer, "draft-rejected", SMALL, "float32", draft_spec=DRAFT)
    try:
        pair.peer.post("send", pair.name, [("bad", [0, 1, 2], [5, 6, 7])], None)
        before, draft_before = pair.cache.clone(), pair.draft.clone()

        def refuse(request_id: str, dst: list[int]) -> None:
            raise ValueError(f"blocks {dst} are not reserved for {request_id}")
        with pytest.raises(ValueError, match="not reserved for bad"):
            pair.receiver.recv(pair.cache, refuse, timeout=20.0, draft_cache=pair.draft)
        assert torch.equal(pair.cache, before) and torch.equal(pair.draft, draft_before)
        pair.peer.reply()
        pair.peer.post("abort_midway", pair.name, ("doomed", [0, 1], [2, 3]))
        with pytest.raises(KVTransferError, match="aborted"):
            pair.receiver.recv(pair.cache, timeout=20.0, draft_cache=pair.draft)
        assert pair.peer.reply() == "prefill failed"
        pair.transfer([("after", [4, 5], [2, 3])])
        with pytest.raises(ValueError, match="give draft_cache"):  # this pair's transfers carry a draft
            pair.receiver.recv(pair.cache, timeout=1.0)
    finally:
        pair.receiver.close()


def test_sender_close_ends_receiver(peer: Peer) -> None:
    pair = Pair(peer, "closing", SMALL, "float32")
    peer.call("close", "closing")
    with pytest.raises(KVChannelClosed, match="prefill side closed"):
        pair.receiver.recv(pair.cache, timeout=20.0)
    with pytest.raises(KVChannelClosed):
        pair.receiver.recv(pair.cache, timeout=20.0)
    pair.receiver.close()


class _PopSignal:
    """Wraps a receiver's header store: ``waiting`` is set as recv enters its blocking wait."""

    def __init__(self, store: Any) -> None:
        self._store, self.waiting = store, threading.Event()

    def queue_pop(self, *args: Any) -> Any:
        self.waiting.set()
        return self._store.queue_pop(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_receiver_close_wakes_a_blocked_recv(peer: Peer) -> None:
    pair = Pair(peer, "idle", SMALL, "float32")
    pair.receiver._store = signal_store = _PopSignal(pair.receiver._store)
    outcome: list[BaseException] = []

    def loop() -> None:
        try:
            pair.receiver.recv(pair.cache)  # no timeout: idle until a transfer or close
        except BaseException as e:
            outcome.append(e)
    thread = threading.Thread(target=loop)
    thread.start()
    assert signal_store.waiting.wait(20)  # recv is in its header wait, with nothing to receive
    assert thread.is_alive() and not outcome
    pair.receiver.close()
    thread.join(20)
    assert not thread.is_alive()
    assert isinstance(outcome[0], KVChannelClosed)


def test_gloo_sender_killed_mid_transfer(peer: Peer) -> None:
    """The prefill process dies (SIGKILL) with half the layers sent over gloo: recv raises
    KVTransferError for that request within the pair's deadline, the pair is marked broken,
    this process lives on, and a new pair works."""
    doomed = Peer()
    try:
        spec = dict(SMALL, num_layers=8, num_blocks=64, block_size=16)
        timeout = 8.0  # the pair's deadline, setup included
        pair = Pair(doomed, "doomed", spec, "float32", timeout=timeout)
        assert pair.backend == "gloo"
        outcome: list[tuple[BaseException, float]] = []

        def receive() -> None:  # gloo sends complete only as the receiver takes them
            try:
                pair.receiver.recv(pair.cache, timeout=20.0)
            except BaseException as e:
                outcome.append((e, time.monotonic()))
        thread = threading.Thread(target=receive)
        thread.start()
        doomed.post("die_midway", "doomed", ("r", list(range(64)), list(range(64))))
        assert doomed.reply() == "dying"
        died = time.monotonic()
        thread.join(timeout + 2 * SLACK_S)
        assert not thread.is_alive() and len(outcome) == 1, "recv did not end after the sender died"
        failed, ended = outcome[0]
        assert isinstance(failed, KVTransferError) and not isinstance(failed, KVChannelClosed), repr(failed)
        assert failed.request_id == "r" and ended - died < timeout + SLACK_S, (failed, ended - died)
        assert_broken_after_death(pair, doomed)
    finally:
        if doomed.proc.is_alive():
            doomed.proc.kill()
    after = Pair(peer, "after-death", SMALL, "float32")
    try:
        after.transfer([("after", [0, 1], [2, 3])])
    finally:
        after.receiver.close()
