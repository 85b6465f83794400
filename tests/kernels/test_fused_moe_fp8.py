"""Fused MoE with float8_e4m3fn experts (W8A8): the Triton launcher against the
reference (per-channel and block scales, hostile shapes and routings, strides,
configs, argument checks, warm-up, tuning), the reference against a per-token
float64 loop over dequantized values, and on CUDA bf16 with 128x128 blocks at
the Qwen3-30B-A3B shape, CUDA-graph replay and no compiles after warm-up."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES
from tests.kernels.test_fused_moe import MoeInputs, make_inputs

import kernels
from kernels import reference

fm = importlib.import_module("kernels.fused_moe")

cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
FP8 = torch.float8_e4m3fn
# fp8 dots on CUDA take K tiles of >= 32, so 16-column groups run under the interpreter only.
BLOCK_SIZES = [None, (16, 16), (32, 32)] if DEVICE != "cuda" else [None, (32, 32), (128, 128)]
BLOCK_IDS = ["channel" if b is None else f"block{b[0]}x{b[1]}" for b in BLOCK_SIZES]
SMALL_BLOCK = (32, 32)  # valid on every device
# Launcher and reference read the same e4m3 codes and scales and differ by rounding only,
# but the intermediate is quantized again: an element within that rounding of a midpoint
# between two e4m3 codes lands on the other code (2^-4 to 2^-3 relative), which moves its
# token's output row by up to ~1e-2 (values of order one). With float32 x that is rare: at
# most a few rows may differ by more than FP32_TOLERANCE. With 16-bit x (the kernel keeps
# gate and up in float32 where the reference rounds them) it is common: bounded normwise,
# ||got - want|| <= NORMWISE * ||want||. Every element stays within LOOSE.
FP32_TOLERANCE = 1e-4
NORMWISE = {torch.float16: 2e-2, torch.bfloat16: 4e-2}
LOOSE = {torch.float32: 3e-2, torch.float16: 1e-1, torch.bfloat16: 2e-1}


def quantize_weight(w: torch.Tensor, block_size: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, C] float -> (e4m3 codes, float32 scales): amax / 448 per row or per [bn, bk] block."""
    w = w.float()
    e, r, c = w.shape
    if block_size is None:
        scale = (w.abs().amax(dim=2) / 448).clamp(min=1e-12)  # [E, R]
        return (w / scale[:, :, None]).to(FP8), scale
    bn, bk = block_size
    nr, nc = -(-r // bn), -(-c // bk)
    padded = torch.zeros(e, nr * bn, nc * bk, device=w.device)
    padded[:, :r, :c] = w
    scale = (padded.view(e, nr, bn, nc, bk).abs().amax(dim=(2, 4)) / 448).clamp(min=1e-12)  # [E, nr, nc]
    full = scale.repeat_interleave(bn, dim=1)[:, :r].repeat_interleave(bk, dim=2)[:, :, :c]
    return (w / full).to(FP8), scale


@dataclass
class Fp8Inputs:
    moe: MoeInputs  # w13 and w2 hold e4m3 codes
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block_size: tuple[int, int] | None

    def args(self) -> tuple:
        return self.moe.args()

    def scales(self) -> dict:
        return dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale, block_size=self.block_size)


def make_fp8_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                    block_size: tuple[int, int] | None, **kw) -> Fp8Inputs:
    """``make_inputs``' random routing and activations, its weights quantized to e4m3."""
    inp = make_inputs(num_tokens, num_experts, top_k, hidden, inter, torch.float32, **kw)
    inp.x = inp.x.to(dtype)
    inp.w13, w13_scale = quantize_weight(inp.w13, block_size)
    inp.w2, w2_scale = quantize_weight(inp.w2, block_size)
    return Fp8Inputs(inp, w13_scale, w2_scale, block_size)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert_close_but_for_flips(got.float(), want.float(), dtype)


