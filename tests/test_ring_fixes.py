"""Issue 26, item 6 (its sequence-ring and weight-check points): the checks agree with the runtime, and say where.

* a TawPipe group reducing a layer again after its sum left (the runtime
  faults): named at the reduce;
* `rings shift 1, -1`: two rings, compiled, checked, simulated, and run on 4
  gloo ranks within 1e-12 of one process in float64;
* an exchange listing its receive before its send (the runtime runs it):
  accepted, and run on 4 ranks; a send of another exchange still running is
  still a stale buffer;
* one rank moving an all_to_all exchange to point to point: a matching error
  naming both ranks, not a deadlock;
* errors' places: rails the ring search refuses at `file:line:col`, a ring
  error's instruction with its written `at step` beside it, a skipped forward
  block named never computed.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipec.commands.attention import AttentionJob, attention_checks
from pipec.compiler import ops
from pipec.compiler.checks import check_weights
from pipec.compiler.checks.rings import check_rings
from pipec.compiler.driver import compile_target
from pipec.compiler.ir import Action, Program
from pipec.compiler.simulate import simulate
from pipec.errors import CoverageError, EvalError, MatchError, RouteError
from cli_util import cli
from source_util import error_of, located
from test_ring_order import ZIGZAG as ZIGZAG_WRITTEN


def _with_rows(program: Program, rows: dict[int, list[Action]]) -> Program:
    ranks = list(program.ranks)
    for rank, row in rows.items():
        ranks[rank] = row
    return replace(program, ranks=ranks)


# ------------------------------------------------------------------ weight passing


def test_a_group_reducing_a_layer_again_after_its_sum_left_is_named_at_the_reduce():
    """TawPipe (P = 4, G = 2): group {0, 1} reduces layer 3 to rank 1, which sends the sum to the owner, rank 3.

    The group then reduces layer 3 once more: rank 1 ends holding a (zero) partial
    of a layer it does not own, on which the runtime faults; the check names it.
    """
    program = compile_target("tawpipe", {"P": 4, "G": 2}).program
    assert program.weights.owners[3] == 3 and program.weights.groups[:2] == (0, 0)
    rows = {}
    for rank in (0, 1):
        row = list(program.ranks[rank])
        reduce = next(a for a in row if a.op == ops.EXCHANGE and any(
            p.op == ops.REDUCE_G and program.stages[p.stage].position == 3 for p in a.parts))
        part = next(p for p in reduce.parts if p.op == ops.REDUCE_G)
        assert part.peer == 1
        number = 1 + max(a.mb for a in row if a.op == ops.EXCHANGE)
        rows[rank] = row + [Action(-1, ops.EXCHANGE, number, parts=(part,)), Action(-1, ops.EXCHANGE_WAIT, number)]
    assert any(p.op == ops.SEND_G for a in program.ranks[1] if a.op == ops.EXCHANGE for p in a.parts)
    again = _with_rows(program, rows)
    with pytest.raises(RouteError) as caught:
        check_weights(again)
    error = caught.value
    assert (error.rank, error.step) == (1, len(program.ranks[1]))
    assert str(error).splitlines()[0] == (
        f"rank 1, step {len(program.ranks[1])}: 7REDUCE_G5 reduces layer 3's gradient again after its sum left "
        "this rank: this rank, which does not own the layer, is left with a partial that is never sent on (the "
        "runtime faults at its end)")


# ------------------------------------------------------------------ several shift rings

BIDIRECTIONAL = """\
schedule s(P: ranks = 4) {
  sequence chunks 2 * P
  hold chunk c on rank c % P
  mask causal
  rings shift 1, -1
}
"""


def _bidirectional(tmp_path, P: int):
    path = tmp_path / "bidirectional.pipe"
    path.write_text(BIDIRECTIONAL)
    return compile_target(str(path), {"P": P}).program  # compile_target runs every check


@pytest.mark.parametrize("P", [3, 4, 5])
def test_two_opposite_shift_rings_compile_check_and_simulate(tmp_path, P):
    program = _bidirectional(tmp_path, P)
    rings = program.rings
    assert rings.rings == (tuple(range(P)), tuple((-i) % P for i in range(P)))
    assert rings.pieces == 2  # one piece per ring by default
    for rank, row in enumerate(program.ranks):  # KV leaves every rank both ways
        peers = {p.peer for a in row if a.op == ops.EXCHANGE for p in a.parts if p.op == "SEND_KV"}
        assert peers == {(rank + 1) % P, (rank - 1) % P}
    result = simulate(program)
    assert len(result.ranks) == P and result.makespan == max(r.busy + r.idle for r in result.ranks) > 0


def test_two_offsets_of_one_ring_are_refused_at_the_second():
    error = error_of(EvalError, BIDIRECTIONAL.replace("shift 1, -1", "shift 1, 5"))
    assert located(error, 5, 18) == ("the ring offsets 1 and 5 make the same ring on 4 ranks (r -> r + 1): write "
                                     "each ring once")


def test_an_offset_sharing_a_factor_with_the_ranks_is_refused_where_written():
    error = error_of(EvalError, BIDIRECTIONAL.replace("shift 1, -1", "shift 1, 2"))
    assert located(error, 5, 18) == ("the ring offset 2 shares the factor 2 with the 4 ranks: the ring r -> r + 2 "
                                     "would visit only 2 of them; pick an offset coprime with 4")


# ------------------------------------------------------------------ an exchange listing its receive first


def _receives_first(program: Program) -> Program:
    """Every exchange's parts reversed: the receive of each ring step listed before its send."""
    return replace(program, ranks=[[a._replace(parts=tuple(reversed(a.parts))) if a.op == ops.EXCHANGE else a
                                    for a in row] for row in program.ranks])


