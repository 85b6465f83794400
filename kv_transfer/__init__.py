"""KV-cache block transfer from a prefill process (sender) to a decode process (receiver).

One package, one interface with two roles (README.md has the diagram):

    scheduler side   what to send or receive for a request, admission, its transfer state
                     prefill: KVSendScheduler      decode: KVReceiveScheduler
    worker side      moving bytes, tensor-parallel parts
                     prefill: KVSendWorker          decode: KVReceiveWorker
                     TP ranks 1..N-1: rank_worker (installed over engine.rank_calls)

The services translate RPCs into calls on these and the engine's named operations; what
two servers say to set up a channel is ``ChannelRequest`` / ``ChannelOffer``.

Below the roles, the pair and its protocol. A *pair* is one (prefill, decode) couple
with its own 2-rank torch.distributed group, created lazily the first time the prefill
server sends to that decode server (never ``init_process_group``: one process holds
many pairs).

Setup (addresses travel over gRPC; that is the services' job, not this module's)::

    decode:  KVReceiver.listen(host, layout)  -> (receiver, port)   TCPStore server on a free port,
                                                                    the rest runs in a thread
    prefill: KVSender.connect(host, port, layout)                   blocks until the pair is up
    both:    hello/<rank> = {"protocol", "backend" asked for, "gpu" UUID, "layout"} (JSON, in the store)
             both run the same checks on both hellos: a mismatch raises KVTransferError on both
             sides before any process group exists; else both settle the same backend:
             NCCL when the caches sit on two different GPUs (compared by UUID: in containers
             every GPU is cuda:0), gloo otherwise (host-staged when a cache is on a GPU)
             ProcessGroupGloo|NCCL(PrefixStore(pair_name, store clone), rank, 2)   rank 0 = sender
             NCCL: its one communicator is built right away, on the cache's GPU
             one 1-element message, sender to receiver

One transfer (the receiver needs to know nothing in advance)::

    control  store queue "hdr"  {"request_id", "runs", "pack", "chunk_layers"}  (JSON; "draft": a draft
             model's plan; "state": a hybrid model's {"slot", "bytes"}, the receiver's state slot)
    data     layers cut into chunks of chunk_layers; chunk by chunk, one batch (NCCL group) each:
               pack=False   kv_cache[l, s:s+n] -> kv_cache[l, d:d+n]  for l in chunk, (s, d, n) in runs
               pack=True    gather kv_cache[chunk][:, src] -> one staging message -> scatter into [:, dst]
             a linear-attention state (every linear layer's conv and ssm of the request's slot, as
             bytes) rides in the last chunk's batch as one message, before the trailer
             the trailer rides in the last chunk's batch: status (_OK | _ABORTED) and the
             sender's meta (JSON: the first sampled token), known only once prefill is done,
             so a sender can post each layer as prefill computes it (``send_layer``); it ends
             with the canary's checksums of sampled blocks, which the receiver checks (canary.py)

The sender picks the plan (``plan_transfer``): long runs go in place, every layer in one
NCCL group; short runs are gathered into chunks (two staging slots a side, so gathering
chunk k+1 overlaps sending chunk k, and scattering chunk k overlaps receiving chunk k+1).

Why the header goes through the store and not the process group: the receiver
waits for the next header for as long as the pair is idle. An idle gloo recv
that times out closes the pair ("Application timeout caused pair closure"), and
an idle NCCL recv cannot be cancelled short of aborting the communicator. A store
queue wait has no such side effect, and ``close()`` can wake it.

Tensors: ``kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``
(K at 0, V at 1), contiguous, so ``kv_cache[l, s:s+n]`` is one contiguous chunk and
goes on the wire without a copy. Either side's cache may instead be a head slice of a
contiguous cache (``cache[..., h0:h1, :]``), as when tensor-parallel ranks on the two sides
hold different shares of the KV heads: a sliced sender always gathers (packs), and a sliced
receiver stages what comes in place and copies it into its heads. Every side's data work runs on the pair's own CUDA
stream, ordered after the calling thread's stream; ``send`` and ``recv`` return once
the data has left / landed.

Failure model: every blocking step has a deadline. NCCL transfers are polled from the
calling thread and the group is aborted at the deadline (NCCL runs with blocking wait:
no watchdog thread that could end the process). A data-plane error (timeout, peer
gone) marks the pair broken; later calls raise and the services build a new pair.
Closing aborts an NCCL group rather than shutting it down: destroying a communicator
waits for the peer to destroy its end. A transfer the decode side rejects (``validate``
raises, or a block id out of range) is still received, into scratch memory, so the
pair stays in sync.
"""
from __future__ import annotations

from kv_transfer.channel import ChannelOffer, ChannelRequest, OpenChannel, RankEndpoint
from kv_transfer.layout import engine_layout
from kv_transfer.protocol import (BACKENDS, DEFAULT_PAIR_NAME, DEFAULT_TIMEOUT_S, PROTOCOL_VERSION,
                                  RECEIVER_RANK, SENDER_RANK, KVChannelClosed, KVLayout, KVTransferError,
                                  ReceivedKV, StateMove, TransferStats, WirePlan, check_compatible, choose_backend,
                                  chunk_ranges, gpu_uuid, merge_runs, plan_transfer, resolve_backend)
from kv_transfer.receive_scheduler import KVReceiveScheduler, ReceiveProgress
from kv_transfer.receive_worker import KVReceiveWorker
from kv_transfer.receiver import KVReceiver
from kv_transfer.send_scheduler import KVSendScheduler
from kv_transfer.send_worker import KVSendWorker
from kv_transfer.sender import KVSender, KVSendTransfer

__all__ = ["BACKENDS", "DEFAULT_PAIR_NAME", "DEFAULT_TIMEOUT_S", "PROTOCOL_VERSION", "RECEIVER_RANK", "SENDER_RANK",
           "KVChannelClosed", "KVLayout", "KVTransferError", "ReceivedKV", "StateMove", "TransferStats", "WirePlan",
           "check_compatible", "choose_backend", "chunk_ranges", "gpu_uuid", "merge_runs", "plan_transfer",
           "resolve_backend", "KVReceiver", "KVSender", "KVSendTransfer",
           "ChannelOffer", "ChannelRequest", "OpenChannel", "RankEndpoint", "engine_layout",
           "KVSendScheduler", "KVSendWorker", "KVReceiveScheduler", "KVReceiveWorker", "ReceiveProgress"]
