"""Stages placed on groups of ranks, and sub-steps of a compute on the group's communicator (docs/ir.md, placements).

The program of these tests: stage 0 sharded on ranks {0, 1}, each member gathering
the stage's weights from the group's shards (a ``GATHER`` sub-step) inside every
forward and backward and dropping them after it (``RESHARD``), then
reduce-scattering the stage's gradient (``REDUCE_GRAD``); stage 1 on rank 2 alone. Each member hands its share of
an activation to rank 2, which hands each member its share of the gradient.
It is proved by ``check_all`` (the placement checks and the one symbolic run);
each planted hazard is named with its own message, at its rank and step.
"""
from __future__ import annotations

import copy
import io
import json
from dataclasses import replace

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.driver import compile_target
from pipec.compiler.emit import program_from_json, program_to_json
from pipec.compiler.emit.json_program import write_program_json
from pipec.compiler.ir import Action, Communicator, Placement, Program, StageInfo, batch
from pipec.errors import ConflictError, DeadlockError, ImportError_, MatchError, UsageError, WellFormedError

GROUP = Placement((0, 1), 0, sharded=True)


def _compute(op: str, stage: int, mb: int, substep: bool = True) -> Action:
    return Action(stage, op, mb, -1, (Action(stage, ops.GATHER, mb),) if substep else ())


def placed() -> Program:
    reshard = Action(0, ops.RESHARD)
    member = [_compute("F", 0, 0), reshard, Action(0, "SEND_F", 0, 2), _compute("F", 0, 1), reshard,
              Action(0, "SEND_F", 1, 2), Action(0, "RECV_B", 0, 2), _compute("B", 0, 0), reshard,
              Action(0, "RECV_B", 1, 2), _compute("B", 0, 1), Action(-1, ops.EXCHANGE, 0, -1, (Action(0, ops.REDUCE_GRAD),)),
              reshard, Action(-1, ops.EXCHANGE_WAIT, 0)]
    last = [batch([Action(1, "RECV_F", 0, 0), Action(1, "RECV_F", 0, 1)]), Action(1, "F", 0),
            batch([Action(1, "RECV_F", 1, 0), Action(1, "RECV_F", 1, 1)]), Action(1, "F", 1),
            Action(1, "B", 0), batch([Action(1, "SEND_B", 0, 0), Action(1, "SEND_B", 0, 1)]),
            Action(1, "B", 1), batch([Action(1, "SEND_B", 1, 0), Action(1, "SEND_B", 1, 1)])]
    return Program("placed", 3, 2, [StageInfo(0, 0, 0, 0, GROUP), StageInfo(1, 2, 0, 1)], [[0, 1]], [0, 0],
                   [list(member), list(member), last], communicators=[Communicator(0, (0, 1), ops.STAGE_GROUP, 0)])


def with_row(program: Program, rank: int, change) -> Program:
    ranks = [list(row) for row in program.ranks]
    ranks[rank] = change(ranks[rank])
    return replace(program, ranks=ranks)


def _through_json(program: Program) -> dict:
    return json.loads(json.dumps(program_to_json(program)))


# ------------------------------------------------------------------ proved


def test_a_stage_on_a_group_with_a_sub_step_before_its_forward_is_proved():
    program = placed()
    assert program.placed_on_groups
    assert program.grid()[0][:3] == ["(0GATHER0)0F0", "0RESHARD", "0SEND_F0"]
    check_all(program)


def test_the_program_file_carries_the_group_and_the_sub_steps_and_reads_back_proved():
    program = placed()
    data = _through_json(program)
    assert data["stages"][0]["placement"] == {"ranks": [0, 1], "communicator": 0, "sharded": True,
                                              "shares": [0, 1], "shards": [0, 1], "saver": 0}
    assert "placement" not in data["stages"][1]  # one rank: as every file before
    assert data["ranks"][0][0] == {"op": "F", "text": "(0GATHER0)0F0", "stage": 0, "mb": 0, "parts": [
        {"op": "GATHER", "text": "0GATHER0", "stage": 0, "mb": 0}]}
    out = io.StringIO()
    write_program_json(program, out)
    assert json.loads(out.getvalue()) == data
    back = program_from_json(data)
    assert back == program
    check_all(back)


