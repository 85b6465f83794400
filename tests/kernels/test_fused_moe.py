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


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_a_bad_config_is_refused_whichever_path_serves(monkeypatch, num_tokens):
    """The pair GEMV (up to PAIR_GEMV_MAX_TOKENS tokens) takes no tiles from the config; a bad one is
    refused all the same."""
    monkeypatch.setattr(fm, "PAIR_GEMV_MAX_TOKENS", 2)
    inp = make_inputs(num_tokens, 3, 2, 24, 20, torch.float32)
    with pytest.raises(ValueError, match="fused_moe: .*config"):
        kernels.fused_moe(*inp.args(), config={1: {"block_m": 24}})


def test_reference_rejects_unknown_activation():
    inp = make_inputs(2, 3, 2, 8, 8, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="activation"):
        reference.fused_moe(*inp.args(), activation="relu")


def test_warm_up_runs_once_per_compile_choice(monkeypatch):
    inp = make_inputs(1, 4, 2, 24, 20, torch.float32)
    calls = []
    real = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    # 2 slots, E=4: up to PAIR_GEMV_MAX_TOKENS the pair GEMV (one compile); then the align chunk
    # holds next_pow2(2T) >= 16 pairs (new at T = 9, 17, 33), and the default float32 tiles grow
    # past 16 pairs per expert (T = 33).
    monkeypatch.setattr(fm, "PAIR_GEMV_MAX_TOKENS", 2)
    assert fm.warm_up(inp.w13, inp.w2, 2, 40, ids_dtypes=(torch.int32,)) == len(calls)
    assert calls == [1, 3, 9, 17, 33]
    calls.clear()
    assert fm.warm_up(inp.w13, inp.w2, 2, 8) == 4 and calls == [1, 1, 3, 3]  # int32 and int64 ids


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


# ---- gpt-oss: expert biases and the clamped SwiGLU ("swigluoai") ------------------------------------------


def _biases(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0,
            device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 100)
    return (torch.randn(num_experts, 2 * inter, generator=gen).to(dtype).to(device),
            torch.randn(num_experts, hidden, generator=gen).to(dtype).to(device))


# (name, T, E, K, H, I, activation, experts, bias): limit 1.0 clamps many gate and up values
GPT_OSS_CASES = [
    ("swigluoai_bias_one_token", 1, 4, 2, 24, 20, "swigluoai", None, True),
    ("swigluoai_bias_t17_top4", 17, 6, 4, 40, 36, "swigluoai", None, True),
    ("swigluoai_no_bias", 9, 8, 2, 24, 40, "swigluoai", [1, 6], False),
    ("silu_bias_many_tiles", 40, 3, 2, 48, 24, "silu", None, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPT_OSS_CASES, ids=[c[0] for c in GPT_OSS_CASES])
def test_launcher_matches_reference_with_biases_and_swigluoai(case, dtype):
    _, t, e, k, h, i, act, experts, bias = case
    inp = make_inputs(t, e, k, h, i, dtype, experts=experts, seed=t)
    b13, b2 = _biases(e, h, i, dtype, seed=t) if bias else (None, None)
    kw = dict(activation=act, w13_bias=b13, w2_bias=b2, swiglu_alpha=1.702, swiglu_limit=1.0)
    got = kernels.fused_moe(*inp.args(), **kw)
    assert got.is_contiguous()
    assert_close(got, reference.fused_moe(*inp.args(), **kw), dtype)


def test_biases_alone_and_strided_bias_rows():
    # One bias at a time (each is its own compile-time choice); bias rows wider than the tensor.
    inp = make_inputs(11, 5, 2, 24, 20, torch.float32, seed=12)
    b13, b2 = _biases(5, 24, 20, torch.float32)
    wide13 = torch.randn(5, 64, device=DEVICE)[:, 3:43]
    wide13.copy_(b13)
    for kw in (dict(w13_bias=b13), dict(w2_bias=b2), dict(w13_bias=wide13, w2_bias=b2)):
        assert_close(kernels.fused_moe(*inp.args(), activation="swigluoai", **kw),
                     reference.fused_moe(*inp.args(), activation="swigluoai", **kw), torch.float32)
    # ids outside [0, E) add no bias either
    inp.topk_ids[3, :] = -1
    got = kernels.fused_moe(*inp.args(), w13_bias=b13, w2_bias=b2)
    assert (got[3] == 0).all()
    assert_close(got, reference.fused_moe(*inp.args(), w13_bias=b13, w2_bias=b2), torch.float32)


def _gpt_oss_params(e: int, h: int, i: int, seed: int) -> dict[str, torch.Tensor]:
    """transformers' GptOssExperts parameters (float64): gate_up_proj [E, H, 2I] with gate and up
    columns interleaved (2j gate j, 2j+1 up j), down_proj [E, I, H], their biases."""
    gen = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(e, h, 2 * i, generator=gen, dtype=torch.float64) * h**-0.5,
            "gate_up_proj_bias": torch.randn(e, 2 * i, generator=gen, dtype=torch.float64) * 0.5,
            "down_proj": torch.randn(e, i, h, generator=gen, dtype=torch.float64) * i**-0.5,
            "down_proj_bias": torch.randn(e, h, generator=gen, dtype=torch.float64) * 0.5}