def assert_close_but_for_flips(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
                               tight: float = FP32_TOLERANCE) -> None:
    """[T, H] outputs equal up to rounding and a few intermediate e4m3 flips (see above)."""
    torch.testing.assert_close(got, want, atol=LOOSE[dtype], rtol=LOOSE[dtype])
    if dtype != torch.float32:
        err = (got - want).norm() / want.norm()
        assert err <= NORMWISE[dtype], f"normwise error {err:.3g} > {NORMWISE[dtype]}"
        return
    off_rows = ((got - want).abs() > tight * (1 + want.abs())).any(dim=1).nonzero().flatten().tolist()
    assert len(off_rows) <= 1 + got.shape[0] // 10, f"rows {off_rows} of {got.shape[0]} differ by > {tight}"


def run_both(inp: Fp8Inputs, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    got = kernels.fused_moe(*inp.args(), **inp.scales(), **kw)
    assert got.is_contiguous()
    return got, reference.fused_moe(*inp.args(), **inp.scales(), **kw)


# (name, T, E, K, H, I, activation, experts the tokens may pick (None: all)): H, I and 2I
# are not multiples of the scale blocks or the tiles, so the last groups are partial.
CASES = [
    ("one_token", 1, 4, 2, 40, 20, "silu", None),
    ("three_tokens_top1", 3, 5, 1, 48, 36, "gelu_tanh", None),
    ("t33_top3", 33, 8, 3, 72, 40, "silu", None),
    ("t33_idle_experts", 33, 6, 2, 40, 52, "gelu_tanh", [1, 4]),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=BLOCK_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_launcher_matches_reference(case, dtype, block_size):
    _, t, e, k, h, i, act, experts = case
    inp = make_fp8_inputs(t, e, k, h, i, dtype, block_size, experts=experts, seed=t + e)
    got, want = run_both(inp, activation=act)
    assert_close(got, want, dtype)


# The intermediate rows of pairs outside [0, E) are never written: quantizing their garbage
# may divide or cast NaN under the interpreter (numpy warns); GEMM 2 never reads them.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=BLOCK_IDS)
def test_ids_outside_the_experts_contribute_nothing(block_size):
    # An expert-parallel rank marks other ranks' experts with ids outside [0, E).
    inp = make_fp8_inputs(7, 5, 3, 40, 36, torch.float32, block_size, ids_dtype=torch.int64, seed=4)
    ids = inp.moe.topk_ids
    ids[1, 0] = -1
    ids[3, 2] = 5
    ids[5, :] = 1 << 40  # would wrap into range if narrowed first
    got, want = run_both(inp)
    assert_close(got, want, torch.float32)
    assert (got[5] == 0).all() and (want[5] == 0).all()


def test_strided_views_and_scales():
    base = make_fp8_inputs(11, 5, 2, 40, 36, torch.float32, (32, 32), seed=5)
    wide = torch.randn(11, 56, device=DEVICE)
    wide[:, 8:48] = base.moe.x
    x = wide[:, 8:48]  # rows 56 apart
    ids = base.moe.topk_ids.t().contiguous().t()  # column-major [T, K]
    weights = base.moe.topk_weights.t().contiguous().t()
    w13_scale = base.w13_scale.transpose(1, 2).contiguous().transpose(1, 2)  # k-groups innermost no more
    w2_scale = base.w2_scale.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    got = kernels.fused_moe(x, base.moe.w13, base.moe.w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale,
                            block_size=(32, 32))
    assert_close(got, reference.fused_moe(*base.args(), **base.scales()), torch.float32)
    channel = make_fp8_inputs(11, 5, 2, 40, 36, torch.float32, None, seed=5)
    got = kernels.fused_moe(x, channel.moe.w13, channel.moe.w2, weights, ids,
                            w13_scale=channel.w13_scale.t().contiguous().t(), w2_scale=channel.w2_scale[:, None, :][:, 0])
    assert_close(got, reference.fused_moe(*channel.args(), **channel.scales()), torch.float32)


def test_empty_batch():
    inp = make_fp8_inputs(0, 4, 2, 40, 20, torch.float32, SMALL_BLOCK)
    assert kernels.fused_moe(*inp.args(), **inp.scales()).shape == (0, 40)
    assert reference.fused_moe(*inp.args(), **inp.scales()).shape == (0, 40)


def test_config_block_k_capped_at_the_scale_blocks():
    # A config's BLOCK_K of 64 runs as 32 with 32-column groups (a tile lies in one k-group).
    bs = (32, 32)
    inp = make_fp8_inputs(19, 4, 2, 72, 52, torch.float32, bs, seed=6)
    entry = {"block_m": 16, "gemm1": {"block_n": 16, "block_k": 64, "group_m": 2, "num_warps": 4, "num_stages": 2},
             "gemm2": {"block_n": 32, "block_k": 16, "group_m": 1, "num_warps": 4, "num_stages": 2}}
    assert fm.fp8_block_k(64, bs, torch.device("cpu")) == 32 and fm.fp8_block_k(16, bs, torch.device("cpu")) == 16
    assert fm.fp8_block_k(16, None, torch.device("cuda")) == 32
    got, want = run_both(inp, config={32: entry})
    assert_close(got, want, torch.float32)


def test_default_tiles_double_block_k_for_fp8():
    for t in (1, 40, 300, 5000):
        bf16, fp8 = fm.default_tiles(t, 8, 2, torch.bfloat16), fm.default_tiles(t, 8, 2, FP8)
        assert fp8.block_m == bf16.block_m
        assert (fp8.gemm1.block_k, fp8.gemm2.block_k) == (2 * bf16.gemm1.block_k, 2 * bf16.gemm2.block_k)


def _bad_calls():
    inp = make_fp8_inputs(4, 3, 2, 40, 20, torch.float32, SMALL_BLOCK)
    w13_scale, w2_scale = inp.w13_scale, inp.w2_scale
    plain = make_inputs(4, 3, 2, 40, 20, torch.float32)
    return [
        ("w2", dict(w2=plain.w2)),  # e4m3 w13 with float32 w2
        ("w13", dict(w13=plain.w13)),
        ("w13_scale", dict(w13_scale=None)),
        ("w2_scale", dict(w2_scale=None)),
        ("w13_scale", dict(w13_scale=w13_scale[:, :-1])),
        ("w2_scale", dict(w2_scale=w2_scale.double())),
        ("w13_scale", dict(block_size=None)),  # block scales read as per channel
        ("w13_scale", dict(block_size=(16, 32))),  # shapes of other blocks
        ("block_size", dict(block_size=(16, 24))),
        ("block_size", dict(block_size=16)),
        ("w13_scale", dict(w13=plain.w13, w2=plain.w2)),  # scales for 16-bit weights
    ] + ([("block_size", _cuda_16_column_groups(inp))] if DEVICE == "cuda" else [])


def _cuda_16_column_groups(inp: Fp8Inputs) -> dict:
    """Well-shaped (16, 16) block scales: 16-column k-groups, which fp8 dots on CUDA (K >= 32) cannot take."""
    shape13, shape2 = fm.fp8_scale_shapes(inp.moe.w13, inp.moe.w2, (16, 16))
    return dict(block_size=(16, 16), w13_scale=torch.ones(shape13, device=DEVICE),
                w2_scale=torch.ones(shape2, device=DEVICE))


@pytest.mark.parametrize("name,change", _bad_calls(), ids=[f"{n}-{i}" for i, (n, _) in enumerate(_bad_calls())])
def test_bad_arguments_raise_value_error(name, change):
    inp = make_fp8_inputs(4, 3, 2, 40, 20, torch.float32, SMALL_BLOCK)
    args = dict(x=inp.moe.x, w13=inp.moe.w13, w2=inp.moe.w2, topk_weights=inp.moe.topk_weights,
                topk_ids=inp.moe.topk_ids)
    kwargs = inp.scales()
    for key, value in change.items():
        (kwargs if key in kwargs else args)[key] = value
    with pytest.raises(ValueError, match=f"fused_moe: .*{name}"):
        kernels.fused_moe(*args.values(), **kwargs)
    if name != "block_size":  # the reference checks the scales' presence and shapes only
        cpu = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()} for d in (args, kwargs)]
        with pytest.raises(ValueError, match="fused_moe: "):
            reference.fused_moe(*cpu[0].values(), **cpu[1])


