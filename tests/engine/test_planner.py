"""The step planner (engine/planner.py), the one place a step's path is decided, on
hand-made scheduler rows: every path (eager, decode graph, verify graph, mixed-step graph),
the bucket and the attention split variant it picks, and whether the step is overlapped,
for each reason a graph or an overlap is declined."""
from __future__ import annotations

import pytest

from engine.planner import plan_step
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest
from engine.step_plan import GraphMenu, StepPath, StepPlan, StepRuntime

MENU = GraphMenu(decode_sizes=(1, 2, 4, 8), max_num_seqs=8, max_blocks_per_seq=4,
                 variants={4: ((32, 2), (64, 8))}, verify_len=3, verify_sizes=(1, 2, 4),
                 mixed_sizes=(16, 32))
OVERLAP = StepRuntime(MENU, overlap=True, overlap_mixed=True)


def _row(prompt_len: int, computed: int, new: int, blocks: int = 1, drafts: int = 0,
         held: bool = False) -> ScheduledRequest:
    """A row of a request of ``prompt_len`` tokens, of which ``computed`` have KV, scheduled
    for ``new`` tokens (``drafts`` of them proposals) over a table of ``blocks`` blocks."""
    r = Request(f"r{prompt_len}-{computed}-{new}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64))
    r.num_computed_tokens = computed
    r.hold_kv_on_finish = held
    return ScheduledRequest(r, new, (list(range(blocks)),), draft_token_ids=list(range(7, 7 + drafts)))


def _decode(n: int, context: int = 10, blocks: int = 1) -> list[ScheduledRequest]:
    return [_row(context, context - 1, 1, blocks) for _ in range(n)]


def test_decode_steps_take_the_smallest_graph_that_holds_them():
    assert plan_step(_decode(1), OVERLAP) == StepPlan(StepPath.DECODE_GRAPH, 1, None, overlapped=True)
    assert plan_step(_decode(3), OVERLAP) == StepPlan(StepPath.DECODE_GRAPH, 4, 2, overlapped=True)
    assert plan_step(_decode(8), OVERLAP).bucket == 8
    # the split variant follows the batch's longest context: <= 32, <= 64, and past the last
    assert plan_step(_decode(4, context=32), OVERLAP).splits == 2
    assert plan_step(_decode(4, context=33), OVERLAP).splits == 8
    assert plan_step(_decode(4, context=500, blocks=4), OVERLAP).splits == 8
    # --no-async-scheduling (or a layer-wise sink): the same graph, read at once
    assert plan_step(_decode(3), StepRuntime(MENU)) == StepPlan(StepPath.DECODE_GRAPH, 4, 2)


def test_decode_steps_no_graph_holds_run_eagerly():
    assert plan_step(_decode(9), StepRuntime(MENU, overlap=True)) == StepPlan(overlapped=False)
    wide = _decode(2) + [_row(80, 79, 1, blocks=5)]  # a table wider than the buffers
    assert plan_step(wide, StepRuntime(MENU, overlap=True)).path is StepPath.EAGER
    assert plan_step(_decode(9), OVERLAP) == StepPlan(overlapped=True)  # overlap_mixed: eager, queued


def test_without_graphs_every_step_is_eager_and_read_at_once():
    for rows in (_decode(2), [_row(20, 0, 20)], [_row(10, 9, 3, drafts=2)]):
        assert plan_step(rows, StepRuntime(None, overlap=True, overlap_mixed=True)) == StepPlan()
    assert plan_step([], OVERLAP) == StepPlan()


def test_layerwise_sends_and_held_rows_run_eagerly_and_are_read_at_once():
    assert plan_step(_decode(2), OVERLAP, layerwise=True) == StepPlan()
    assert plan_step(_decode(1) + [_row(20, 0, 20, held=True)], OVERLAP) == StepPlan()
    assert plan_step([_row(10, 9, 1, held=True)], OVERLAP) == StepPlan()


def test_rows_with_proposals_take_a_verify_graph_and_are_never_overlapped():
    rows = [_row(10, 9, 3, drafts=2), _row(12, 11, 1), _row(14, 13, 2, drafts=1)]
    assert plan_step(rows, OVERLAP) == StepPlan(StepPath.VERIFY_GRAPH, 4)
    too_many = [_row(10, 9, 4, drafts=3)]  # more proposals than verify_len - 1
    assert plan_step(too_many, OVERLAP) == StepPlan()
    assert plan_step(rows * 2, OVERLAP) == StepPlan()  # 6 rows: no verify graph of more than 4
    with_chunk = rows + [_row(30, 0, 8)]  # a prefill chunk beside them
    assert plan_step(with_chunk, OVERLAP) == StepPlan()
    assert plan_step(rows, StepRuntime(GraphMenu((1, 2, 4), 8, 4))) == StepPlan()  # no verify graphs


def test_steps_with_prefill_chunks_take_a_token_bucket():
    rows = _decode(3) + [_row(40, 0, 12)]  # 15 tokens
    assert plan_step(rows, OVERLAP) == StepPlan(StepPath.MIXED_GRAPH, 16, overlapped=True)
    assert plan_step(_decode(3) + [_row(40, 0, 14)], OVERLAP).bucket == 32
    assert plan_step([_row(40, 0, 33)], OVERLAP) == StepPlan(overlapped=True)  # past the largest bucket
    assert plan_step(_decode(7) + [_row(40, 0, 4)], OVERLAP) == StepPlan(overlapped=True)  # no spare sequence
    assert plan_step([_row(40, 0, 8, blocks=5)], OVERLAP).path is StepPath.EAGER  # a table too wide
    # overlap_mixed off: the same graph, read at once; so without --async-scheduling
    assert plan_step(rows, StepRuntime(MENU, overlap=True)) == StepPlan(StepPath.MIXED_GRAPH, 16)
    assert plan_step(rows, StepRuntime(MENU, overlap_mixed=True)) == StepPlan(StepPath.MIXED_GRAPH, 16)
    # a one-token chunk that does not reach the end of its prompt is not a decode row
    assert plan_step([_row(20, 4, 1)], OVERLAP) == StepPlan(StepPath.MIXED_GRAPH, 16, overlapped=True)


def test_a_row_a_step_ahead_counts_the_positions_in_flight():
    row = _row(10, 9, 1)
    row.lookahead, row.computed_ahead = 1, 1  # the step in flight computes position 9 and samples
    assert row.samples and plan_step([row], OVERLAP) == StepPlan(StepPath.DECODE_GRAPH, 1, None, overlapped=True)
    row = _row(32, 31, 1, blocks=3)
    row.lookahead, row.computed_ahead = 1, 1  # position 32 computed a step ahead: context 33, the second variant
    assert plan_step([row] + _decode(2), OVERLAP).splits == 8


def test_a_plan_has_a_bucket_exactly_when_it_replays_a_graph():
    with pytest.raises(ValueError, match="bucket"):
        StepPlan(StepPath.DECODE_GRAPH)
    with pytest.raises(ValueError, match="bucket"):
        StepPlan(StepPath.EAGER, 4)
    assert StepPlan(StepPath.MIXED_GRAPH, 512, overlapped=True).describe() == "mixed_graph[512] overlapped"
