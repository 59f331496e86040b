"""One prover for every family (``compiler/checks/symbolic.py``).

A program holding weight passing's exchanges (FSDP's all-gathers) and a
sequence ring's (KV and dK, dV sends) on the same two ranks is proved by one
symbolic run: each family's semantics gives its ops their meaning, and the
engine matches, meets and waits all of them together, so a hazard that only
shows when the families run side by side (a wait of one family holding up a
collective of the other) is named, as are planted hazards of each family.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_all, prove_exchanges
from pipec.compiler.checks.rings import RingReport
from pipec.compiler.checks.weights import WeightReport
from pipec.compiler.family import families_of
from pipec.compiler.ir import Action, Program, RingPlan
from pipec.compiler.lower_rings import lower_plan
from pipec.compiler.driver import compile_target
from pipec.errors import CoverageError, DeadlockError, MatchError, RouteError, WellFormedError

RING_EXCHANGES = 100  # the ring's exchange numbers, moved past the weights'


def _renumbered(action: Action) -> Action:
    if ops.RULES[action.op].category in (ops.EXCHANGE_OF, ops.EXCHANGE_WAIT_OF):
        return action._replace(mb=action.mb + RING_EXCHANGES)
    return action


def mixed(ring_first_on: tuple[int, ...] = ()) -> Program:
    """FSDP on two ranks, and on the same ranks a causal-free ring of two chunks: each rank runs
    its weight-passing list, then its ring list (or the ring first, on ``ring_first_on``)."""
    fsdp = compile_target("fsdp", {"P": 2}).program
    ring = lower_plan(RingPlan(2, (0, 1), 1, ((0, 1),), False))
    rows = []
    for rank in range(2):
        weights, blocks = list(fsdp.ranks[rank]), [_renumbered(a) for a in ring.ranks[rank]]
        rows.append(blocks + weights if rank in ring_first_on else weights + blocks)
    return replace(fsdp, name="fsdp+ring", ranks=rows, rings=ring.rings, communicators=[])


def with_row(program: Program, rank: int, change) -> Program:
    ranks = [list(row) for row in program.ranks]
    ranks[rank] = change(ranks[rank])
    return replace(program, ranks=ranks)


def at(row: list[Action], text: str) -> int:
    return next(i for i, a in enumerate(row) if a.text() == text)


def test_a_program_of_two_families_is_proved_by_one_run():
    program = mixed()
    assert [f.name for f in families_of(program)] == [ops.WEIGHT_PASSING, ops.SEQUENCE_RING]
    reports = prove_exchanges(program)
    assert isinstance(reports[ops.WEIGHT_PASSING], WeightReport)
    assert isinstance(reports[ops.SEQUENCE_RING], RingReport)
    assert reports[ops.SEQUENCE_RING].blocks == 4  # two chunks, no mask
    assert reports[ops.WEIGHT_PASSING].peak_buffers == prove_exchanges(
        compile_target("fsdp", {"P": 2}).program)[ops.WEIGHT_PASSING].peak_buffers
    check_all(program)  # a ring in it: the symbolic run alone


def test_a_wait_of_one_family_holding_a_collective_of_the_other_is_a_deadlock():
    """Rank 1 runs its ring first: it waits for rank 0's KV, which rank 0 sends only after the
    all-gather that rank 1 has not joined. Neither family's prover alone sees it."""
    with pytest.raises(DeadlockError) as caught:
        prove_exchanges(mixed(ring_first_on=(1,)))
    message = caught.value.message
    assert "rank 0 (instruction 0) waits in (0ALLGATHER_W0)EXCHANGE1 for rank 1 to join 0ALLGATHER_W0" in message
    assert f"rank 1 (instruction 2) waits in EXCHANGE_WAIT{RING_EXCHANGES} for 1SEND_KV0 to meet rank 0" in message


