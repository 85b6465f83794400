"""The disk tier of the KV cache (--kv-offloading-path, engine/kv_disk_tier.py): blocks the host
tier drops are written to files named by their prefix hash, and a prefix lookup that misses the
device and the host reads them back, bit for bit, on this server or another sharing the
directory; files that do not verify are refused, counted and recomputed."""
from __future__ import annotations

import argparse
import errno
import logging
import itertools
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine import kv_disk_tier
from engine.block_hash import leading_run
from engine.config import EngineArgs
from engine.kv_disk_tier import DiskKVTier
from engine.request import RequestStatus
from kv_transfer.layout import engine_layout
from rpc.engine_metrics import _SchedulerCollector
from tests.engine.families import make_family_model, random_prompts
from tests.engine.test_kv_offload import _greedy, _hashes

BS = 4  # block size of the engine tests
BLOCK_BYTES = 3 * 2 * BS * 2 * 16 * 4  # the tiny model's block: 3 layers x K,V x 4 tokens x 2 heads x 16 x fp32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("disk") / "qwen3", "qwen3", seed=3)


@pytest.fixture
def engines():
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.engine.close()


def _llm(made: list[LLM], model, path: Path | None, device_blocks: int = 16, host_blocks: int = 12,
         disk_gib: float = 1.0, **kw) -> LLM:
    extra = dict(kv_offloading_path=str(path), kv_offloading_disk_size=disk_gib) if path is not None else {}
    llm = LLM(str(model), block_size=BS, num_gpu_blocks_override=device_blocks, max_num_batched_tokens=64,
              kv_offloading_size=host_blocks * BLOCK_BYTES / 2**30, dtype="float32", **extra, **kw)
    made.append(llm)
    return llm


def _disk(llm: LLM) -> DiskKVTier:
    disk = llm.engine.host_kv.disk
    assert disk is not None
    return disk


def _payload(path: Path) -> bytes:
    data = path.read_bytes()
    return data[len(data) - BLOCK_BYTES:]


def _push_to_disk(llm: LLM, prompt: list[int], n: int, seed: int = 11) -> tuple[list[int], list[torch.Tensor]]:
    """Run ``prompt``, then others until its first ``n`` blocks left the device and the host for
    the disk: its greedy tokens, and the KV of those blocks as first computed."""
    first = _greedy(llm, [prompt])[0]
    assert first.num_cached_tokens == 0
    kv, host, disk = llm.engine.scheduler.kv, llm.engine.host_kv, _disk(llm)
    hashes = _hashes(llm, prompt, n)
    fresh = [llm.engine.runner.kv_cache[:, kv.pool.cached[h].block_id].to("cpu", copy=True) for h in hashes]
    for p in random_prompts([40] * 5, seed=seed):  # 5 x 11 blocks through 16 device + 12 host ones
        _greedy(llm, [p])
    disk.drain()
    assert not any(h in kv.pool.cached or h in host for h in hashes)
    assert all(disk.file_of(h).is_file() for h in hashes)
    return first.outputs[0].token_ids, fresh


def _assert_no_leaks(llm: LLM) -> None:
    kv, host = llm.engine.scheduler.kv, llm.engine.host_kv
    host.drain_reads()  # (reads a request stopped waiting for end as cached host blocks)
    assert host.num_reads_in_flight == 0
    assert not llm.engine.scheduler._disk_waits
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert not kv._host_hits
    host.check()
    assert host.num_pending_copies == 0 and not host._pinned and not host._pending
    disk = host.disk
    if disk is not None:
        disk.drain()
        assert disk._queue.unfinished_tasks == 0
        assert sorted(disk._free_staging) == list(range(disk._staging.shape[0]))  # every staging buffer back


