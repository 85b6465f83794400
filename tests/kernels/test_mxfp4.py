"""MXFP4 (gpt-oss's expert format): the reference quantizer and dequantizer on known values
(the e2m1 grid, ties, scale edges), against transformers' own dequantization, and the
fused MoE kernel's MXFP4 variant (weights dequantized in registers) against the reference."""
from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl

from tests.kernels._common import DEVICE, DTYPES
from tests.kernels.test_fused_moe import assert_close, make_inputs

import kernels
from kernels import reference
from kernels.mxfp4_reference import (
    E2M1_VALUES,
    dequantize_mxfp4,
    dequantize_mxfp4_packed,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)

fm = importlib.import_module("kernels.fused_moe")

GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)


# ---- the format -------------------------------------------------------------------------------------------


def test_the_e2m1_grid_round_trips_exactly_with_its_codes_in_nibble_order():
    # One block holding the 16 codes in order (amax 6: scale 2^0), then 16 zeros; and the same
    # values times 2^-3 and 2^5.
    block = torch.cat([GRID, torch.zeros(16, dtype=torch.float64)])
    w = torch.stack([block, block * 2**-3, block * 2**5])  # [3, 32]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 1, 16) and scales.shape == (3, 1) and blocks.dtype == scales.dtype == torch.uint8
    assert scales.flatten().tolist() == [127, 124, 132]
    # byte j = code 2j (low nibble) | code 2j + 1 (high nibble)
    assert blocks[0, 0, :8].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert (blocks[:, :, 8:] == 0).all()
    back = dequantize_mxfp4(blocks, scales)
    assert back.dtype == torch.float32 and torch.equal(back.double(), w)
    assert torch.equal(torch.signbit(back[0, :16]), torch.signbit(GRID.float()))  # -0 is code 8
    assert torch.equal(unpack_e2m1(blocks[0, 0]), torch.tensor(list(range(16)) + [0] * 16))
    assert torch.equal(pack_e2m1(unpack_e2m1(blocks)), blocks)


def test_round_to_nearest_ties_to_even():
    # amax 6 fixes the scale at 1; each midpoint goes to the neighbour with the even code.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    above = [0.26, 0.76, 1.26, 1.76, 2.51, 3.51, 5.01]
    want_above = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    vals = torch.tensor([6.0] + mids + [-m for m in mids] + above + [-a for a in above] + [0.0] * 3,
                        dtype=torch.float64)
    assert vals.numel() == 32
    got = dequantize_mxfp4(*quantize_mxfp4(vals[None]))[0].double()
    expect = torch.tensor([6.0] + want + [-v for v in want] + want_above + [-v for v in want_above] + [0.0] * 3,
                          dtype=torch.float64)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("amax,scale", [
    (6.0, 127),  # 6 * 2^0 fits exactly
    (6.0000001, 128),  # just above: the next power of two (nothing clips)
    (4.5, 127),  # above 6 * 2^-1
    (3.0, 126),  # exactly 6 * 2^-1
    (1.0, 125),  # 6 * 2^-3 < 1 <= 6 * 2^-2
    (6 * 2.0**-127, 0),  # the least scale, exact
    (6 * 2.0**125, 252),  # large, exact (6 * 2^127, scale 254, is past float32's range)
])
def test_the_scale_is_the_least_power_of_two_that_fits_the_block(amax, scale):
    w = torch.zeros(1, 32, dtype=torch.float64)
    w[0, 5] = amax
    w[0, 6] = -amax / 3
    blocks, scales = quantize_mxfp4(w)
    assert int(scales) == scale
    back = dequantize_mxfp4(blocks, scales).double()
    step = 2.0 ** (scale - 127)
    assert abs(float(back[0, 5]) - amax) <= step and float(back[0, 5]) <= 6 * step


