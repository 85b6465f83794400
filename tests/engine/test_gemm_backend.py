"""The BLAS library a decode graph is captured under (``engine/gemm_backend.py``).

On CPU: the setting's parsing and per-size choice, the preference put back after a block
(also when it raises), ``auto`` keeping the fastest graph only past its margin, and the
capture hook leaving CPU alone. On the GPU (marker ``gpu``): graphs captured under
cuBLASLt and under ``auto`` replay to what the same code gives eagerly."""
from __future__ import annotations

import pytest
import torch

from engine import gemm_backend as gb


def test_parse_and_library_for():
    assert gb.parse(None) is None and gb.parse(" ") is None
    assert gb.parse("auto") == "auto" and gb.parse("CUBLASLT") == "cublaslt"
    table = gb.parse("256:cublas, 8:cublaslt")
    assert table == [(8, "cublaslt"), (256, "cublas")]
    assert [gb.library_for(table, r) for r in (1, 8, 9, 256, 512)] == ["cublaslt"] * 2 + ["cublas"] * 3
    assert gb.library_for(None, 4) is None and gb.library_for("auto", 4) == "auto"
    for bad in ("cublass", "8:ck", "x:cublas", "8cublas"):
        with pytest.raises(ValueError, match=gb.BLAS_ENV):
            gb.parse(bad)


def test_table_text_merges_runs():
    assert gb.table_text({1: "cublaslt", 2: "cublaslt", 4: "cublas", 8: "cublas", 16: "cublaslt"}) == \
        "2:cublaslt,8:cublas,16:cublaslt"
    assert gb.table_text({1: "cublas", 256: "cublas"}) == "cublas"
    winners = {1: "cublaslt", 8: "cublaslt", 32: "cublas", 256: "cublas"}
    table = gb.parse(gb.table_text(winners))
    assert all(gb.library_for(table, m) == lib for m, lib in winners.items())
    assert gb.library_for(table, 24) == "cublas"  # between two measured sizes: the larger one's


class _FakePreference:
    """torch.backends.cuda.preferred_blas_library without CUDA: records what was set."""

    def __init__(self, monkeypatch, now="cublas", refuse=()):
        self.now, self.refuse, self.calls = now, refuse, []
        monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", self)
        monkeypatch.setattr(torch.backends.cuda, "_BlasBackends", {"cublas": "cublas", "cublaslt": "cublaslt"})

    def __call__(self, backend=None):
        if backend is not None:
            if backend in self.refuse:
                raise RuntimeError(f"not compiled with {backend}")
            self.calls.append(backend)
            self.now = backend
        return self.now


def test_prefer_puts_back_the_preference(monkeypatch):
    pref = _FakePreference(monkeypatch)
    with gb.prefer("cublaslt", "cuda:0"):
        assert pref.now == "cublaslt"
    assert pref.now == "cublas"
    with pytest.raises(KeyError):
        with gb.prefer("cublaslt"):
            raise KeyError
    assert pref.now == "cublas" and pref.calls == ["cublaslt", "cublas"] * 2
    with gb.prefer("cublaslt", "cpu"), gb.prefer(None):  # nothing off CUDA or for None
        pass
    assert len(pref.calls) == 4


def test_real_preference_readable_without_cuda():
    """The real getter answers on a CPU build (setting cuBLASLt there raises: ``available``)."""
    before = torch.backends.cuda.preferred_blas_library()
    assert gb.current() in ("default", "cublas", "cublaslt", "ck")
    assert isinstance(gb.available("cublaslt"), bool)
    assert torch.backends.cuda.preferred_blas_library() == before


def test_fastest_needs_its_margin():
    graphs = {"cublas": 10.0, "cublaslt": 9.95}  # 0.5% faster: noise, the default stays
    assert gb.fastest(graphs, time_ms=lambda g: g) == "cublas"
    graphs = {"cublas": 10.0, "cublaslt": 9.5}
    assert gb.fastest(graphs, time_ms=lambda g: g) == "cublaslt"
    order = []
    gb.fastest({"a": 1.0, "b": 2.0}, time_ms=lambda g: order.append(g) or g)
    assert order == [1.0, 2.0] * gb.AUTO_ROUNDS  # interleaved, the same count each


def test_capture_under_each_setting(monkeypatch):
    pref = _FakePreference(monkeypatch)
    seen = []

    def capture_one():
        seen.append(pref.now)
        return f"graph-{pref.now}"

    assert gb.capture(capture_one, 8, "cpu", "cublaslt") == "graph-cublas" and seen == ["cublas"]  # CPU: as is
    monkeypatch.setenv(gb.BLAS_ENV, "cublaslt")  # read by the runtime config only, never at capture
    assert gb.capture(capture_one, 8, "cuda") == "graph-cublas"  # unset: the preference untouched
    assert pref.calls == []
    table = "8:cublaslt,256:cublas"
    assert gb.capture(capture_one, 4, "cuda", table) == "graph-cublaslt" and pref.now == "cublas"
    assert gb.capture(capture_one, 16, "cuda", table) == "graph-cublas" and gb.chosen[16] == "cublas"
    times = {"graph-cublas": 2.0, "graph-cublaslt": 1.0}
    monkeypatch.setattr(gb, "_replay_ms", lambda g: times[g])
    seen.clear()
    assert gb.capture(capture_one, 32, "cuda", "auto") == "graph-cublaslt" and seen == ["cublas", "cublaslt"]
    assert gb.chosen[32] == "cublaslt" and pref.now == "cublas"


