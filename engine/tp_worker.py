"""Tensor-parallel worker processes: ranks 1..N-1 of an engine's model.

``start_workers`` spawns them (fresh interpreters: no CUDA state inherited)
before rank 0 joins the group; each builds its ``ModelRunner`` shard and
runs ``ModelRunner.serve_steps`` until rank 0 says stop. A worker dies with
the process that started it (``PR_SET_PDEATHSIG``), so a killed server
leaves no orphans; a worker that dies breaks the group, and rank 0's next
collective raises, which ends the engine loop (health NOT_SERVING).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing as mp
import signal

from engine.config import EngineConfig

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
JOIN_TIMEOUT_S = 10.0


def rank_device(device: str, rank: int) -> str:
    """cuda:i for rank 0 -> cuda:i+rank; cpu stays cpu."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def start_workers(config: EngineConfig, size: int, host: str, port: int) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, size):
        p = ctx.Process(target=_worker_main, args=(config, rank, size, host, port), daemon=True,
                        name=f"tp-worker-{rank}")
        p.start()
        procs.append(p)
    return procs


def release(group: object, procs: list[mp.Process]) -> None:
    """Rank 0's group and workers, for an engine dropped without close() (or still open when
    the process ends): abort the group, then kill the workers."""
    from engine.parallel import abort_group

    abort_group(group)
    stop_workers(procs, 0.0)


def stop_workers(procs: list[mp.Process], wait: float = JOIN_TIMEOUT_S) -> None:
    """Wait up to ``wait`` s for workers told to stop; kill the ones still running. Once a
    worker has died (a non-zero exit), none waits: the others block in a collective with it."""
    if any(p.exitcode not in (None, 0) for p in procs):
        wait = 0.0
    for p in procs:
        p.join(wait)
        if p.is_alive():
            p.kill()
            p.join(JOIN_TIMEOUT_S)


def _worker_main(config: EngineConfig, rank: int, size: int, host: str, port: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    # Rank 0 decides when the ranks stop (it drains first): a Ctrl-C or SIGTERM sent to the
    # whole process group must not end a worker under a draining server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from engine.runtime_config import log_level

    level = log_level()
    logging.basicConfig(level=level, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s")
    import torch

    from engine.model_runner import ModelRunner
    from engine.parallel import TPGroup

    config = dataclasses.replace(config, device=rank_device(config.device, rank))
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = TPGroup(rank, size, host, port, device)
    runner = ModelRunner(config, tp)
    from engine.rank_calls import RankContext, serve_calls

    # Calls beside the steps: what a layer above installs (the KV transfer's share of this
    # rank: its own heads, from or into its own cache; kv_transfer/rank_worker.py).
    serve_calls(tp.store, rank, {}, context=RankContext(rank, tp.store, runner.kv_cache))
    try:
        runner.serve_steps()
    except Exception as e:  # rank 0 gone or the group broken: nothing left to serve
        logger.info("tensor-parallel rank %d stops: %s", rank, e)
    finally:
        runner.close()
