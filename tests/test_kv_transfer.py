"""KV transfer between two real processes over gloo on 127.0.0.1.

The test process is the decode side (KVReceiver); one spawned peer process is the
prefill side (KVSender), driven over a pipe and reused by every test. Both build
their caches from a seed, so the expected bytes are known without shipping tensors.
"""
from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
from dataclasses import asdict
from typing import Any

import pytest
import torch

from engine.kv_transfer import (
    KVChannelClosed,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferError,
    check_compatible,
    choose_backend,
    merge_runs,
)
from tests.processes import free_port

SMALL = dict(num_layers=3, num_blocks=20, block_size=4, num_kv_heads=2, head_dim=8)
SENDER_SEED, RECEIVER_SEED = 1, 2


def make_cache(seed: int, dtype: str, num_layers: int, num_blocks: int, block_size: int,
               num_kv_heads: int, head_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def layout_for(spec: dict[str, Any], dtype: str) -> KVLayout:
    return KVLayout(model="tiny", dtype=dtype, block_size=spec["block_size"],
                    num_layers=spec["num_layers"], num_kv_heads=spec["num_kv_heads"],
                    head_dim=spec["head_dim"])


# --------------------------------------------------------------------------- peer process

def _peer_main(conn: Any) -> None:
    """Prefill side. Commands: (name, *args); replies ("ok", value) or ("err", type, message)."""
    senders: dict[str, KVSender] = {}
    caches: dict[str, torch.Tensor] = {}
    while True:
        cmd, *args = conn.recv()
        try:
            result: Any = None
            if cmd == "stop":
                break
            if cmd == "connect":
                pair, port, layout, spec, dtype, device, backend = args
                caches[pair] = make_cache(SENDER_SEED, dtype, **spec).to(device)
                senders[pair] = KVSender.connect("127.0.0.1", port, KVLayout.from_dict(layout),
                                                 backend=backend, device=device, timeout=20.0)
            elif cmd == "send":  # several requests, one after the other
                pair, requests = args
                result = [asdict(senders[pair].send(rid, src, dst, caches[pair], meta={"first_token": len(src)}))
                          for rid, src, dst in requests]
            elif cmd == "send_concurrent":
                pair, requests = args
                errors: list[BaseException] = []

                def one(rid: str, src: list[int], dst: list[int]) -> None:
                    try:
                        senders[pair].send(rid, src, dst, caches[pair])
                    except BaseException as e:  # reported below
                        errors.append(e)
                threads = [threading.Thread(target=one, args=r) for r in requests]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise errors[0]
            elif cmd == "abort_midway":  # prefill fails after layer 0
                pair, (rid, src, dst) = args
                try:
                    with senders[pair].begin(rid, src, dst, caches[pair]) as transfer:
                        transfer.send_layer(0)
                        raise RuntimeError("prefill failed")
                except RuntimeError as e:
                    result = str(e)
            elif cmd == "close":
                senders.pop(args[0]).close()
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("err", type(e).__name__, str(e)))


