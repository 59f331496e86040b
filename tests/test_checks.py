"""The safety checks on planted faults: each is caught, located and named.

Faults are planted in hand-checked programs (compute orders from
reference_orders, lowered with insert_communication); every test asserts the
error class, the rank and step it points at, and the words that name the fault.
"""
from __future__ import annotations

import pytest

from pipec.compiler.checks import (
    check_all,
    check_conflict,
    check_deadlock,
    check_matching,
    check_memory,
    check_well_formed,
    peak_activations,
)
from pipec.compiler.ir import (
    ALLREDUCE_GRAD,
    ALLREDUCE_WAIT,
    FREE_F,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Program,
)
from pipec.compiler.liveness import insert_frees
from pipec.compiler.lower_comms import insert_communication
from pipec.errors import BudgetError, ConflictError, DeadlockError, MatchError, ProgramError, WellFormedError
from reference_orders import compute_program, gpipe, one_f_one_b
from test_lower_comms import bidirectional, v_shape


def texts(program: Program, rank: int) -> list[str]:
    return [a.text() for a in program.ranks[rank]]


def step_of(program: Program, rank: int, text: str) -> int:
    return texts(program, rank).index(text)


def unbatch(program: Program, rank: int, text: str) -> None:
    """Replace the BATCH written ``text`` on ``rank`` by its parts, one instruction each, in order."""
    row = program.ranks[rank]
    step = step_of(program, rank, text)
    row[step:step + 1] = list(row[step].parts)


def assert_located(error: ProgramError, rank: int, step: int | None) -> None:
    assert (error.rank, error.step) == (rank, step)
    rendered = error.render()
    head = f"rank {rank}, step {step}: " if step is not None else f"rank {rank}: "
    assert rendered.startswith(head + error.message)
    if step is not None:
        marked = error.grid[rank][step]
        assert f"[{marked}]" in rendered  # the grid window marks the cell


def compute_orders(program: Program) -> list[list[tuple[str, int, int]]]:
    return [[(a.op, a.stage, a.mb) for a in row] for row in program.ranks]


# ----------------------------------------------------------------- well-formed


def test_duplicated_task_is_named_with_both_places():
    orders = compute_orders(gpipe(2, 2))
    orders[0].append(("F", 0, 1))
    program = compute_program("dup", [0, 1], 2, orders)
    with pytest.raises(WellFormedError) as info:
        check_well_formed(program)
    assert_located(info.value, 0, 4)
    assert "0F1 appears twice (first at rank 0, step 1)" in info.value.message
    assert (0, 1) in info.value.marks


def test_missing_task_is_named_at_its_forward():
    orders = compute_orders(gpipe(2, 2))
    orders[1].remove(("B", 1, 1))
    program = compute_program("missing", [0, 1], 2, orders)
    with pytest.raises(WellFormedError) as info:
        check_all(insert_communication(program))
    assert "task 1B1 is missing" in info.value.message
    assert info.value.rank == 1 and info.value.grid[1][info.value.step] == "1F1"


def test_missing_forward_and_split_backward_mixes():
    cases = [
        ([("F", 0, 0), ("B", 0, 0)], [("B", 1, 0)], "task 1F0 is missing"),
        ([("F", 0, 0), ("B", 0, 0), ("I", 0, 0), ("W", 0, 0)], [("F", 1, 0), ("B", 1, 0)], "0B0 and 0I0 both appear"),
        ([("F", 0, 0), ("I", 0, 0)], [("F", 1, 0), ("B", 1, 0)], "task 0W0 is missing"),
        ([("F", 0, 0), ("B", 0, 0), ("W", 0, 0)], [("F", 1, 0), ("B", 1, 0)], "0B0 and"),
    ]
    for rank0, rank1, words in cases[:3]:
        with pytest.raises(WellFormedError, match=words):
            check_well_formed(compute_program("mix", [0, 1], 1, [rank0, rank1]))
    rank0, rank1, _ = cases[3]
    with pytest.raises(WellFormedError, match="task 0I0 is missing"):
        check_well_formed(compute_program("mix", [0, 1], 1, [rank0, rank1]))


def test_compute_on_the_wrong_rank():
    orders = compute_orders(gpipe(2, 2))
    orders[1].remove(("F", 1, 0))
    orders[0].insert(1, ("F", 1, 0))
    program = compute_program("wrong", [0, 1], 2, orders)
    with pytest.raises(WellFormedError) as info:
        check_well_formed(program)
    assert_located(info.value, 0, 1)
    assert "1F0 runs on rank 0, but stage 1 lives on rank 1" in info.value.message
    with pytest.raises(ConflictError) as info:
        check_conflict(program)
    assert_located(info.value, 0, 1)
    assert "another rank's buffers" in info.value.message