def test_scale_edge_cases():
    zeros, tiny, huge = (torch.zeros(32, dtype=torch.float64), torch.full((32,), 2.0**-140, dtype=torch.float64),
                         torch.zeros(32, dtype=torch.float64))
    huge[3], huge[4] = 2.0**130, -(2.0**129)
    blocks, scales = quantize_mxfp4(torch.stack([zeros.double(), tiny, huge.double()]))
    # all zeros: scale 2^-127 (s = 0), zero codes; tiny: the least scale, rounded to 0;
    # huge: the largest scale (254), clipped at +-6 (codes 7 and 14: -4)
    assert scales.flatten().tolist() == [0, 0, 254]
    assert (blocks[:2] == 0).all()
    assert unpack_e2m1(blocks[2, 0])[3:5].tolist() == [7, 14]
    back = dequantize_mxfp4(blocks, scales)
    assert (back[:2] == 0).all()
    # 6 * 2^127 is past float32's largest value: inf; 4 * 2^127 = 2^129 too; 1 * 2^127 is not
    assert back[2, 3] == float("inf") and back[2, 4] == float("-inf") and (back[2, :3] == 0).all()
    one = dequantize_mxfp4(torch.full((1, 16), 0x22, dtype=torch.uint8), torch.tensor([254], dtype=torch.uint8))
    assert (one == 2.0**127).all()
    # e8m0 255 is NaN; 0 is 2^-127, a float32 subnormal kept exactly
    nan = dequantize_mxfp4(torch.full((1, 16), 0x11, dtype=torch.uint8), torch.tensor([255], dtype=torch.uint8))
    assert torch.isnan(nan).all()
    least = dequantize_mxfp4(torch.full((1, 16), 0x22, dtype=torch.uint8), torch.tensor([0], dtype=torch.uint8))
    assert (least == 2.0**-127).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(torch.full((1, 32), float("inf")))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(1, 16, dtype=torch.int8), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks must be"):
        dequantize_mxfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))


def test_random_weights_requantize_to_themselves_within_half_a_step():
    w = torch.randn(4, 6, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 6, 3, 16) and scales.shape == (4, 6, 3)
    back = dequantize_mxfp4(blocks, scales)
    # the gap between e2m1 values is at most 2 scale units (4 -> 6): within 1 unit of w
    unit = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1)
    assert ((back.double() - w.double()).abs() <= unit).all()
    # the values quantize to themselves (a block whose max rounded down may take a smaller scale)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(back)), back)
    assert torch.equal(dequantize_mxfp4_packed(blocks.flatten(-2), scales), back)


def test_nibble_order_and_orientation_match_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(1)
    e, rows, groups = 3, 10, 4
    blocks = torch.randint(0, 256, (e, rows, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (e, rows, groups), dtype=torch.uint8, generator=gen)
    hf = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]: transposed
    assert hf.shape == (e, groups * 32, rows)
    assert torch.equal(dequantize_mxfp4(blocks, scales), hf.transpose(1, 2))


# ---- the Triton kernel's tile dequantization ------------------------------------------------------------------


