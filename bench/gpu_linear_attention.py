"""Gated DeltaNet's kernels on one GPU: correctness at real shapes, then times against floors.

    python -m bench.gpu_linear_attention [--out FILE.json] [--quick] [--no-fla]

Shapes: one Qwen3-Next-80B-A3B linear-attention layer on one GPU (Hk = 16 q/k heads,
Hv = 32 v heads, Dk = Dv = 128, conv kernel 4, conv dim 2*16*128 + 32*128 = 8192), bfloat16
activations, float32 recurrent state, every sequence in its own state slot (slots shuffled).

1. Checks: each Triton op (``kernels.causal_conv1d``, ``kernels.gated_delta_rule`` in both
   forms, ``kernels.gated_rms_norm``) against its reference (``kernels.reference``, run on
   the GPU) on random inputs: a decode batch of 32, a mixed batch (prefills of 1000, 300 and
   70 tokens beside decode rows, mixed has_initial_state), and an 8192-token prefill.
   Reported: max abs error and relative error (||got - want|| / ||want||) of outputs and
   states; "FAIL" past the tolerance. If fla-core is importable (``fla.ops.gated_delta_rule``;
   not a dependency of pdserve), its ``chunk_gated_delta_rule`` / ``fused_recurrent_...``
   are checked the same way, states gathered into and scattered out of its [N, H, K, V]
   initial_state (fla has no state slots).
2. Times (CUDA-graph replay, median; state buffers cycled past L2 for decode): decode at
   batch 1, 32 and 128 (conv, recurrent delta rule, gated norm, and the chunked form for
   comparison), a 2000-token prefill beside 127 decode rows (the dispatch, which splits the
   batch by length, against the chunked kernels for every row), and an 8192-token prefill
   (one sequence; conv, chunked delta rule, the recurrent kernel once, norm; fla too if
   present). Each time is printed beside its floor: the bytes an op must move at the
   read bandwidth measured in the same run, and its FLOPs at ``--tflops`` (dense bf16 peak,
   default 790; the kernels' 16-bit dots run in TF32, about half that), whichever is longer.

Results also go to ``--out`` (JSON) when given. Exit status 1 if a check failed.
"""
from __future__ import annotations

import importlib

import argparse
import json
import sys
import time
import traceback

HK, HV, DK, DV, KCONV = 16, 32, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV
TOL = 2e-2  # relative error of bf16 outputs; float32 states: the same bound


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _maxabs(got, want) -> float:
    return (got.float() - want.float()).abs().max().item()


class Batch:
    """A varlen batch of sequences at the model's shapes, with states in shuffled slots."""

    def __init__(self, lens, init, seed=0, num_slots=None):
        import torch
        import torch.nn.functional as F

        gen = torch.Generator(device="cuda").manual_seed(seed)
        dev, bf16 = "cuda", torch.bfloat16
        self.lens = list(lens)
        B, T = len(lens), sum(lens)
        num_slots = num_slots or B + 3
        self.T, self.B = T, B
        self.qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        self.slots = torch.randperm(num_slots, generator=gen, device=dev)[:B].to(torch.int32)
        self.init = torch.tensor(init, dtype=torch.bool, device=dev)
        # The conv's input: the fused q|k|v projection [T, CONV_DIM]; the delta rule reads views of it.
        self.x = torch.randn(T, CONV_DIM, generator=gen, device=dev).to(bf16)
        self.conv_w = (torch.randn(CONV_DIM, KCONV, generator=gen, device=dev) / 2).to(bf16)
        self.conv_state = torch.randn(num_slots, CONV_DIM, KCONV - 1, generator=gen, device=dev).to(bf16)
        mixed = torch.randn(T, CONV_DIM, generator=gen, device=dev).to(bf16)
        self.q = mixed[:, :HK * DK].view(T, HK, DK)
        self.k = mixed[:, HK * DK:2 * HK * DK].view(T, HK, DK)
        self.v = mixed[:, 2 * HK * DK:].view(T, HV, DV)
        self.beta = torch.sigmoid(torch.randn(T, HV, generator=gen, device=dev)).to(bf16)
        A = torch.empty(HV, device=dev).uniform_(0.01, 16, generator=gen)
        self.g = -A * F.softplus(torch.randn(T, HV, generator=gen, device=dev) - 4.0)  # float32, as the layer's
        self.ssm_state = torch.randn(num_slots, HV, DK, DV, generator=gen, device=dev) * 0.1
        self.z = torch.randn(T * HV, DV, generator=gen, device=dev).to(bf16)
        self.norm_w = torch.randn(DV, generator=gen, device=dev).to(bf16)

    def conv_args(self, state):
        return (self.x, self.conv_w, None, state, self.slots, self.qsl, self.init)

    def delta_args(self, state):
        return (self.q, self.k, self.v, self.g, self.beta, state, self.slots, self.qsl, self.init)


