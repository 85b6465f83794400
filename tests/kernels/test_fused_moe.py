"""Fused MoE: the Triton launcher against the reference (align invariants,
hostile routings, strides, configs, argument checks), the reference against a
per-token loop and against transformers' Qwen3MoeExperts, and on CUDA bf16 at
the Qwen3-30B-A3B shape and CUDA-graph replay."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES

import kernels
from kernels import reference

# The module, not the launcher of the same name that kernels exports.
fm = importlib.import_module("kernels.fused_moe")

cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")


@dataclass
class MoeInputs:
    x: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K]

    def args(self) -> tuple:
        return self.x, self.w13, self.w2, self.topk_weights, self.topk_ids


def make_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                experts: list[int] | None = None, ids_dtype: torch.dtype = torch.int32, seed: int = 0,
                device: str = DEVICE) -> MoeInputs:
    """Random inputs with values of order one; each token picks top_k distinct
    experts among ``experts`` (default: all), so the others get no token."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else list(range(num_experts)))
    scores = torch.rand(num_tokens, len(pool), generator=gen)
    ids = pool[scores.topk(top_k, dim=-1).indices]
    weights = torch.rand(num_tokens, top_k, generator=gen)
    weights = weights / weights.sum(-1, keepdim=True)
    return MoeInputs(
        x=torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device),
        w13=(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype).to(device),
        w2=(torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype).to(device),
        topk_weights=weights.to(device),
        topk_ids=ids.to(ids_dtype).to(device),
    )


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


