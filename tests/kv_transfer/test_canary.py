"""The transfer canary (kv_transfer/canary.py): the sender's checksum of sampled blocks rides in
the trailer and the receiver recomputes it over what landed. Intact transfers of fresh random
data never flag, whatever the plan, dtype, head slice (tensor-parallel parts), draft cache or
layer-wise send; a block corrupted after it landed (the test hook) fails the transfer with
KVChecksumError naming the request and the layer, the pair stays usable, and the decode side's
scheduler counts it once and fails the request like any other transfer failure. Pairs over
gloo in this process (a thread a side)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kv_transfer import KVLayout, KVReceiveScheduler, KVReceiver, KVSender, StateMove, WirePlan, canary
from kv_transfer.canary import KVChecksumError, sample_positions, weighted_sums
from kv_transfer.protocol import describe_state
from kv_transfer.tp_parts import receive_part

LAYERS, BLOCKS, BS, HEADS, HD = 3, 24, 4, 2, 8


def _cache(seed: int, dtype: torch.dtype = torch.float32, layers: int = LAYERS, heads: int = HEADS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, BLOCKS, 2, BS, heads, HD), generator=g).to(dtype)


def _layout(dtype: str = "float32", heads: int = HEADS, **more: Any) -> KVLayout:
    fp8 = dtype == "float8_e4m3fn"
    return KVLayout(model="tiny", dtype=dtype, block_size=BS, num_layers=LAYERS, num_kv_heads=heads, head_dim=HD,
                    k_scales=(1.0,) * LAYERS if fp8 else (), v_scales=(1.0,) * LAYERS if fp8 else (),
                    model_dtype="float32" if fp8 else "", **more)


@pytest.fixture
def corrupt_every(monkeypatch):
    """Turn the test hook on in this (the receiving) process, as PDSERVE_TEST_CORRUPT_KV_EVERY does."""
    def set_every(n: int) -> None:
        monkeypatch.setattr(canary, "TEST_CORRUPTION", canary._CorruptionHook(n))
    return set_every


class _Pairs:
    """One gloo pair per layout, made once, in this process."""

    def __init__(self) -> None:
        self.made: dict[KVLayout, tuple[KVSender, KVReceiver]] = {}

    def get(self, layout: KVLayout) -> tuple[KVSender, KVReceiver]:
        if layout not in self.made:
            receiver, port = KVReceiver.listen("127.0.0.1", layout, timeout=20)
            self.made[layout] = (KVSender.connect("127.0.0.1", port, layout, timeout=20), receiver)
            receiver.wait_connected()
        return self.made[layout]


@pytest.fixture(scope="module")
def pairs():
    p = _Pairs()
    yield p
    for sender, receiver in p.made.values():
        sender.close()
        receiver.close()


def _transfer(pair, rid: str, src: list[int], dst: list[int], kv: torch.Tensor, into: torch.Tensor,
              plan: tuple[bool, int] | None = None, layerwise: bool = False, draft=None, state=None,
              linear_states=None) -> dict:
    """Send from this thread, receive on another; {"ok": ReceivedKV} or {"error": exception}."""
    sender, receiver = pair
    got: dict = {}

    def recv() -> None:
        try:
            got["ok"] = receiver.recv(into, timeout=20, draft_cache=draft[1] if draft else None,
                                      linear_states=linear_states)
        except Exception as e:  # noqa: BLE001 - checked by the caller
            got["error"] = e
    t = threading.Thread(target=recv)
    t.start()
    if layerwise:  # as layerwise.stream_send: the layers given one by one, the token at the end
        with sender.begin(rid, src, dst, kv, overlap=True, draft_cache=draft[0] if draft else None,
                          state=state) as transfer:
            for layer in range(sender.layout.num_layers):
                transfer.send_layer(layer)
            transfer.finish({"first_token": 7})
    else:
        sender.send(rid, src, dst, kv, meta={"first_token": 7}, plan=WirePlan(*plan) if plan else None,
                    draft_cache=draft[0] if draft else None, state=state)
    t.join(30)
    assert not t.is_alive()
    return got


# ---------------------------------------------------------------------------- the sample, the sums

@given(st.text(min_size=1, max_size=20), st.integers(1, 300), st.integers(1, 80))
def test_the_sample_is_in_range_distinct_and_visits_every_block_over_the_layers(rid, n, layers) -> None:
    pos = sample_positions(rid, n, layers)
    assert pos.shape == (layers, min(2, n)) and ((pos >= 0) & (pos < n)).all()
    assert all(len(set(row)) == len(row) for row in pos.tolist())
    assert np.array_equal(pos, sample_positions(rid, n, layers))  # both sides pick the same blocks
    if layers >= n:
        assert set(pos[:, 0].tolist()) == set(range(n))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]),
       st.integers(1, 5), st.integers(1, 40), st.integers(0, 2**31), st.data())
def test_any_changed_byte_changes_the_sum_and_nothing_else_does(dtype, rows, width, seed, data) -> None:
    x = torch.randn((rows, 2, width), generator=torch.Generator().manual_seed(seed)).to(dtype)
    sums = weighted_sums(x)
    assert torch.equal(sums, weighted_sums(x.clone()))
    row = data.draw(st.integers(0, rows - 1))
    byte = data.draw(st.integers(0, x[row].numel() * x.element_size() - 1))
    flip = data.draw(st.integers(1, 255))
    y = x.clone()
    y[row].reshape(-1).view(torch.uint8)[byte] ^= flip
    changed = weighted_sums(y) != sums
    assert changed.tolist() == [r == row for r in range(rows)]


# ---------------------------------------------------------------------------- pairs

@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, BLOCKS), st.sampled_from([None, (True, 1), (True, 2), (False, 3)]),
       st.booleans())
def test_intact_transfers_of_fresh_random_data_never_flag(pairs, seed, n, plan, layerwise) -> None:
    rng = np.random.default_rng(seed)
    src, dst = rng.permutation(BLOCKS)[:n].tolist(), rng.permutation(BLOCKS)[:n].tolist()
    kv, into = _cache(seed % 1000), _cache(seed % 1000 + 1)
    got = _transfer(pairs.get(_layout()), f"req-{seed}", src, dst, kv, into, plan, layerwise=layerwise)
    assert "error" not in got, got
    assert torch.equal(into[:, dst], kv[:, src])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("plan, layerwise", [(None, False), ((True, 2), False), ((False, 3), False), (None, True)])
def test_a_block_corrupted_after_it_landed_fails_the_transfer_and_the_pair_goes_on(
        pairs, corrupt_every, dtype, plan, layerwise) -> None:
    pair = pairs.get(_layout(str(dtype).removeprefix("torch.")))
    kv, into = _cache(1, dtype), _cache(2, dtype)
    src, dst = [3, 4, 5, 9, 11], [20, 21, 1, 2, 6]
    corrupt_every(2)  # the first transfer lands intact, the second is corrupted
    for rid in ("a", "b"):
        got = _transfer(pair, rid, src, dst, kv, into, plan, layerwise=layerwise)
    assert isinstance(got["error"], KVChecksumError), got
    assert got["error"].request_id == "b"
    assert "request b: KV checksum mismatch in layers 0" in str(got["error"])
    corrupt_every(0)
    got = _transfer(pair, "c", src, dst, kv, into, plan, layerwise=layerwise)  # the same pair, in step
    assert "error" not in got, got
    assert torch.equal(into[:, dst].view(torch.uint8), kv[:, src].view(torch.uint8))


def test_tensor_parallel_parts_head_slices_and_a_draft_cache(pairs, corrupt_every) -> None:
    """A part moves one share of the KV heads, from a head slice into a head slice (a sender of
    4 heads, a receiver of 2 of them); a draft model's blocks ride in the same transfer: each
    sampled and checked."""
    draft_layout = KVLayout(model="draft", dtype="float32", block_size=BS, num_layers=2, num_kv_heads=1, head_dim=HD)
    pair = pairs.get(_layout(heads=2, draft=draft_layout))
    kv, whole = _cache(3, heads=4), _cache(4, heads=4)
    sent, into = kv[..., 1:3, :], whole[..., 2:4, :]
    draft = (_cache(5, layers=2, heads=1), _cache(6, layers=2, heads=1))
    src, dst = [0, 1, 2, 7], [10, 11, 12, 3]
    for every in (0, 1):
        corrupt_every(every)
        got = _transfer(pair, f"tp-{every}", src, dst, sent, into, draft=draft)
        if every:
            assert isinstance(got.get("error"), KVChecksumError), got
        else:
            assert "error" not in got, got
            assert torch.equal(whole[:, dst, ..., 2:4, :], kv[:, src, ..., 1:3, :])
            assert torch.equal(draft[1][:, dst], draft[0][:, src])


class _State:
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.conv, self.ssm = torch.randn((3, 4, 5), generator=g), torch.randn((3, 2, 3000), generator=g)


def test_a_linear_attention_state_is_sampled_too(pairs, corrupt_every) -> None:
    """A hybrid model's state (here with no block sent: the prompt was cached): its windows are
    checked, and a corrupted state fails the transfer naming it."""
    spec = ((4, 5), "float32", (2, 3000), "float32")
    pair = pairs.get(_layout(linear_state=describe_state([1, 2], [spec, spec])))
    mine, theirs = [_State(7), _State(8)], [_State(9), _State(10)]
    for every in (0, 1):
        corrupt_every(every)
        got = _transfer(pair, f"state-{every}", [], [], _cache(1), _cache(2), state=StateMove(mine, 1, 2),
                        linear_states=theirs)
        if every:
            assert isinstance(got.get("error"), KVChecksumError), got
            assert "the linear-attention state" in str(got["error"])
        else:
            assert "error" not in got, got
            assert all(torch.equal(a.ssm[2], b.ssm[1]) and torch.equal(a.conv[2], b.conv[1])
                       for a, b in zip(theirs, mine))


# ---------------------------------------------------------------------------- the decode side's account

class _Loop:
    """The engine's thread, run inline, over a recording engine."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(failed=[], begin_kv_receive=lambda *a: None,
                                      kv_failed=lambda rid, msg: self.engine.failed.append((rid, msg)))

    def submit(self, fn) -> Future:
        f: Future = Future()
        f.set_result(fn(self.engine))
        return f


def test_a_mismatch_fails_the_request_like_any_transfer_failure_and_is_counted_once() -> None:
    class Corrupted:
        is_usable = True

        def recv(self, heads, validate, **kw):
            validate("r", [1, 2])  # admitted: the blocks are the request's
            err = KVChecksumError("request r: KV checksum mismatch in layers 0")
            err.request_id = "r"
            raise err

    loop, told = _Loop(), []
    scheduler = KVReceiveScheduler(loop, timeout=5, on_checksum_mismatch=lambda: told.append(1))
    go, stats = receive_part(Corrupted(), torch.zeros(1), 1, "KV transfer from p", scheduler.admit, scheduler.ended,
                             scheduler.refused)
    assert (go, stats) == (True, None)  # the pair goes on
    assert scheduler.num_checksum_mismatches == 1 and told == [1]
    [(rid, message)] = loop.engine.failed
    assert rid == "r" and "KV checksum mismatch" in message
    assert scheduler.num_receiving == 0
