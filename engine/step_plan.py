"""The values that pass between the step planner and the runner that carries a plan out.

``StepPlan`` says how one step runs; ``GraphMenu`` is what the runner's CUDA graphs can
hold, without their tensors; ``StepRuntime`` is what the planner reads besides the step.
Value objects only: the planner (``engine/planner.py``) decides, the model runner obeys.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class StepPath(enum.Enum):
    EAGER = "eager"  # the forward pass launched kernel by kernel
    DECODE_GRAPH = "decode_graph"  # every row decodes one token: a graph of ``bucket`` rows
    VERIFY_GRAPH = "verify_graph"  # rows with proposals: a graph of ``bucket`` rows of verify_len tokens
    MIXED_GRAPH = "mixed_graph"  # prefill chunks (and decode rows): a graph of ``bucket`` tokens


@dataclass(frozen=True)
class StepPlan:
    """How one step runs. ``bucket``: what a graph is padded to (rows of a decode or verify
    graph, tokens of a mixed-step graph); ``splits``: the attention's split count of the
    decode graph's variant; ``overlapped``: queued without waiting for the device, its
    tokens read at the next step (the step after may be scheduled ahead of them)."""

    path: StepPath = StepPath.EAGER
    bucket: int | None = None
    splits: int | None = None
    overlapped: bool = False

    def __post_init__(self) -> None:
        if (self.path is StepPath.EAGER) != (self.bucket is None):
            raise ValueError(f"a {self.path.value} step has a bucket exactly when it replays a graph")

    def describe(self) -> str:
        bucket = "" if self.bucket is None else f"[{self.bucket}]"
        return f"{self.path.value}{bucket}{' overlapped' if self.overlapped else ''}"


@dataclass(frozen=True)
class GraphMenu:
    """The CUDA graphs a runner holds (captured, or run eagerly in tests), as the planner
    needs them: decode graphs of ``decode_sizes`` rows (``variants[size]``: (longest context,
    attention splits) ascending by context), verify graphs of ``verify_len`` tokens a row at
    ``verify_sizes``, mixed-step graphs of ``mixed_sizes`` tokens over ``max_num_seqs``
    sequences; every block table at most ``max_blocks_per_seq`` wide."""

    decode_sizes: tuple[int, ...]
    max_num_seqs: int
    max_blocks_per_seq: int
    variants: dict[int, tuple[tuple[int, int | None], ...]] = field(default_factory=dict)
    verify_len: int = 1
    verify_sizes: tuple[int, ...] = ()
    mixed_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # A size without variants: one graph for every context, the kernel's own split count.
        unbounded = ((self.max_blocks_per_seq * 2**20, None),)
        object.__setattr__(self, "variants", {s: tuple(sorted(self.variants.get(s) or unbounded))
                                              for s in self.decode_sizes})


@dataclass(frozen=True)
class StepRuntime:
    """What the planner reads besides the step, resolved once the runner is built.
    ``graphs``: None where no step replays a graph (CPU, --enforce-eager, the prefill tier,
    the reference kernels). ``overlap``: steps may be queued ahead (--async-scheduling, and
    no layer-wise KV sends, which read each step's outcome at once). ``overlap_mixed``:
    steps with prefill chunks are queued too, not only pure decode steps."""

    graphs: GraphMenu | None = None
    overlap: bool = False
    overlap_mixed: bool = False