def test_shares_meet_where_their_intervals_overlap():
    program = placed()
    assert program.share_peers(0, 0, 1) == program.share_peers(0, 1, 1) == (2,)
    assert program.share_peers(1, 2, 0) == (0, 1)
    four = Program("four", 4, 1, [StageInfo(0, 0, 0, 0, Placement((0, 1), 0)), StageInfo(1, 2, 0, 1, Placement((2, 3), 1))],
                   [[0, 1]], [0], [[], [], [], []],
                   communicators=[Communicator(0, (0, 1), ops.STAGE_GROUP, 0), Communicator(1, (2, 3), ops.STAGE_GROUP, 1)])
    assert [four.share_peers(0, r, 1) for r in (0, 1)] == [(2,), (3,)]  # member i to member i


def test_programs_without_groups_are_unchanged():
    program = compile_target("1f1b", {"P": 4, "N": 8}).program
    assert not program.placed_on_groups and all(s.placement is None for s in program.stages)
    assert all("placement" not in s for s in program_to_json(program)["stages"])
    data = _through_json(program)
    data["ranks"][0][0] = {"op": "GATHER", "text": "0GATHER0", "stage": 0, "mb": 0}
    with pytest.raises(ImportError_) as caught:
        program_from_json(data)
    assert caught.value.message == ("GATHER is a sub-step of a compute of a stage placed on a group of ranks, and "
                                    "this program places none (no stage has a \"placement\")")
    data["ranks"][0][0] = {"op": "ZZ", "text": "ZZ"}
    with pytest.raises(ImportError_) as caught:
        program_from_json(data)
    known = caught.value.message.split("; known: ")[1].split(", ")
    assert "GATHER" not in known and "ALLGATHER_W" in known  # the ops a file without groups may hold are as before
    data = _through_json(program)
    data["ranks"][0][0]["parts"] = [{"op": "GATHER", "text": "0GATHER0", "stage": 0, "mb": 0}]
    with pytest.raises(ImportError_, match=r"only a BATCH, an EXCHANGE or an all_to_all \(ALLTOALL_KV, ALLTOALL_DKV\) "
                                           r"has \"parts\", not F"):
        program_from_json(data)


# ----------------------------------------------------------------- hazards


def test_a_member_that_skips_the_sub_step_is_named():
    skipped = with_row(placed(), 1, lambda row: [_compute("F", 0, 0, substep=False)] + row[1:])
    with pytest.raises(WellFormedError) as caught:
        check_all(skipped)
    assert caught.value.message == ("rank 1 runs 0F0 without the sub-step 0GATHER0 that rank 0 runs in it (step 0): "
                                    "every member of stage 0's group (ranks 0, 1) runs each compute with the same "
                                    "sub-steps, in the same order")
    assert (caught.value.rank, caught.value.step, caught.value.marks) == (1, 0, [(0, 0)])


def test_members_meeting_the_groups_collectives_out_of_order_are_named():
    # rank 1 runs microbatch 1 first: its first gather on the group is another than rank 0's
    swapped = with_row(placed(), 1, lambda row: row[3:6] + row[0:3] + row[6:])
    with pytest.raises(MatchError) as caught:
        check_all(swapped)
    assert caught.value.message == (
        f"the 1st collective on communicator 0 ({ops.STAGE_GROUP} 0: ranks 0, 1) is 0GATHER1 here but 0GATHER0 "
        "on rank 0 (step 0): every member must meet its collectives in the same order")
    assert (caught.value.rank, caught.value.step) == (1, 0)


