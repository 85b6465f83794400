"""KV-cache block transfer from a prefill process (sender) to a decode process (receiver).

A *pair* is one (prefill, decode) couple with its own 2-rank torch.distributed
group, created lazily the first time the prefill server sends to that decode
server (never ``init_process_group``: one process holds many pairs).

Setup (addresses travel over gRPC; that is the services' job, not this module's)::

    decode:  KVReceiver.listen(host, layout)  -> (receiver, port)   TCPStore server on a free port,
                                                                    the rest runs in a thread
    prefill: KVSender.connect(host, port, layout)                   blocks until the pair is up
    both:    hello/<rank> = {"protocol", "backend", "layout"} (JSON, through the store)
             both compare, both raise KVTransferError on a mismatch, before any process group exists
             ProcessGroupGloo|NCCL(PrefixStore(pair_name, store), rank, 2)   rank 0 = sender, 1 = receiver
             one 1-element warm-up message (NCCL builds its communicator on the first op)

One transfer (the receiver needs to know nothing in advance)::

    control  store queue "hdr"   {"request_id", "src": [...], "dst": [...]}   (JSON, one message)
    data     process group       for layer in 0..L-1, for (s, d, n) in merge_runs(src, dst):
                                     sender kv_cache[layer, s:s+n]  ->  receiver kv_cache[layer, d:d+n]

Why the header goes through the store and not the process group: the receiver
waits for the next header for as long as the pair is idle. An idle gloo recv
that times out closes the pair ("Application timeout caused pair closure"), and
an idle NCCL recv trips the watchdog, which tears the process down. A store
queue wait has no such side effect, and ``close()`` can wake it.

Tensors: ``kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``
(K at 0, V at 1), contiguous, so ``kv_cache[l, s:s+n]`` is one contiguous chunk
and goes on the wire without a copy (gloo on CPU, NCCL on GPU). gloo with a CUDA
cache stages each layer through pinned host buffers (two, used alternately).
At most two layers are in flight: posting layer l waits for layer l-1.

Failure model: every blocking step has a deadline. A data-plane error (timeout,
peer gone) marks the pair broken; later calls raise and the services build a new
pair. A transfer the decode side rejects (``validate`` raises, or a block id out
of range) is still received, into scratch memory, so the pair stays in sync.
"""
from __future__ import annotations

from engine.kv_transfer.protocol import (DEFAULT_PAIR_NAME, DEFAULT_TIMEOUT_S, PROTOCOL_VERSION, RECEIVER_RANK,
                                         SENDER_RANK, KVChannelClosed, KVLayout, KVTransferError, ReceivedKV,
                                         TransferStats, check_compatible, choose_backend, merge_runs)
from engine.kv_transfer.receiver import KVReceiver
from engine.kv_transfer.sender import KVSender, KVSendTransfer

__all__ = ["DEFAULT_PAIR_NAME", "DEFAULT_TIMEOUT_S", "PROTOCOL_VERSION", "RECEIVER_RANK", "SENDER_RANK",
           "KVChannelClosed", "KVLayout", "KVTransferError", "ReceivedKV", "TransferStats", "check_compatible",
           "choose_backend", "merge_runs", "KVReceiver", "KVSender", "KVSendTransfer"]
