"""The compiled CPU attention (kernels/cpu_attention.py) against the reference:
random mixed batches (decode rows, chunks over a paged prefix, empty rows) with
block tables in random order, GQA ratios, partial last blocks, sliding windows,
attention sinks, 16/32-bit and FP8 caches, and the head dims of each code path
(multiples of 16 with their own loops, other multiples of 16, and the scalar path); the cache
write byte for byte; the fallback when it cannot be built; a build lock left by a killed
build (removed) or held by a live process (waited for within a bound); the engine using it,
loaded at start-up."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from tests.kernels._common import TOLERANCES, has_compiler

from kernels import cpu_attention, reference

FP8 = torch.float8_e4m3fn
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ext():
    if not has_compiler():
        pytest.skip("no C++ compiler: the CPU attention runs the reference (tested below)")
    module = cpu_attention.extension()
    assert module is not None, f"the compiled CPU attention did not build: {cpu_attention.unavailable_reason()}"
    return module


def _batch(rng: random.Random, gen: torch.Generator, *, dtype, cache_dtype, head_dim, num_kv_heads, group,
           block_size, seqs):
    """seqs: (cached tokens, new tokens) per sequence. The cache has the engine's layout
    ([num_blocks, 2, block_size, H, D], K and V views of it), its blocks handed out in
    random order; blocks no sequence owns, and the slots past each sequence's end, are
    NaN (a read of them poisons the output), table padding is -1 or an unowned block.
    q is a view of a fused qkv projection (not contiguous)."""
    lens = [c + n for c, n in seqs]
    owned = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(owned) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    spare = pool[sum(owned):]
    kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
    width = max(owned, default=0) + rng.randint(0, 3)
    tables = torch.empty((len(seqs), max(width, 1)), dtype=torch.int32)
    for b, (n, nb) in enumerate(zip(lens, owned)):
        mine, pool = pool[:nb], pool[nb:]
        pad = -1 if rng.random() < 0.5 else spare[0]
        tables[b] = torch.tensor(mine + [pad] * (tables.shape[1] - nb))
        for i in range(n):
            kv[mine[i // block_size], :, i % block_size] = torch.randn(2, num_kv_heads, head_dim, generator=gen)
    if cache_dtype == FP8:
        kv = reference.quantize_fp8(kv, 1.0)  # NaN stays NaN in e4m3
    else:
        kv = kv.to(cache_dtype)
    q_lens = [n for _, n in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    hq = num_kv_heads * group
    qkv = torch.randn(int(qsl[-1]), (hq + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :hq * head_dim].view(-1, hq, head_dim)
    return q, kv[:, 0], kv[:, 1], tables, qsl, torch.tensor(lens, dtype=torch.int32)


def _random_case(seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    head_dim = rng.choice([8, 24, 64, 64, 128, 80])  # 8, 24: scalar path; 80: run-time vector loop
    block_size = rng.choice([1, 2, 4, 16, 16, 32])
    kinds = [rng.choice(["decode", "decode", "chunk", "prompt", "empty"]) for _ in range(rng.randint(1, 7))]
    seqs = []
    for kind in kinds:
        ctx = rng.randint(0, 70)
        seqs.append({"decode": (ctx, 1), "chunk": (ctx, rng.randint(2, 40)), "prompt": (0, rng.randint(1, 50)),
                     "empty": (ctx, 0)}[kind])
    if all(n == 0 for _, n in seqs):
        seqs.append((5, 1))
    dtype = rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    cache_dtype = FP8 if rng.random() < 0.2 else dtype
    window = rng.choice([None, None, 1, rng.randint(2, 30)])
    shape = dict(dtype=dtype, cache_dtype=cache_dtype, head_dim=head_dim, num_kv_heads=rng.choice([1, 2, 3]),
                 group=rng.choice([1, 2, 3, 4, 5]), block_size=block_size, seqs=seqs)
    return rng, gen, shape, window


@pytest.mark.parametrize("seed", range(40))
def test_paged_attention_matches_the_reference_at_random_shapes(ext, seed):
    rng, gen, shape, window = _random_case(seed)
    args = _batch(rng, gen, **shape)
    scales = dict(k_scale=0.7, v_scale=1.3) if shape["cache_dtype"] == FP8 else {}
    # odd seeds: attention sinks too (tests/kernels/test_attention_sinks.py checks them against their formula)
    sinks = torch.randn(args[0].shape[1], generator=gen) + 2.0 if seed % 2 else None
    want = reference.paged_attention(*args, 0.3, sliding_window=window, sinks=sinks, **scales)
    got = cpu_attention.paged_attention(*args, 0.3, sliding_window=window, sinks=sinks, **scales)
    rows = int(args[4][-1])
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got[:rows].isnan().any()
    atol, rtol = TOLERANCES[shape["dtype"]]
    torch.testing.assert_close(got[:rows], want[:rows], atol=atol, rtol=rtol,
                               msg=lambda m: f"{shape} window={window} sinks={sinks is not None}: {m}")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_decode_step_of_the_default_model_shape(ext, head_dim):
    """32 decode rows of 150-250 tokens, 9 query / 3 kv heads, 16-token blocks: the CPU
    benchmark's step (and the other head dim with its own loop)."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    args = _batch(rng, gen, dtype=torch.float32, cache_dtype=torch.float32, head_dim=head_dim, num_kv_heads=3,
                  group=3, block_size=16, seqs=[(rng.randint(150, 250), 1) for _ in range(32)])
    want = reference.paged_attention(*args, head_dim ** -0.5)
    torch.testing.assert_close(cpu_attention.paged_attention(*args, head_dim ** -0.5), want, atol=2e-5, rtol=2e-5)