def test_spilled_prefix_reloads_from_disk_exactly(model, tmp_path, engines):
    """A prompt's blocks leave the device, then the host, for files; the prompt again reads them
    back: the files hold the KV as computed, the device gets it bit for bit, the tokens are the
    uncached run's, and the hits are counted per tier."""
    llm = _llm(engines, model, tmp_path)
    prompt = random_prompts([40], seed=7)[0]
    want, fresh = _push_to_disk(llm, prompt, 9)
    disk = _disk(llm)
    hashes = _hashes(llm, prompt, 9)
    for h, block in zip(hashes, fresh):  # the file's payload is the block's bytes
        assert _payload(disk.file_of(h)) == block.numpy().tobytes()
    stored, host = disk.stored_blocks_total, llm.engine.host_kv
    assert stored >= 9 and disk.written_bytes_total == stored * disk.file_bytes

    again = _greedy(llm, [prompt])[0]
    assert again.num_cached_tokens == 36
    assert again.outputs[0].token_ids == want
    kv = llm.engine.scheduler.kv
    for h, block in zip(hashes, fresh):
        assert torch.equal(llm.engine.runner.kv_cache[:, kv.pool.cached[h].block_id].cpu(), block)
    assert disk.loaded_blocks_total == 9 and disk.read_bytes_total == 9 * disk.file_bytes
    s = llm.engine.stats()
    assert s.disk_kv is not None and s.disk_kv.loaded_blocks_total == 9
    assert s.host_kv_loaded_total >= 9  # (disk hits load from the host tier like its own)
    flat = {m.name: m.samples for m in _SchedulerCollector(llm.engine, {"role": "t"}).collect()}
    assert flat["pdserve:kv_offload_disk_loaded_blocks"][0].value == 9
    assert flat["pdserve:kv_offload_disk_hit_tokens"][0].value == 36
    assert flat["pdserve:kv_offload_disk_stored_blocks"][0].value == disk.stored_blocks_total
    assert flat["pdserve:kv_offload_disk_written_bytes"][0].value == disk.written_bytes_total
    assert {x.labels["cause"]: x.value for x in flat["pdserve:kv_offload_disk_errors"]} == \
        {c: 0 for c in kv_disk_tier.CAUSES}
    # The hit by source: all 36 tokens from disk, none from host memory or the device cache.
    assert s.prefix_hits_by_source == {"device": 0, "host": 0, "disk": 36}
    assert {x.labels["source"]: x.value for x in flat["pdserve:prompt_tokens_cached_by_source"]} == \
        {"device": 0, "host": 0, "disk": 36}
    assert flat["pdserve:external_prefix_cache_hits"][0].value == 36
    assert flat["pdserve:prefix_cache_hits"][0].value == 0
    # Once read, the blocks are host blocks: a prompt sharing them, after some left the device
    # again, hits host memory for those still there (a block read from disk is a disk hit once).
    _greedy(llm, random_prompts([40], seed=12))
    on_device = leading_run(hashes, kv.pool.cached)
    in_host = leading_run(hashes[on_device:], host)
    assert on_device < 9 and in_host > 0
    assert _greedy(llm, [prompt[:36] + [5] * 8])[0].num_cached_tokens == 36
    assert llm.engine.stats().prefix_hits_by_source == {
        "device": BS * on_device, "host": BS * in_host, "disk": 36 + BS * (9 - on_device - in_host)}
    _assert_no_leaks(llm)


def test_second_server_serves_a_prefix_the_first_computed(model, tmp_path, engines):
    """Two engines sharing the directory: the second, started after the first spilled a prompt,
    serves it from disk (cached tokens, the first's greedy tokens), and a restarted first
    engine too."""
    a = _llm(engines, model, tmp_path)
    prompt = random_prompts([40], seed=8)[0]
    want, _ = _push_to_disk(a, prompt, 9)
    b = _llm(engines, model, tmp_path)
    assert _disk(b).layout_id == _disk(a).layout_id and _disk(b).lookup(_hashes(b, prompt, 9)) == 9
    out = _greedy(b, [prompt])[0]
    assert out.num_cached_tokens == 36 and out.outputs[0].token_ids == want
    assert _disk(b).loaded_blocks_total == 9 and _disk(b).stored_blocks_total == 0
    a.engine.close()
    restarted = _llm(engines, model, tmp_path)
    out = _greedy(restarted, [prompt])[0]
    assert out.num_cached_tokens == 36 and out.outputs[0].token_ids == want
    for llm in (b, restarted):
        _assert_no_leaks(llm)


def _foreign(tmp_path: Path, ours: DiskKVTier, block_hash: int, **changes) -> Path:
    """A file written by a tier of another layout (the record with ``changes``) for ``block_hash``."""
    record = {**__import__("json").loads(ours.record), **changes}
    shape = (3, 2, record["block_size"], 2, 16)
    dtype = getattr(torch, record["dtype"])
    tier = DiskKVTier(tmp_path / "foreign", 2**20, record, shape, dtype)
    tier.spill(block_hash, torch.ones(shape, dtype=dtype))
    tier.drain()
    tier.close()
    return tier.file_of(block_hash)