def _fla():
    """fla-core's kernels where the machine has them (`pip install fla-core==0.6.0` on the GPU
    machine; never a dependency of pdserve's: with fla installed, transformers' Qwen3-Next takes
    fla's kernels instead of its PyTorch path, which the CPU tests compare against)."""
    try:
        ops = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:  # noqa: BLE001 - any import failure means no fla
        return None, f"{type(e).__name__}: {e}"
    return (ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule), None


def _fla_call(fn, b: Batch, state):
    """fla on our batch: one [1, T] varlen call from states gathered out of the slots
    (zeros where has_initial_state is False); returns (o [T, Hv, Dv], new states [B, ...])."""
    import torch

    h0 = torch.where(b.init[:, None, None, None], state[b.slots.long()], 0.0)
    o, ht = fn(b.q[None], b.k[None], b.v[None], g=b.g[None], beta=b.beta[None], initial_state=h0,
               output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=b.qsl.long())
    return o[0], ht


def check(results: dict, use_fla: bool) -> bool:
    import torch

    import kernels
    from kernels import gated_delta, reference

    ok = True
    cases = {
        "decode x32": ([1] * 32, [True] * 32),
        "mixed": ([1000, 1, 300, 1, 1, 70, 4], [False, True, True, True, False, True, True]),
        "prefill 8192": ([8192], [False]),
    }
    fla, why = _fla() if use_fla else (None, "--no-fla")
    if fla is None:
        print(f"fla-core: not used ({why})")
    for name, (lens, init) in cases.items():
        b = Batch(lens, init, seed=1)
        rows = {}
        sel = b.slots.long()
        want_state = b.conv_state.clone()
        want = reference.causal_conv1d(*b.conv_args(want_state))
        got_state = b.conv_state.clone()
        got = kernels.causal_conv1d(*b.conv_args(got_state))
        rows["causal_conv1d"] = (got, want, got_state[sel], want_state[sel])

        want_state = b.ssm_state.clone()
        want = reference.gated_delta_rule(*b.delta_args(want_state))
        for label, fn in (("gated_delta_rule (dispatch)", kernels.gated_delta_rule),
                          ("gated_delta_rule recurrent", gated_delta.gated_delta_rule_recurrent),
                          ("gated_delta_rule chunked", gated_delta.gated_delta_rule_chunked)):
            if label.endswith("recurrent") and max(lens) > 1000:
                continue
            got_state = b.ssm_state.clone()
            got = fn(*b.delta_args(got_state))
            rows[label] = (got, want, got_state[sel], want_state[sel])
        if fla is not None:
            for label, fn in (("fla chunk", fla[0]), ("fla fused_recurrent", fla[1])):
                try:
                    o, ht = _fla_call(fn, b, b.ssm_state)
                    rows[label] = (o, want, ht, want_state[sel])
                except Exception as e:  # noqa: BLE001
                    print(f"  {name}: {label} failed: {type(e).__name__}: {e}")
                    results.setdefault("errors", []).append(f"{name} {label}: {e}")

        o = want.reshape(-1, DV)
        rows["gated_rms_norm"] = (kernels.gated_rms_norm(o, b.z, b.norm_w, 1e-6),
                                  reference.gated_rms_norm(o, b.z, b.norm_w, 1e-6), None, None)
        for label, (got, want_, gs, ws) in rows.items():
            entry = {"max_abs": _maxabs(got, want_), "rel": _rel(got, want_)}
            if gs is not None:
                entry["state_max_abs"] = _maxabs(gs, ws)
                entry["state_rel"] = _rel(gs, ws)
            bad = entry["rel"] > TOL or entry.get("state_rel", 0.0) > TOL or entry["rel"] != entry["rel"]
            ours = not label.startswith("fla")
            ok &= not (bad and ours)
            entry["ok"] = not bad
            results.setdefault("checks", {}).setdefault(name, {})[label] = entry
            state = (f"  state max|d| {entry['state_max_abs']:.2e} rel {entry['state_rel']:.2e}"
                     if "state_rel" in entry else "")
            print(f"  {name:13s} {label:28s} max|d| {entry['max_abs']:.2e} rel {entry['rel']:.2e}{state}"
                  f"{'  FAIL' if bad else ''}")
        del b, rows
        torch.cuda.empty_cache()
    return ok


