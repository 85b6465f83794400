"""KV transfer between two real processes: gloo on 127.0.0.1 on any machine, and on
GPUs host-staged gloo (one GPU) and NCCL (two GPUs).

The test process is the decode side (KVReceiver); one spawned peer process is the
prefill side (KVSender), driven over a pipe and reused by every test. Both build
their caches from a seed, so the expected bytes are known without shipping tensors.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import pytest
import torch

from kv_transfer import (
    KVChannelClosed,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferError,
    WirePlan,
    check_compatible,
    choose_backend,
    chunk_ranges,
    merge_runs,
    plan_transfer,
    resolve_backend,
)
from kv_transfer.protocol import (decode_runs, encode_runs, expand_runs, has_repeats, is_head_slice, run_array,
                                  slow_path)
from tests.processes import free_port

SMALL = dict(num_layers=3, num_blocks=20, block_size=4, num_kv_heads=2, head_dim=8)
SENDER_SEED, RECEIVER_SEED, DRAFT_SEED = 1, 2, 3
# A draft model's cache beside SMALL's: the same blocks, other layers and heads.
DRAFT = dict(num_layers=2, num_blocks=20, block_size=4, num_kv_heads=1, head_dim=4)


def make_cache(seed: int, dtype: str, num_layers: int, num_blocks: int, block_size: int,
               num_kv_heads: int, head_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


# An FP8 cache's per-layer scales (a layout of float8_e4m3fn must carry them).
FP8_K_SCALES, FP8_V_SCALES = (0.37, 1.25, 0.5), (1.9, 0.125, 3.0)


def layout_for(spec: dict[str, Any], dtype: str) -> KVLayout:
    fp8 = dtype == "float8_e4m3fn"
    return KVLayout(model="tiny", dtype=dtype, block_size=spec["block_size"],
                    num_layers=spec["num_layers"], num_kv_heads=spec["num_kv_heads"],
                    head_dim=spec["head_dim"], k_scales=FP8_K_SCALES if fp8 else (),
                    v_scales=FP8_V_SCALES if fp8 else (), model_dtype="float32" if fp8 else "")


# --------------------------------------------------------------------------- peer process

def _peer_main(conn: Any) -> None:
    """Prefill side. Commands: (name, *args); replies ("ok", value) or ("err", type, message)."""
    senders: dict[str, KVSender] = {}
    caches: dict[str, torch.Tensor] = {}
    drafts: dict[str, torch.Tensor | None] = {}  # a draft model's cache, sent beside the pair's
    while True:
        cmd, *args = conn.recv()
        try:
            result: Any = None
            if cmd == "stop":
                break
            if cmd == "connect":  # heads: send only these KV heads of the cache (a view), or None
                pair, port, layout, spec, dtype, device, backend, timeout, heads, *more = args
                caches[pair] = make_cache(SENDER_SEED, dtype, **spec).to(device)
                drafts[pair] = make_cache(DRAFT_SEED, dtype, **more[0]).to(device) if more and more[0] else None
                if heads is not None:
                    caches[pair] = caches[pair][..., heads[0]:heads[1], :]
                senders[pair] = KVSender.connect("127.0.0.1", port, KVLayout.from_dict(layout),
                                                 backend=backend, device=device, timeout=timeout)
                result = senders[pair].backend
            elif cmd == "send":  # several requests, one after the other; plan: None or (pack, chunk_layers)
                pair, requests, plan = args
                plan = WirePlan(*plan) if plan else None
                result = [asdict(senders[pair].send(rid, src, dst, caches[pair], meta={"first_token": len(src)},
                                                    plan=plan, draft_cache=drafts[pair]))
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
                    with senders[pair].begin(rid, src, dst, caches[pair], draft_cache=drafts[pair]) as transfer:
                        transfer.send_layer(0)
                        raise RuntimeError("prefill failed")
                except RuntimeError as e:
                    result = str(e)
            elif cmd == "die_midway":  # the process dies with half the layers sent
                pair, (rid, src, dst) = args
                transfer = senders[pair].begin(rid, src, dst, caches[pair], plan=WirePlan(True, 1))
                for layer in range(senders[pair].layout.num_layers // 2):
                    transfer.send_layer(layer)
                if caches[pair].is_cuda:
                    torch.cuda.synchronize()
                conn.send(("ok", "dying"))
                os.kill(os.getpid(), signal.SIGKILL)
            elif cmd == "warm":  # CUDA up on a device, so that pair setup is quick
                torch.ones(1, device=args[0]).sum().item()
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
                 sender_device: str = "cpu", receiver_device: str = "cpu", backend: str = "auto",
                 timeout: float = 20.0, heads: tuple[tuple[int, int], tuple[int, int]] | None = None,
                 receiver_spec: dict[str, Any] | None = None, draft_spec: dict[str, Any] | None = None) -> None:
        """``heads``: (the sender's heads, the receiver's heads) of the two caches that the pair
        moves (as between tensor-parallel ranks holding different shares of the KV heads); the
        receiver's cache is ``receiver_spec`` (default ``spec``). ``draft_spec``: both sides
        also hold a draft model's cache of that shape, whose same blocks every transfer moves."""
        self.peer, self.name, self.spec = peer, name, spec
        (s0, s1), (r0, r1) = heads or ((0, spec["num_kv_heads"]), (0, spec["num_kv_heads"]))
        layout = layout_for(dict(spec, num_kv_heads=s1 - s0), dtype)
        if draft_spec is not None:
            layout = KVLayout(**{**layout.to_dict(), "draft": layout_for(draft_spec, dtype)})
        self.receiver, port = KVReceiver.listen("127.0.0.1", layout, backend=backend,
                                                device=receiver_device, timeout=timeout)
        self.backend = peer.call("connect", name, port, layout.to_dict(), spec, dtype, sender_device, backend,
                                 timeout, heads and heads[0], draft_spec)
        self.receiver.wait_connected()
        assert self.receiver.backend == self.backend  # both sides settled the same backend
        self.sent = make_cache(SENDER_SEED, dtype, **spec).to(receiver_device)[..., s0:s1, :]
        self.whole = make_cache(RECEIVER_SEED, dtype, **(receiver_spec or spec)).to(receiver_device)
        self.cache = self.whole[..., r0:r1, :]  # the whole cache when heads is None
        self.draft_sent = self.draft = None
        if draft_spec is not None:
            self.draft_sent = make_cache(DRAFT_SEED, dtype, **draft_spec).to(receiver_device)
            self.draft = make_cache(RECEIVER_SEED, dtype, **draft_spec).to(receiver_device)

    def transfer(self, requests: list[tuple[str, list[int], list[int]]],
                 plan: tuple[bool, int] | None = None) -> list[tuple[Any, ...]]:
        """Send requests from the peer, receive and check each; return (recv stats, send stats)."""
        self.peer.post("send", self.name, requests, plan)
        results = []
        for rid, src, dst in requests:
            expected = self.whole.clone()
            expected[:, dst, ..., self._heads(), :] = self.sent[:, src]
            if self.draft is not None:
                expected_draft = self.draft.clone()
                expected_draft[:, dst] = self.draft_sent[:, src]
            got_rid, got_dst, stats, meta = self.receiver.recv(self.cache, timeout=20.0, draft_cache=self.draft)
            assert (got_rid, got_dst) == (rid, dst)
            assert meta == {"first_token": len(src)}  # the header's meta travels with the blocks
            assert torch.equal(self.whole, expected)  # the dst blocks' heads exactly, nothing else touched
            if self.draft is not None:
                assert torch.equal(self.draft, expected_draft)  # and the same blocks of the draft's cache
            results.append(stats)
        return list(zip(results, self.peer.reply()))


    def _heads(self) -> slice:
        """The receiver's heads within its whole cache."""
        offset = (self.cache.data_ptr() - self.whole.data_ptr()) // self.cache.element_size()
        return slice(offset // self.spec["head_dim"], offset // self.spec["head_dim"] + self.cache.shape[4])


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


def test_runs_travel_as_one_array_and_repeats_are_refused() -> None:
    src, dst = [4, 5, 6, 9, 1], [0, 1, 7, 8, 3]
    runs = run_array(src, dst)
    assert runs.dtype == np.int64 and runs.tolist() == [list(r) for r in merge_runs(src, dst)]
    assert np.array_equal(decode_runs(encode_runs(runs)), runs)
    assert expand_runs(runs, 0).tolist() == src and expand_runs(runs, 1).tolist() == dst
    assert not has_repeats(np.array(dst)) and has_repeats(np.array([3, 1, 3]))
    assert not has_repeats(np.zeros(0, dtype=np.int64))
    layout = KVLayout(model="m", dtype="float32", block_size=8, num_layers=3, num_kv_heads=2, head_dim=4)
    sender = KVSender(layout, "gloo", 5.0, "cpu")  # never connected: the check comes first
    cache = torch.zeros(3, 10, 2, 8, 2, 4)
    with pytest.raises(ValueError, match="duplicate dst block ids"):
        sender.begin("r", [0, 1], [4, 4], cache)
    with pytest.raises(ValueError, match="out of range"):
        sender.begin("r", [0, 10], [4, 5], cache)


def test_a_cache_may_be_a_slice_of_its_kv_heads_only() -> None:
    cache = torch.zeros(3, 10, 2, 4, 6, 8)
    layout = KVLayout(model="m", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    assert is_head_slice(cache[..., 1:3, :]) and is_head_slice(cache)
    layout.check_cache(cache[..., 4:6, :])
    for not_a_head_slice in (cache[:, 1:5, ..., 0:2, :], cache[..., 0:4:2, :], cache[..., 0:2, 0:8].transpose(0, 1)):
        with pytest.raises(ValueError):
            layout.check_cache(not_a_head_slice)


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


def test_an_fp8_layout_carries_its_scales_and_the_models_dtype() -> None:
    """The compatibility record of an FP8 cache: the KV dtype, every layer's scales and the
    model's dtype, through JSON (the pair's hello) and protobuf (OpenKVChannel) unchanged;
    a pair refused on each, with both sides' values named."""
    import json

    from rpc.layout_convert import layout_from_proto, layout_to_proto

    cache = torch.zeros(3, 20, 2, 4, 2, 8, dtype=torch.float8_e4m3fn)
    fp8 = KVLayout.of(cache, "m", (FP8_K_SCALES, FP8_V_SCALES), "float32")
    assert fp8 == KVLayout("m", "float8_e4m3fn", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8,
        k_scales=FP8_K_SCALES, v_scales=FP8_V_SCALES, model_dtype="float32")
    assert KVLayout.from_dict(json.loads(json.dumps(fp8.to_dict()))) == fp8
    assert layout_from_proto(layout_to_proto(fp8)) == fp8
    bf16 = KVLayout.of(torch.zeros(3, 20, 2, 4, 2, 8, dtype=torch.bfloat16), "m")
    assert bf16.model_dtype == "bfloat16" and layout_from_proto(layout_to_proto(bf16)) == bf16
    with pytest.raises(KVTransferError) as e:
        check_compatible(fp8, bf16, "decode", "prefill")
    assert str(e.value) == ("KV layout mismatch between decode and prefill: dtype 'float8_e4m3fn' != 'bfloat16'; "
                            "k_scales [0.37, 1.25, 0.5] != none; v_scales [1.9, 0.125, 3.0] != none; "
                            "model_dtype 'float32' != 'bfloat16'")
    other_scale = KVLayout.of(cache, "m", ((0.37, 1.25, 0.5), (1.9, 0.25, 3.0)), "float32")
    with pytest.raises(KVTransferError) as e:
        check_compatible(fp8, other_scale, "decode", "prefill")
    assert str(e.value) == ("KV layout mismatch between decode and prefill: "
                            "v_scales [1.9, 0.125, 3.0] != [1.9, 0.25, 3.0]")
    other_model_dtype = KVLayout.of(cache, "m", (FP8_K_SCALES, FP8_V_SCALES), "bfloat16")
    with pytest.raises(KVTransferError) as e:
        check_compatible(fp8, other_model_dtype, "decode", "prefill")
    assert str(e.value) == "KV layout mismatch between decode and prefill: model_dtype 'float32' != 'bfloat16'"
    for bad in (dict(k_scales=(), v_scales=()), dict(k_scales=(1.0, 1.0), v_scales=(1.0, 1.0)),
                dict(dtype="bfloat16")):  # FP8 without its scales, too few scales, scales of a bf16 cache
        with pytest.raises(ValueError, match="KVLayout"):
            KVLayout(**{**fp8.to_dict(), **bad})


def test_choose_backend_by_gpu_uuid() -> None:
    a, b = "a7d887d8-9fe1-475a-4ba1-b80aa0ce8253", "64e490f7-0be7-acdb-c82d-da3343bbd06c"
    # Two containers each see their GPU as cuda:0; only the UUIDs tell them apart.
    assert choose_backend(a, b) == ("nccl", "nccl: prefill on GPU a7d887d8, decode on GPU 64e490f7")
    backend, reason = choose_backend(a, a)
    assert backend == "gloo" and reason.startswith("gloo (host-staged)") and "share GPU a7d887d8" in reason
    assert choose_backend(a, None)[0] == choose_backend(None, b)[0] == "gloo"
    assert "only prefill is on a GPU" in choose_backend(a, None)[1]
    assert choose_backend(None, None) == ("gloo", "gloo: prefill and decode on CPU")


def test_a_slower_transport_than_the_gpus_allow_is_named() -> None:
    """Both caches on GPUs and the KV through host memory: a warning at setup says why."""
    assert slow_path("nccl", "GPU-a", "GPU-b") is None
    assert slow_path("gloo", None, None) is None and slow_path("gloo", "GPU-a", None) is None
    assert "NCCL would move it GPU to GPU" in slow_path("gloo", "GPU-a", "GPU-b")
    assert "share GPU GPU-a" in slow_path("gloo", "GPU-a", "GPU-a")


def test_resolve_backend() -> None:
    a, b = "gpu-a", "gpu-b"
    assert resolve_backend("auto", "auto", a, b)[0] == "nccl"
    assert resolve_backend("auto", "auto", a, a)[0] == "gloo"
    assert resolve_backend("nccl", "auto", a, b)[0] == resolve_backend("auto", "nccl", a, b)[0] == "nccl"
    backend, reason = resolve_backend("gloo", "auto", a, b)  # asking for gloo is always possible
    assert backend == "gloo" and "automatic choice would be nccl" in reason
    with pytest.raises(KVTransferError, match="prefill and decode share GPU"):
        resolve_backend("auto", "nccl", a, a)
    with pytest.raises(KVTransferError, match="NCCL needs GPUs on both sides|only decode"):
        resolve_backend("nccl", "nccl", None, b)
    with pytest.raises(KVTransferError, match="prefill asks for gloo, decode for nccl"):
        resolve_backend("gloo", "nccl", a, b)
    with pytest.raises(KVTransferError, match="unknown KV transfer backend 'mpi'"):
        resolve_backend("mpi", "auto", a, b)


def test_chunk_ranges_and_plans() -> None:
    assert chunk_ranges(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_ranges(4, 4) == chunk_ranges(4, 9) == [(0, 4)]
    with pytest.raises(ValueError):
        chunk_ranges(4, 0)
    block = 64 << 10  # one block of one layer, Llama-3.1-8B shape (16 tokens x 8 heads x 128 x bf16 x K,V)
    one_run = merge_runs(range(64), range(100, 164))  # 1k tokens, contiguous on both sides
    long_run = merge_runs(range(1024), range(8, 1032))  # 16k tokens, contiguous: 64 MiB a layer
    scattered = merge_runs(range(64), range(0, 128, 2))  # 64 runs of one block
    # Long runs go in place, every layer in one batch; 4 MiB runs are worth gathering.
    assert plan_transfer(long_run, 32, block, "nccl", True) == WirePlan(pack=False, chunk_layers=32)
    assert plan_transfer(one_run, 32, block, "nccl", True) == WirePlan(pack=True, chunk_layers=16)
    packed = plan_transfer(scattered, 32, block, "nccl", True)
    assert packed.pack and 1 <= packed.chunk_layers <= 32
    assert plan_transfer(scattered, 32, 16 * block, "nccl", True).chunk_layers <= packed.chunk_layers
    # Layers given as prefill computes them: chunks of ~64 MiB, in place or gathered as before.
    assert plan_transfer(long_run, 32, block, "nccl", True, overlap=True) == WirePlan(pack=False, chunk_layers=1)
    four_k = merge_runs(range(256), range(256))  # 16 MiB a layer
    assert plan_transfer(four_k, 32, block, "nccl", True, overlap=True) == WirePlan(pack=False, chunk_layers=4)
    assert plan_transfer(one_run, 32, block, "nccl", True, overlap=True) == WirePlan(pack=True, chunk_layers=16)
    assert plan_transfer(scattered, 32, block, "gloo", False) == WirePlan(pack=False, chunk_layers=1)
    assert plan_transfer(scattered, 32, block, "gloo", True) == WirePlan(pack=True, chunk_layers=1)
    assert plan_transfer([], 32, block, "nccl", True) == WirePlan(pack=False, chunk_layers=32)


# --------------------------------------------------------------------------- two processes

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


def test_sender_failing_midway_is_reported_and_pair_stays_usable(pairs: Any) -> None:
    pair = pairs("float32")
    pair.peer.post("abort_midway", pair.name, ("doomed", [0, 1], [2, 3]))
    with pytest.raises(KVTransferError, match="aborted"):
        pair.receiver.recv(pair.cache, timeout=20.0)
    assert pair.peer.reply() == "prefill failed"
    # Blocks 2 and 3 now hold whatever was sent; the decode server frees them with the request.
    pair.transfer([("after", [4, 5], [2, 3])])


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
        assert not pair.receiver.is_usable
        with pytest.raises(KVTransferError, match="broken"):
            pair.receiver.recv(pair.cache, timeout=1.0)
        start = time.monotonic()
        pair.receiver.close()
        assert time.monotonic() - start < SLACK_S
        doomed.proc.join(10)
        assert doomed.proc.exitcode == -signal.SIGKILL
    finally:
        if doomed.proc.is_alive():
            doomed.proc.kill()
    after = Pair(peer, "after-death", SMALL, "float32")
    try:
        after.transfer([("after", [0, 1], [2, 3])])
    finally:
        after.receiver.close()


# Deadlines are checked as "not before the timeout, and well before a hang": a loaded
# 2-core machine can add seconds of scheduling delay, so the upper slack is generous.
SLACK_S = 5.0


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


# --------------------------------------------------------------------------- GPU (skipped on CPU)
# Throughput is measured by bench/kv_transfer.py, not here.

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
        assert not pair.receiver.is_usable
        with pytest.raises(KVTransferError, match="broken"):
            pair.receiver.recv(pair.cache, timeout=1.0)
        start = time.monotonic()
        pair.receiver.close()
        assert time.monotonic() - start < SLACK_S
        doomed.proc.join(10)
        assert doomed.proc.exitcode == -signal.SIGKILL
    finally:
        if doomed.proc.is_alive():
            doomed.proc.kill()
    x = torch.randn(1024, 1024, device="cuda:0")
    assert torch.allclose(x @ torch.eye(1024, device="cuda:0"), x)
    time.sleep(2.0)  # a watchdog or heartbeat thread would act by now
    _gpu_round_trip(peer, "after-death", "cuda:1", "cuda:0", "nccl")


# --------------------------------------------------------------------------- bounded setup steps

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