def test_bad_files_are_refused_counted_and_recomputed(model, tmp_path, engines, caplog):
    """A restarted server meets files it cannot verify: truncated, corrupt (payload, name),
    another format version, another layout (another model, dtype, block size), unreadable.
    Each is refused at its block (the hit stops there), counted by cause, logged once per
    cause, removed (not the unreadable one), and the request gets the uncached tokens."""
    a = _llm(engines, model, tmp_path)
    prompt = random_prompts([40], seed=9)[0]
    want, _ = _push_to_disk(a, prompt, 9)
    a.engine.close()
    ours = _disk(a)
    files = [ours.file_of(h) for h in _hashes(a, prompt, 9)]
    pristine = [f.read_bytes() for f in files]

    def flip(at: int):
        def damage(path: Path) -> None:
            data = bytearray(path.read_bytes())
            data[at] ^= 0x40
            path.write_bytes(bytes(data))
        return damage

    def replace_with(source: Path):
        def damage(path: Path) -> None:
            path.write_bytes(source.read_bytes())
        return damage

    def unreadable(path: Path) -> None:
        path.unlink()
        path.mkdir()  # (root reads any mode: a directory under the name fails open alike)

    cases = [  # (block damaged, damage, cause)
        (8, lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
        (7, lambda p: p.write_bytes(p.read_bytes()[:20]), "truncated"),
        (6, flip(-1), "corrupt"),  # the payload's last byte
        (5, replace_with(files[4]), "corrupt"),  # another block's file under this name
        (4, flip(8), "version"),
        (3, replace_with(_foreign(tmp_path, ours, 0, model="other")), "layout"),
        (2, replace_with(_foreign(tmp_path, ours, 0, dtype="float16")), "layout"),
        (1, replace_with(_foreign(tmp_path, ours, 0, block_size=8)), "layout"),
        (0, unreadable, "read"),
    ]
    caplog.set_level(logging.WARNING, logger="engine.kv_disk_tier")
    for block, damage, cause in cases:
        for f, data in zip(files, pristine):  # (each case: the other files intact)
            if f.is_dir():
                f.rmdir()
            f.write_bytes(data)
        damage(files[block])
        llm = _llm(engines, model, tmp_path)
        out = _greedy(llm, [prompt])[0]
        assert out.outputs[0].token_ids == want, cause
        assert out.num_cached_tokens == 4 * block, cause
        disk = _disk(llm)
        assert disk.errors == {c: int(c == cause) for c in kv_disk_tier.CAUSES}, (block, cause)
        assert disk.loaded_blocks_total == block
        assert files[block].exists() == (cause == "read"), cause  # refused files are removed
        _assert_no_leaks(llm)
        llm.engine.close()
    warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == len(cases)  # one engine per case: each logs its first refusal of a cause
    assert any("model: 'other' here 'qwen3'" in w for w in warnings)
    assert any("block_size: 8 here 4" in w for w in warnings)


def test_disk_full_is_counted_logged_once_and_served(model, tmp_path, engines, monkeypatch, caplog):
    """Every write fails with ENOSPC: counted, one warning line, nothing left behind, and
    every request still gets its tokens."""
    real_open = open

    def full_open(file, mode="r", *args, **kw):
        if "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real_open(file, mode, *args, **kw)

    ref = _llm(engines, model, None)
    prompts = random_prompts([40] * 6, seed=12)
    want = [o.outputs[0].token_ids for o in _greedy(ref, prompts)]
    monkeypatch.setattr(kv_disk_tier, "open", full_open, raising=False)
    caplog.set_level(logging.WARNING, logger="engine.kv_disk_tier")
    llm = _llm(engines, model, tmp_path)
    got = [_greedy(llm, [p])[0].outputs[0].token_ids for p in prompts]
    disk = _disk(llm)
    disk.drain()
    assert got == want
    assert disk.errors["no_space"] > 1 and disk.stored_blocks_total == 0
    assert sum("ENOSPC" in r.getMessage() for r in caplog.records) == 1
    assert not any(disk.dir.iterdir())  # no temporary file left
    _assert_no_leaks(llm)


def test_directory_bound_holds_under_load(model, tmp_path, engines):
    """Two servers writing one directory far past its bound: after every request it holds at
    most the bound (each cleans up the least recently used files first, the other's included),
    and what is still there still serves."""
    bound = 20 * (BLOCK_BYTES + 400)  # ~20 files
    a = _llm(engines, model, tmp_path, device_blocks=12, host_blocks=4, disk_gib=bound / 2**30)
    b = _llm(engines, model, tmp_path, device_blocks=12, host_blocks=4, disk_gib=bound / 2**30)
    prompts = random_prompts([20] * 24, seed=13)
    for i, p in enumerate(prompts):
        llm = (a, b)[i % 2]
        _greedy(llm, [p])
        _disk(llm).drain()
        _disk((a, b)[1 - i % 2])._rescan()  # (what it would do on its own within rescan_s)
        used = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
        assert used <= bound, i
    stored = _disk(a).stored_blocks_total + _disk(b).stored_blocks_total
    assert stored * _disk(a).file_bytes > 2 * bound
    assert _disk(a).removed_files_total + _disk(b).removed_files_total > 0
    for llm in (a, b):
        _assert_no_leaks(llm)


def test_layout_record_is_the_handshakes(model, tmp_path, engines):
    """The files' layout record holds the P/D handshake's record, field for field, and the
    checkpoint's identity: another checkpoint of the same name and shape gets another layout
    and never reads this one's files."""
    a = _llm(engines, model, tmp_path)
    record = __import__("json").loads(_disk(a).record)
    handshake = engine_layout(a.engine).to_dict()
    assert {k: record[k] for k in handshake} == {k: list(v) if isinstance(v, tuple) else v
                                               for k, v in handshake.items()}
    assert set(record) - set(handshake) == {"checkpoint", "tensor_parallel_size"}
    other = make_family_model(tmp_path.parent / f"{tmp_path.name}-other" / "qwen3", "qwen3", seed=4)
    prompt = random_prompts([40], seed=14)[0]
    _push_to_disk(a, prompt, 9)
    b = _llm(engines, other, tmp_path)
    assert engine_layout(b.engine) == engine_layout(a.engine)  # (the handshake cannot tell them apart)
    assert _disk(b).layout_id != _disk(a).layout_id
    assert _greedy(b, [prompt])[0].num_cached_tokens == 0
    assert _disk(b).errors == {c: 0 for c in kv_disk_tier.CAUSES}


def test_flags(tmp_path):
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--model", "m", "--kv-offloading-size", "2", "--kv-offloading-path", str(tmp_path),
         "--kv-offloading-disk-size", "0.5"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.kv_offloading_path, args.kv_offloading_disk_size) == (str(tmp_path), 0.5)
    from engine.config import CacheConfig

    with pytest.raises(ValueError, match="needs the host tier"):
        CacheConfig(kv_offloading_path=str(tmp_path))
    with pytest.raises(ValueError, match="--kv-offloading-disk-size must be positive"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_path=str(tmp_path), kv_offloading_disk_size=0)
    with pytest.raises(ValueError, match="holds no KV block"):
        DiskKVTier(tmp_path, 100, {"x": 1}, (3, 2, BS, 2, 16), torch.float32)