def _delta_bytes(T, B, Hk, Hv, Dk, Dv, act=2, state=4):
    return T * (2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv) * act + 2 * B * Hv * Dk * Dv * state


def _delta_flops_recurrent(T, Hv, Dk, Dv):
    return T * Hv * Dk * Dv * 7  # decay, k^T S, update (2), q^T S (2) per state entry, roughly


def _delta_flops_chunked(T, Hv, Dk, Dv, C=64):
    # per chunk and head: k k^T, w and u (X times [C, Dk] and [C, Dv]), w S, q S, q k^T, A v_new, k^T v_new
    per_chunk = 2 * C * C * Dk + 2 * C * C * (Dk + Dv) + 3 * 2 * C * Dk * Dv + 2 * C * C * Dk + 2 * C * C * Dv
    return T // C * Hv * per_chunk


def timing(results: dict, quick: bool, use_fla: bool, tflops: float) -> None:
    import torch

    import kernels
    from bench.gemm_timing import cycle_copies, graph_us, read_bandwidth
    from kernels import gated_delta

    bw = read_bandwidth()
    print(f"read bandwidth {bw / 1e12:.2f} TB/s; FLOP floor at {tflops:.0f} TFLOP/s")
    results["read_bandwidth"] = bw
    fla, _ = _fla() if use_fla else (None, None)
    rows = []

    def report(case, op, us, nbytes, flops):
        floor = max(nbytes / bw, flops / (tflops * 1e12)) * 1e6
        rows.append({"case": case, "op": op, "us": us, "floor_us": floor, "bytes": nbytes, "flops": flops})
        print(f"  {case:14s} {op:30s} {us:9.1f} us   floor {floor:8.1f} us ({100 * floor / us:5.1f}%)   "
              f"{nbytes / 1e6:9.2f} MB  {flops / 1e9:8.2f} GFLOP")

    batches = [1, 32] if quick else [1, 32, 128]
    for B in batches:
        b = Batch([1] * B, [True] * B, seed=2, num_slots=B)
        case = f"decode x{B}"
        ssm_bytes = B * HV * DK * DV * 4
        copies = cycle_copies(ssm_bytes)
        ssm = [b.ssm_state.clone() for _ in range(copies)]
        conv = [b.conv_state.clone() for _ in range(copies)]
        us = graph_us(lambda i: kernels.causal_conv1d(*b.conv_args(conv[i])), copies)
        report(case, "causal_conv1d", us, B * CONV_DIM * (2 + 2 + 2 * (KCONV - 1) * 2) + CONV_DIM * KCONV * 2,
               2 * B * CONV_DIM * KCONV)
        nbytes = _delta_bytes(B, B, HK, HV, DK, DV)
        us = graph_us(lambda i: gated_delta.gated_delta_rule_recurrent(*b.delta_args(ssm[i])), copies)
        report(case, "gated_delta_rule recurrent", us, nbytes, _delta_flops_recurrent(B, HV, DK, DV))
        us = graph_us(lambda i: gated_delta.gated_delta_rule_chunked(*b.delta_args(ssm[i])), copies)
        report(case, "gated_delta_rule chunked", us, nbytes, _delta_flops_recurrent(B, HV, DK, DV))
        if fla is not None:
            try:
                us = graph_us(lambda i: _fla_call(fla[1], b, ssm[i]), copies)
                report(case, "fla fused_recurrent (+gather)", us, nbytes, _delta_flops_recurrent(B, HV, DK, DV))
            except Exception as e:  # noqa: BLE001
                print(f"  {case}: fla fused_recurrent not timed: {type(e).__name__}: {e}")
        o = torch.randn(B * HV, DV, device="cuda").to(torch.bfloat16)
        us = graph_us(lambda i: kernels.gated_rms_norm(o, b.z, b.norm_w, 1e-6), 1)
        report(case, "gated_rms_norm", us, 3 * B * HV * DV * 2, 8 * B * HV * DV)
        del ssm, conv, b
        torch.cuda.empty_cache()

    # A prefill chunk beside decode rows: the dispatch splits it (recurrent for the decode rows).
    b = Batch([2000] + [1] * 127, [False] + [True] * 127, seed=4)
    case = "2000 + 127x1"
    ssm_state = b.ssm_state.clone()
    nbytes = _delta_bytes(b.T, b.B, HK, HV, DK, DV)
    flops = _delta_flops_chunked(2000, HV, DK, DV)
    us = graph_us(lambda i: kernels.gated_delta_rule(*b.delta_args(ssm_state)), 1)
    report(case, "gated_delta_rule (dispatch)", us, nbytes, flops)
    us = graph_us(lambda i: gated_delta.gated_delta_rule_chunked(*b.delta_args(ssm_state)), 1)
    report(case, "gated_delta_rule chunked", us, nbytes, flops)
    del b
    torch.cuda.empty_cache()

    T = 8192
    case = f"prefill {T}"
    b = Batch([T], [False], seed=3)
    conv_state, ssm_state = b.conv_state.clone(), b.ssm_state.clone()
    us = graph_us(lambda i: kernels.causal_conv1d(*b.conv_args(conv_state)), 1)
    report(case, "causal_conv1d", us, T * CONV_DIM * 4 + CONV_DIM * KCONV * 2, 2 * T * CONV_DIM * KCONV)
    nbytes = _delta_bytes(T, 1, HK, HV, DK, DV)
    flops = _delta_flops_chunked(T, HV, DK, DV)
    us = graph_us(lambda i: gated_delta.gated_delta_rule_chunked(*b.delta_args(ssm_state)), 1)
    report(case, "gated_delta_rule chunked", us, nbytes, flops)
    if not quick:
        gated_delta.gated_delta_rule_recurrent(*b.delta_args(ssm_state))  # compiles this variant
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gated_delta.gated_delta_rule_recurrent(*b.delta_args(ssm_state))
        torch.cuda.synchronize()
        report(case, "gated_delta_rule recurrent (1 run)", (time.perf_counter() - t0) * 1e6, nbytes,
               _delta_flops_recurrent(T, HV, DK, DV))
    if fla is not None:
        try:
            _fla_call(fla[0], b, ssm_state)  # fla autotunes on its first calls, outside the graph
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                _fla_call(fla[0], b, ssm_state)
            end.record()
            torch.cuda.synchronize()
            report(case, "fla chunk (eager, +gather)", start.elapsed_time(end) * 100, nbytes, flops)
        except Exception as e:  # noqa: BLE001
            print(f"  {case}: fla chunk not timed: {type(e).__name__}: {e}")
    o = torch.randn(T * HV, DV, device="cuda").to(torch.bfloat16)
    us = graph_us(lambda i: kernels.gated_rms_norm(o, b.z, b.norm_w, 1e-6), 1)
    report(case, "gated_rms_norm", us, 3 * T * HV * DV * 2, 8 * T * HV * DV)
    results["times"] = rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--quick", action="store_true", help="decode at 1 and 32 only, no recurrent 8k prefill")
    p.add_argument("--no-fla", action="store_true", help="leave fla-core out even if it imports")
    p.add_argument("--tflops", type=float, default=790.0, help="the FLOP floor's rate (dense bf16 peak)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    results: dict = {"device": torch.cuda.get_device_name(), "shapes": dict(Hk=HK, Hv=HV, Dk=DK, Dv=DV, K=KCONV,
                                                                             conv_dim=CONV_DIM)}
    print(f"{results['device']}: Hk {HK}, Hv {HV}, Dk {DK}, Dv {DV}, conv kernel {KCONV}, conv dim {CONV_DIM}, bf16")
    ok = True
    try:
        print("checks (Triton vs reference on the GPU):")
        ok = check(results, not args.no_fla)
        print("times (CUDA-graph replay):")
        timing(results, args.quick, not args.no_fla, args.tflops)
    except Exception:  # noqa: BLE001 - report what was measured
        traceback.print_exc()
        ok = False
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