def test_capture_skips_a_library_the_build_lacks(monkeypatch):
    pref = _FakePreference(monkeypatch, refuse=("cublaslt",))
    monkeypatch.setattr(gb, "_replay_ms", lambda g: pytest.fail("one candidate: nothing to time"))
    assert gb.capture(lambda: f"graph-{pref.now}", 1, "cuda", "auto") == "graph-cublas"
    assert gb.capture(lambda: f"graph-{pref.now}", 1, "cuda", "cublaslt") == "graph-cublas"
    assert pref.now == "cublas"


def test_bench_floor_is_bytes_or_flops():
    from bench.gemm_choice import BF16_PEAK, COPY_BW, _winner, floor_us

    assert _winner({"cublas": 100.0, "cublaslt": 99.5}, "cublas") == "cublas"  # inside the margin
    assert _winner({"cublas": 100.0, "cublaslt": 95.0}, "cublas") == "cublaslt"
    assert _winner({"cublaslt": 95.0, "default": 96.0}, "cublas") == "cublaslt"  # the process's failed

    assert floor_us(1, 4096, 4096) == pytest.approx(2 * (4096 * 4096 + 2 * 4096) / COPY_BW * 1e6)
    assert floor_us(256, 4096, 128256) == pytest.approx(2 * 256 * 4096 * 128256 / BF16_PEAK * 1e6)  # compute


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting", ["cublaslt", "auto"])
def test_graphs_under_a_blas_library_match_eager_bf16(tiny_llama_dir, monkeypatch, setting):
    """Every graph replays to the captured code run eagerly on the same padded buffers, under
    the library it was captured under (a kernel choice the graph lost would show here) and,
    within bf16 rounding, under the process's own."""
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

    from .test_cuda_graphs_gpu import _prefill, _prompts, replay_decode

    monkeypatch.setenv(gb.BLAS_ENV, setting)
    gb.chosen.clear()
    before = torch.backends.cuda.preferred_blas_library()
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), dtype="bfloat16",
                                                   kv_cache_memory="64MiB", max_num_seqs=32,
                                                   async_scheduling=False))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.use_graphs
    assert torch.backends.cuda.preferred_blas_library() == before  # capture put it back
    # every graph, decode and mixed-step (keyed by its rows: a mixed bucket by its tokens)
    assert set(gb.chosen) == set(graphs.sizes) | set(graphs.mixed_sizes), gb.chosen
    if setting == "cublaslt":
        assert set(gb.chosen.values()) == {"cublaslt"}
    _prefill(engine, _prompts(384, [3 + 11 * i for i in range(19)]), 8)  # 19 rows: the graph of 24
    with torch.inference_mode():
        out = engine.scheduler.schedule()
        replayed = replay_decode(graphs, out.scheduled).clone()
        with gb.prefer(gb.chosen[24]):
            same = graphs._forward(24, graphs.last_splits)[:19]
        default = graphs._forward(24, graphs.last_splits)[:19]
    rel = ((replayed - same).norm() / same.norm()).item()
    assert rel < 1e-3, (gb.chosen[24], rel)
    rel_default = ((replayed - default).norm() / default.norm()).item()
    assert rel_default < 0.08, rel_default
    print(setting, gb.chosen, "replay vs eager (same library)", rel, "vs eager (process default)", rel_default)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_keeps_the_kernels_of_the_library_it_was_captured_under():
    """32 x 4096 -> 4096 bf16 (the o projection of a 32-row decode batch): on an H200 with
    torch 2.11 cuBLASLt and cuBLAS give different bits here (bench.gemm_choice: max |diff|
    0.016), so a replay equal to the cuBLASLt output bit for bit, after the preference was put
    back to cuBLAS, is the cuBLASLt kernel."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    out = torch.empty(32, 4096, device="cuda", dtype=torch.bfloat16)
    eager = {}
    for lib in ("cublas", "cublaslt"):
        with gb.prefer(lib):
            eager[lib] = F.linear(x, w)

    def capture_one():
        out.copy_(F.linear(x, w))  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(F.linear(x, w))
        return graph

    for lib in ("cublaslt", "cublas"):
        before = torch.backends.cuda.preferred_blas_library()
        graph = gb.capture(capture_one, 32, "cuda", lib)
        assert torch.backends.cuda.preferred_blas_library() == before
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[lib]), lib
    print("cuBLAS and cuBLASLt outputs differ:", not torch.equal(eager["cublas"], eager["cublaslt"]),
          (eager["cublas"].float() - eager["cublaslt"].float()).abs().max().item())