_ids = itertools.count()


@pytest.fixture(scope="module")
def storm(model, tmp_path_factory):
    llm = LLM(str(model), block_size=BS, num_gpu_blocks_override=12, max_num_batched_tokens=32, dtype="float32",
              kv_offloading_size=4 * BLOCK_BYTES / 2**30, kv_offloading_path=str(tmp_path_factory.mktemp("storm")),
              kv_offloading_disk_size=40 * (BLOCK_BYTES + 400) / 2**30)
    yield llm
    llm.engine.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_leak_in_any_tier_after_cancel_storms(storm, data):
    """Requests sharing prefixes (hits in every tier) arrive, step and are cancelled at random;
    once all are gone, no device or host block is held, no copy is pending, no staging buffer
    is out, and every tier's accounting is whole."""
    llm = storm
    bases = random_prompts([16, 20, 24, 28], seed=15)
    n = data.draw(st.integers(1, 8))
    ids = []
    for i in range(n):
        base = bases[data.draw(st.integers(0, 3))]
        tail = data.draw(st.lists(st.integers(3, 300), min_size=1, max_size=9))
        req = llm.engine.add_request(f"storm-{next(_ids)}", base + tail,
                                     SamplingParams(temperature=0, max_tokens=data.draw(st.integers(1, 12))))
        ids.append(req.request_id)
    for _ in range(data.draw(st.integers(0, 8))):
        llm.engine.step()
        for rid in ids:
            if data.draw(st.booleans()):
                llm.engine.abort_request(rid)
    for rid in ids:
        if data.draw(st.booleans()):
            llm.engine.abort_request(rid)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _assert_no_leaks(llm)


