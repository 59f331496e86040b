"""Issue 26, item 6: programs the checks and the runtime judged differently, and the ring errors' wording.

Each test plants one program the runtime runs exactly (or faults on) and
asserts the check's verdict, with its exact message where one is expected.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_weights
from pipec.compiler.driver import compile_target
from pipec.compiler.ir import Action, Program
from pipec.errors import RouteError


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
