"""The KV pair's handshake proves both ends know PDSERVE_KV_SECRET before a
process group exists: same secret -> blocks move; a different or missing
secret -> both ends fail with an authentication error and nothing lands."""
from __future__ import annotations

import threading

import pytest
import torch

from kv_transfer import KVLayout, KVReceiver, KVSender, KVTransferError
from kv_transfer.pair import KV_SECRET_ENV

LAYOUT = KVLayout(model="tiny", dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def _cache(fill: float) -> torch.Tensor:
    return torch.full((2, 6, 2, 4, 2, 8), fill)  # [layers, blocks, 2, block_size, kv_heads, head_dim]


def _use(monkeypatch, secret: str | None) -> None:
    if secret is None:
        monkeypatch.delenv(KV_SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(KV_SECRET_ENV, secret)


def _pair(monkeypatch, decode_secret: str | None, prefill_secret: str | None):
    """A receiver made with one secret; the next sender gets the other (each end reads it when made)."""
    _use(monkeypatch, decode_secret)
    receiver, port = KVReceiver.listen("127.0.0.1", LAYOUT, timeout=10.0)
    _use(monkeypatch, prefill_secret)
    return receiver, port


def test_same_secret_pairs_and_moves_blocks(monkeypatch):
    receiver, port = _pair(monkeypatch, "s3cret", "s3cret")
    sender = KVSender.connect("127.0.0.1", port, LAYOUT, timeout=10.0)
    try:
        receiver.wait_connected()
        src, dst = _cache(1.0), _cache(0.0)
        t = threading.Thread(target=lambda: sender.send("r1", [3], [5], src, meta={"first_token": 7}))
        t.start()
        got = receiver.recv(dst)
        t.join(10)
        assert got[0] == "r1" and torch.equal(dst[:, 5], src[:, 3]) and dst[:, :5].abs().sum() == 0
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("decode_secret, prefill_secret", [("s3cret", "other"), ("s3cret", None), (None, "s3cret")])
def test_a_peer_without_the_secret_gets_no_pair(monkeypatch, decode_secret, prefill_secret):
    receiver, port = _pair(monkeypatch, decode_secret, prefill_secret)
    try:
        with pytest.raises(KVTransferError, match="failed KV pair authentication"):
            KVSender.connect("127.0.0.1", port, LAYOUT, timeout=10.0)
        with pytest.raises(KVTransferError, match="failed KV pair authentication"):
            receiver.wait_connected()
        assert not receiver.is_connected
    finally:
        receiver.close()


def _store_of(port: int):
    """A plain client of a pair's store (what anyone who can reach the port can do)."""
    from datetime import timedelta

    import torch.distributed as dist

    from kv_transfer import DEFAULT_PAIR_NAME

    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10), wait_for_workers=False)
    return dist.PrefixStore(DEFAULT_PAIR_NAME, store)


def test_a_recorded_proof_replayed_in_another_pair_is_refused(monkeypatch):
    """Someone who read a good pair's handshake (its store is plain TCP) and offers the
    sender's hello, nonce and proof to a new receiver: fresh nonces make the proof stale."""
    receiver, port = _pair(monkeypatch, "s3cret", "s3cret")
    sender = KVSender.connect("127.0.0.1", port, LAYOUT, timeout=10.0)
    try:
        receiver.wait_connected()
        seen = _store_of(port)
        recorded = {k: seen.get(k) for k in ("hello/0", "auth/nonce/0", "auth/proof/0")}
    finally:
        sender.close()
        receiver.close()
    replayed, port = KVReceiver.listen("127.0.0.1", LAYOUT, timeout=30.0)
    try:
        stranger = _store_of(port)
        for key, value in recorded.items():
            stranger.set(key, value)
        with pytest.raises(KVTransferError, match="failed KV pair authentication"):
            replayed.wait_connected()
        assert not replayed.is_connected
    finally:
        replayed.close()


def test_a_stranger_naming_a_peer_cannot_replace_its_pair(monkeypatch, tiny_llama_dir):
    """OpenKVChannel from someone without the secret, naming a working peer:
    the stranger's pair fails authentication and the peer's pair keeps working."""
    import asyncio

    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from kv_transfer import ChannelRequest, KVReceiveScheduler, KVReceiveWorker
    from rpc.engine_bridge import EngineBridge

    monkeypatch.setenv(KV_SECRET_ENV, "cluster-secret")
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="4MiB"))
    layout = KVLayout.of(engine.kv_cache, engine.config.model.served_model_name)
    request = ChannelRequest(peer="prefill:1", layout=layout, device="cpu")

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        bridge = EngineBridge(engine, "decode", "test")
        bridge.start()
        # 30 s: a setup bound only (a loaded machine may be slow to connect)
        receivers = KVReceiveWorker(engine, KVReceiveScheduler(bridge.loop, 30.0), "127.0.0.1", 30.0)
        try:
            resp = await loop.run_in_executor(None, receivers.open, request)
            sender = await loop.run_in_executor(None, lambda: KVSender.connect("127.0.0.1", resp.port, layout,
                                                                               timeout=10))
            resp2 = await loop.run_in_executor(None, receivers.open, request)
            monkeypatch.setenv(KV_SECRET_ENV, "guess")  # the stranger's end (read when it connects)
            with pytest.raises(KVTransferError, match="authentication"):
                await loop.run_in_executor(None, lambda: KVSender.connect("127.0.0.1", resp2.port, layout,
                                                                          timeout=10))
            for _ in range(200):  # the failed pair is forgotten; the good one stays
                if receivers.num_pairs == 1:
                    break
                await asyncio.sleep(0.05)
            assert receivers.num_pairs == 1 and sender.is_usable
            q = bridge.open_stream("r")
            await bridge.run(lambda e: e.reserve("r", list(range(3, 20)), SamplingParams(max_tokens=2,
                                                                                        temperature=0)))
            dst = (await asyncio.wait_for(q.get(), 10)).block_ids
            source = torch.randn_like(engine.kv_cache)
            await loop.run_in_executor(None, lambda: sender.send("r", [7, 8], dst, source,
                                                                 meta={"first_token": 5}))
            d = await asyncio.wait_for(q.get(), 10)
            assert d.error is None and d.token_ids[0] == 5
            assert torch.equal(engine.kv_cache[:, dst[0]], source[:, 7])
            sender.close()
        finally:
            receivers.close()
            bridge.stop()

    asyncio.run(scenario())