def test_one_long_sequence_split_over_kv_heads(ext):
    """Fewer sequences than threads: the work is split by kv head."""
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    for seqs in ([(900, 1)], [(300, 200)]):
        args = _batch(rng, gen, dtype=torch.float32, cache_dtype=torch.float32, head_dim=64, num_kv_heads=4,
                      group=2, block_size=16, seqs=seqs)
        for window in (None, 100):
            want = reference.paged_attention(*args, 0.125, sliding_window=window)
            got = cpu_attention.paged_attention(*args, 0.125, sliding_window=window)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_block_id_outside_the_cache_is_an_error(ext):
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    q, kc, vc, tables, qsl, lens = _batch(rng, gen, dtype=torch.float32, cache_dtype=torch.float32, head_dim=16,
                                          num_kv_heads=1, group=1, block_size=4, seqs=[(6, 1)])
    tables[0, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_attention.paged_attention(q, kc, vc, tables, qsl, lens, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        cpu_attention.paged_attention(q, kc, vc, tables, qsl, lens, 1.0, sliding_window=0)


def test_only_the_blocks_a_window_reads_are_checked(ext):
    """A block before the window is never read, so its id is not checked; the first block
    the window reaches is."""
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    q, kc, vc, tables, qsl, lens = _batch(rng, gen, dtype=torch.float32, cache_dtype=torch.float32, head_dim=16,
                                          num_kv_heads=1, group=1, block_size=4, seqs=[(11, 1)])
    want = reference.paged_attention(q, kc, vc, tables, qsl, lens, 1.0, sliding_window=4)  # keys 8..11
    tables[0, 1] = kc.shape[0]  # keys 4..7: outside the window
    torch.testing.assert_close(cpu_attention.paged_attention(q, kc, vc, tables, qsl, lens, 1.0, sliding_window=4), want)
    with pytest.raises(RuntimeError, match="outside the cache"):  # the window of 5 reaches key 7
        cpu_attention.paged_attention(q, kc, vc, tables, qsl, lens, 1.0, sliding_window=5)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.bfloat16), (torch.float32, FP8),
                                               (torch.bfloat16, FP8)])