def test_a_block_on_disk_and_back_in_the_host_tier_is_a_host_hit(tmp_path):
    """A prefix whose blocks are all on disk, one of them also in the host tier again (stored
    after its spill): the lookup reads the others from disk and takes that one as the host hit
    it is, keeping every host block accounted for (it used to read it again into a second host
    block and lose the first)."""
    from engine.kv_offload import HostKVTier

    shape = (3, 2, BS, 2, 16)
    host = HostKVTier(4, shape, torch.float32, torch.device("cpu"))
    disk = DiskKVTier(tmp_path, 1 << 30, {"model": "t"}, shape, torch.float32)
    host.attach_disk(disk)
    try:
        blocks = {h: torch.randn(shape) for h in (11, 22, 33)}
        for h, block in blocks.items():
            assert disk.spill(h, block)
        disk.drain()
        slot = host._take_slot()
        host.buffer[slot].copy_(blocks[22])
        host._lru[22] = slot  # 22 is back in the host tier
        assert host.find([11, 22, 33]) == 0  # (11 and 33 are being read, off this thread)
        assert host.reading(11) is not None and host.reading(22) is None and host.reading(33) is not None
        host.check()
        host.drain_reads()
        assert host.find([11, 22, 33]) == 3
        host.check()
        assert host._lru[22] == slot
        for h, block in blocks.items():
            assert torch.equal(host.buffer[host._lru[h]], block)
    finally:
        disk.close()


# ---- reads off the step ------------------------------------------------------------------
class _SlowDisk:
    """Opening a KV block file for reading waits at a gate until ``release`` (the builtin
    ``open`` as the disk tier's module sees it: the OS call, not our code); ``fail``: the
    open then fails with EIO, ``die``: it raises SystemExit (which ends the calling thread)."""

    def __init__(self, monkeypatch, fail: bool = False, die: bool = False, limit_s: float = 20.0) -> None:
        self.gate = threading.Event()
        self.opened: list[str] = []
        self.threads: set[str] = set()
        real_open = open

        def slow_open(file, mode="r", *args, **kw):
            if "r" in mode and str(file).endswith(".kv"):
                self.opened.append(Path(file).name)
                self.threads.add(threading.current_thread().name)
                if not self.gate.wait(limit_s):
                    raise OSError(errno.ETIMEDOUT, "the test's gate was never opened", str(file))
                if die:
                    raise SystemExit("the reader dies")
                if fail:
                    raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))
            return real_open(file, mode, *args, **kw)

        monkeypatch.setattr(kv_disk_tier, "open", slow_open, raising=False)

    def release(self) -> None:
        self.gate.set()


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _until_done(llm: LLM, requests) -> None:
    deadline = time.monotonic() + 60
    while not all(r.is_finished for r in requests):
        assert time.monotonic() < deadline
        if not llm.engine.step().did_work:
            llm.engine.wait_for_background(0.05)