def _pdserve_layout(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I], b13 [E, 2I] gate then up, b2 [E, H])."""
    gu = p["gate_up_proj"]
    w13 = torch.cat([gu[:, :, 0::2], gu[:, :, 1::2]], dim=2).transpose(1, 2).contiguous()
    b = p["gate_up_proj_bias"]
    return (w13, p["down_proj"].transpose(1, 2).contiguous(), torch.cat([b[:, 0::2], b[:, 1::2]], dim=1),
            p["down_proj_bias"])


def test_reference_matches_gpt_oss_loop():
    # GptOssExperts.forward written out token by token, slot by slot, in float64.
    e, k, h, i, alpha, limit = 6, 3, 32, 24, 1.702, 0.9
    inp = make_inputs(13, e, k, h, i, torch.float64, experts=[0, 2, 3, 5], device="cpu", seed=21)
    p = _gpt_oss_params(e, h, i, seed=22)
    want = torch.zeros_like(inp.x)
    for t in range(inp.x.shape[0]):
        for slot in range(k):
            ex = int(inp.topk_ids[t, slot])
            gate_up = inp.x[t] @ p["gate_up_proj"][ex] + p["gate_up_proj_bias"][ex]
            gate, up = gate_up[0::2].clamp(max=limit), gate_up[1::2].clamp(-limit, limit)
            gated = (up + 1) * (gate * torch.sigmoid(gate * alpha))
            out = gated @ p["down_proj"][ex] + p["down_proj_bias"][ex]
            want[t] += out * float(inp.topk_weights[t, slot])
    w13, w2, b13, b2 = _pdserve_layout(p)
    got = reference.fused_moe(inp.x, w13, w2, inp.topk_weights, inp.topk_ids, activation="swigluoai",
                              w13_bias=b13, w2_bias=b2, swiglu_alpha=alpha, swiglu_limit=limit)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("num_tokens", [1, 19])
def test_reference_matches_transformers_gpt_oss_experts(num_tokens):
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    e, k, h, i = 8, 4, 64, 48
    inp = make_inputs(num_tokens, e, k, h, i, torch.float32, device="cpu", seed=num_tokens + 30)
    config = GptOssConfig(num_local_experts=e, num_experts_per_tok=k, hidden_size=h, intermediate_size=i,
                          swiglu_limit=1.5)
    experts = GptOssExperts(config)
    p = _gpt_oss_params(e, h, i, seed=num_tokens)
    with torch.no_grad():
        for name, t in p.items():
            getattr(experts, name).copy_(t)
        want = experts(inp.x, inp.topk_ids.long(), inp.topk_weights)
    w13, w2, b13, b2 = (t.float() for t in _pdserve_layout(p))
    got = reference.fused_moe(inp.x, w13, w2, inp.topk_weights, inp.topk_ids, activation="swigluoai",
                              w13_bias=b13, w2_bias=b2, swiglu_alpha=config.swiglu_alpha,
                              swiglu_limit=config.swiglu_limit)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def _bad_bias_calls():
    """(name, change, whether the reference refuses it too: it takes any strides)."""
    b13, b2 = _biases(3, 24, 20, torch.float32)
    return [
        ("w13_bias", dict(w13_bias=b13[:, :20]), True),
        ("w13_bias", dict(w13_bias=b13.half()), True),
        ("w13_bias", dict(w13_bias=b13.t().contiguous().t()), False),
        ("w2_bias", dict(w2_bias=b2[:2]), True),
        ("w2_bias", dict(w2_bias=b2.double()), True),
        ("swiglu_limit", dict(swiglu_limit=float("nan")), False),
        ("swiglu_alpha", dict(swiglu_alpha=None), False),
    ]


@pytest.mark.parametrize("name,change,reference_too", _bad_bias_calls(),
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(_bad_bias_calls())])
def test_bad_bias_arguments_raise_value_error(name, change, reference_too):
    inp = make_inputs(4, 3, 2, 24, 20, torch.float32)
    with pytest.raises(ValueError, match=f"fused_moe: .*{name}"):
        kernels.fused_moe(*inp.args(), activation="swigluoai", **change)
    if reference_too:
        with pytest.raises(ValueError, match=f"fused_moe: .*{name}"):
            reference.fused_moe(*inp.args(), activation="swigluoai", **change)


# ---- the FusedMoE layer (engine/layers/moe.py) with gpt-oss's biases, on CPU ----------------------------------


class _Rank:
    """A tensor-parallel rank without communication: the test adds up the ranks' outputs."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _load(layer: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> None:
    params = dict(layer.named_parameters())
    assert set(params) == set(checkpoint)
    for name, t in checkpoint.items():
        loader = getattr(params[name], "weight_loader", None)
        if loader is None:
            params[name].data.copy_(t)
        else:
            loader(params[name], t, None)


GPT_OSS_LAYER = dict(num_experts=8, top_k=3, hidden=32, inter=48, limit=1.2)


