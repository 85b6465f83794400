"""``--enable-lora`` and the flags beside it, as vLLM names them."""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.block_hash import hash_block_tokens


@dataclass(frozen=True)
class LoRAConfig:
    modules: tuple[tuple[str, str], ...] = ()  # --lora-modules: (name, path), loaded at start
    max_loras: int = 1  # adapters in device memory at once (and in one step)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters' tensors kept on the host (None: max_loras)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def describe(self) -> str:
        return (f"max_loras={self.max_loras} max_lora_rank={self.max_lora_rank} max_cpu_loras={self.cpu_loras} "
                f"modules={','.join(n for n, _ in self.modules) or None}")


@dataclass(frozen=True)
class LoRARequest:
    """The offline API's adapter for a prompt, as vLLM spells it (``lora_int_id`` is kept for
    vLLM's signature; the name identifies the adapter)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def parse_lora_module(spec: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry: ``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}``."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            obj = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"--lora-modules {spec!r}: not valid JSON: {e}") from e
        name, path = obj.get("name"), obj.get("path")
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {spec!r}: expected name=path or {{\"name\": ..., \"path\": ...}}")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"--lora-modules {spec!r}: needs a name and a path")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class LoRAInfo:
    """A registered adapter as the engine reports it."""

    name: str
    path: str
    rank: int
    fingerprint: str
    base_model: str | None

    @property
    def root_hash(self) -> int:
        """Block 0's parent hash for requests under this adapter: its blocks never match the
        base model's or another adapter's (or this name's earlier contents)."""
        return lora_root_hash(self.name, self.fingerprint)


def lora_root_hash(name: str, fingerprint: str) -> int:
    data = f"lora:{name}:{fingerprint}".encode()
    return hash_block_tokens(0, list(data))