@triton.jit
def _tile_kernel(q_ptr, s_ptr, out_ptr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    kh = tl.arange(0, BLOCK_K // 2)
    kg = tl.arange(0, BLOCK_K // 32)
    n = tl.arange(0, BLOCK_N)
    # q [BLOCK_N, BLOCK_K / 2] and s [BLOCK_N, BLOCK_K / 32] row-major, read as [k, n] tiles
    q = tl.load(q_ptr + n[None, :] * (BLOCK_K // 2) + kh[:, None])
    s = tl.load(s_ptr + n[None, :] * (BLOCK_K // 32) + kg[:, None])
    w = fm._mxfp4_tile(q, s, BLOCK_K, BLOCK_N)  # [BLOCK_K, BLOCK_N]
    k = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + n[None, :] * BLOCK_K + k[:, None], w)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's numpy at scale 254: inf
def test_kernel_tile_dequantizes_every_byte_and_scale_exactly():
    # Rows of 64 elements (two scale groups); all 256 bytes, scales at the edges and in between.
    n, k = 32, 64
    q = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, k // 2)
    edge = [0, 1, 2, 3, 100, 126, 127, 128, 200, 253, 254, 255]
    s = torch.tensor([edge[(i + j) % len(edge)] for i in range(n) for j in range(2)], dtype=torch.uint8).view(n, 2)
    out = torch.empty(n, k, dtype=torch.float32, device=DEVICE)
    _tile_kernel[(1,)](q.to(DEVICE), s.to(DEVICE), out, BLOCK_K=k, BLOCK_N=n)
    want = dequantize_mxfp4_packed(q, s)
    torch.testing.assert_close(out.cpu(), want, atol=0, rtol=0, equal_nan=True)


# ---- the fused MoE kernel with MXFP4 experts ------------------------------------------------------------------


def mxfp4_experts(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """16-bit experts -> the kernels' MXFP4 arguments (blocks flattened to bytes), on w13's device."""
    b13, s13 = quantize_mxfp4(w13.float().cpu())
    b2, s2 = quantize_mxfp4(w2.float().cpu())
    dev = w13.device
    return dict(w13=b13.flatten(-2).to(dev), w2=b2.flatten(-2).to(dev), w13_scale=s13.to(dev), w2_scale=s2.to(dev))


# (name, T, E, K, H, I, activation, bias, experts): H = 96 and 160 are not multiples of 64 or 128
CASES = [
    ("one_token", 1, 4, 2, 64, 32, "swigluoai", True, None),
    ("t13_h96", 13, 6, 3, 96, 64, "swigluoai", True, None),
    ("silu_no_bias", 9, 5, 2, 160, 32, "silu", False, [0, 3, 4]),
    ("many_tiles_per_expert", 40, 3, 2, 64, 96, "gelu_tanh", True, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_launcher_matches_reference_with_mxfp4_experts(case, dtype):
    _, t, e, k, h, i, act, bias, experts = case
    inp = make_inputs(t, e, k, h, i, dtype, experts=experts, seed=t)
    q = mxfp4_experts(inp.w13, inp.w2)
    gen = torch.Generator().manual_seed(t)
    kw = dict(activation=act, w13_scale=q["w13_scale"], w2_scale=q["w2_scale"], swiglu_limit=2.0)
    if bias:
        kw.update(w13_bias=torch.randn(e, 2 * i, generator=gen).to(dtype).to(DEVICE),
                  w2_bias=torch.randn(e, h, generator=gen).to(dtype).to(DEVICE))
    args = (inp.x, q["w13"], q["w2"], inp.topk_weights, inp.topk_ids)
    got = kernels.fused_moe(*args, **kw)
    want = reference.fused_moe(*args, **kw)
    assert_close(got, want, dtype)
    # the reference is the 16-bit path on the dequantized weights
    w13 = dequantize_mxfp4_packed(q["w13"].cpu(), q["w13_scale"].cpu()).to(dtype).to(DEVICE)
    w2 = dequantize_mxfp4_packed(q["w2"].cpu(), q["w2_scale"].cpu()).to(dtype).to(DEVICE)
    plain = {key: v for key, v in kw.items() if not key.endswith("_scale")}
    assert torch.equal(want, reference.fused_moe(inp.x, w13, w2, inp.topk_weights, inp.topk_ids, **plain))


def test_mxfp4_configs_strides_and_outside_ids():
    inp = make_inputs(19, 4, 2, 96, 64, torch.float32, seed=6)
    q = mxfp4_experts(inp.w13, inp.w2)
    inp.topk_ids[2, 1] = -1
    args = (inp.x, q["w13"], q["w2"], inp.topk_weights, inp.topk_ids)
    kw = dict(w13_scale=q["w13_scale"], w2_scale=q["w2_scale"])
    want = reference.fused_moe(*args, **kw)
    # block_k 16 runs as 32 (a tile takes whole scale groups); 64 does not divide H = 96
    tiles = {"block_m": 16, "gemm1": {"block_n": 16, "block_k": 16, "group_m": 2, "num_warps": 4, "num_stages": 2},
             "gemm2": {"block_n": 32, "block_k": 64, "group_m": 1, "num_warps": 4, "num_stages": 2}}
    assert_close(kernels.fused_moe(*args, config={32: tiles}, **kw), want, torch.float32)
    # expert-strided views of the packed bytes and scales
    wide = torch.zeros(4, 2 * 64 + 8, 48 + 4, dtype=torch.uint8, device=DEVICE)
    wide[:, 8:, 4:] = q["w13"]
    wide_s = torch.zeros(4, 2 * 64, 3 + 5, dtype=torch.uint8, device=DEVICE)
    wide_s[:, :, 5:] = q["w13_scale"]
    got = kernels.fused_moe(inp.x, wide[:, 8:, 4:], q["w2"], inp.topk_weights, inp.topk_ids,
                            w13_scale=wide_s[:, :, 5:], w2_scale=q["w2_scale"])
    assert_close(got, want, torch.float32)


def _bad_mxfp4_calls():
    inp = make_inputs(4, 3, 2, 64, 32, torch.float32)
    q = mxfp4_experts(inp.w13, inp.w2)
    return [
        ("w13_scale", dict(w13_scale=None)),
        ("w13_scale", dict(w13_scale=q["w13_scale"].float())),
        ("w2_scale", dict(w2_scale=q["w2_scale"][:, :, :0])),
        ("w2", dict(w2=inp.w2)),  # uint8 w13 with a float w2
        ("w2", dict(w2=q["w2"][:, :32])),
        ("w13", dict(w13=q["w13"][:, :, :16])),
        ("block_size", dict(block_size=(32, 32))),
        ("hidden", dict(x=inp.x[:, :48], w13=q["w13"][:, :, :24], w2=q["w2"][:, :48])),
    ]


@pytest.mark.parametrize("name,change", _bad_mxfp4_calls(),
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(_bad_mxfp4_calls())])
def test_bad_mxfp4_arguments_raise_value_error(name, change):
    inp = make_inputs(4, 3, 2, 64, 32, torch.float32)
    q = mxfp4_experts(inp.w13, inp.w2)
    args = dict(x=inp.x, w13=q["w13"], w2=q["w2"], topk_weights=inp.topk_weights, topk_ids=inp.topk_ids)
    kw = dict(w13_scale=q["w13_scale"], w2_scale=q["w2_scale"])
    for key in list(change):
        (args if key in args else kw)[key] = change.pop(key)
    with pytest.raises(ValueError, match=f"fused_moe: .*{name}"):
        kernels.fused_moe(*args.values(), **kw)
    with pytest.raises(ValueError, match="fused_moe: "):
        reference.fused_moe(*[a.cpu() for a in args.values()],
                            **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})


def test_mxfp4_warm_up_and_tuning_loop(monkeypatch):
    import triton.testing

    inp = make_inputs(3, 4, 2, 64, 32, torch.float32)
    q = mxfp4_experts(inp.w13, inp.w2)
    with pytest.raises(ValueError, match="x_dtype is required"):
        fm.warm_up(q["w13"], q["w2"], 2, 4, w13_scale=q["w13_scale"], w2_scale=q["w2_scale"])
    # the pair GEMV (1 and 2 tokens) and one grouped-GEMM config (3 and 4)
    monkeypatch.setattr(fm, "PAIR_GEMV_MAX_TOKENS", 2)
    assert fm.warm_up(q["w13"], q["w2"], 2, 4, x_dtype=torch.float32, ids_dtypes=(torch.int32,),
                      w13_scale=q["w13_scale"], w2_scale=q["w2_scale"]) == 2
    # the tuning loop on CPU with a stand-in timer: every candidate runs, the first wins ties
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    entry = fm._tune_one(inp.x, q["w13"], q["w2"], 2, torch.Generator(device=DEVICE), 1, 2,
                         w13_scale=q["w13_scale"], w2_scale=q["w2_scale"])
    tiles = fm.MoeTiles.from_dict(entry)  # float32 activations: the float32 candidates, whole scale groups
    assert (tiles.gemm1.block_n, tiles.gemm1.block_k) == fm._GEMM_CANDIDATES_FP32[0][:2]
    args = (inp.x, q["w13"], q["w2"], inp.topk_weights, inp.topk_ids)
    kw = dict(w13_scale=q["w13_scale"], w2_scale=q["w2_scale"])
    assert_close(kernels.fused_moe(*args, config={3: entry}, **kw), reference.fused_moe(*args, **kw), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "16bit"])
def test_the_pair_gemv_matches_the_grouped_gemms_and_the_reference(monkeypatch, dtype, mxfp4):
    """A few tokens take the pair GEMV (no align step, no dot): the same result as the grouped
    GEMMs within their rounding, with biases, a foreign expert id and K not a multiple of BLOCK_K."""
    t, e, k, h, i = 3, 5, 2, 96, 160  # 96 and 160: BLOCK_K 64 takes masked last steps
    inp = make_inputs(t, e, k, h, i, dtype, seed=11)
    inp.topk_ids[1, 0] = e  # another rank's expert: contributes nothing
    gen = torch.Generator().manual_seed(3)
    kw = dict(activation="swigluoai", swiglu_limit=2.0,
              w13_bias=torch.randn(e, 2 * i, generator=gen).to(dtype).to(DEVICE),
              w2_bias=torch.randn(e, h, generator=gen).to(dtype).to(DEVICE))
    if mxfp4:
        q = mxfp4_experts(inp.w13, inp.w2)
        w13, w2 = q["w13"], q["w2"]
        kw.update(w13_scale=q["w13_scale"], w2_scale=q["w2_scale"])
    else:
        w13, w2 = inp.w13, inp.w2
    args = (inp.x, w13, w2, inp.topk_weights, inp.topk_ids)
    want = reference.fused_moe(*args, **kw)
    monkeypatch.setattr(fm, "PAIR_GEMV_MAX_TOKENS", t)
    assert fm.gemv_tiles(t, w13, inp.x) is not None
    gemv = kernels.fused_moe(*args, **kw)
    monkeypatch.setattr(fm, "PAIR_GEMV_MAX_TOKENS", 0)
    assert fm.gemv_tiles(t, w13, inp.x) is None
    grouped = kernels.fused_moe(*args, **kw)
    assert_close(gemv, want, dtype)
    assert_close(gemv, grouped, dtype)
    if dtype == torch.float32:  # the same exact products, summed in another order
        torch.testing.assert_close(gemv, grouped, atol=1e-5, rtol=1e-5)
