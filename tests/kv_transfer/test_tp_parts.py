"""Tensor-parallel parts: who sends which KV heads to whom, a pair between two head slices
(one rank's share of each side's heads), and a tensor-parallel engine's ranks each sending
their own heads (the worker ranks through kv_transfer/rank_worker.py)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.parallel import kv_head_range
from kv_transfer.tp_parts import KVPart, kv_transfer_parts
from tests.kv_transfer.pairs import SMALL, Pair, PeerError, Peer

PROMPT = list(range(3, 40))


@pytest.mark.parametrize("heads, sender_heads, receiver_heads, plan", [
    (((2, 4), (1, 3)), 4, 6, None), (((2, 4), (1, 3)), 4, 6, (True, 1)), (((2, 4), (1, 3)), 4, 6, (True, 2)),
    (((0, 2), (2, 4)), 2, 4, None), (((0, 2), (2, 4)), 2, 4, (False, 3)), (((0, 2), (2, 4)), 2, 4, (True, 3))])
def test_head_slices_land_in_the_receivers_heads(peer: Peer, heads: Any, sender_heads: int, receiver_heads: int,
                                                 plan: tuple[bool, int] | None) -> None:
    """Tensor-parallel ranks hold different shares of the KV heads: a pair moves one rank's
    share of the sender's heads into the receiver's share of its own, a head slice of each
    cache. Only those heads of the destination blocks change; a sliced sender always packs."""
    pair = Pair(peer, f"heads-{heads}-{plan}", dict(SMALL, num_kv_heads=sender_heads), "float32", heads=heads,
                receiver_spec=dict(SMALL, num_kv_heads=receiver_heads))
    try:
        requests = [("runs", [5, 6, 7, 8], [2, 3, 9, 10]), ("shuffled", [11, 0, 4], [7, 19, 1]), ("empty", [], [])]
        for (_, src, _), (rstats, sstats) in zip(requests, pair.transfer(requests, plan)):
            assert rstats.num_bytes == sstats["num_bytes"] == 3 * len(src) * 2 * 4 * 2 * 8 * 4  # 2 heads, fp32
    finally:
        pair.receiver.close()


def test_a_sliced_sender_refuses_an_in_place_plan(peer: Peer) -> None:
    pair = Pair(peer, "sliced-in-place", dict(SMALL, num_kv_heads=4), "float32", heads=((1, 3), (0, 2)))
    try:
        with pytest.raises(PeerError, match="must pack"):
            pair.peer.call("send", pair.name, [("r", [0, 1], [2, 3])], (False, 3))
        pair.transfer([("after", [0, 1], [2, 3])])  # nothing was sent: the pair is still in step
    finally:
        pair.receiver.close()


def test_kv_transfer_parts_cover_every_receiver_head_once_rank_to_rank():
    assert kv_transfer_parts(2, 1, 8) == [KVPart(0, 0, (0, 4), (0, 4)), KVPart(1, 0, (0, 4), (4, 8))]
    assert kv_transfer_parts(1, 2, 8) == [KVPart(0, 0, (0, 4), (0, 4)), KVPart(0, 1, (4, 8), (0, 4))]
    assert kv_transfer_parts(4, 2, 2) == [KVPart(0, 0, (0, 1), (0, 1)), KVPart(2, 1, (0, 1), (0, 1))]
    for heads in (1, 2, 4, 8):
        sizes = [n for n in (1, 2, 4, 8) if heads % n == 0 or n % heads == 0]
        for p in sizes:
            for d in sizes:
                got = {}
                for part in kv_transfer_parts(p, d, heads):
                    s_lo, _ = kv_head_range(part.src_rank, p, heads)
                    d_lo, d_hi = kv_head_range(part.dst_rank, d, heads)
                    src = range(s_lo + part.src_heads[0], s_lo + part.src_heads[1])  # global heads sent
                    dst = range(d_lo + part.dst_heads[0], d_lo + part.dst_heads[1])
                    assert list(src) == list(dst) and d_lo <= dst.start and dst.stop <= d_hi
                    for h in dst:
                        assert (part.dst_rank, h) not in got  # each receiver head once
                        got[(part.dst_rank, h)] = part.src_rank
                want = {(r, h) for r in range(d) for h in range(*kv_head_range(r, d, heads))}
                assert set(got) == want, (p, d, heads)


@pytest.mark.slow
def test_each_rank_sends_its_own_kv_heads(tiny_llama_dir):
    """A TP = 2 engine's KV leaves rank by rank (rank 0 in-process, rank 1 through a call to
    its worker), each rank's heads over a pair of their own, into one TP = 1 cache: what lands
    is what one rank computes (up to the all-reduce's summation order), rank 0's heads bit for bit."""
    import threading

    from engine.rank_calls import RankCallError, call
    from kv_transfer import KVLayout, KVReceiver, KVSender
    from kv_transfer.rank_worker import install_rank_handlers

    kw = dict(dtype="float32", device="cpu", kv_cache_memory="4MiB", block_size=4, num_gpu_blocks_override=12)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    one = LLM(str(tiny_llama_dir), **kw)
    one.generate([PROMPT], sp)
    full = one.engine.kv_cache
    tp = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kw)
    try:
        tp.generate([PROMPT], sp)
        install_rank_handlers(tp.engine.tp, 30.0)  # as the KV roles do when they are built
        landed = torch.zeros_like(full)
        blocks = list(range(full.shape[1]))
        ends = []
        for part in kv_transfer_parts(2, 1, 2):
            dst = landed[..., part.dst_heads[0]:part.dst_heads[1], :]
            receiver, port = KVReceiver.listen("127.0.0.1", KVLayout.of(dst, "tiny"), timeout=20.0)
            ends.append(receiver)
            got = threading.Thread(target=receiver.recv, args=(dst,), kwargs={"timeout": 20.0})
            got.start()
            lo, hi = part.src_heads
            if part.src_rank == 0:
                sender = KVSender.connect("127.0.0.1", port, KVLayout.of(dst, "tiny"), timeout=20.0)
                ends.append(sender)
                sender.send("r", blocks, blocks, tp.engine.kv_cache[..., lo:hi, :])
            else:
                store = tp.engine.tp.store
                call(store, part.src_rank, "kv_connect", dict(
                    key="p", host="127.0.0.1", port=port, layout=KVLayout.of(dst, "tiny").to_dict(),
                    heads=[lo, hi], backend="auto", timeout=20.0), 30.0)
                stats = call(store, part.src_rank, "kv_send",
                             dict(key="p", request_id="r", src=blocks, dst=blocks, meta={}), 30.0)
                assert stats["num_blocks"] == len(blocks)
                with pytest.raises(RankCallError, match="no KV pair"):
                    call(store, part.src_rank, "kv_send",
                         dict(key="nope", request_id="r", src=[], dst=[], meta={}), 30.0)
                call(store, part.src_rank, "kv_close", dict(key="p"), 30.0)
            got.join(20.0)
        assert landed.abs().sum() > 0
        assert torch.equal(landed[..., 0:1, :], tp.engine.kv_cache)
        torch.testing.assert_close(landed, full, rtol=1e-5, atol=1e-5)
        for end in ends:
            end.close()
    finally:
        tp.engine.close()