def test_warm_up_runs_once_per_compile_choice(monkeypatch):
    inp = make_fp8_inputs(1, 4, 2, 40, 20, torch.float32, SMALL_BLOCK)
    calls = []
    real = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda x, *a, **kw: calls.append((x.shape[0], x.dtype)) or real(x, *a, **kw))
    with pytest.raises(ValueError, match="x_dtype"):
        fm.warm_up(inp.moe.w13, inp.moe.w2, 2, 4, **inp.scales())
    n = fm.warm_up(inp.moe.w13, inp.moe.w2, 2, 20, ids_dtypes=(torch.int32,), x_dtype=torch.float16, **inp.scales())
    # The 16-bit path's choices (the align chunk grows at T = 9, 17); fp8_quantize
    # compiles once for every row count.
    assert n == len(calls) and [t for t, _ in calls] == [1, 9, 17]
    assert all(dtype == torch.float16 for _, dtype in calls)


def test_tuning_caps_block_k_and_picks_a_runnable_config(monkeypatch):
    import triton.testing

    ran: list[fm.GemmTiles] = []
    real_gemm = fm._gemm

    def recording_gemm(*args, **kw):
        ran.append(args[8])
        return real_gemm(*args, **kw)

    def fake_do_bench(fn, **kw):
        fn()
        return 1.0 if ran[-1].block_n == 64 else 2.0

    monkeypatch.setattr(fm, "_gemm", recording_gemm)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    inp = make_fp8_inputs(5, 4, 2, 72, 40, torch.float32, (32, 32))
    entry = fm._tune_one(inp.moe.x, inp.moe.w13, inp.moe.w2, 2, torch.Generator(device=DEVICE), 1, 3,
                         **inp.scales())
    assert ran and all(t.block_k <= 32 for t in ran)
    assert fm.MoeTiles.from_dict(entry).gemm1.block_n == 64
    got, want = run_both(inp, config={5: entry})
    assert_close(got, want, torch.float32)
    channel = fm._candidate_tiles(16, FP8, 1)
    assert [t.block_k for t in channel] == [2 * c[1] for c in fm._GEMM_CANDIDATES[16]]


