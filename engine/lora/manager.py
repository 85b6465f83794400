"""Which adapters an engine knows, which sit on the host, and which hold a device slot.

    registered   name -> its directory and fingerprint (``--lora-modules``, or loaded at run
                 time); every one was read and checked when registered
    host cache   at most ``--max-cpu-loras`` adapters' tensors, least recently used dropped
                 (read again from the directory when needed)
    slots        ``--max-loras`` device slots; ``activate`` gives a step's adapters slots,
                 taking free ones first, then the least recently used slot not in the step

The scheduler keeps each step to ``--max-loras`` adapters, so ``activate`` always finds
room. A slot is copied on the compute stream, so a step still running on the old
contents finishes before they change. Registering and unregistering take a lock and
may run on any thread (file reads happen outside it); ``activate`` runs on the engine
loop.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from types import ModuleType
from typing import Callable

import numpy as np
import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter, LoRAError, ModuleShape, load_adapter
from engine.lora.config import LoRAInfo
from engine.lora.layers import LoRABatch, LoRALayer, attach_lora

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int, max_tokens: int,
                 device: torch.device, dtype: torch.dtype, ops: ModuleType) -> None:
        if max_loras < 1 or max_rank < 1 or max_cpu_loras < max_loras:
            raise ValueError(f"--max-loras {max_loras} and --max-lora-rank {max_rank} must be >= 1, and "
                             f"--max-cpu-loras {max_cpu_loras} >= --max-loras")
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.dtype = dtype
        self.batch = LoRABatch(max_tokens, max_loras, device, ops)
        self.layers: dict[str, LoRALayer] = attach_lora(model, self.batch, max_rank, dtype)
        self.modules: dict[str, ModuleShape] = {m: s for layer in self.layers.values()
                                                for m, s in layer.shapes().items()}
        self._lock = threading.Lock()
        self._registered: dict[str, LoRAInfo] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU: oldest first
        self._slots: list[str | None] = [None] * max_loras
        self._slot_fingerprints: list[str | None] = [None] * max_loras
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))  # LRU
        self.num_slot_loads = 0
        # Tensor parallelism, rank 0: told each time it fills a slot (the other ranks follow).
        self.on_slot_filled: Callable[[int, LoRAInfo], None] | None = None

    # ---- registry (any thread) ---------------------------------------------
    def register(self, name: str, path: str) -> LoRAInfo:
        """Read and check the adapter at ``path`` and serve it as ``name``; LoRAError says why not.
        Registering a name again replaces its contents (later requests see the new ones)."""
        adapter = self._read(name, path)
        info = LoRAInfo(name, str(path), adapter.rank, adapter.fingerprint, adapter.base_model)
        with self._lock:
            self._registered[name] = info
            self._remember(adapter)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d modules, %.1f MiB)", name, path, adapter.rank,
                    len(adapter.weights), adapter.num_bytes / 2**20)
        return info

    def unregister(self, name: str) -> LoRAInfo:
        with self._lock:
            info = self._registered.pop(name, None)
            if info is None:
                raise LoRAError(f"LoRA adapter {name!r} is not loaded")
            self._host.pop(name, None)
        return info

    def get(self, name: str) -> LoRAInfo | None:
        with self._lock:
            return self._registered.get(name)

    def list(self) -> list[LoRAInfo]:
        with self._lock:
            return list(self._registered.values())

    def held(self) -> list[str]:
        """Adapters in device slots now."""
        return [n for n in self._slots if n is not None]

    def _read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter from its directory, in the model dtype (pinned for a GPU: slot copies
        then do not make the engine loop wait)."""
        adapter = load_adapter(name, path, self.modules, self.max_rank)
        pin = self.batch.device.type == "cuda"
        for module, (a, b) in adapter.weights.items():
            a, b = a.to(self.dtype), b.to(self.dtype)
            adapter.weights[module] = (a.pin_memory(), b.pin_memory()) if pin else (a, b)
        return adapter

    def _remember(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _host_adapter(self, info: LoRAInfo) -> LoRAAdapter:
        with self._lock:
            adapter = self._host.get(info.name)
            if adapter is not None and adapter.fingerprint == info.fingerprint:
                self._host.move_to_end(info.name)
                return adapter
        adapter = self._read(info.name, info.path)
        if adapter.fingerprint != info.fingerprint:
            raise LoRAError(f"LoRA adapter {info.name!r}: the files at {info.path} changed since it was loaded; "
                            "load it again")
        with self._lock:
            self._remember(adapter)
        return adapter

    # ---- slots (engine loop) -----------------------------------------------
    def _slot_of(self, info: LoRAInfo) -> int | None:
        for slot, (held, fp) in enumerate(zip(self._slots, self._slot_fingerprints)):
            if held == info.name and fp == info.fingerprint:
                return slot
        return None

    def _load_slot(self, slot: int, info: LoRAInfo) -> None:
        adapter = self._host_adapter(info)
        if self.on_slot_filled is not None:
            self.on_slot_filled(slot, info)
        for layer in self.layers.values():
            layer.set_slot(slot, adapter)
        self._slots[slot], self._slot_fingerprints[slot] = info.name, info.fingerprint
        self.num_slot_loads += 1

    def follow_slot(self, slot: int, message: bytes) -> None:
        """Tensor parallelism, ranks > 0: rank 0 filled ``slot`` (its message: the adapter's
        name, path and fingerprint); fill this rank's share of it the same way."""
        spec = json.loads(message)
        info = LoRAInfo(spec["name"], spec["path"], 0, spec["fingerprint"], None)
        with self._lock:
            if self._registered.get(info.name) != info:
                self._registered[info.name] = info
        self._load_slot(slot, info)

    def prefetch(self, info: LoRAInfo) -> None:
        """Copy ``info`` into a slot ahead of its first step (a decode server, while the prompt
        is prefilled elsewhere) if a slot is free: never evicts an adapter in use."""
        if self._slot_of(info) is not None:
            return
        with self._lock:
            registered = {(i.name, i.fingerprint) for i in self._registered.values()}
        free = [s for s, (n, fp) in enumerate(zip(self._slots, self._slot_fingerprints))
                if n is None or (n, fp) not in registered]
        if free:
            self._load_slot(free[0], info)
            self._slot_use.move_to_end(free[0])

    def unusable(self, infos: list[LoRAInfo]) -> dict[str, str]:
        """The adapters of ``infos`` that cannot be placed in a slot, by name, with the reason:
        not in a slot and their files changed since they were loaded. Checked before a step
        runs, so that only their requests fail (the host copy read here serves ``activate``)."""
        bad: dict[str, str] = {}
        for info in {i.name: i for i in infos}.values():
            if self._slot_of(info) is None:
                try:
                    self._host_adapter(info)
                except LoRAError as e:
                    bad[info.name] = str(e)
        return bad

    def activate(self, infos: list[LoRAInfo]) -> dict[str, int]:
        """A slot for each adapter of a step (at most ``max_loras`` distinct ones)."""
        want = {i.name: i for i in infos}
        if len(want) > self.max_loras:
            raise RuntimeError(f"a step with {len(want)} LoRA adapters; --max-loras is {self.max_loras}")
        out: dict[str, int] = {}
        for name, info in want.items():
            slot = self._slot_of(info)
            if slot is not None:
                out[name] = slot
        for name, info in want.items():
            if name in out:
                continue
            taken = set(out.values())
            slot = next(s for s in self._slot_use if s not in taken)
            self._load_slot(slot, info)
            out[name] = slot
        for slot in out.values():
            self._slot_use.move_to_end(slot)
        return out

    def row_slots(self, row_infos: list[LoRAInfo | None]) -> np.ndarray | None:
        """Each row's slot (-1: the base model), its adapters placed in slots; None: no adapter."""
        if not any(i is not None for i in row_infos):
            return None
        slots = self.activate([i for i in row_infos if i is not None])
        return np.array([-1 if i is None else slots[i.name] for i in row_infos], dtype=np.int32)

    def set_step(self, row_infos: list[LoRAInfo | None], counts: np.ndarray) -> None:
        """An eager step's rows (their adapters, None: the base model) and token counts."""
        per_row = self.row_slots(row_infos)
        self.batch.set(None if per_row is None else np.repeat(per_row, counts))

    def set_graph_step(self, row_infos: list[LoRAInfo | None], size: int, query_len: int = 1) -> None:
        """A decode graph's rows (``query_len`` tokens each), padded to ``size`` rows of no adapter."""
        slots = np.full(size, -1, dtype=np.int32)
        per_row = self.row_slots(row_infos)
        if per_row is not None:
            slots[:len(per_row)] = per_row
        self.batch.upload(np.repeat(slots, query_len))