class PeerError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class Peer:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child,), daemon=True)
        self.proc.start()

    def post(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def reply(self, timeout: float = 30.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("peer did not answer")
        status, *rest = self.conn.recv()
        if status == "err":
            raise PeerError(*rest)
        return rest[0]

    def call(self, *cmd: Any) -> Any:
        self.post(*cmd)
        return self.reply()


@pytest.fixture(scope="module")
def peer() -> Any:
    p = Peer()
    yield p
    p.post("stop")
    p.proc.join(10)
    if p.proc.is_alive():
        p.proc.kill()


class Pair:
    """Decode side here, prefill side in the peer; ``sent`` is the peer's cache, recomputed."""

    def __init__(self, peer: Peer, name: str, spec: dict[str, Any], dtype: str,
                 sender_device: str = "cpu", receiver_device: str = "cpu", backend: str = "gloo") -> None:
        self.peer, self.name, self.spec = peer, name, spec
        layout = layout_for(spec, dtype)
        self.receiver, port = KVReceiver.listen("127.0.0.1", layout, backend=backend,
                                                device=receiver_device, timeout=20.0)
        peer.call("connect", name, port, layout.to_dict(), spec, dtype, sender_device, backend)
        self.receiver.wait_connected()
        self.sent = make_cache(SENDER_SEED, dtype, **spec).to(receiver_device)
        self.cache = make_cache(RECEIVER_SEED, dtype, **spec).to(receiver_device)

    def transfer(self, requests: list[tuple[str, list[int], list[int]]]) -> list[tuple[Any, ...]]:
        """Send requests from the peer, receive and check each; return (recv stats, send stats)."""
        self.peer.post("send", self.name, requests)
        results = []
        for rid, src, dst in requests:
            expected = self.cache.clone()
            expected[:, dst] = self.sent[:, src]
            got_rid, got_dst, stats, meta = self.receiver.recv(self.cache, timeout=20.0)
            assert (got_rid, got_dst) == (rid, dst)
            assert meta == {"first_token": len(src)}  # the header's meta travels with the blocks
            assert torch.equal(self.cache, expected)  # the dst blocks exactly, nothing else touched
            results.append(stats)
        return list(zip(results, self.peer.reply()))


@pytest.fixture(scope="module")
def pairs(peer: Peer) -> Any:
    made: dict[str, Pair] = {}

    def get(dtype: str) -> Pair:
        if dtype not in made:
            made[dtype] = Pair(peer, dtype, SMALL, dtype)
        return made[dtype]
    yield get
    for pair in made.values():
        pair.receiver.close()


# --------------------------------------------------------------------------- pure functions

def test_merge_runs() -> None:
    assert merge_runs([], []) == []
    assert merge_runs([7], [3]) == [(7, 3, 1)]
    assert merge_runs([0, 1, 2, 3], [10, 11, 12, 13]) == [(0, 10, 4)]
    assert merge_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    # src consecutive but dst not, and the reverse: both must be consecutive
    assert merge_runs([0, 1, 2], [5, 9, 10]) == [(0, 5, 1), (1, 9, 2)]
    assert merge_runs([3, 8, 9], [0, 1, 2]) == [(3, 0, 1), (8, 1, 2)]
    assert merge_runs([5, 4, 3], [0, 1, 2]) == [(5, 0, 1), (4, 1, 1), (3, 2, 1)]  # descending
    with pytest.raises(ValueError):
        merge_runs([1, 2], [1])
    rng = random.Random(0)
    for _ in range(100):  # the runs cover exactly the pairs, in order
        n = rng.randrange(0, 12)
        src, dst = rng.sample(range(30), n), sorted(rng.sample(range(30), n))
        flat = [(s + i, d + i) for s, d, k in merge_runs(src, dst) for i in range(k)]
        assert flat == list(zip(src, dst))


def test_layout_of_and_check_compatible() -> None:
    cache = torch.zeros(3, 20, 2, 4, 2, 8, dtype=torch.bfloat16)
    layout = KVLayout.of(cache, "m")
    assert layout == KVLayout("m", "bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    assert KVLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError):
        KVLayout.of(torch.zeros(3, 20, 4, 2, 8), "m")
    check_compatible(layout, layout)
    other = KVLayout("n", "float32", block_size=16, num_layers=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(KVTransferError) as e:
        check_compatible(layout, other, "prefill", "decode")
    assert str(e.value) == ("KV layout mismatch between prefill and decode: model 'm' != 'n'; "
                            "dtype 'bfloat16' != 'float32'; block_size 4 != 16")


def test_choose_backend() -> None:
    assert choose_backend("cuda:0", "cuda:1", same_gpu=False)[0] == "nccl"
    backend, reason = choose_backend("cuda:0", "cuda:0", same_gpu=True)
    assert backend == "gloo" and reason.startswith("gloo (host-staged)") and "cuda:0" in reason
    assert choose_backend("cuda:0", "cpu", same_gpu=False)[0] == "gloo"
    assert choose_backend("cpu", "cpu", same_gpu=False) == ("gloo", "gloo: prefill and decode on CPU")


# --------------------------------------------------------------------------- two processes

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transfers_land_exactly(pairs: Any, dtype: str) -> None:
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
    assert [r[1]["num_messages"] for r in pair.transfer(requests[:1])] == [3]  # one merged run


def test_rejected_transfer_is_drained_and_pair_stays_usable(pairs: Any) -> None:
    pair = pairs("float32")
    requests = [("bad", [0, 1, 2], [5, 6, 7]), ("out-of-range", [3], [25]), ("good", [3, 9], [6, 1])]
    pair.peer.post("send", pair.name, requests)
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


def test_throughput_loopback(peer: Peer) -> None:
    spec = dict(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=8, head_dim=64)  # 16 MiB
    pair = Pair(peer, "bench", spec, "float32")
    try:
        rng = random.Random(0)
        for label, dst in [("1 run/layer", list(range(64))), ("64 runs/layer", rng.sample(range(64), 64))]:
            results = pair.transfer([(label, list(range(64)), dst)] * 3)
            best_r = max(r.bytes_per_second for r, _ in results)
            best_s = max(s["num_bytes"] / s["seconds"] for _, s in results)
            mib = results[0][0].num_bytes / 2**20
            print(f"\nKV transfer gloo loopback, {mib:.0f} MiB, {label}: "
                  f"receiver {best_r / 1e9:.2f} GB/s, sender {best_s / 1e9:.2f} GB/s")
            assert best_r > 0
    finally:
        pair.receiver.close()


def test_layout_mismatch_raises_on_both_sides(peer: Peer) -> None:
    decode = layout_for(SMALL, "float32")
    receiver, port = KVReceiver.listen("127.0.0.1", decode, timeout=20.0)
    prefill = KVLayout("tiny", "bfloat16", block_size=8, num_layers=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(PeerError) as sender_side:
        peer.call("connect", "mismatch", port, prefill.to_dict(), SMALL, "bfloat16", "cpu", "gloo")
    assert sender_side.value.kind == "KVTransferError"
    with pytest.raises(KVTransferError) as receiver_side:
        receiver.wait_connected()
    for message in (sender_side.value.message, str(receiver_side.value)):
        assert message == ("KV layout mismatch between prefill and decode: "
                           "dtype 'bfloat16' != 'float32'; block_size 8 != 4")
    receiver.close()


def test_sender_close_ends_receiver(peer: Peer) -> None:
    pair = Pair(peer, "closing", SMALL, "float32")
    peer.call("close", "closing")
    with pytest.raises(KVChannelClosed, match="prefill side closed"):
        pair.receiver.recv(pair.cache, timeout=20.0)
    with pytest.raises(KVChannelClosed):
        pair.receiver.recv(pair.cache, timeout=20.0)
    pair.receiver.close()


def test_receiver_close_wakes_a_blocked_recv(peer: Peer) -> None:
    pair = Pair(peer, "idle", SMALL, "float32")
    outcome: list[BaseException] = []

    def loop() -> None:
        try:
            pair.receiver.recv(pair.cache)  # no timeout: idle until a transfer or close
        except BaseException as e:
            outcome.append(e)
    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    pair.receiver.close()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert isinstance(outcome[0], KVChannelClosed)



def test_connect_to_nobody_fails_within_timeout() -> None:
    layout = layout_for(SMALL, "float32")
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no KV receiver listening"):
        KVSender.connect("127.0.0.1", free_port(), layout, timeout=1.0)
    assert time.monotonic() - start < 1.5


def test_listen_without_sender_times_out() -> None:
    receiver, port = KVReceiver.listen("127.0.0.1", layout_for(SMALL, "float32"), timeout=0.5)
    assert port > 0
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no prefill server connected"):
        receiver.wait_connected()
    assert time.monotonic() - start < 2.0
    receiver.close()


# --------------------------------------------------------------------------- GPU (skipped on CPU)

def _gpu_round_trip(peer: Peer, name: str, sender_device: str, receiver_device: str,
                    backend: str) -> None:
    spec = dict(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=8, head_dim=64)
    pair = Pair(peer, name, spec, "bfloat16", sender_device, receiver_device, backend)
    try:
        rng = random.Random(1)
        requests = [("contiguous", list(range(8)), list(range(20, 28))),
                    ("shuffled", rng.sample(range(64), 40), rng.sample(range(64), 40))]
        for _, sstats in pair.transfer(requests):
            assert sstats["backend"] == backend
        big = [(f"all{i}", list(range(64)), list(range(64))) for i in range(3)]
        best = max(r.bytes_per_second for r, _ in pair.transfer(big))
        print(f"\nKV transfer {backend} {sender_device} -> {receiver_device}, "
              f"{64 * 4 * pair.cache[0, 0].numel() * 2 / 2**20:.0f} MiB: {best / 1e9:.2f} GB/s")
    finally:
        pair.receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_same_device_host_staged(peer: Peer) -> None:
    assert choose_backend("cuda:0", "cuda:0", same_gpu=True)[0] == "gloo"
    _gpu_round_trip(peer, "staged", "cuda:0", "cuda:0", "gloo")
    _gpu_round_trip(peer, "cpu-to-gpu", "cpu", "cuda:0", "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_nccl_between_two_devices(peer: Peer) -> None:
    backend, _ = choose_backend("cuda:1", "cuda:0", same_gpu=False)
    _gpu_round_trip(peer, "nccl", "cuda:1", "cuda:0", backend)