def test_store_kv_cache_writes_the_references_bytes(ext, dtype, cache_dtype):
    gen = torch.Generator().manual_seed(4)
    num_blocks, bs, heads, d, tokens = 9, 4, 3, 32, 14
    kv = torch.randn(num_blocks, 2, bs, heads, d, generator=gen).to(cache_dtype)
    mine = kv.clone()
    qkv = (torch.randn(tokens, 5 * heads * d, generator=gen) * 3).to(dtype)  # K/V: views of a fused projection
    key, value = qkv[:, :heads * d].view(tokens, heads, d), qkv[:, 2 * heads * d:3 * heads * d].view(tokens, heads, d)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[[2, 9]] = -1  # skipped
    scales = dict(k_scale=0.05, v_scale=2.0) if cache_dtype == FP8 else {}
    reference.store_kv_cache(key, value, kv[:, 0], kv[:, 1], slots, **scales)
    cpu_attention.store_kv_cache(key, value, mine[:, 0], mine[:, 1], slots, **scales)
    assert torch.equal(mine.view(torch.uint8), kv.view(torch.uint8))


def test_store_kv_cache_rejects_a_slot_outside_the_cache(ext):
    kv = torch.zeros(2, 2, 4, 1, 16)
    key = torch.ones(1, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_attention.store_kv_cache(key, key, kv[:, 0], kv[:, 1], torch.tensor([8]))


FALLBACK_CHILD = r"""
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s", stream=sys.stdout)
from kernels import cpu_attention, reference
g = torch.Generator().manual_seed(0)
kv = torch.randn(6, 2, 4, 2, 16, generator=g)
q = torch.randn(3, 4, 16, generator=g)
args = (q, kv[:, 0], kv[:, 1], torch.tensor([[3, 1, 4], [0, 5, 2]], dtype=torch.int32),
        torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([9, 7], dtype=torch.int32), 0.25)
same = [torch.equal(cpu_attention.paged_attention(*args), reference.paged_attention(*args)) for _ in range(3)]
print(json.dumps({"same": same, "reason": cpu_attention.unavailable_reason()}))
"""


@pytest.mark.parametrize("broken", ["CXX", "source"])
def test_without_a_build_it_runs_the_reference_and_says_why_once(tmp_path, broken):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), PYTHONPATH=REPO)
    if broken == "CXX":
        env["CXX"] = str(tmp_path / "no-such-compiler")
    else:  # a compiler that fails on the source (torch asks the real one for its version)
        fake = tmp_path / "cxx"
        # (both of the library's sources: ninja waits for a compile under way when another fails)
        fake.write_text("#!/bin/sh\ncase \"$*\" in *paged_attention.cpp*|*elementwise.cpp*)\n"
                        "  echo 'paged_attention.cpp:1:1: error: broken on purpose' >&2; exit 1;;\n"
                        "esac\nexec c++ \"$@\"\n")
        fake.chmod(0o755)
        env["CXX"] = str(fake)
        if not any(os.access(os.path.join(d, "ninja"), os.X_OK) for d in os.get_exec_path()):
            pytest.skip("ninja is not on PATH: the build is not tried")
    child = subprocess.run([sys.executable, "-c", FALLBACK_CHILD], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["same"] == [True, True, True]
    logged = [ln for ln in lines[:-1] if "compiled CPU attention unavailable" in ln]
    assert len(logged) == 1, child.stdout
    want = "no C++ compiler" if broken == "CXX" else "error: broken on purpose"
    assert want in result["reason"] and want in logged[0]


LOAD_CHILD = r"""
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout)
from kernels import cpu_attention
t0 = time.monotonic()
loaded = cpu_attention.extension(float(sys.argv[1]) if len(sys.argv) > 1 else None) is not None
print(json.dumps({"loaded": loaded, "reason": cpu_attention.unavailable_reason(), "seconds": time.monotonic() - t0}))
"""
# A build's lock as torch's FileBaton takes it (O_CREAT | O_EXCL, kept open while it builds).
HOLD_LOCK = ("import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('locked', flush=True); "
             "time.sleep(600)")


def _built_copy(tmp_path):
    """An extensions folder holding a copy of the built extension (ninja finds it up to date:
    no compile), the environment that points a child at it, and its torch lock file's path."""
    from torch.utils import cpp_extension

    src = cpp_extension._get_build_directory(cpu_attention._NAME, verbose=False)
    dst = tmp_path / "ext" / cpu_attention._NAME
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lock", "pdserve-build.lock"))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), PYTHONPATH=REPO)
    return env, str(dst / "lock")


def _hold_lock(lock: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, lock], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def _load_in_child(env: dict, timeout: float, build_timeout: float | None = None) -> tuple[dict, list[str]]:
    args = [] if build_timeout is None else [str(build_timeout)]
    child = subprocess.run([sys.executable, "-c", LOAD_CHILD, *args], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=timeout)
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


def test_a_stale_build_lock_left_by_a_killed_build_is_removed_and_the_load_completes(ext, tmp_path):
    """torch waits for its build lock without bound, and a build killed midway leaves it: the
    next load finds no live process holding it, removes it with one log line, and loads."""
    env, lock = _built_copy(tmp_path)
    holder = _hold_lock(lock)
    holder.kill()
    holder.wait()
    assert os.path.exists(lock)
    result, logged = _load_in_child(env, timeout=120)  # it waited forever before
    assert result["loaded"] and result["reason"] is None, (result, logged)
    removed = [ln for ln in logged if "removed the stale build lock" in ln]
    assert len(removed) == 1 and lock in removed[0], logged
    assert not os.path.exists(lock)


def test_a_build_lock_held_by_a_live_process_is_waited_for_within_the_limit_then_the_reference_runs(ext, tmp_path):
    """A lock a live process holds is not removed: the load waits for it at most
    the build timeout (PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT, which the engine passes on), then
    the references run, and one log line says why (the lock, its holder)."""
    env, lock = _built_copy(tmp_path)
    holder = _hold_lock(lock)
    try:
        result, logged = _load_in_child(env, timeout=120, build_timeout=2)
    finally:
        holder.kill()
        holder.wait()
    assert not result["loaded"] and 2 <= result["seconds"] < 30, result
    reason = result["reason"]
    assert "did not end within 2 s" in reason and lock in reason and f"pid {holder.pid}" in reason, reason
    unavailable = [ln for ln in logged if "compiled CPU attention unavailable" in ln]
    assert len(unavailable) == 1 and reason in unavailable[0], logged
    assert not any("removed the stale build lock" in ln for ln in logged), logged
    assert os.path.exists(lock)  # its holder's, not ours to remove


def test_the_engine_runs_it_on_cpu(ext, tmp_path, monkeypatch):
    """The model's attention layers call the compiled attention on CPU (the reference
    ops module), and greedy tokens equal those of the reference attention."""
    from tests.conftest import make_tiny_model

    from engine import LLM, SamplingParams

    model_dir = make_tiny_model(tmp_path / "tiny", seed=5)
    prompts = [[5, 9, 33, 7, 100, 3, 41], [12, 8], list(range(20, 58))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    calls = {"n": 0}
    compiled = ext.paged_attention

    class Counting:
        def __getattr__(self, name):
            return getattr(ext, name)

        def paged_attention(self, *args):
            calls["n"] += 1
            return compiled(*args)

    def generate() -> list[list[int]]:
        # Built with the extension in place: the layers run as direct calls of it where they can
        # (engine/models/llama_cpu.py), through its wrapper otherwise; without it, the reference.
        llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
                  kv_cache_memory="2MiB")
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    monkeypatch.setitem(cpu_attention._state, "module", Counting())
    ours = generate()
    assert calls["n"] > 0
    monkeypatch.setitem(cpu_attention._state, "module", None)  # every call to the reference
    assert generate() == ours


def test_the_engine_loads_it_at_start_up_not_in_its_first_step(ext, tmp_path, monkeypatch):
    """A build (a minute) or load inside a step holds that step, and every abort and deadline
    queued behind it: a request cancelled while it prefilled kept its blocks for the whole build
    (tests/e2e/test_cancellation.py). The model runner loads it before the engine serves."""
    from tests.conftest import make_tiny_model

    from engine import LLM

    loads = []
    monkeypatch.delitem(cpu_attention._state, "module")
    monkeypatch.delitem(cpu_attention._state, "reason")
    monkeypatch.setattr(cpu_attention, "_load", lambda timeout: loads.append(timeout) or (ext, None))
    LLM(str(make_tiny_model(tmp_path / "tiny", seed=5)), dtype="float32", device="cpu", block_size=4,
        kv_cache_memory="2MiB")
    assert loads == [cpu_attention.DEFAULT_BUILD_TIMEOUT_S] and cpu_attention._state["module"] is ext