# (name, T, E, K, H, I, activation, experts the tokens may pick (None: all))
# H and I are not multiples of the tiles; default tiles take 16 sorted rows.
CASES = [
    ("one_token", 1, 4, 2, 24, 20, "silu", None),
    ("three_tokens_top1", 3, 5, 1, 32, 16, "gelu_tanh", None),
    ("t17_top4", 17, 6, 4, 40, 36, "silu", None),
    ("many_tiles_per_expert", 40, 3, 2, 48, 24, "gelu_tanh", None),
    ("idle_experts", 9, 8, 2, 24, 40, "silu", [1, 6]),
    ("all_on_one_expert", 20, 4, 1, 32, 20, "gelu_tanh", [2]),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_launcher_matches_reference(case, dtype):
    _, t, e, k, h, i, act, experts = case
    inp = make_inputs(t, e, k, h, i, dtype, experts=experts, seed=t)
    got = kernels.fused_moe(*inp.args(), activation=act)
    assert got.is_contiguous()
    assert_close(got, reference.fused_moe(*inp.args(), activation=act), dtype)


def _check_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    sorted_ids, block_expert = fm._align(topk_ids, num_experts, block_m)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    ids = topk_ids.reshape(-1).long().cpu()
    num_pairs = ids.numel()
    valid = (ids >= 0) & (ids < num_experts)
    counts = torch.bincount(ids[valid], minlength=num_experts)
    tiles = (counts + block_m - 1) // block_m
    used = int(tiles.sum())
    assert block_expert.numel() == fm.max_blocks(num_pairs, num_experts, block_m) >= used
    # Tiles in expert order, each expert's cdiv(n_e, BLOCK_M) of them, then -1.
    assert block_expert[:used].tolist() == torch.repeat_interleave(torch.arange(num_experts), tiles).tolist()
    assert (block_expert[used:] == -1).all()
    rows = sorted_ids[: used * block_m].view(used, block_m)
    for b in range(used):
        pairs = rows[b][rows[b] != num_pairs].long()
        assert (rows[b][pairs.numel():] == num_pairs).all(), "padding only at the end of an expert's last tile"
        assert (ids[pairs] == block_expert[b]).all()
    placed = rows[rows != num_pairs].long()
    # Every valid pair exactly once, ascending within each expert.
    assert sorted(placed.tolist()) == torch.nonzero(valid).flatten().tolist()
    assert placed.tolist() == sorted(placed.tolist(), key=lambda p: (int(ids[p]), p))


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("align_elems", [fm._ALIGN_ELEMS, 256], ids=["one_chunk", "chunks"])
def test_alignment_invariants(block_m, align_elems, monkeypatch):
    # 256 elements over 16 expert columns: chunks of 16 pairs, so the count,
    # scan and place kernels all run.
    monkeypatch.setattr(fm, "_ALIGN_ELEMS", align_elems)
    inp = make_inputs(37, 9, 3, 16, 16, torch.float32, experts=[0, 2, 3, 5, 8], ids_dtype=torch.int64)
    inp.topk_ids[4, 1] = -1
    inp.topk_ids[11, 0] = 9
    _check_alignment(inp.topk_ids, 9, block_m)
    _check_alignment(inp.topk_ids[:1], 9, block_m)
    # More tiles than one program of the place kernel labels (64): several programs.
    many = make_inputs(1100, 9, 2, 16, 16, torch.float32, seed=8).topk_ids
    assert fm.max_blocks(2200, 9, block_m) > 64
    _check_alignment(many, 9, block_m)


def test_several_align_chunks_match_reference(monkeypatch):
    monkeypatch.setattr(fm, "_ALIGN_ELEMS", 256)
    inp = make_inputs(33, 6, 2, 24, 20, torch.float32, seed=3)
    assert_close(kernels.fused_moe(*inp.args()), reference.fused_moe(*inp.args()), torch.float32)


def test_ids_outside_the_experts_contribute_nothing():
    # An expert-parallel rank marks other ranks' experts with ids outside [0, E).
    inp = make_inputs(6, 5, 3, 24, 20, torch.float32, ids_dtype=torch.int64, seed=4)
    inp.topk_ids[1, 0] = -1
    inp.topk_ids[3, 2] = 5
    inp.topk_ids[5, :] = 1 << 40  # would wrap into range if narrowed first
    got = kernels.fused_moe(*inp.args())
    want = reference.fused_moe(*inp.args())
    assert_close(got, want, torch.float32)
    assert (got[5] == 0).all()
    kept = inp.topk_ids.clone()
    kept[1, 0] = kept[3, 2] = 0
    zeroed = inp.topk_weights.clone()
    zeroed[1, 0] = zeroed[3, 2] = 0
    assert_close(want[:5], reference.fused_moe(inp.x, inp.w13, inp.w2, zeroed, kept)[:5], torch.float32)


def test_strided_views():
    base = make_inputs(11, 5, 2, 24, 20, torch.float32, seed=5)
    wide = torch.randn(11, 40, device=DEVICE)
    wide[:, 8:32] = base.x
    x = wide[:, 8:32]  # rows 40 apart
    ids = base.topk_ids.t().contiguous().t()  # column-major [T, K]
    weights = base.topk_weights.t().contiguous().t()
    w13 = torch.randn(5, 48, 24, device=DEVICE)[:, 4:44]  # expert stride 48 * 24, row stride 24
    w2 = base.w2
    got = kernels.fused_moe(x, w13, w2, weights, ids)
    assert_close(got, reference.fused_moe(x.contiguous(), w13.contiguous(), w2, weights.contiguous(),
                                          ids.contiguous()), torch.float32)


def test_empty_batch():
    inp = make_inputs(0, 4, 2, 24, 20, torch.float32)
    assert kernels.fused_moe(*inp.args()).shape == (0, 24)
    assert reference.fused_moe(*inp.args()).shape == (0, 24)


def test_explicit_config_entries():
    inp = make_inputs(19, 4, 2, 40, 36, torch.float32, seed=6)
    want = reference.fused_moe(*inp.args())
    small = {"block_m": 16, "gemm1": {"block_n": 16, "block_k": 16, "group_m": 2, "num_warps": 4, "num_stages": 2},
             "gemm2": {"block_n": 32, "block_k": 16, "group_m": 1, "num_warps": 4, "num_stages": 2}}
    large = {"block_m": 32, "gemm1": {"block_n": 64, "block_k": 64, "group_m": 8, "num_warps": 4, "num_stages": 2},
             "gemm2": {"block_n": 16, "block_k": 64, "group_m": 8, "num_warps": 4, "num_stages": 2}}
    # JSON gives string keys; T=19 takes the entry of 32, the smallest count >= 19.
    config = {"4": small, "32": large}
    assert fm.pick_tiles(config, 19, 4, 2, torch.float32) == fm.MoeTiles.from_dict(large)
    assert fm.pick_tiles(config, 3, 4, 2, torch.float32) == fm.MoeTiles.from_dict(small)
    assert fm.pick_tiles({1: small, 8: large}, 500, 4, 2, torch.float32).block_m == 32  # past the largest
    for cfg in (config, {1: small}):
        assert_close(kernels.fused_moe(*inp.args(), config=cfg), want, torch.float32)


def _bad_calls():
    inp = make_inputs(4, 3, 2, 24, 20, torch.float32)
    x, w13, w2, w, ids = inp.args()
    entry = fm.default_tiles(4, 3, 2, torch.float32).as_dict()
    return [
        ("x", dict(x=x[:, None])),
        ("x", dict(x=x.t().contiguous().t())),  # stride 4 along H
        ("x", dict(x=x.to(torch.int32))),
        ("w13", dict(w13=w13[:, :39])),
        ("w13", dict(w13=w13.half())),
        ("w13", dict(w13=w13[:, :, :20])),
        ("w2", dict(w2=w2[:, :, :10])),
        ("w2", dict(w2=w2[:2])),
        ("topk_ids", dict(topk_ids=ids[:3])),
        ("topk_ids", dict(topk_ids=ids.float())),
        ("topk_weights", dict(topk_weights=w.half())),
        ("topk_weights", dict(topk_weights=w[:, :1])),
        ("activation", dict(activation="relu")),
        ("config", dict(config={})),
        ("config", dict(config={"many": entry})),
        ("config", dict(config={4: {**entry, "block_m": 24}})),
        ("config", dict(config={4: {**entry, "gemm2": {"block_n": 32}}})),
    ]


@pytest.mark.parametrize("name,change", _bad_calls(), ids=[f"{n}-{i}" for i, (n, _) in enumerate(_bad_calls())])
def test_bad_arguments_raise_value_error(name, change):
    inp = make_inputs(4, 3, 2, 24, 20, torch.float32)
    args = dict(x=inp.x, w13=inp.w13, w2=inp.w2, topk_weights=inp.topk_weights, topk_ids=inp.topk_ids)
    kwargs = {k: change.pop(k) for k in ("activation", "config") if k in change}
    args.update(change)
    with pytest.raises(ValueError, match=f"fused_moe: .*{name}"):
        kernels.fused_moe(*args.values(), **kwargs)


def test_reference_rejects_unknown_activation():
    inp = make_inputs(2, 3, 2, 8, 8, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="activation"):
        reference.fused_moe(*inp.args(), activation="relu")


def test_warm_up_runs_once_per_compile_choice(monkeypatch):
    inp = make_inputs(1, 4, 2, 24, 20, torch.float32)
    calls = []
    real = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    # 2 slots, E=4: the align chunk holds next_pow2(2T) >= 16 pairs (new at T = 9,
    # 17, 33), and the default float32 tiles grow past 16 pairs per expert (T = 33).
    assert fm.warm_up(inp.w13, inp.w2, 2, 40, ids_dtypes=(torch.int32,)) == len(calls)
    assert calls == [1, 9, 17, 33]
    calls.clear()
    assert fm.warm_up(inp.w13, inp.w2, 2, 8) == 2 and calls == [1, 1]  # int32 and int64 ids


def test_tuning_picks_the_fastest_candidate_and_skips_failures(monkeypatch):
    # The tuning loop on CPU with a stand-in timer: the GEMM tiles of block_n 64
    # "run fastest", block_k 64 "fails to compile"; every candidate really runs once.
    import triton.testing

    ran: list[fm.GemmTiles] = []
    real_gemm = fm._gemm

    def recording_gemm(*args, **kw):
        ran.append(args[8])  # the GemmTiles
        return real_gemm(*args, **kw)

    def fake_do_bench(fn, **kw):
        fn()
        if ran[-1].block_k == 64:
            raise RuntimeError("out of resources")
        return 1.0 if ran[-1].block_n == 64 else 2.0

    monkeypatch.setattr(fm, "_gemm", recording_gemm)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    inp = make_inputs(5, 4, 2, 40, 36, torch.float32)
    entry = fm._tune_one(inp.x, inp.w13, inp.w2, 2, torch.Generator(device=DEVICE), 1, None)
    tiles = fm.MoeTiles.from_dict(entry)
    assert (tiles.block_m, tiles.gemm1.block_n, tiles.gemm1.block_k) == (16, 64, 32)
    assert_close(kernels.fused_moe(*inp.args(), config={5: entry}), reference.fused_moe(*inp.args()), torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        fm.tune(4, 40, 36, 2, torch.float32, "cpu")


# ---- the reference against independent oracles --------------------------------------------------------


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_reference_matches_per_token_loop(activation):
    inp = make_inputs(23, 7, 3, 32, 24, torch.float64, experts=[0, 1, 4, 6], device="cpu", seed=7)
    act = reference.MOE_ACTIVATIONS[activation]
    inter = inp.w13.shape[1] // 2
    want = torch.zeros_like(inp.x)
    for t in range(inp.x.shape[0]):
        for k in range(inp.topk_ids.shape[1]):
            e = int(inp.topk_ids[t, k])
            gate = inp.w13[e, :inter] @ inp.x[t]
            up = inp.w13[e, inter:] @ inp.x[t]
            want[t] += float(inp.topk_weights[t, k]) * (inp.w2[e] @ (act(gate) * up))
    torch.testing.assert_close(reference.fused_moe(*inp.args(), activation=activation), want,
                               atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("activation,hf_act", [("silu", "silu"), ("gelu_tanh", "gelu_pytorch_tanh")])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_reference_equals_transformers_qwen3_moe_experts(num_tokens, activation, hf_act):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, k, h, i = 16, 4, 64, 48
    inp = make_inputs(num_tokens, e, k, h, i, torch.float32, experts=list(range(0, 16, 3)) + [15], device="cpu",
                      seed=num_tokens)
    config = Qwen3MoeConfig(num_experts=e, num_experts_per_tok=k, hidden_size=h, moe_intermediate_size=i,
                            hidden_act=hf_act)
    config._experts_implementation = "eager"
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(inp.w13)
        experts.down_proj.copy_(inp.w2)
        want = experts(inp.x, inp.topk_ids.long(), inp.topk_weights)
    got = reference.fused_moe(*inp.args(), activation=activation)
    assert torch.equal(got, want)


# ---- CUDA: bf16 at the Qwen3-30B-A3B shape, CUDA graphs, tuning ----------------------------------------------


@functools.lru_cache(maxsize=1)
def _qwen3_30b_a3b_experts() -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's experts at the Qwen3-30B-A3B shape, bf16 on the GPU (made once)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(128, 2 * 768, 2048, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 2048**-0.5
    w2 = torch.randn(128, 2048, 768, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 768**-0.5
    return w13, w2


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("num_tokens", [1, 32, 300, 2048])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_bf16_qwen3_30b_a3b_shape(num_tokens, activation):
    inp = make_inputs(num_tokens, 128, 8, 16, 16, torch.bfloat16, seed=num_tokens)  # the routing
    inp.w13, inp.w2 = _qwen3_30b_a3b_experts()
    inp.x = torch.randn(num_tokens, 2048, device=DEVICE, dtype=torch.bfloat16)
    got = kernels.fused_moe(*inp.args(), activation=activation)
    want = reference.fused_moe(*inp.args(), activation=activation)
    # The reference rounds gate, up, the product and each expert's output to bf16
    # and sums in bf16; the kernel keeps float32 until the intermediate.
    exact = reference.fused_moe(*[t.float() if t.is_floating_point() else t for t in inp.args()],
                                activation=activation)
    err_kernel = (got.float() - exact).abs().max().item()
    err_reference = (want.float() - exact).abs().max().item()
    assert err_kernel <= max(2 * err_reference, 1e-2), (err_kernel, err_reference)
    torch.testing.assert_close(got.float(), want.float(), atol=6e-2, rtol=5e-2)


@pytest.mark.gpu
@cuda_only
def test_weights_past_2_31_elements():
    # w13 holds 5 * 2 * 34000 * 8192 elements (5.6 GB): expert 4 starts past 2^31,
    # reached only with 64-bit offsets.
    e, h, i = 5, 8192, 34000
    assert 4 * 2 * i * h > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) * i**-0.5
    x = torch.randn(3, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.tensor([[4, 2], [2, 0], [3, 4]], device="cuda", dtype=torch.int32)
    weights = torch.rand(3, 2, device="cuda", generator=gen)
    torch.testing.assert_close(kernels.fused_moe(x, w13, w2, weights, ids).float(),
                               reference.fused_moe(x, w13, w2, weights, ids).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("num_tokens", [1, 64, 600])  # 600 x 4 pairs: align in three launches
def test_cuda_graph_replay_with_new_inputs(num_tokens):
    e, k, h, i = 32, 4, 512, 256
    assert fm._align_shape(600 * k, e)[2] > 1
    static = make_inputs(num_tokens, e, k, h, i, torch.bfloat16, seed=1)
    kernels.fused_moe(*static.args())  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.fused_moe(*static.args())
    for seed in (2, 3):
        fresh = make_inputs(num_tokens, e, k, h, i, torch.bfloat16, seed=seed,
                            experts=[0, 5, 6, 31] if seed == 3 else None)  # most experts idle
        static.x.copy_(fresh.x)
        static.topk_ids.copy_(fresh.topk_ids)
        static.topk_weights.copy_(fresh.topk_weights)
        graph.replay()
        torch.testing.assert_close(out.float(), reference.fused_moe(static.x, static.w13, static.w2,
                                                                    static.topk_weights, static.topk_ids).float(),
                                   atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@cuda_only
def test_tune_returns_usable_configs():
    configs = fm.tune(8, 256, 128, 2, torch.bfloat16, torch.device("cuda"), token_counts=(1, 64), rep_ms=5,
                      max_candidates=2)
    assert sorted(configs) == [1, 64]
    inp = make_inputs(40, 8, 2, 256, 128, torch.bfloat16)
    torch.testing.assert_close(kernels.fused_moe(*inp.args(), config=configs).float(),
                               reference.fused_moe(*inp.args()).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@cuda_only
def test_after_warm_up_no_batch_size_compiles():
    import logging

    from kernels import compiles

    e, k, h, i = 24, 6, 384, 160  # a shape no other test compiles
    inp = make_inputs(1, e, k, h, i, torch.bfloat16)
    config = {1: fm.default_tiles(1, e, k, torch.bfloat16).as_dict(),
              256: fm.default_tiles(256, e, k, torch.bfloat16).as_dict(),
              2048: fm.default_tiles(2048, e, k, torch.bfloat16).as_dict()}
    fm.warm_up(inp.w13, inp.w2, k, 3000, config=config)
    compiles.watch(logging.getLogger("pdserve-test"))
    n = compiles.count
    for num_tokens, ids_dtype in ((1, torch.int32), (3, torch.int64), (77, torch.int32), (640, torch.int64),
                                  (2999, torch.int32)):
        batch = make_inputs(num_tokens, e, k, h, i, torch.bfloat16, ids_dtype=ids_dtype, seed=num_tokens)
        batch.w13, batch.w2 = inp.w13, inp.w2
        kernels.fused_moe(*batch.args(), config=config)
    assert compiles.count == n


# ---- `pdserve bench kernels`: the fused MoE case ------------------------------------------------------------


def test_bench_counts_each_distinct_expert_once():
    from bench import kernels as bench_kernels

    ids = torch.tensor([[3, 7], [7, 3], [0, 3]])
    assert bench_kernels.moe_weight_bytes(ids, 8, 16, 4, 2) == 3 * (3 * 16 * 4 * 2)
    assert bench_kernels.moe_weight_bytes(torch.tensor([[3, -1], [8, 3]]), 8, 16, 4, 2) == 3 * 16 * 4 * 2
    assert bench_kernels.moe_flops(8192, 8, 2048, 768) == 2 * 8192 * 8 * (2 * 768 * 2048 + 2048 * 768)


def test_bench_case_runs_end_to_end_on_a_tiny_shape(capsys):
    # The GPU run's code path with a stand-in timer, on CPU: a wrong name or
    # unit in the report shows up here rather than on the borrowed GPU.
    from bench import kernels as bench_kernels

    timer = lambda fn: (fn(), 0.01)[1]  # noqa: E731 - 10 us a call
    result = bench_kernels.bench_fused_moe(timer, 1e12, device=DEVICE, dtype=torch.float32, shape=(6, 32, 24, 2),
                                           decode_tokens=(1, 3), prefill_tokens=20, matmul_size=32,
                                           eager_bench=timer)
    assert [row["tokens"] for row in result["cases"]] == [1, 3, 20]
    assert all(row["max_abs_err"] < 1e-4 for row in result["cases"])
    one = result["cases"][0]
    assert one["weight_bytes"] == 2 * 3 * 32 * 24 * 4  # one token, two distinct experts
    assert one["tuned_us"] == 10 / bench_kernels.MOE_ROUTINGS
    assert result["cases"][2]["flops"] == bench_kernels.moe_flops(20, 2, 32, 24)
    assert "fused_moe    20 tokens" in capsys.readouterr().out
