"""Tensor parallelism, the family added as a module (docs/ir.md, "Adding a family").

What the family's program is (every rank's list alike: each layer's forward,
its all-reduce, ..., the backwards in reverse), what the one prover names
when a list is wrong (an all-reduce met out of order, a task on a partial
input, a backward before its forward, a slice never computed, a partial
never summed, a rank that never joins), what the simulator prices, and that
the program file carries it. The runtime's exactness against one process is
``test_tensor_parallel_run.py``'s.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.costs import costs_from_json
from pipec.compiler.emit.json_program import program_from_json, program_to_json
from pipec.compiler.families.tensor_parallel import TensorPlan, tensor_program
from pipec.compiler.family import families_of
from pipec.compiler.ir import Action
from pipec.compiler.simulate import simulate
from pipec.errors import CoverageError, DeadlockError, MatchError, RouteError


def program(P: int = 2, L: int = 2, N: int = 2):
    return tensor_program(TensorPlan(L, P), N, "megatron_mlp")


def with_row(prog, rank: int, change):
    ranks = [list(row) for row in prog.ranks]
    ranks[rank] = change(ranks[rank])
    return replace(prog, ranks=ranks)


def at(row: list[Action], text: str) -> int:
    return next(i for i, a in enumerate(row) if a.text() == text)


def swapped(row: list[Action], first: str, second: str) -> list[Action]:
    i, j = at(row, first), at(row, second)
    row[i], row[j] = row[j], row[i]
    return row


def test_every_rank_runs_every_slice_with_an_all_reduce_after_each_but_the_first_layers_backward():
    prog = program()
    assert [f.name for f in families_of(prog)] == [ops.TENSOR_PARALLEL]
    text = " ".join(a.text() for a in prog.ranks[0])
    assert text == ("0TF0 (0ALLREDUCE_TF0)EXCHANGE0 EXCHANGE_WAIT0 1TF0 (1ALLREDUCE_TF0)EXCHANGE1 EXCHANGE_WAIT1 "
                    "1TB0 (1ALLREDUCE_TB0)EXCHANGE2 EXCHANGE_WAIT2 0TB0 "
                    "0TF1 (0ALLREDUCE_TF1)EXCHANGE3 EXCHANGE_WAIT3 1TF1 (1ALLREDUCE_TF1)EXCHANGE4 EXCHANGE_WAIT4 "
                    "1TB1 (1ALLREDUCE_TB1)EXCHANGE5 EXCHANGE_WAIT5 0TB1")
    assert prog.ranks[1] == prog.ranks[0]
    check_all(prog)


@pytest.mark.parametrize("P, L, N", [(2, 1, 1), (2, 3, 2), (3, 2, 4), (4, 4, 3)])
def test_the_derived_program_is_proved_at_several_sizes(P, L, N):
    check_all(program(P, L, N))


def test_all_reduces_met_out_of_order_on_one_rank_are_named():
    prog = with_row(program(), 1, lambda row: swapped(row, "(0ALLREDUCE_TF0)EXCHANGE0", "(1ALLREDUCE_TF0)EXCHANGE1"))
    with pytest.raises(MatchError, match=r"the 1st collective on communicator 0 .* is 1ALLREDUCE_TF0 here but "
                                         r"0ALLREDUCE_TF0 on rank 0"):
        check_all(prog)


def test_a_forward_on_a_partial_input_is_named():
    # the wait for layer 0's output moved after layer 1's forward: it would read a partial sum
    def late_wait(row):
        wait = row.pop(at(row, "EXCHANGE_WAIT0"))
        row.insert(at(row, "1TF0") + 1, wait)
        return row
    with pytest.raises(RouteError, match=r"rank 0, step 2: 1TF0: the forward of layer 1, microbatch 0 needs the "
                                         r"whole output of layer 0 for microbatch 0, whose all-reduce this rank has "
                                         r"not waited"):
        check_all(with_row(program(), 0, late_wait))


def test_a_backward_before_its_forward_is_named():
    def early(row):
        backward = row.pop(at(row, "0TB0"))
        row.insert(0, backward)
        return row
    with pytest.raises(CoverageError, match=r"0TB0: the backward of layer 0, microbatch 0 runs before its forward on "
                                            r"this rank"):
        check_all(with_row(program(), 0, early))


def test_a_slice_never_computed_on_one_rank_is_named():
    prog = with_row(program(L=1, N=2), 1, lambda row: [a for a in row if a.text() != "0TB1"])
    with pytest.raises(CoverageError, match=r"the backward of layer 0, microbatch 1 never runs on rank 1"):
        check_all(prog)


def test_a_partial_never_all_reduced_is_named():
    def unsummed(row):
        i = at(row, "(1ALLREDUCE_TB0)EXCHANGE2")
        del row[i:i + 2]
        return row
    prog = replace(program(), ranks=[unsummed(list(row)) for row in program().ranks])
    with pytest.raises(RouteError, match=r"partial of the backward of layer 1, microbatch 0 is never all-reduced|"
                                         r"needs the whole input gradient of layer 1"):
        check_all(prog)


def test_a_rank_that_never_joins_an_all_reduce_is_a_named_deadlock():
    def missing(row):
        i = at(row, "(1ALLREDUCE_TF1)EXCHANGE4")
        del row[i:i + 2]
        return row
    with pytest.raises((DeadlockError, MatchError, RouteError)) as caught:
        check_all(with_row(program(), 1, missing))
    assert "rank" in str(caught.value) and "ALLREDUCE" in str(caught.value)


def test_unit_costs_give_no_bubble_and_links_price_each_all_reduce():
    P, L, N = 4, 3, 2
    prog = program(P, L, N)
    result = simulate(prog)
    assert result.makespan == N * L * (1 + 2)  # F = 1, B = 2 on every rank, all-reduces free
    assert result.bubble_fraction() == 0
    # links of 2**20 bytes per unit of time carry one all-reduce of a boundary tensor of 2**20 bytes on P ranks
    # in 2 (P - 1) / P units, each a ring of 2 (P - 1) steps of 1/P of it, one after another on every rank
    costs = costs_from_json({"compute": {"TF": 1, "TB": 2}, "links": {"latency": 0, "bandwidth": 2 ** 20},
                             "sizes": {"boundary": 2 ** 20}})
    priced = simulate(prog, costs)
    reduces = N * (2 * L - 1)
    assert priced.makespan == pytest.approx(N * L * 3 + reduces * 2 * (P - 1) / P)


def test_the_program_file_carries_the_plan_and_reads_back_equal():
    prog = program(3, 2, 2)
    data = json.loads(json.dumps(program_to_json(prog)))
    assert data["tensor"] == {"layers": 2}
    assert program_from_json(data) == prog