def test_a_placement_naming_a_rank_outside_the_program_is_named():
    outside = replace(placed(), stages=[StageInfo(0, 0, 0, 0, Placement((0, 3), 0)), StageInfo(1, 2, 0, 1)])
    with pytest.raises(WellFormedError) as caught:
        check_all(outside)
    assert caught.value.message == "stage 0 is placed on ranks 0, 3, but rank 3 is none of the program's (ranks 0..2)"
    assert caught.value.rank == 0


def test_a_p2p_to_a_group_addressed_wrongly_is_named():
    # rank 2 hands rank 1's share of the gradient to rank 0, which holds the other share
    wrong = with_row(placed(), 2, lambda row: row[:5] + [batch([Action(1, "SEND_B", 0, 0), Action(1, "SEND_B", 0, 0)])]
                     + row[6:])
    with pytest.raises(MatchError) as caught:
        check_all(wrong)
    assert caught.value.message == ("1SEND_B0 sends rank 2's share of the gradient of 1B0 to rank 0 a second time: "
                                    "every member of stage 0 (on ranks 0, 1) takes its own share, from rank 2")
    # a member sending its share to its own group instead of the next stage's
    inward = with_row(placed(), 1, lambda row: row[:2] + [Action(0, "SEND_F", 0, 0)] + row[3:])
    with pytest.raises(MatchError) as caught:
        check_all(inward)
    assert caught.value.message == ("0SEND_F0 sends rank 1's share of the activation of 0F0 to rank 0, but stage 1 "
                                    "(on rank 2) takes that share on rank 2")
    assert (caught.value.rank, caught.value.step) == (1, 2)


def test_a_share_read_before_it_arrives_is_named():
    early = with_row(placed(), 1, lambda row: row[:6] + [row[7], row[6]] + row[8:])
    with pytest.raises(ConflictError) as caught:
        check_all(early)
    assert caught.value.message == ("(0GATHER0)0B0 reads rank 2's share of the gradient of 1B0, which this rank has "
                                    "not received before it")
    assert (caught.value.rank, caught.value.step) == (1, 6)


def test_a_gather_waiting_on_a_member_that_waits_on_the_next_stage_is_a_deadlock_naming_the_cycle():
    # rank 1 waits for its gradient before its second forward; rank 2 sends it only after that forward's
    # activation, which rank 0 makes only after the gather rank 1 has not joined
    held = with_row(placed(), 1, lambda row: row[:3] + [row[6]] + row[3:6] + row[7:])
    with pytest.raises(DeadlockError) as caught:
        check_all(held)
    assert caught.value.message == (
        "deadlock: rank 0 (step 3) waits in (0GATHER1)0F1 for rank 1 to join 0GATHER1; rank 1 (step 3) waits in "
        "0RECV_B0 for 0RECV_B0 to meet rank 2; rank 2 (step 2) waits in (1RECV_F1;1RECV_F1)BATCH for 1RECV_F1 to "
        "meet ranks 0, 1")
    assert (caught.value.rank, caught.value.step, caught.value.marks) == (0, 3, [(1, 3), (2, 2)])


def test_sub_steps_and_tasks_are_held_to_their_stage_and_member():
    cases = (
        (2, lambda row: row[:1] + [_compute("F", 1, 0)] + row[2:],
         "(1GATHER0)1F0 holds sub-steps, but stage 1 lives on one rank: sub-steps meet on the group a stage is "
         "placed on"),
        (0, lambda row: [Action(0, ops.GATHER, 0), _compute("F", 0, 0, False)] + row[1:],
         "0GATHER0 stands outside a compute: a sub-step (GATHER) is a part of the compute it runs in"),
        (0, lambda row: [Action(0, "F", 0, -1, (Action(0, ops.GATHER, 1),))] + row[1:],
         "(0GATHER1)0F0 holds 0GATHER1, which names another compute: a sub-step names the stage and microbatch "
         "of the compute it runs in"),
        (1, lambda row: row[:10], "task 0B1 is missing (or 0I1 and 0W1) on rank 1 (ranks 0, 1 run stage 0)"),
        (2, lambda row: row + [Action(0, "F", 0)], "0F0 runs on rank 2, but stage 0 lives on ranks 0, 1"),
        (0, lambda row: row + [row[0]], "(0GATHER0)0F0 appears twice on rank 0 (first at step 0)"),
    )
    for rank, change, message in cases:
        with pytest.raises(WellFormedError) as caught:
            check_all(with_row(placed(), rank, change))
        assert caught.value.message == message


