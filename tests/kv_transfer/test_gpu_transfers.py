"""Transfers with caches on GPUs (skipped on CPU): host-staged gloo on one GPU, NCCL between
two, with their faults (a rejected or aborted transfer, the sender closing or killed
mid-transfer). Throughput is measured by bench/kv_transfer.py, not here."""
from __future__ import annotations

import random
import time

import pytest
import torch

from kv_transfer import KVChannelClosed, KVTransferError
from tests.kv_transfer.pairs import assert_broken_after_death, SLACK_S, Pair, Peer


GPU_SPEC = dict(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=8, head_dim=64)  # 8 MiB in bf16


GPU_DRAFT = dict(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=32)


def _gpu_round_trip(peer: Peer, name: str, sender_device: str, receiver_device: str, backend: str,
                    plans: tuple[tuple[bool, int] | None, ...] = (None,), draft: dict | None = None) -> None:
    """Every plan moves exact bytes (of a draft model's cache too, with ``draft``). The
    receiver closes first while the peer's sender lives on: closing must not wait for the peer."""
    pair = Pair(peer, name, GPU_SPEC, "bfloat16", sender_device, receiver_device, draft_spec=draft)
    try:
        assert pair.backend == backend  # settled from the GPUs' UUIDs ("auto" on both sides)
        rng = random.Random(name)
        requests = [("contiguous", list(range(8)), list(range(20, 28))),
                    ("shuffled", rng.sample(range(64), 40), rng.sample(range(64), 40)),
                    ("all", list(range(64)), rng.sample(range(64), 64)),
                    ("empty", [], [])]
        for plan in plans:
            for rstats, sstats in pair.transfer(requests, plan):
                assert sstats["backend"] == rstats.backend == backend
    finally:
        start = time.monotonic()
        pair.receiver.close()
        assert time.monotonic() - start < SLACK_S


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_same_device_host_staged(peer: Peer) -> None:
    _gpu_round_trip(peer, "staged", "cuda:0", "cuda:0", "gloo", plans=(None, (True, 3)))
    _gpu_round_trip(peer, "cpu-to-gpu", "cpu", "cuda:0", "gloo", plans=(None, (True, 2)))
    _gpu_round_trip(peer, "staged-draft", "cuda:0", "cuda:0", "gloo", plans=(None, (True, 3)), draft=GPU_DRAFT)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("sender_device, receiver_device", [("cuda:1", "cuda:0"), ("cuda:0", "cuda:1")])