def test_b_before_its_f_on_the_same_rank():
    orders = compute_orders(one_f_one_b(2, 2))
    assert orders[1][:2] == [("F", 1, 0), ("B", 1, 0)]
    orders[1][:2] = [("B", 1, 0), ("F", 1, 0)]
    program = compute_program("early", [0, 1], 2, orders)
    with pytest.raises(WellFormedError) as info:
        check_well_formed(program)
    assert_located(info.value, 1, 0)
    assert info.value.message == "1B0 needs 1F0, which comes later on this rank (step 1)"
    assert (1, 1) in info.value.marks


def test_cross_rank_dependency_cycle_names_every_member():
    program = compute_program("cycle", [0, 1], 2, [
        [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
        [("F", 1, 1), ("B", 1, 1), ("F", 1, 0), ("B", 1, 0)],
    ])
    with pytest.raises(WellFormedError) as info:
        check_well_formed(program)
    error = info.value
    assert_located(error, 0, 1)
    assert error.message == ("dependency cycle: rank 0 step 1 (0B0) needs 1B0 (rank 1 step 3); "
                             "rank 1 step 0 (1F1) needs 0F1 (rank 0 step 2)")
    assert error.marks == [(1, 0)]


@pytest.mark.parametrize("action,words", [
    (Action(5, "F", 0), "there is no stage 5"),
    (Action(0, "F", 9), "there is no microbatch 9"),
])
def test_out_of_range_tasks(action, words):
    program = gpipe(2, 2)
    program.ranks[0].insert(2, action)
    with pytest.raises(WellFormedError, match=words) as info:
        check_all(program)
    assert_located(info.value, 0, 2)


def test_microbatch_that_does_not_ride_the_stage():
    program = bidirectional()  # mb 2 rides the up pipeline; stage 0 is on the down one
    program.ranks[0].append(Action(0, "F", 2))
    with pytest.raises(WellFormedError, match="microbatch 2 rides pipeline 1, but stage 0 belongs to pipeline 0"):
        check_well_formed(program)


# -------------------------------------------------------------------- matching


def test_swapped_send_order_on_a_pair_names_both_ranks_and_tensors():
    program = insert_communication(gpipe(2, 4))
    row = program.ranks[0]
    first, second = step_of(program, 0, "0SEND_F1"), step_of(program, 0, "0SEND_F2")
    row[first], row[second] = row[second], row[first]
    with pytest.raises(MatchError) as info:
        check_all(program)
    error = info.value
    assert_located(error, 1, step_of(program, 1, "1RECV_F1"))
    for words in ("rank 0", "rank 1", "activation of 0F1", "activation of 0F2", "out of order"):
        assert words in error.message
    assert sorted(error.marks) == [(0, first), (0, second)]


def test_a_receive_nobody_sends_and_a_send_nobody_receives():
    program = insert_communication(gpipe(2, 2))
    del program.ranks[0][step_of(program, 0, "0SEND_F0")]
    with pytest.raises(MatchError) as info:
        check_matching(program)
    assert_located(info.value, 1, step_of(program, 1, "1RECV_F0"))
    assert "which never sends it" in info.value.message

    program = insert_communication(gpipe(2, 2))
    del program.ranks[1][step_of(program, 1, "1RECV_F0")]
    with pytest.raises(MatchError) as info:
        check_matching(program)
    assert_located(info.value, 0, step_of(program, 0, "0SEND_F0"))
    assert "which never receives it" in info.value.message


def test_a_send_to_a_rank_that_does_not_read_it():
    program = insert_communication(gpipe(3, 2))
    step = step_of(program, 0, "0SEND_F0")
    program.ranks[0][step] = program.ranks[0][step]._replace(peer=2)
    with pytest.raises(MatchError) as info:
        check_matching(program)
    assert_located(info.value, 0, step)
    assert "from rank 0 to rank 2, but it is made on rank 0 and read (by stage 1) on rank 1" in info.value.message


def test_a_message_for_a_local_handoff_is_an_error():
    program = insert_communication(v_shape(2, 1))  # stages 1 and 2 both live on rank 1
    row = program.ranks[1]
    row.insert(step_of(program, 1, "2F0"), Action(2, RECV_F, 0, 1))
    row.insert(step_of(program, 1, "1F0") + 1, Action(1, SEND_F, 0, 1))
    with pytest.raises(MatchError, match="the hand-off is local, not a message") as info:
        check_matching(program)
    assert info.value.rank == 1


def test_malformed_communication_fields():
    program = insert_communication(gpipe(2, 1))
    program.ranks[0].append(Action(0, SEND_B, 0, 7))
    with pytest.raises(MatchError, match="peer rank 7 does not exist"):
        check_matching(program)
    program = insert_communication(gpipe(2, 1))
    program.ranks[0].insert(0, Action(0, RECV_F, 0, 1))
    with pytest.raises(MatchError, match="receives a tensor no stage produces"):
        check_matching(program)


# -------------------------------------------------------------------- conflict


def test_a_read_before_its_receive():
    program = insert_communication(gpipe(2, 2))
    row = program.ranks[1]
    recv, read = step_of(program, 1, "1RECV_F1"), step_of(program, 1, "1F1")
    assert read == recv + 1
    row[recv], row[read] = row[read], row[recv]
    with pytest.raises(ConflictError) as info:
        check_all(program)
    assert_located(info.value, 1, recv)
    assert info.value.message == f"1F1 reads the activation of 0F1 before it is received (step {read})"


def test_a_second_receive_overwrites_the_buffer():
    program = insert_communication(gpipe(2, 2))
    row = program.ranks[1]
    row.insert(1, row[0])  # 1RECV_F0 twice
    with pytest.raises(ConflictError, match="received a second time") as info:
        check_conflict(program)
    assert_located(info.value, 1, 1)


def test_a_send_before_its_producer():
    program = insert_communication(gpipe(2, 3))
    row = program.ranks[0]
    make, send = step_of(program, 0, "0F1"), step_of(program, 0, "0SEND_F1")
    row[make], row[send] = row[send], row[make]
    with pytest.raises(ConflictError, match=r"activation of 0F1 is sent \(step 2\) before 0F1 makes it") as info:
        check_all(program)
    assert_located(info.value, 0, 2)


def test_frees_before_the_send_and_twice():
    program = insert_frees(insert_communication(gpipe(2, 2)))
    program.ranks[0].insert(1, Action(0, FREE_F, 0))  # 0F0, FREE, 0SEND_F0 ...
    with pytest.raises(ConflictError, match="frees the activation before 0SEND_F0 uses it") as info:
        check_conflict(program)
    assert_located(info.value, 0, 1)
    program = insert_frees(insert_communication(gpipe(2, 2)))
    program.ranks[1].append(Action(1, FREE_F, 1))
    with pytest.raises(ConflictError, match="frees the activation twice"):
        check_conflict(program)


# -------------------------------------------------------------------- deadlock


def test_facing_blocking_sends_deadlock_and_the_cycle_is_named():
    program = insert_communication(one_f_one_b(2, 3))
    unbatch(program, 0, "(0SEND_F1;0RECV_B0)BATCH")  # 0F1 0SEND_F1 0RECV_B0 0B0
    unbatch(program, 1, "(1SEND_B0;1RECV_F1)BATCH")  # 1B0 1SEND_B0 1RECV_F1 1F1
    check_matching(program)
    check_conflict(program)
    send0, send1 = step_of(program, 0, "0SEND_F1"), step_of(program, 1, "1SEND_B0")
    with pytest.raises(DeadlockError) as info:
        check_all(program)
    error = info.value
    assert [(rank, step) for rank, step, _ in error.cycle] == [(0, send0), (1, send1)]
    assert error.cycle[0][2] == (f"waits for rank 1 to receive the activation of 0F1 "
                                 f"(its step {step_of(program, 1, '1RECV_F1')}, 1RECV_F1)")
    assert error.cycle[1][2].startswith("waits for rank 0 to receive the gradient of 1B0")
    assert error.message.startswith(f"deadlock: rank 0 step {send0} (0SEND_F1) waits for rank 1")
    assert f"rank 1 step {send1} (1SEND_B0) waits for rank 0" in error.message
    assert_located(error, 0, send0)
    assert error.marks == [(1, send1)] and "[1SEND_B0]" in error.render()
    # the same program is fine for a runtime whose sends do not block
    check_deadlock(program, "async")


def torch_style(program: Program) -> Program:
    """Post every receive at the start of its rank's list (sends stay after their producers)."""
    lowered = insert_communication(program)
    for row in lowered.ranks:
        parts = [part for action in row for part in action.comms()]
        receives = [p for p in parts if p.op in (RECV_F, RECV_B)]
        row[:] = receives + [p for action in row for p in (action.comms() or (action,)) if p.op not in (RECV_F, RECV_B)]
    return lowered


def test_async_semantics_accept_receives_posted_early():
    program = torch_style(one_f_one_b(3, 4))
    assert texts(program, 0)[0] == "0RECV_B0" and texts(program, 1)[:2] == ["1RECV_F0", "1RECV_F1"]
    check_all(program, semantics="async")
    with pytest.raises(DeadlockError) as info:  # a blocking receive of a gradient before any forward
        check_all(program, semantics="rendezvous")
    assert "waits for rank" in info.value.message


def test_async_reader_before_its_own_receive_waits_forever():
    program = insert_communication(gpipe(2, 1))
    row = program.ranks[1]
    row[0], row[1] = row[1], row[0]  # 1F0 before 1RECV_F0
    with pytest.raises(DeadlockError, match="needs the activation of 0F0, which this rank receives only later"):
        check_deadlock(program, "async")


def test_an_allreduce_one_replica_never_reaches_deadlocks_and_is_named():
    program = insert_communication(bidirectional())
    check_all(program)
    row = program.ranks[1]
    dropped = next(a for a in row if a.op == ALLREDUCE_GRAD and program.stages[a.stage].position == 0)
    row[:] = [a for a in row if a.stage != dropped.stage or a.op not in (ALLREDUCE_GRAD, ALLREDUCE_WAIT)]
    waiting = next(i for i, a in enumerate(program.ranks[0])
                   if a.op == ALLREDUCE_GRAD and program.stages[a.stage].position == 0)
    with pytest.raises(DeadlockError) as info:
        check_all(program)
    error = info.value
    assert error.cycle == [(0, waiting, "waits for rank 1 to join the all-reduce of chunk 0, which it never does")]
    assert_located(error, 0, waiting)


def test_allreduces_in_opposite_orders_deadlock():
    program = insert_communication(bidirectional())
    row = program.ranks[1]
    grads = [i for i, a in enumerate(row) if a.op == ALLREDUCE_GRAD]
    row[grads[0]], row[grads[1]] = row[grads[1]], row[grads[0]]
    waits = [i for i, a in enumerate(row) if a.op == ALLREDUCE_WAIT]
    row[waits[0]], row[waits[1]] = row[waits[1]], row[waits[0]]
    check_matching(program)
    with pytest.raises(DeadlockError) as info:
        check_all(program)
    error = info.value
    assert sorted(rank for rank, _, _ in error.cycle) == [0, 1]
    assert all(program.ranks[rank][step].op == ALLREDUCE_GRAD for rank, step, _ in error.cycle)
    assert all("to join the all-reduce of chunk" in waits_on for _, _, waits_on in error.cycle)


def test_unknown_semantics_is_rejected():
    with pytest.raises(ValueError, match="unknown semantics"):
        check_deadlock(insert_communication(gpipe(2, 1)), "eager")


# ---------------------------------------------------------------------- memory


def test_peak_activations_and_budget():
    program = insert_communication(gpipe(3, 5))
    assert peak_activations(program) == [5, 5, 5]
    check_memory(program, None)
    check_memory(program, 5)
    with pytest.raises(BudgetError) as info:
        check_all(program, memory_budget=4)
    error = info.value
    assert_located(error, 0, step_of(program, 0, "0F4"))
    assert "over the budget of 4" in error.message and "peak is 5" in error.message


def test_split_backward_frees_its_activation_at_i():
    program = compute_program("zb", [0], 2, [[("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("I", 0, 1),
                                              ("W", 0, 1)]])
    check_all(program)
    assert peak_activations(program) == [2]
    with pytest.raises(BudgetError) as info:
        check_memory(program, 1)
    assert_located(info.value, 0, 1)


# ------------------------------------------------------------------- check_all


def test_check_all_reports_the_first_failing_check_in_order():
    program = insert_communication(one_f_one_b(2, 3))
    unbatch(program, 0, "(0SEND_F1;0RECV_B0)BATCH")
    unbatch(program, 1, "(1SEND_B0;1RECV_F1)BATCH")  # a deadlock ...
    program.ranks[1].append(Action(1, "F", 0))         # ... and a duplicated task: well-formed comes first
    with pytest.raises(WellFormedError, match="appears twice"):
        check_all(program)


def test_an_unknown_instruction_is_named():
    program = insert_communication(gpipe(2, 1))
    program.ranks[1].insert(1, Action(1, "UNSHARD"))
    with pytest.raises(WellFormedError, match="unknown instruction 'UNSHARD'") as info:
        check_all(program)
    assert_located(info.value, 1, 1)
