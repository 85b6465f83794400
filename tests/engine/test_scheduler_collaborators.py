"""The scheduler's collaborators come through its constructor and stay for its life: a
speculator (proposals per request or per step), the structured-output grammars, the LoRA
limit and the waiting-queue bound (the one value a server sets later, through
``limit_waiting``). They read as properties, and nothing outside the scheduler assigns
them; nothing outside the block pool assigns its lost-events mark. CPU, no model."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.lora.config import LoRAInfo
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative import Speculator
from engine.structured_outputs import GrammarState

REPO = Path(__file__).resolve().parents[2]
S = RequestStatus


def make(**collaborators) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256),
                     CacheConfig(block_size=4, enable_prefix_caching=False), 32, **collaborators)


def req(rid: str, n: int = 5, max_tokens: int = 8, **params) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   max_model_len=256)


def step(s: Scheduler, token: int = 7):
    """One step whose proposals are all rejected (a speculating row gets the target's token only)."""
    out = s.schedule()
    s.update_from_output(out, [([token] if x.draft_token_ids else token) if x.samples else None
                               for x in out.scheduled])
    return out


def test_a_speculator_proposes_per_request():
    asked = []

    def propose(r: Request, k: int) -> list[int]:
        asked.append((r.request_id, k))
        return [3] * k

    s = make(speculator=Speculator(3, propose=propose))
    assert s.num_speculative_tokens == 3 and s.speculator.propose is propose
    a = req("a")
    s.add_request(a)
    step(s)  # the prompt: no proposals
    assert asked == [] and a.num_output_tokens == 1
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.draft_token_ids) for x in out.scheduled] == [("a", 4, [3, 3, 3])]
    assert asked == [("a", 3)]
    # without one, the same request decodes a token a step
    plain = make()
    assert plain.speculator is None and plain.num_speculative_tokens == 0
    b = req("b")
    plain.add_request(b)
    step(plain)
    assert [(x.num_new_tokens, x.draft_token_ids) for x in plain.schedule().scheduled] == [(1, [])]


def test_no_proposals_above_disable_by_batch_size():
    asked = []
    s = make(speculator=Speculator(2, propose=lambda r, k: asked.append(k) or [3] * k, disable_by_batch_size=1))
    for rid in ("a", "b"):
        s.add_request(req(rid, max_tokens=3 if rid == "a" else 8))
    step(s)
    while s.num_running > 1:  # two running: no proposals, the proposer is not asked
        assert s.speculation_off and all(not x.draft_token_ids for x in step(s).scheduled)
    assert asked == []
    assert not s.speculation_off and any(x.draft_token_ids for x in s.schedule().scheduled) and asked


def test_a_batch_speculator_proposes_for_the_steps_rows():
    batches = []

    def propose_batch(rows):
        batches.append([(r.request_id, k, list(ids)) for r, k, ids in rows])
        return {r.request_id: [9] * k for r, k, _ in rows}

    s = make(speculator=Speculator(2, propose_batch=propose_batch))
    a = req("a", n=7)
    s.add_request(a)
    step(s)
    assert batches == []
    out = s.schedule()
    # its blocks for the proposals' positions (7 computed, 1 + 2 more: 3 blocks of 4) taken first
    assert batches == [[("a", 2, s.kv.get_block_ids("a"))]] and len(batches[0][0][2]) == 3
    assert [(x.num_new_tokens, x.draft_token_ids) for x in out.scheduled] == [(3, [9, 9])]


class FakeGrammars:
    """What the scheduler asks of the grammar manager, with the state set by the test."""

    def __init__(self) -> None:
        self.state: dict[str, GrammarState] = {}
        self.prefetched: list[tuple[str, int]] = []
        self.freed: list[str] = []

    def poll(self, r: Request) -> tuple[GrammarState, str]:
        return self.state.get(r.request_id, GrammarState.WAIT), "bad constraint"

    def prefetch(self, pairs) -> None:
        self.prefetched += [(r.request_id, t) for r, t in pairs]

    def free(self, request_id: str) -> None:
        self.freed.append(request_id)

    @property
    def num_requests(self) -> int:
        return len(self.state)


