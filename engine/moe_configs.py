"""Tile configs for the fused MoE kernel, tuned once per GPU and shape and kept on disk.

``kernels.fused_moe.tune`` times a small grid of tiles per token count (a
minute or two, mostly compiles); this module owns the cache of its results, so
each machine pays that once per model shape::

    <cache_dir()>/moe_configs/
      E128_H2048_I768_K8_bfloat16_NVIDIA-H200_triton-3.6.0.json    {"1": {tiles}, ..., "8192": {tiles}}
      .E128_..._triton-3.6.0.json.tmp-XXXX                          a write in progress (or a crashed one)

The key names everything the best tiles depend on: the experts' shape (``I``
is a tensor-parallel rank's share), the weights' dtype (FP8 weights with block
scales add the blocks: ``float8_e4m3fn-block128x128``; MXFP4 experts, uint8 in the
kernel, are named with the activations' dtype their dots run in: ``mxfp4-bfloat16``), the GPU model and the
Triton version (a new compiler can change what is fastest). Invariant: a file
under its final name is complete, because it only appears through
``os.replace`` of a fully written temporary sibling. Two processes that miss at once (ranks of one
server) both tune and the last rename wins; either file is valid. A file that
cannot be read or does not parse is tuned again and replaced.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import triton

from engine.model_files import cache_dir

logger = logging.getLogger(__name__)

# tune_fn(num_experts, hidden, intermediate, top_k, dtype, device) -> {token count: tiles}
TuneFn = Callable[[int, int, int, int, torch.dtype, torch.device], dict]


def config_key(num_experts: int, hidden: int, intermediate: int, top_k: int, dtype: torch.dtype,
               device_name: str, triton_version: str, block_size: tuple[int, int] | None = None,
               x_dtype: torch.dtype | None = None) -> str:
    """A file-name-safe key naming every input the tuned tiles depend on (``x_dtype``: MXFP4's
    activations, uint8 ``dtype``)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype == torch.uint8:
        dtype_name = f"mxfp4-{str(x_dtype).removeprefix('torch.')}"
    if block_size is not None:
        dtype_name += f"-block{block_size[0]}x{block_size[1]}"
    raw = f"E{num_experts}_H{hidden}_I{intermediate}_K{top_k}_{dtype_name}_{device_name}_triton-{triton_version}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw)


def config_path(key: str) -> Path:
    return cache_dir() / "moe_configs" / f"{key}.json"


def moe_kernel_config(
    num_experts: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tune_fn: TuneFn | None = None,
    *,
    block_size: tuple[int, int] | None = None,
    x_dtype: torch.dtype | None = None,
) -> dict[int, dict] | None:
    """The ``config`` to pass to ``kernels.fused_moe`` for this shape on this GPU.

    ``dtype`` is the experts' weight dtype; FP8 weights with block scales pass
    their ``block_size`` (given to ``tune_fn`` as a keyword); MXFP4 experts (``dtype``
    torch.uint8) pass the activations' ``x_dtype`` (likewise). None off CUDA (the
    reference path has no tiles). Otherwise the cached file if it is readable,
    else the result of ``tune_fn`` (default ``kernels.fused_moe.tune``), written
    to the cache before it is returned. Keys are token counts (ints).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if dtype == torch.uint8 and x_dtype is None:
        raise ValueError("moe_kernel_config: MXFP4 experts (uint8) need the activations' x_dtype")
    key = config_key(num_experts, hidden, intermediate, top_k, dtype, torch.cuda.get_device_name(device),
                     triton.__version__, block_size, x_dtype if dtype == torch.uint8 else None)
    path = config_path(key)
    cached = _load(path)
    if cached is not None:
        return cached
    if tune_fn is None:
        from kernels.fused_moe import tune as tune_fn
    logger.info("fused MoE tiles for %s not cached: tuning them on this GPU (a minute or two, once)", key)
    started = time.perf_counter()
    blocks = {} if block_size is None else {"block_size": tuple(block_size)}
    if dtype == torch.uint8:
        blocks["x_dtype"] = x_dtype
    configs = tune_fn(num_experts, hidden, intermediate, top_k, dtype, device, **blocks)
    parsed = _parse(json.loads(json.dumps(configs)))  # what a later load will see
    if parsed is None:
        raise ValueError(f"moe_kernel_config: tune_fn returned no usable {{token count: tiles}} dict: {configs!r}")
    _write_atomically(path, configs)
    logger.info("fused MoE tiles for %s tuned in %.1f s (%d token counts), cached in %s", key,
                time.perf_counter() - started, len(parsed), path)
    return parsed


def _parse(data: Any) -> dict[int, dict] | None:
    """{token count: tiles} with int keys, or None if ``data`` is not shaped like one."""
    if not isinstance(data, dict) or not data:
        return None
    out: dict[int, dict] = {}
    for count, tiles in data.items():
        try:
            n = int(count)
        except (TypeError, ValueError):
            return None
        if n < 1 or not isinstance(tiles, dict) or not {"block_m", "gemm1", "gemm2"} <= set(tiles):
            return None
        out[n] = tiles
    return out


def _load(path: Path) -> dict[int, dict] | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("fused MoE tile cache %s unreadable (%s); tuning again", path, e)
        return None
    try:
        parsed = _parse(json.loads(text))
    except ValueError:
        parsed = None
    if parsed is None:
        logger.warning("fused MoE tile cache %s is not a {token count: tiles} JSON object; tuning again", path)
    return parsed


def _write_atomically(path: Path, configs: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({str(k): configs[k] for k in sorted(configs, key=int)}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
