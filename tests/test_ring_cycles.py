"""Issue 26, item 7: rings written as cycles, `rings cycle (0, 2, 4, 1, 3), ...`.

* a cycle set compiles, checks and simulates; the same rings written as
  cycles (from any rank) and as shifts are the same program;
* a written order under `rings cycle` needs no `pieces` (one per cycle);
* P = 5, float64: `rings shift 1, -1`, the same two rings as cycles, and two
  rings no shift makes, each within 1e-12 of one process (one gloo launch);
* every value error at the item or cycle that causes it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipec.commands.attention import AttentionJob, attention_checks
from pipec.compiler.driver import compile_target
from pipec.compiler.lower_rings import ring_plan
from pipec.compiler.simulate import simulate
from pipec.dsl.spec import RingSpec
from pipec.errors import EvalError, ResolveError, UsageError
from source_util import error_of, located
from test_ring_order import ZIGZAG

SCHEDULE = """\
schedule s(P: ranks = 5) {
  sequence chunks 2 * P
  hold chunk c on rank c % P
  mask causal
  rings RINGS
}
"""
BOTH_WAYS = "cycle (0, 1, 2, 3, 4), (2, 1, 0, P - 1, 3)"  # rank 2 first: the ring is the same from any rank
NO_SHIFT = "cycle (0, 1, 2, 4, 3), (0, 2, 1, 3, 4)"  # arc-disjoint, and neither is r -> r + k


def _text(rings: str) -> str:
    return SCHEDULE.replace("RINGS", rings)


def _program(tmp_path, rings: str, **params):
    path = tmp_path / f"rings{abs(hash(rings))}.pipe"
    path.write_text(_text(rings))
    return compile_target(str(path), params).program  # compile_target runs every check


def test_cycles_compile_check_and_simulate_in_the_order_written(tmp_path):
    program = _program(tmp_path, NO_SHIFT)
    assert program.rings.rings == ((0, 1, 2, 4, 3), (0, 2, 1, 3, 4)) and program.rings.pieces == 2
    for rank, row in enumerate(program.ranks):  # KV leaves each rank for its successor on each ring
        peers = {p.peer for a in row if a.op == "EXCHANGE" for p in a.parts if p.op == "SEND_KV"}
        assert peers == {ring[(ring.index(rank) + 1) % 5] for ring in program.rings.rings}
    result = simulate(program)
    assert len(result.ranks) == 5 and result.makespan > 0


@pytest.mark.parametrize("cycles, shifts", [
    (BOTH_WAYS, "shift 1, -1"),
    ("cycle (3, 4, 0, 1, 2)", "shift 1"),
    ("cycle (0, 2, 4, 1, 3), (0, 3, 1, 4, 2)", "shift 2, 3"),
])
def test_cycles_equal_to_shifts_are_the_same_program(tmp_path, cycles, shifts):
    written, shifted = _program(tmp_path, cycles), _program(tmp_path, shifts)
    assert written.rings == shifted.rings
    assert written.ranks == shifted.ranks


def test_a_written_order_under_cycles_takes_one_piece_per_cycle(tmp_path):
    text = ZIGZAG.replace("rings shift 1", "rings cycle (0, 1, 2, 3)")
    assert text != ZIGZAG
    path = tmp_path / "written.pipe"
    path.write_text(text)
    program = compile_target(str(path), {"P": 4}).program
    assert program.ranks == compile_target("zigzag_ring", {"P": 4}).program.ranks


def test_on_five_ranks_bidirectional_and_written_rings_reproduce_one_process(tmp_path):
    programs = {rings: _program(tmp_path, rings) for rings in ("shift 1, -1", BOTH_WAYS, NO_SHIFT)}
    jobs = [AttentionJob(program, program.rings.chunks * program.rings.pieces * 2, heads=2, head_dim=4, batch=1,
                         dtype="float64", seed=seed) for seed, program in enumerate(programs.values())]
    for rings, result in zip(programs, attention_checks(jobs, 5, 60.0, deadline_s=300.0)):
        for field in ("out", "dq", "dk", "dv"):
            assert result[field] <= 1e-12, f"rings {rings}: {field} differs by {result[field]:.3g}"
            assert result["scale"][field] > 0.1  # the comparison is not of zeros


@pytest.mark.parametrize("rings, col, message", [
    ("cycle (0, 1, 7, 3, 4)", 22, "rank 7 of cycle 1 is outside 0..4"),
    ("cycle (0, 1, 2, 3, 4), (0, 2, 4, 1, -1)", 45, "rank -1 of cycle 2 is outside 0..4"),
    ("cycle (0, 1, 2, 2, 4)", 25, "rank 2 is listed twice in cycle 1 (items 3 and 4), so it leaves out rank 3: a "
                                  "ring visits every rank once"),
    ("cycle (0, 1, 2)", 15, "cycle 1 lists 3 of the 5 ranks and leaves out ranks 3 and 4: a ring visits "
                            "every rank once"),
    ("cycle (0, 1, 2, 3, 4, 5)", 15, "cycle 1 lists 6 ranks, but a ring over 5 ranks visits each once"),
    ("cycle (0, 1, 2, 3, 4), (0, 2, 3, 4, 1)", 32,
     "cycles 1 and 2 share the arc 2 -> 3: the rings must be arc-disjoint, as every other kind's are, so that each "
     "link carries one ring's KV (`pieces EXPR` cuts more KV pieces over the same rings)"),
    ("cycle (0, 1, 2, 3, 4), (0, 2, 4, 1, 3), (4, 0, 1, 2, 3)", 49,
     "cycles 1 and 3 are the same ring: the rings must be arc-disjoint, as every other kind's are, so that each "
     "link carries one ring's KV (`pieces EXPR` cuts more KV pieces over the same rings)"),
])
def test_a_cycle_that_is_no_ring_of_the_ranks_is_refused_where_written(rings, col, message):
    assert located(error_of(EvalError, _text(rings)), 5, col) == message


def test_a_cycle_written_for_other_ranks_is_refused_at_its_size():
    error = error_of(EvalError, _text("cycle (0, 1, 2, 3, 4)"), P=4)
    assert located(error, 5, 15) == "cycle 1 lists 5 ranks, but a ring over 4 ranks visits each once"


@pytest.mark.parametrize("rings, col, message", [
    ("cycle", 3, "`rings cycle` takes one or more cycles, each every rank once in ring order: `rings cycle (0, 2, "
                 "1, 3), ...`"),
    ("cycle P", 15, "a cycle of ranks is written in place as a tuple of ranks in ring order, `(0, 2, 1, 3)`: KV "
                    "goes from each rank to the next, and from the last back to the first"),
    ("cycle (0, true, 2, 3, 4)", 19, "a rank of a cycle must be an integer, not a boolean"),
])
def test_a_cycle_not_written_as_ranks_is_refused_where_written(rings, col, message):
    assert located(error_of(ResolveError, _text(rings)), 5, col) == message


def test_a_hand_built_spec_with_cycles_sharing_an_arc_is_refused():
    spec = RingSpec(chunks=3, holders=(0, 1, 2), causal=True, rings="cycle", ring_args=((0, 1, 2), (1, 2, 0)))
    with pytest.raises(UsageError, match=r"^rings cycle: arc 1 -> 2 is used twice \(again by ring 1\)$"):
        ring_plan(spec, 3)
    assert ring_plan(replace(spec, ring_args=((0, 1, 2), (0, 2, 1))), 3).rings == ((0, 1, 2), (0, 2, 1))