# ---- the reference against an independent oracle ------------------------------------------------------------


def _oracle_quantize(v: torch.Tensor, group: int | None) -> torch.Tensor:
    """1-D float32 row -> its e4m3 round trip in float64, group by group (the fp8_quantize contract)."""
    out = torch.empty(v.shape, dtype=torch.float64)
    g = group or v.numel()
    for c0 in range(0, v.numel(), g):
        part = v[c0:c0 + g]
        s = torch.clamp(part.abs().max() / 448, min=1 / (448 * 512))  # float32
        out[c0:c0 + g] = (part / s).clamp(-448, 448).to(FP8).double() * s.double()
    return out


def _oracle(inp: Fp8Inputs, activation: str) -> torch.Tensor:
    """A per-(token, slot) loop in float64 over dequantized values; weight w[e, r, c]
    = code * scale[e, r // bn, c // bk] indexed element by element."""
    x, w13, w2, topk_weights, topk_ids = inp.args()
    act = reference.MOE_ACTIVATIONS[activation]
    e, two_i, h = w13.shape
    bs = inp.block_size

    def dequantize(w, scale):
        rows, cols = torch.arange(w.shape[1]), torch.arange(w.shape[2])
        s = scale.double()[:, :, None] if bs is None else scale.double()[:, rows // bs[0]][:, :, cols // bs[1]]
        return w.double() * s

    w13d, w2d = dequantize(w13, inp.w13_scale), dequantize(w2, inp.w2_scale)
    group = None if bs is None else bs[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        a = _oracle_quantize(x[t].float(), group)
        for k in range(topk_ids.shape[1]):
            ex = int(topk_ids[t, k])
            if not 0 <= ex < e:
                continue
            gate, up = w13d[ex, :two_i // 2] @ a, w13d[ex, two_i // 2:] @ a
            inter = _oracle_quantize((act(gate) * up).float(), group)
            out[t] += float(topk_weights[t, k]) * (w2d[ex] @ inter)
    return out


@pytest.mark.parametrize("block_size", [None, (16, 16), (32, 16), (128, 128)],
                         ids=["channel", "block16x16", "block32x16", "block128x128"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_reference_matches_per_token_float64_loop(activation, block_size):
    inp = make_fp8_inputs(23, 7, 3, 72, 40, torch.float32, block_size, experts=[0, 1, 4, 6], device="cpu", seed=7)
    inp.moe.topk_ids[2, 1] = 7  # outside [0, E)
    got = reference.fused_moe(*inp.args(), **inp.scales(), activation=activation)
    assert_close_but_for_flips(got.double(), _oracle(inp, activation), torch.float32, tight=1e-5)


# ---- CUDA: bf16 with 128x128 blocks at the Qwen3-30B-A3B shape, CUDA graphs, warm-up, tuning ---------------


@functools.lru_cache(maxsize=2)
def _qwen3_30b_a3b_fp8_experts(block_size) -> tuple[torch.Tensor, ...]:
    """One layer's experts at the Qwen3-30B-A3B shape, e4m3 on the GPU (made once)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(128, 2 * 768, 2048, device=DEVICE, generator=gen) * 2048**-0.5
    w2 = torch.randn(128, 2048, 768, device=DEVICE, generator=gen) * 768**-0.5
    return (*quantize_weight(w13, block_size), *quantize_weight(w2, block_size))


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("block_size", [(128, 128), None], ids=["block128x128", "channel"])
@pytest.mark.parametrize("num_tokens", [1, 32, 300, 2048])
def test_bf16_qwen3_30b_a3b_shape(num_tokens, block_size):
    moe = make_inputs(num_tokens, 128, 8, 16, 16, torch.bfloat16, seed=num_tokens)  # the routing
    moe.w13, w13_scale, moe.w2, w2_scale = _qwen3_30b_a3b_fp8_experts(block_size)
    moe.x = torch.randn(num_tokens, 2048, device=DEVICE, dtype=torch.bfloat16)
    inp = Fp8Inputs(moe, w13_scale, w2_scale, block_size)
    got, want = run_both(inp)
    # The same steps with float32 x: no 16-bit rounding of gate, up, the intermediate and the outputs.
    exact = reference.fused_moe(moe.x.float(), *inp.args()[1:], **inp.scales())
    err_kernel = (got.float() - exact).abs().max().item()
    err_reference = (want.float() - exact).abs().max().item()
    assert err_kernel <= max(2 * err_reference, 2e-2), (err_kernel, err_reference)
    torch.testing.assert_close(got.float(), want.float(), atol=8e-2, rtol=5e-2)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("block_size", [(128, 128), None], ids=["block128x128", "channel"])
@pytest.mark.parametrize("num_tokens", [1, 64, 600])  # 600 x 4 pairs: align in three launches
def test_cuda_graph_replay_with_new_inputs(num_tokens, block_size):
    e, k, h, i = 32, 4, 512, 256
    static = make_fp8_inputs(num_tokens, e, k, h, i, torch.bfloat16, block_size, seed=1)
    kernels.fused_moe(*static.args(), **static.scales())  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.fused_moe(*static.args(), **static.scales())
    for seed in (2, 3):
        fresh = make_inputs(num_tokens, e, k, h, i, torch.bfloat16, seed=seed,
                            experts=[0, 5, 6, 31] if seed == 3 else None)  # most experts idle
        static.moe.x.copy_(fresh.x)
        static.moe.topk_ids.copy_(fresh.topk_ids)
        static.moe.topk_weights.copy_(fresh.topk_weights)
        graph.replay()
        assert_close(out, reference.fused_moe(*static.args(), **static.scales()), torch.bfloat16)


@pytest.mark.gpu
@cuda_only
def test_after_warm_up_no_batch_size_compiles():
    import logging

    from kernels import compiles

    e, k, h, i, bs = 24, 6, 384, 160, (128, 128)  # a shape no other test compiles
    inp = make_fp8_inputs(1, e, k, h, i, torch.bfloat16, bs)
    config = {n: fm.default_tiles(n, e, k, FP8).as_dict() for n in (1, 256, 2048)}
    fm.warm_up(inp.moe.w13, inp.moe.w2, k, 3000, config=config, x_dtype=torch.bfloat16, **inp.scales())
    compiles.watch(logging.getLogger("pdserve-test"))
    n = compiles.count
    for num_tokens, ids_dtype in ((1, torch.int32), (3, torch.int64), (16, torch.int32), (77, torch.int32),
                                  (640, torch.int64), (2999, torch.int32)):
        batch = make_fp8_inputs(num_tokens, e, k, h, i, torch.bfloat16, bs, ids_dtype=ids_dtype, seed=num_tokens)
        kernels.fused_moe(batch.moe.x, inp.moe.w13, inp.moe.w2, batch.moe.topk_weights, batch.moe.topk_ids,
                          config=config, **inp.scales())
    assert compiles.count == n


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("block_size", [(128, 128), None], ids=["block128x128", "channel"])
def test_tune_returns_usable_configs(block_size):
    configs = fm.tune(8, 256, 128, 2, FP8, torch.device("cuda"), token_counts=(1, 64), rep_ms=5,
                      max_candidates=2, block_size=block_size)
    assert sorted(configs) == [1, 64]
    inp = make_fp8_inputs(40, 8, 2, 256, 128, torch.bfloat16, block_size)
    got, want = run_both(inp, config=configs)
    assert_close(got, want, torch.bfloat16)


# ---- bench/fused_moe_fp8.py ---------------------------------------------------------------------------------


def test_bench_runs_end_to_end_on_a_tiny_shape(capsys):
    # The GPU run's code path with a stand-in timer, on CPU: a wrong name or unit in
    # the report shows up here rather than on the borrowed GPU.
    from bench import fused_moe_fp8

    timer = lambda fn: (fn(), 0.01)[1]  # noqa: E731 - 10 us a call
    result = fused_moe_fp8.bench_fp8_moe(timer, 1e12, device=DEVICE, shape=(6, 40, 24, 2), tokens=(1, 20),
                                         decode_max=8, tune=False)
    assert list(result["variants"]) == ["bf16", "fp8-channel", "fp8-block128"]
    for variant, data in result["variants"].items():
        one, many = data["cases"]
        if variant != "bf16" or DEVICE == "cuda":  # the interpreter's bfloat16 tl.dot is wrong
            assert one["max_abs_err"] < 0.1 and many["max_abs_err"] < 0.1
        assert one["speedup_vs_bf16"] == 1.0 and "flops_per_s" in many
        nbytes = 2 * 3 * 40 * 24 * (2 if variant == "bf16" else 1)  # one token, two distinct experts
        assert one["weight_bytes"] >= nbytes and (one["weight_bytes"] == nbytes) == (variant == "bf16")
    assert "fused_moe fp8-block128    20 tokens" in capsys.readouterr().out