# ---------------------------------------------------------- the JSON reader


def _bad_files():
    def stage0(**changes):
        return lambda data: data["stages"][0]["placement"].update(changes)

    yield "a rank outside the program", stage0(ranks=[0, 3]), r'"stages\[0\]\.placement\.ranks"\[1\] must be an integer in 0\.\.2, got 3'
    yield "an empty group", stage0(ranks=[]), r"stages\[0\]\.placement\.ranks must list two or more ranks"
    yield "one rank", stage0(ranks=[0]), r"stages\[0\]\.placement\.ranks must list two or more ranks"
    yield "placed twice inconsistently", lambda data: data["stages"][0].update(rank=1), (
        r"stage 0 is on rank 1 but placed on ranks \[0, 1\]: a stage on a group names its first member")
    yield "a communicator whose members differ", lambda data: data["communicators"][0].update(ranks=[0, 2]), (
        r"stage 0 is placed on ranks \[0, 1\], but its communicator 0 is .* on ranks \[0, 2\]: a stage's group meets "
        "on a communicator of exactly its members")
    yield "no such communicator", stage0(communicator=4), (
        r"stage 0 is placed on ranks \[0, 1\] meeting on communicator 4, but \"communicators\" lists 1")
    yield "a sub-step standing alone", lambda data: data["ranks"][0].insert(0, data["ranks"][0][0]["parts"][0]), (
        r"GATHER is a sub-step of a compute")
    yield "empty sub-steps", lambda data: data["ranks"][0][0].update(parts=[]), r"a F with sub-steps needs a non-empty list \"parts\""


@pytest.mark.parametrize("what,mutate,message", list(_bad_files()), ids=[name for name, _, _ in _bad_files()])
def test_bad_placements_in_a_program_file_are_refused_with_a_located_error(what, mutate, message):
    data = copy.deepcopy(_through_json(placed()))
    mutate(data)
    with pytest.raises(ImportError_, match=message):
        program_from_json(data)


# ----------------------------------------------- interpretations that refuse


def test_the_simulator_refuses_groups_of_different_sizes_by_name():
    # A group of two hands each member's share to one rank: the simulator prices groups of one size
    # (tests/test_compose_simulate.py runs those).
    from pipec.compiler.simulate import simulate

    with pytest.raises(UsageError, match="^placed places its stages on groups of 1 and 2 ranks; the simulator"):
        simulate(placed())


def test_the_runtime_and_torchs_csv_refuse_a_stage_on_a_group_by_name():
    from argparse import Namespace

    from pipec.commands.run import check_launch
    from pipec.compiler.emit.torch_csv import write_torch_csv

    said = "placed places stage 0 on the group of ranks 0, 1; pipec proves a program with stages on rank groups, but"
    # the runtime trains stages on groups of one size (PP x DP, PP x FSDP: tests/test_compose_runtime.py)
    with pytest.raises(UsageError, match="^placed: placed places stage 0 on the group of ranks 0, 1, but its stages "
                                         r"sit on groups of different sizes \(1, 2\)"):
        check_launch(Namespace(target="placed"), placed())
    with pytest.raises(UsageError, match=rf"^{said} torch's schedule CSV \(one rank per stage\) does not run one yet$"):
        write_torch_csv(placed(), with_comms=True)