def test_gpu_nccl_between_two_devices(peer: Peer, sender_device: str, receiver_device: str) -> None:
    # In place, one group; packed in chunks of 1, 3 (uneven) and all layers; the sender's own choice.
    plans = (None, (False, 4), (False, 1), (True, 1), (True, 3), (True, 4))
    _gpu_round_trip(peer, f"nccl-{sender_device[-1]}", sender_device, receiver_device, "nccl", plans)
    _gpu_round_trip(peer, f"nccl-draft-{sender_device[-1]}", sender_device, receiver_device, "nccl", plans[:4],
                    draft=GPU_DRAFT)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_nccl_rejected_aborted_and_closed_by_sender(peer: Peer) -> None:
    pair = Pair(peer, "nccl-faults", GPU_SPEC, "bfloat16", "cuda:1", "cuda:0")
    assert pair.backend == "nccl"
    for plan in (None, (True, 1), (False, 4)):
        requests = [("bad", [0, 1, 2], [5, 6, 7]), ("out-of-range", [3], [99]), ("good", [3, 9], [6, 1])]
        pair.peer.post("send", pair.name, requests, plan)
        before = pair.cache.clone()

        def validate(request_id: str, dst: list[int]) -> None:
            if request_id == "bad":
                raise ValueError("not reserved")
        with pytest.raises(ValueError, match="not reserved"):
            pair.receiver.recv(pair.cache, validate, timeout=20.0)
        with pytest.raises(KVTransferError, match="out of range"):
            pair.receiver.recv(pair.cache, validate, timeout=20.0)
        assert torch.equal(pair.cache, before)  # drained: nothing written
        assert pair.receiver.recv(pair.cache, validate, timeout=20.0)[:2] == ("good", [6, 1])
        before[:, [6, 1]] = pair.sent[:, [3, 9]]
        assert torch.equal(pair.cache, before)
        assert len(pair.peer.reply()) == 3
    pair.peer.post("abort_midway", pair.name, ("doomed", [0, 1], [2, 3]))
    with pytest.raises(KVTransferError, match="aborted"):
        pair.receiver.recv(pair.cache, timeout=20.0)
    assert pair.peer.reply() == "prefill failed"
    pair.transfer([("after", [4, 5], [2, 3])])
    start = time.monotonic()
    peer.call("close", pair.name)  # the sender closes first this time
    assert time.monotonic() - start < SLACK_S
    with pytest.raises(KVChannelClosed, match="prefill side closed"):
        pair.receiver.recv(pair.cache, timeout=20.0)
    pair.receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_nccl_sender_killed_mid_transfer(peer: Peer) -> None:
    """The prefill process dies with half the layers sent: recv raises KVTransferError within
    the pair's deadline, this process lives on (no watchdog ends it), the GPU still works
    and a new pair does too."""
    doomed = Peer()
    try:
        spec = dict(GPU_SPEC, num_layers=8, num_blocks=256)  # 64 MiB, a chunk a layer
        timeout = 8.0  # the pair's deadline, setup included
        doomed.call("warm", "cuda:1")
        pair = Pair(doomed, "doomed", spec, "bfloat16", "cuda:1", "cuda:0", timeout=timeout)
        assert pair.backend == "nccl"
        doomed.post("die_midway", "doomed", ("r", list(range(256)), list(range(256))))
        assert doomed.reply() == "dying"
        start = time.monotonic()
        with pytest.raises(KVTransferError) as failed:
            pair.receiver.recv(pair.cache, timeout=20.0)
        elapsed = time.monotonic() - start
        assert failed.value.request_id == "r" and not isinstance(failed.value, KVChannelClosed)
        assert elapsed < timeout + SLACK_S, elapsed
        assert_broken_after_death(pair, doomed)
    finally:
        if doomed.proc.is_alive():
            doomed.proc.kill()
    x = torch.randn(1024, 1024, device="cuda:0")
    assert torch.allclose(x @ torch.eye(1024, device="cuda:0"), x)
    time.sleep(2.0)  # a watchdog or heartbeat thread would act by now
    _gpu_round_trip(peer, "after-death", "cuda:1", "cuda:0", "nccl")


def _canary_on_gpu(peer: Peer, monkeypatch, name: str, sender_device: str, receiver_device: str,
                   backend: str) -> None:
    """The transfer canary on GPUs: intact transfers (every plan) pass it, a block corrupted after
    it landed (the test hook, in this receiving process) fails it, and the pair goes on."""
    from kv_transfer import canary

    pair = Pair(peer, name, GPU_SPEC, "bfloat16", sender_device, receiver_device)
    try:
        assert pair.backend == backend
        rng = random.Random(name)
        requests = [("a", rng.sample(range(64), 40), rng.sample(range(64), 40)), ("b", [5], [9])]
        # host staging packs (the sender refuses an in-place plan from a GPU cache over gloo)
        for plan in (None, (True, 1), (True, 4) if backend == "gloo" else (False, 4)):
            pair.transfer(requests, plan)
        monkeypatch.setattr(canary, "TEST_CORRUPTION", canary._CorruptionHook(1))
        pair.peer.post("send", pair.name, [("bad", list(range(10)), list(range(30, 40)))], None)
        with pytest.raises(canary.KVChecksumError, match="request bad: KV checksum mismatch"):
            pair.receiver.recv(pair.cache, timeout=20)
        pair.peer.reply()
        monkeypatch.setattr(canary, "TEST_CORRUPTION", canary._CorruptionHook(0))
        pair.transfer(requests)
    finally:
        pair.receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_canary_host_staged(peer: Peer, monkeypatch) -> None:
    _canary_on_gpu(peer, monkeypatch, "canary-staged", "cuda:0", "cuda:0", "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_canary_nccl(peer: Peer, monkeypatch) -> None:
    _canary_on_gpu(peer, monkeypatch, "canary-nccl", "cuda:0", "cuda:1", "nccl")