def _gpt_oss_checkpoint(seed: int = 40) -> dict[str, torch.Tensor]:
    """A gpt-oss MoE block's tensors in pdserve's names and layout (de-interleaved), float32."""
    c = GPT_OSS_LAYER
    e, h, i = c["num_experts"], c["hidden"], c["inter"]
    w13, w2, b13, b2 = (t.float() for t in _pdserve_layout(_gpt_oss_params(e, h, i, seed)))
    gen = torch.Generator().manual_seed(seed + 1)
    return {"gate.weight": torch.randn(e, h, generator=gen), "gate.bias": torch.randn(e, generator=gen),
            "experts.gate_up_proj": w13, "experts.down_proj": w2, "experts.gate_up_proj_bias": b13,
            "experts.down_proj_bias": b2}


def _gpt_oss_layer(tp=None, expert_parallel: bool = False, method=None):
    from engine.layers.moe import FusedMoE

    c = GPT_OSS_LAYER
    return FusedMoE(c["num_experts"], c["top_k"], c["hidden"], c["inter"], renormalize=True, activation="swigluoai",
                    ops=reference, tp=tp, expert_parallel=expert_parallel, method=method, bias=True,
                    router_bias=True, swiglu_alpha=1.702, swiglu_limit=c["limit"])


def test_layer_runs_gpt_oss_routing_biases_and_swiglu():
    ckpt = _gpt_oss_checkpoint()
    layer = _gpt_oss_layer()
    _load(layer, ckpt)
    assert layer.gate.bias is not None
    x = torch.randn(11, GPT_OSS_LAYER["hidden"], generator=torch.Generator().manual_seed(41))
    # GptOssTopKRouter: top-k of the biased logits, softmax over those k
    top, ids = torch.topk(x @ ckpt["gate.weight"].T + ckpt["gate.bias"], GPT_OSS_LAYER["top_k"], dim=-1)
    want = reference.fused_moe(x, ckpt["experts.gate_up_proj"], ckpt["experts.down_proj"], top.softmax(-1), ids,
                               activation="swigluoai", w13_bias=ckpt["experts.gate_up_proj_bias"],
                               w2_bias=ckpt["experts.down_proj_bias"], swiglu_limit=GPT_OSS_LAYER["limit"])
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor_parallel", "expert_parallel"])
def test_layer_biases_split_over_two_ranks(expert_parallel):
    ckpt = _gpt_oss_checkpoint()
    one = _gpt_oss_layer()
    _load(one, ckpt)
    ranks = [_gpt_oss_layer(_Rank(r, 2), expert_parallel) for r in range(2)]
    for layer in ranks:
        _load(layer, ckpt)
    e, i = GPT_OSS_LAYER["num_experts"], GPT_OSS_LAYER["inter"]
    b13, b2 = ckpt["experts.gate_up_proj_bias"], ckpt["experts.down_proj_bias"]
    r1 = ranks[1].experts
    if expert_parallel:  # rank 1: experts [4, 8) whole, and their down biases
        assert torch.equal(r1.gate_up_proj_bias, b13[e // 2:]) and torch.equal(r1.down_proj_bias, b2[e // 2:])
        assert ranks[1].activation_args()["w2_bias"] is r1.down_proj_bias
    else:  # rank 1: the second half of each expert's gate rows and of its up rows; the down bias on rank 0 only
        assert torch.equal(r1.gate_up_proj_bias, torch.cat([b13[:, i // 2:i], b13[:, i + i // 2:]], dim=1))
        assert ranks[0].activation_args()["w2_bias"] is ranks[0].experts.down_proj_bias
        assert ranks[1].activation_args()["w2_bias"] is None
    assert r1.gate_up_proj_bias.full_shape == (e, 2 * i) and r1.down_proj_bias.full_shape == tuple(b2.shape)
    x = torch.randn(9, GPT_OSS_LAYER["hidden"], generator=torch.Generator().manual_seed(42))
    torch.testing.assert_close(ranks[0](x) + ranks[1](x), one(x), atol=1e-5, rtol=1e-5)


def test_layer_loads_per_expert_down_biases_and_refuses_unknown_activations():
    from engine.layers.moe import FusedMoE

    layer = _gpt_oss_layer(_Rank(1, 2), expert_parallel=True)
    b = layer.experts.down_proj_bias
    assert b.shard_ids == tuple(("down", e) for e in range(4, 8))
    b.weight_loader(b, torch.full((GPT_OSS_LAYER["hidden"],), 3.0), ("down", 5))
    b.weight_loader(b, torch.full((GPT_OSS_LAYER["hidden"],), 7.0), ("down", 0))  # rank 0's: skipped
    assert (b[1] == 3.0).all() and not (b == 7.0).any()
    assert b.checkpoint_slice(None) == (0, 4, 8) and b.checkpoint_slice(("down", 0)) == (0, 0, 0)
    with pytest.raises(ValueError, match="checkpoint tensor of shape"):
        b.weight_loader(b, torch.zeros(4, 5), None)
    with pytest.raises(ValueError, match="MoE activation 'relu'"):
        FusedMoE(4, 2, 8, 8, renormalize=True, activation="relu", ops=reference, tp=None)