def test_other_requests_step_while_a_prefix_is_read_from_disk(model, tmp_path, engines, monkeypatch):
    """A prompt whose prefix is on disk, its reads slowed down at the OS: it waits in the queue
    (WAITING_FOR_DISK_KV) while a request running before it keeps decoding a token a step and
    one arriving after it is admitted and decodes too; the steps never block on the files.
    Once read, the prompt takes them as disk hits and its tokens and KV are the uncached run's."""
    # (room for all three: no preemption; steps in order, so a step's token is counted in it, on CUDA too)
    llm = _llm(engines, model, tmp_path, device_blocks=32, async_scheduling=False)
    prompt = random_prompts([40], seed=7)[0]
    want, fresh = _push_to_disk(llm, prompt, 9)
    engine, host, disk = llm.engine, llm.engine.host_kv, _disk(llm)
    before = dict(engine.stats().prefix_hits_by_source)
    slow = _SlowDisk(monkeypatch)
    running = engine.add_request("running", random_prompts([12], seed=30)[0], _params(40))
    for _ in range(3):
        engine.step()
    assert running.num_output_tokens == 3
    waiting = engine.add_request("from-disk", prompt, _params(6))
    later = engine.add_request("later", random_prompts([12], seed=31)[0], _params(20))
    steps = 0
    started = time.monotonic()
    while steps < 12:
        t = time.monotonic()
        engine.step()
        assert time.monotonic() - t < 5.0  # (a step that read the files would wait at the gate)
        steps += 1
    assert slow.opened and slow.threads == {"kv-disk-reader"}
    assert waiting.status == RequestStatus.WAITING_FOR_DISK_KV and waiting.num_computed_tokens == 0
    assert waiting in engine.scheduler.waiting and waiting not in engine.scheduler.running
    assert host.num_reads_in_flight > 0 and disk.loaded_blocks_total == 0
    assert running.num_output_tokens == 3 + steps  # one token every step the reads were in flight
    assert later.status == RequestStatus.RUNNING and later.num_output_tokens >= steps - 1
    assert time.monotonic() - started < 30
    host.check()
    slow.release()
    _until_done(llm, [running, waiting, later])
    assert waiting.output_token_ids == want
    assert waiting.num_cached_tokens == 36
    kv = engine.scheduler.kv
    for h, block in zip(_hashes(llm, prompt, 9), fresh):
        assert torch.equal(engine.runner.kv_cache[:, kv.pool.cached[h].block_id].cpu(), block)
    assert disk.loaded_blocks_total == 9
    after = engine.stats().prefix_hits_by_source
    assert after["disk"] - before["disk"] == 36 and after["host"] == before["host"]
    _assert_no_leaks(llm)


def test_aborting_a_request_mid_read_leaks_nothing(model, tmp_path, engines, monkeypatch):
    """The request waiting for its prefix's reads is aborted while they are in flight: it ends
    at once, the host blocks being read stay reserved until the reads end and then are ordinary
    cached host blocks (a later request takes them as disk hits); no block of any tier is lost."""
    llm = _llm(engines, model, tmp_path)
    prompt = random_prompts([40], seed=16)[0]
    want, _ = _push_to_disk(llm, prompt, 9)
    engine, host, disk = llm.engine, llm.engine.host_kv, _disk(llm)
    slow = _SlowDisk(monkeypatch)
    req = engine.add_request("aborted", prompt, _params(4))
    engine.step()
    assert req.status == RequestStatus.WAITING_FOR_DISK_KV
    in_flight = host.num_reads_in_flight
    assert 0 < in_flight <= host.max_reads
    engine.abort_request(req.request_id)
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert not engine.scheduler.requests and not engine.scheduler._disk_waits
    host.check()  # (the blocks read into: reserved, neither free nor cached)
    assert host.num_reads_in_flight == in_flight
    while engine.has_unfinished_requests():
        engine.step()
    slow.release()
    host.drain_reads()
    hashes = _hashes(llm, prompt, 9)
    assert leading_run(hashes, host) == in_flight  # read, and cached here
    _assert_no_leaks(llm)
    before = engine.stats().prefix_hits_by_source["disk"]
    out = _greedy(llm, [prompt])[0]
    assert out.num_cached_tokens == 36 and out.outputs[0].token_ids == want
    assert engine.stats().prefix_hits_by_source["disk"] - before == 36  # each block read is one disk hit
    _assert_no_leaks(llm)


def test_a_failed_read_is_recomputed(model, tmp_path, engines, monkeypatch, caplog):
    """Every read fails at the OS (EIO): counted under "read", the files are kept, the request
    waits only for the failed reads and computes its whole prompt, exactly."""
    llm = _llm(engines, model, tmp_path)
    prompt = random_prompts([40], seed=17)[0]
    want, _ = _push_to_disk(llm, prompt, 9)
    slow = _SlowDisk(monkeypatch, fail=True)
    slow.release()
    caplog.set_level(logging.WARNING, logger="engine.kv_disk_tier")
    out = _greedy(llm, [prompt])[0]
    disk = _disk(llm)
    assert slow.opened and out.num_cached_tokens == 0 and out.outputs[0].token_ids == want
    assert disk.errors["read"] >= 1 and disk.loaded_blocks_total == 0
    assert all(disk.file_of(h).is_file() for h in _hashes(llm, prompt, 9))  # (an I/O error removes nothing)
    assert any("EIO" in r.getMessage() for r in caplog.records)
    _assert_no_leaks(llm)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the reader's death)