def test_grammars_hold_and_end_constrained_requests():
    g = FakeGrammars()
    s = make(grammars=g)
    assert s.grammars is g
    so = {"structured_outputs": {"choice": ["A", "B"]}}
    c, bad, free = req("c", **so), req("bad", **so), req("free")
    for r in (c, bad, free):
        s.add_request(r)
    g.state.update(c=GrammarState.WAIT, bad=GrammarState.WAIT)
    assert [x.request for x in step(s).scheduled] == [free]  # compiling: they wait, in their places
    assert [r.request_id for r in s.waiting] == ["c", "bad"]
    g.state.update(c=GrammarState.READY, bad=GrammarState.ERROR)
    out = step(s, token=5)
    assert [x.request for x in out.scheduled] == [free, c] and out.finished == [bad]
    assert bad.status == S.FINISHED_ABORTED and bad.error.kind == "invalid_constraint"
    assert "bad constraint" in bad.error.message
    assert ("c", 5) in g.prefetched and c.output_token_ids == [5]
    g.state["c"] = GrammarState.DONE  # the grammar is complete: c ends before its next step
    out = s.schedule()
    assert out.finished == [c] and c.status == S.FINISHED_STOPPED and c.stop_reason == "constraint"
    assert {"c", "bad"} <= set(g.freed)


def test_max_loras_limits_the_adapters_of_a_step():
    def under(rid: str, name: str) -> Request:
        r = req(rid)
        r.lora = LoRAInfo(name, f"/adapters/{name}", 8, name, None)
        return r

    s = make(max_loras=1)
    assert s.max_loras == 1
    for r in (under("x", "one"), under("y", "two"), under("z", "one")):
        s.add_request(r)
    assert [x.request.request_id for x in s.schedule().scheduled] == ["x", "z"]  # y waits for a slot
    unlimited = make()
    assert unlimited.max_loras is None
    for r in (under("x", "one"), under("y", "two")):
        unlimited.add_request(r)
    assert len(unlimited.schedule().scheduled) == 2
    with pytest.raises(ValueError, match="max_loras must be at least 1"):
        make(max_loras=0)


def test_the_waiting_queue_bound():
    s = make(max_waiting=2)
    assert s.max_waiting == 2
    s.add_request(req("a"))
    s.add_request(req("b"))
    with pytest.raises(OverflowError, match="waiting queue is full"):
        s.add_request(req("c"))
    s.limit_waiting(None)  # the one owner of the bound, for a server that knows it later
    s.add_request(req("c"))
    assert s.max_waiting is None and len(s.waiting) == 3
    with pytest.raises(ValueError, match="at least 0"):
        s.limit_waiting(-1)


def test_collaborators_are_read_only():
    s = make(speculator=Speculator(2, propose=lambda r, k: []), grammars=FakeGrammars(), max_loras=2,
             max_waiting=4)
    for name in ("speculator", "num_speculative_tokens", "grammars", "max_loras", "max_waiting"):
        with pytest.raises(AttributeError):
            setattr(s, name, None)
    with pytest.raises(ValueError, match="exactly one of propose, propose_batch"):
        Speculator(2)
    with pytest.raises(ValueError, match="exactly one of propose, propose_batch"):
        Speculator(2, propose=lambda r, k: [], propose_batch=lambda rows: {})


# The scheduler's collaborators as they were once assigned from outside, and the block pool's mark.
_SCHEDULER_ATTRS = {"speculator", "batch_speculator", "num_speculative_tokens", "disable_spec_above", "max_loras",
                    "grammars", "max_waiting", "_speculator", "_grammars", "_max_loras", "_max_waiting"}
_POOL_ATTRS = {"events_lost", "_events_lost"}


def _assigned_attributes(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        stack = list(targets)
        while stack:
            t = stack.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                stack.extend(t.elts)
            elif isinstance(t, ast.Attribute):
                yield node.lineno, t


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def test_nothing_outside_assigns_the_schedulers_collaborators_or_the_pools_lost_mark():
    """``<...>.scheduler.<collaborator> = ...`` (or ``sched.``) nowhere in the project's
    packages; ``events_lost`` assigned only by the block pool itself."""
    found = []
    for package in ("engine", "kv_transfer", "rpc", "prefill_service", "decode_service", "gateway", "pdserve",
                    "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            where = path.relative_to(REPO).as_posix()
            for line, t in _assigned_attributes(ast.parse(path.read_text(), str(path))):
                if t.attr in _SCHEDULER_ATTRS and _name(t.value) in ("scheduler", "sched"):
                    found.append(f"{where}:{line}: {ast.unparse(t)}")
                if t.attr in _POOL_ATTRS and where != "engine/block_pool.py":
                    found.append(f"{where}:{line}: {ast.unparse(t)}")
    assert not found, "assigned from outside their owner:\n" + "\n".join(found)
