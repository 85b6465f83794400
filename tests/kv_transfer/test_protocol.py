"""The KV pair's wire protocol as pure functions: merged block runs, the layout (the
compatibility record) and its comparison, the backend choice, the message plan."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kv_transfer import (KVLayout, KVSender, KVTransferError, WirePlan, check_compatible, choose_backend,
                         chunk_ranges, merge_runs, plan_transfer, resolve_backend)
from kv_transfer.protocol import (decode_runs, encode_runs, expand_runs, has_repeats, host_staged, is_head_slice,
                                  run_array, slow_path)
from tests.kv_transfer.pairs import FP8_K_SCALES, FP8_V_SCALES


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


def test_host_staged_is_gloo_with_a_cache_on_a_gpu() -> None:
    """The degraded mode the gateway counts: the KV through host memory though a cache is on a
    GPU (one GPU for both, one side on a GPU, or gloo asked for between two); never between two
    host caches, never under NCCL."""
    for backend, prefill, decode, staged in [("gloo", None, None, False), ("nccl", "GPU-a", "GPU-b", False),
                                             ("gloo", "GPU-a", "GPU-a", True), ("gloo", "GPU-a", None, True),
                                             ("gloo", None, "GPU-b", True), ("gloo", "GPU-a", "GPU-b", True)]:
        assert host_staged(backend, prefill, decode) is staged, (backend, prefill, decode)
    for prefill, decode in [(None, None), ("GPU-a", "GPU-a"), ("GPU-a", None), ("GPU-a", "GPU-b")]:
        backend, _ = choose_backend(prefill, decode)
        assert host_staged(backend, prefill, decode) is (backend == "gloo" and prefill is not None)


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