def test_messages_of_one_pair_swapped_on_one_side_are_named():
    """Rank 0 sends its two dK, dV partials to rank 1 in the other order."""
    def swap(row):
        i, j = at(row, f"(0SEND_DKV0;1RECV_DKV0)EXCHANGE{RING_EXCHANGES + 2}"), \
            at(row, f"(1SEND_DKV0;0RECV_DKV0)EXCHANGE{RING_EXCHANGES + 3}")
        first, second = row[i], row[j]
        row[i] = first._replace(parts=(second.parts[0], first.parts[1]))
        row[j] = second._replace(parts=(first.parts[0], second.parts[1]))
        return row
    with pytest.raises(MatchError, match=r"0RECV_DKV0 from rank 0 gets 1SEND_DKV0 \(rank 0, instruction \d+\): "
                       r"messages are matched in order per pair of ranks, and these carry different values "
                       r"\(dKV partial of rank 1's KV bundle of piece 0 against dKV partial of rank 0's KV bundle of "
                       r"piece 0\)") as caught:
        prove_exchanges(with_row(mixed(), 0, swap))
    assert caught.value.rank == 1  # named where the wrong message arrives


def test_collectives_of_one_communicator_in_another_order_on_one_rank_are_named():
    def swap(row):
        i, j = at(row, "(3ALLGATHER_W1)EXCHANGE3"), at(row, "(2ALLGATHER_W3)EXCHANGE7")
        row[i], row[j] = row[i]._replace(parts=row[j].parts), row[j]._replace(parts=row[i].parts)
        return row
    with pytest.raises(MatchError, match=r"the 2nd collective on communicator 0 .* is \S+ here but \S+ on rank \d "
                                         r"\(instruction 2\): every member must meet its collectives in the same "
                                         r"order") \
            as caught:
        prove_exchanges(with_row(mixed(), 1, swap))
    assert "1ALLGATHER_W1" in caught.value.message and "2ALLGATHER_W3" in caught.value.message


def test_a_ring_block_skipped_is_named():
    with pytest.raises(CoverageError, match=r"block \(query chunk 1, kv chunk 0, piece 0\) is never computed "
                                            "backward"):
        prove_exchanges(with_row(mixed(), 1, lambda row: [a for a in row if a.text() != "1AB0"]))


def test_a_weight_copy_dropped_while_it_arrives_is_named():
    def drop_early(row):
        row.insert(1, Action(0, ops.FREE_W, 0))  # between the all-gather and its wait
        return row
    with pytest.raises(RouteError, match=r"0FREE_W0 drops a copy that is still arriving") as caught:
        prove_exchanges(with_row(mixed(), 0, drop_early))
    assert (caught.value.rank, caught.value.step) == (0, 1)


def test_an_op_of_a_family_the_program_does_not_run_is_refused():
    ring = lower_plan(RingPlan(2, (0, 1), 1, ((0, 1),), False))
    planted = with_row(ring, 0, lambda row: [Action(0, ops.F, 0)] + row)
    with pytest.raises(WellFormedError, match="0F0 is an instruction of activation passing, which this program "
                                              r"\(sequence ring\) does not run"):
        prove_exchanges(planted)


def test_a_part_no_family_of_the_program_moves_is_refused():
    fsdp = compile_target("fsdp", {"P": 2}).program
    kv = Action(-1, ops.EXCHANGE, 50, -1, (Action(0, ops.SEND_KV, 0, 1),))
    planted = with_row(fsdp, 0, lambda row: [kv, Action(-1, ops.EXCHANGE_WAIT, 50)] + row)
    with pytest.raises(MatchError, match=r"0SEND_KV0 cannot be part of an exchange of this program: .*"
                                         r"\(weight passing\)"):
        prove_exchanges(planted)


def test_a_part_outside_an_exchange_is_refused_for_every_family():
    program = mixed()
    for rank, text in ((0, "(0ALLGATHER_W0)EXCHANGE1"), (1, f"(1SEND_KV0;0RECV_KV0)EXCHANGE{RING_EXCHANGES}")):
        def bare(row, text=text):
            i = at(row, text)
            return row[:i] + list(row[i].parts) + row[i + 1:]
        with pytest.raises(MatchError, match="stands outside an exchange") as caught:
            prove_exchanges(with_row(program, rank, bare))
        assert caught.value.rank == rank


def test_the_runtime_refuses_a_program_of_two_families_before_any_worker_starts():
    from argparse import Namespace

    from pipec.commands.run import check_launch
    from pipec.errors import UsageError

    with pytest.raises(UsageError, match="holds ops of weight passing and sequence ring; pipec proves such a program "
                                         "but its runtime trains one family at a time"):
        check_launch(Namespace(target="fsdp+ring"), mixed())