def test_a_dead_reader_or_a_hung_read_never_keeps_a_request_waiting(model, tmp_path, engines, monkeypatch,
                                                                     caplog):
    """The reader thread dies mid-read: the waiting request is recomputed at once, the blocks
    reserved for the lost reads are free again, and no read starts any more. A read that hangs
    keeps its request waiting no longer than max_read_wait_s."""
    llm = _llm(engines, model, tmp_path)
    prompt = random_prompts([40], seed=18)[0]
    want, _ = _push_to_disk(llm, prompt, 9)
    host = llm.engine.host_kv
    slow = _SlowDisk(monkeypatch, die=True)
    slow.release()
    caplog.set_level(logging.ERROR, logger="engine.kv_offload")
    t = time.monotonic()
    out = _greedy(llm, [prompt])[0]
    assert time.monotonic() - t < host.max_read_wait_s
    assert slow.opened and out.num_cached_tokens == 0 and out.outputs[0].token_ids == want
    assert not _disk(llm).reader_alive and host._reads_off
    assert any("reader thread died" in r.getMessage() for r in caplog.records)
    _assert_no_leaks(llm)
    assert _greedy(llm, [prompt])[0].num_cached_tokens == 36  # (computed again: on the device now)

    llm = _llm(engines, model, tmp_path / "hung")
    want, _ = _push_to_disk(llm, prompt, 9)
    host = llm.engine.host_kv
    host.max_read_wait_s = 0.3
    slow = _SlowDisk(monkeypatch)
    t = time.monotonic()
    out = _greedy(llm, [prompt])[0]
    assert 0.3 <= time.monotonic() - t < 10
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == want
    assert host.num_reads_in_flight > 0  # (still hung: their blocks stay reserved)
    host.check()
    slow.release()
    _assert_no_leaks(llm)


def test_the_engine_loop_wakes_when_reads_end(model, tmp_path, engines, monkeypatch):
    """A server's engine loop, idle while the only request waits for its prefix's reads, is
    woken by their end (not by a command): the request finishes soon after, exactly."""
    from engine.engine_loop import EngineLoop

    llm = _llm(engines, model, tmp_path)
    prompt = random_prompts([40], seed=19)[0]
    want, _ = _push_to_disk(llm, prompt, 9)
    slow = _SlowDisk(monkeypatch)
    done = threading.Event()
    loop = EngineLoop(llm.engine, lambda out: any(r.is_finished for r in out.updated) and done.set())
    loop.start()
    try:
        req = loop.submit(lambda e: e.add_request("served", prompt, _params(6))).result(10)
        deadline = time.monotonic() + 10
        while not slow.opened:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        assert req.status == RequestStatus.WAITING_FOR_DISK_KV
        slow.release()
        assert done.wait(20)
    finally:
        loop.stop()
    assert req.output_token_ids == want and req.num_cached_tokens == 36
    _assert_no_leaks(llm)


def test_a_decode_reservation_waits_for_its_prefix_off_the_step(model, tmp_path, engines, monkeypatch):
    """The decode tier's reservation of a prompt whose prefix is on disk: it stays
    WAITING_FOR_BLOCKS while the blocks are read (a reservation queued after it is reserved
    meanwhile), then is reserved with the prefix as its cached tokens (the sender skips them)."""
    llm = _llm(engines, model, tmp_path)
    prompt = random_prompts([40], seed=20)[0]
    _push_to_disk(llm, prompt, 9)
    engine = llm.engine
    slow = _SlowDisk(monkeypatch)
    first = engine.reserve("r-disk", prompt, _params(4))
    second = engine.reserve("r-other", random_prompts([12], seed=32)[0], _params(4))
    reserved = engine.step().reserved
    assert reserved == [second] and first.status == RequestStatus.WAITING_FOR_BLOCKS
    assert list(engine.scheduler.block_waiting) == [first]
    slow.release()
    rounds = 0
    while first.status == RequestStatus.WAITING_FOR_BLOCKS:  # (two rounds: at most 6 blocks read at once)
        engine.host_kv.drain_reads()
        reserved = engine.step().reserved
        rounds += 1
        assert rounds <= 3
    assert reserved == [first] and rounds == 2
    assert first.status == RequestStatus.WAITING_FOR_KV and first.num_cached_tokens == 36
    assert engine.stats().prefix_hits_by_source["disk"] == 36
    for r in (first, second):
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_no_leaks(llm)