def test_an_exchange_listing_its_receive_before_its_send_is_accepted():
    """zigzag: an exchange sends the bundle its receive replaces; one wait completes both, in either order."""
    program = compile_target("zigzag_ring", {"P": 4}).program
    row = program.ranks[0]
    assert any(a.op == ops.EXCHANGE and [p.op for p in a.parts] == ["SEND_KV", "RECV_KV"]
               and a.parts[0].mb == a.parts[1].mb for a in row)  # one buffer: sent, then replaced
    report = check_rings(_receives_first(program))
    assert report == check_rings(program)


def test_a_send_of_another_exchange_still_running_is_still_a_stale_buffer():
    """Rank 0's second ring step split in two: its receive, waited first, replaces the bundle still being sent."""
    program = compile_target("zigzag_ring", {"P": 3}).program
    row = list(program.ranks[0])
    index = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE and a.mb == 1)
    send, recv = row[index].parts
    assert (send.op, recv.op, send.mb, recv.mb) == ("SEND_KV", "RECV_KV", 0, 0)
    wait = row.index(Action(-1, ops.EXCHANGE_WAIT, 1))
    row[wait:wait + 1] = [Action(-1, ops.EXCHANGE_WAIT, 99), row[wait]]
    row[index:index + 1] = [row[index]._replace(parts=(send,)), Action(-1, ops.EXCHANGE, 99, parts=(recv,))]
    with pytest.raises(RouteError) as caught:
        check_rings(_with_rows(program, {0: row}))
    assert str(caught.value).splitlines()[0] == (
        f"rank 0, instruction {wait + 1}: rank 1's KV bundle of piece 0 arrives into the buffer of rank 2's KV "
        "bundle of piece 0 while that one is still being sent: a stale buffer reused")


def test_on_four_ranks_two_opposite_rings_and_receives_listed_first_reproduce_one_process(tmp_path):
    programs = {"bidirectional": _bidirectional(tmp_path, 4),
                "zigzag, receives first": _receives_first(compile_target("zigzag_ring", {"P": 4}).program)}
    jobs = [AttentionJob(program, program.rings.chunks * program.rings.pieces * 3, heads=2, head_dim=4, batch=2,
                         dtype="float64", seed=seed) for seed, program in enumerate(programs.values())]
    for name, result in zip(programs, attention_checks(jobs, 4, 60.0, deadline_s=300.0)):
        for field in ("out", "dq", "dk", "dv"):
            assert result[field] <= 1e-12, f"{name}: {field} differs by {result[field]:.3g}"
            assert result["scale"][field] > 0.1  # the comparison is not of zeros


# ------------------------------------------------------------------ mixed batching


def test_one_rank_moving_an_all_to_all_exchange_to_point_to_point_is_a_matching_error_naming_both_ranks():
    program = compile_target("tasp", {"P": 3}).program
    row = list(program.ranks[1])
    index = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE)
    (alltoall,) = row[index].parts
    assert alltoall.op == "ALLTOALL_KV"
    row[index] = row[index]._replace(parts=alltoall.parts)  # the same messages, point to point
    with pytest.raises(MatchError) as caught:
        check_rings(_with_rows(program, {1: row}))
    error = caught.value
    assert (error.rank, error.step, error.marks) == (1, index, [(2, 0)])
    assert str(error).splitlines()[0] == (
        f"rank 1, instruction {index} (at step 0): 1SEND_KV0 on rank 1 is a point-to-point message, but rank 2 "
        "moves its side, 1RECV_KV0, inside (2SEND_KV0;1RECV_KV0;2SEND_KV1;0RECV_KV1)ALLTOALL_KV0 (instruction 0): "
        "both sides of a message must move it alike")


