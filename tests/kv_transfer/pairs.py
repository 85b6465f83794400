"""What the two-process tests of KV pairs share: caches built from a seed on both sides, so
the expected bytes are known without shipping tensors, and a spawned peer process (the
prefill side, a KVSender) driven over a pipe, while the test process is the decode side
(KVReceiver). gloo on 127.0.0.1 on any machine; on GPUs, host-staged gloo (one GPU) and
NCCL (two GPUs)."""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import asdict
from typing import Any

import pytest
import torch

from kv_transfer import KVLayout, KVReceiver, KVSender, KVTransferError, WirePlan

SMALL = dict(num_layers=3, num_blocks=20, block_size=4, num_kv_heads=2, head_dim=8)


SENDER_SEED, RECEIVER_SEED, DRAFT_SEED = 1, 2, 3


# A draft model's cache beside SMALL's: the same blocks, other layers and heads.
DRAFT = dict(num_layers=2, num_blocks=20, block_size=4, num_kv_heads=1, head_dim=4)


def make_cache(seed: int, dtype: str, num_layers: int, num_blocks: int, block_size: int,
               num_kv_heads: int, head_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


# An FP8 cache's per-layer scales (a layout of float8_e4m3fn must carry them).
FP8_K_SCALES, FP8_V_SCALES = (0.37, 1.25, 0.5), (1.9, 0.125, 3.0)


def layout_for(spec: dict[str, Any], dtype: str) -> KVLayout:
    fp8 = dtype == "float8_e4m3fn"
    return KVLayout(model="tiny", dtype=dtype, block_size=spec["block_size"],
                    num_layers=spec["num_layers"], num_kv_heads=spec["num_kv_heads"],
                    head_dim=spec["head_dim"], k_scales=FP8_K_SCALES if fp8 else (),
                    v_scales=FP8_V_SCALES if fp8 else (), model_dtype="float32" if fp8 else "")


# Deadlines are checked as "not before the timeout, and well before a hang": a loaded
# 2-core machine can add seconds of scheduling delay, so the upper slack is generous.
SLACK_S = 5.0


# --------------------------------------------------------------------------- peer process

def _peer_main(conn: Any) -> None:
    """Prefill side. Commands: (name, *args); replies ("ok", value) or ("err", type, message).
    SIGUSR1 prints its threads' stacks (for a hung transfer)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    senders: dict[str, KVSender] = {}
    caches: dict[str, torch.Tensor] = {}
    drafts: dict[str, torch.Tensor | None] = {}  # a draft model's cache, sent beside the pair's
    while True:
        cmd, *args = conn.recv()
        try:
            result: Any = None
            if cmd == "stop":
                break
            if cmd == "connect":  # heads: send only these KV heads of the cache (a view), or None
                pair, port, layout, spec, dtype, device, backend, timeout, heads, *more = args
                caches[pair] = make_cache(SENDER_SEED, dtype, **spec).to(device)
                drafts[pair] = make_cache(DRAFT_SEED, dtype, **more[0]).to(device) if more and more[0] else None
                if heads is not None:
                    caches[pair] = caches[pair][..., heads[0]:heads[1], :]
                senders[pair] = KVSender.connect("127.0.0.1", port, KVLayout.from_dict(layout),
                                                 backend=backend, device=device, timeout=timeout)
                result = senders[pair].backend
            elif cmd == "send":  # several requests, one after the other; plan: None or (pack, chunk_layers)
                pair, requests, plan = args
                plan = WirePlan(*plan) if plan else None
                result = [asdict(senders[pair].send(rid, src, dst, caches[pair], meta={"first_token": len(src)},
                                                    plan=plan, draft_cache=drafts[pair]))
                          for rid, src, dst in requests]
            elif cmd == "send_concurrent":
                pair, requests = args
                errors: list[BaseException] = []

                def one(rid: str, src: list[int], dst: list[int]) -> None:
                    try:
                        senders[pair].send(rid, src, dst, caches[pair])
                    except BaseException as e:  # reported below
                        errors.append(e)
                threads = [threading.Thread(target=one, args=r) for r in requests]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise errors[0]
            elif cmd == "abort_midway":  # prefill fails after layer 0
                pair, (rid, src, dst) = args
                try:
                    with senders[pair].begin(rid, src, dst, caches[pair], draft_cache=drafts[pair]) as transfer:
                        transfer.send_layer(0)
                        raise RuntimeError("prefill failed")
                except RuntimeError as e:
                    result = str(e)
            elif cmd == "die_midway":  # the process dies with half the layers sent
                pair, (rid, src, dst) = args
                transfer = senders[pair].begin(rid, src, dst, caches[pair], plan=WirePlan(True, 1))
                for layer in range(senders[pair].layout.num_layers // 2):
                    transfer.send_layer(layer)
                if caches[pair].is_cuda:
                    torch.cuda.synchronize()
                conn.send(("ok", "dying"))
                os.kill(os.getpid(), signal.SIGKILL)
            elif cmd == "warm":  # CUDA up on a device, so that pair setup is quick
                torch.ones(1, device=args[0]).sum().item()
            elif cmd == "close":
                senders.pop(args[0]).close()
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("err", type(e).__name__, str(e)))


class PeerError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class Peer:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child,), daemon=True)
        self.proc.start()

    def post(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def reply(self, timeout: float = 30.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("peer did not answer")
        status, *rest = self.conn.recv()
        if status == "err":
            raise PeerError(*rest)
        return rest[0]

    def call(self, *cmd: Any) -> Any:
        self.post(*cmd)
        return self.reply()


class Pair:
    """Decode side here, prefill side in the peer; ``sent`` is the peer's cache, recomputed."""

    def __init__(self, peer: Peer, name: str, spec: dict[str, Any], dtype: str,
                 sender_device: str = "cpu", receiver_device: str = "cpu", backend: str = "auto",
                 timeout: float = 20.0, heads: tuple[tuple[int, int], tuple[int, int]] | None = None,
                 receiver_spec: dict[str, Any] | None = None, draft_spec: dict[str, Any] | None = None) -> None:
        """``heads``: (the sender's heads, the receiver's heads) of the two caches that the pair
        moves (as between tensor-parallel ranks holding different shares of the KV heads); the
        receiver's cache is ``receiver_spec`` (default ``spec``). ``draft_spec``: both sides
        also hold a draft model's cache of that shape, whose same blocks every transfer moves."""
        self.peer, self.name, self.spec = peer, name, spec
        (s0, s1), (r0, r1) = heads or ((0, spec["num_kv_heads"]), (0, spec["num_kv_heads"]))
        layout = layout_for(dict(spec, num_kv_heads=s1 - s0), dtype)
        if draft_spec is not None:
            layout = KVLayout(**{**layout.to_dict(), "draft": layout_for(draft_spec, dtype)})
        self.receiver, port = KVReceiver.listen("127.0.0.1", layout, backend=backend,
                                                device=receiver_device, timeout=timeout)
        self.backend = peer.call("connect", name, port, layout.to_dict(), spec, dtype, sender_device, backend,
                                 timeout, heads and heads[0], draft_spec)
        self.receiver.wait_connected()
        assert self.receiver.backend == self.backend  # both sides settled the same backend
        self.sent = make_cache(SENDER_SEED, dtype, **spec).to(receiver_device)[..., s0:s1, :]
        self.whole = make_cache(RECEIVER_SEED, dtype, **(receiver_spec or spec)).to(receiver_device)
        self.cache = self.whole[..., r0:r1, :]  # the whole cache when heads is None
        self.draft_sent = self.draft = None
        if draft_spec is not None:
            self.draft_sent = make_cache(DRAFT_SEED, dtype, **draft_spec).to(receiver_device)
            self.draft = make_cache(RECEIVER_SEED, dtype, **draft_spec).to(receiver_device)

    def transfer(self, requests: list[tuple[str, list[int], list[int]]],
                 plan: tuple[bool, int] | None = None) -> list[tuple[Any, ...]]:
        """Send requests from the peer, receive and check each; return (recv stats, send stats)."""
        self.peer.post("send", self.name, requests, plan)
        results = []
        for rid, src, dst in requests:
            expected = self.whole.clone()
            expected[:, dst, ..., self._heads(), :] = self.sent[:, src]
            if self.draft is not None:
                expected_draft = self.draft.clone()
                expected_draft[:, dst] = self.draft_sent[:, src]
            try:
                got_rid, got_dst, stats, meta = self.receiver.recv(self.cache, timeout=20.0, draft_cache=self.draft)
            except KVTransferError:
                if self.peer.conn.poll(0):  # the sender failed first: its error is the one to see
                    self.peer.reply(0)
                raise
            assert (got_rid, got_dst) == (rid, dst)
            assert meta == {"first_token": len(src)}  # the header's meta travels with the blocks
            assert torch.equal(self.whole, expected)  # the dst blocks' heads exactly, nothing else touched
            if self.draft is not None:
                assert torch.equal(self.draft, expected_draft)  # and the same blocks of the draft's cache
            results.append(stats)
        return list(zip(results, self.peer.reply()))


    def _heads(self) -> slice:
        """The receiver's heads within its whole cache."""
        offset = (self.cache.data_ptr() - self.whole.data_ptr()) // self.cache.element_size()
        return slice(offset // self.spec["head_dim"], offset // self.spec["head_dim"] + self.cache.shape[4])


def assert_broken_after_death(pair: Pair, doomed: Peer) -> None:
    """After the sending peer died mid-transfer: the receiver is marked broken, refuses
    another receive, closes within SLACK_S, and the peer ended by SIGKILL."""
    assert not pair.receiver.is_usable
    with pytest.raises(KVTransferError, match="broken"):
        pair.receiver.recv(pair.cache, timeout=1.0)
    start = time.monotonic()
    pair.receiver.close()
    assert time.monotonic() - start < SLACK_S
    doomed.proc.join(10)
    assert doomed.proc.exitcode == -signal.SIGKILL


def receive_in_background(receiver: KVReceiver, into: torch.Tensor, key: str = "r", **kw: Any
                          ) -> tuple[dict, threading.Thread]:
    """``receiver.recv(into, **kw)`` on a started thread: its result lands in ``got[key]``, or its
    exception in ``got["error"]`` (checked by the caller after joining the thread)."""
    got: dict = {}

    def recv() -> None:
        try:
            got[key] = receiver.recv(into, **kw)
        except Exception as e:  # noqa: BLE001 - checked by the caller
            got["error"] = e
    t = threading.Thread(target=recv)
    t.start()
    return got, t


def run_to_end(engine) -> None:
    """Step ``engine`` until every request it has is finished."""
    while engine.has_unfinished_requests():
        engine.step()


def finish_on_decode(prefill, decode, request_id: str, first_token: int, request, reference) -> None:
    """After a transfer of ``request_id``: the prefill engine lets its blocks go, the decode
    engine takes the KV with ``first_token`` and runs ``request`` to its end, whose tokens must be
    ``reference``'s (the same request computed in one engine); then the decode engine holds no
    block and no linear-state slot."""
    prefill.release_after_send(request_id)
    decode.kv_received(request_id, first_token)
    run_to_end(decode)
    assert request.output_token_ids == reference.output_token_ids
    kv = decode.scheduler.kv
    assert kv.num_used_blocks == 0 and (kv.states is None or not kv.states.slot_of)