# ------------------------------------------------------------------ where errors point


def test_a_rail_shape_with_no_rings_is_a_value_error_at_the_written_rails(capsys):
    status, out, err = cli(capsys, "check", "tasp:tasp_rails", "-D", "M=3", "-D", "K=2")
    assert status == 1 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("schedules/tasp.pipe:36:15: 3 nodes x 2 devices: no such rings exist: ")
    assert lines[0].endswith("after an odd number (3) of nodes it cannot close")
    assert lines[1:] == ["      rings rails M, K", "                  ^~~~"]
    assert "Traceback" not in err


def test_a_skipped_forward_block_is_named_never_computed_at_its_chunks_first_backward():
    program = compile_target("zigzag_ring", {"P": 3}).program
    skipped = next(a for a in program.ranks[1] if a.op == ops.AF)
    row = [a for a in program.ranks[1] if a != skipped]
    first_backward = next(i for i, a in enumerate(row) if a.op == ops.AB and a.stage == skipped.stage)
    with pytest.raises(CoverageError) as caught:
        check_rings(_with_rows(program, {1: row}))
    kv, piece = program.rings.unblock(skipped.mb)
    backward = row[first_backward]
    assert (caught.value.rank, caught.value.step) == (1, first_backward)
    assert caught.value.message == (
        f"{backward.text()}: the block (query chunk {skipped.stage}, kv chunk {kv}, piece {piece}) is never computed "
        f"forward (1 visible block of chunk {skipped.stage} missing), and the block (query chunk {backward.stage}, "
        f"kv chunk {program.rings.unblock(backward.mb)[0]}, piece 0) needs its queries' global output and "
        "log-sum-exp")


def test_a_forward_block_moved_after_its_chunks_backward_is_still_an_order_error():
    program = compile_target("zigzag_ring", {"P": 3}).program
    moved = next(a for a in program.ranks[1] if a.op == ops.AF)
    row = [a for a in program.ranks[1] if a != moved] + [moved]
    with pytest.raises(CoverageError, match=r"runs backward before the forward of block \(query chunk "
                                            rf"{moved.stage}, "):
        check_rings(_with_rows(program, {1: row}))


def test_a_ring_error_names_the_instruction_and_beside_it_the_written_step(tmp_path):
    """The documented zigzag order with KV taken from the wrong side: 3AF0 is written `at step 1` (rank 3 takes
    kv chunk 0 at t with (3 + t) % 4 == 0), a later instruction of rank 3's list."""
    text = ZIGZAG_WRITTEN.replace("let h = (r - t) % P", "let h = (r + t) % P")
    path = tmp_path / "written.pipe"
    path.write_text(text)
    with pytest.raises(RouteError) as caught:
        compile_target(str(path), {"P": 4})
    error = caught.value
    assert (error.rank, error.written_step) == (3, 1) and error.step > 1
    assert error.grid[3][error.step] == "3AF0"
    assert str(error).splitlines()[0] == (
        f"rank 3, instruction {error.step} (at step 1): 3AF0: the block (query chunk 3, kv chunk 0, piece 0) needs "
        "rank 0's KV bundle of piece 0, which this rank does not hold now")


def test_ring_steps_are_recorded_for_every_instruction_of_the_lowered_lists():
    program = compile_target("zigzag_ring", {"P": 3}).program
    steps = program.rings.steps
    for rank, row in enumerate(program.ranks):
        assert len(steps[rank]) == len(row) and list(steps[rank]) == sorted(steps[rank])
        assert {steps[rank][i] for i, a in enumerate(row) if a.op == ops.AF} == {0, 1, 2}
        assert {steps[rank][i] for i, a in enumerate(row) if a.op == ops.AB} == {3, 4, 5}


def test_other_families_keep_step_for_the_instruction_index():
    program = compile_target("fsdp", {"P": 2}).program
    row = [a for a in program.ranks[1]]
    row.insert(3, Action(-1, ops.EXCHANGE_WAIT, 999))
    with pytest.raises(MatchError) as caught:
        check_weights(_with_rows(program, {1: row}))
    assert str(caught.value).startswith("rank 1, step 3: EXCHANGE_WAIT999 waits for exchange 999")
