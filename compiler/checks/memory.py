"""Memory: how many microbatches' activations a rank holds at once.

A chunk activation is alive on its stage's rank from its F until its B (or,
when the backward is split, its I: the W that follows needs only the layer
inputs, which the runtime keeps in a smaller stash). Walking a rank's list in
order, the count goes up by one at each F and down by one at each B or I; its
maximum is the rank's peak. The count is in activations of one chunk for one
microbatch; chunks of different sizes are the cost model's business.

What an I leaves for its W (the gradients where the weights branch off, and
the layer inputs) is counted apart, the same way: up at each I, down at each W.
"""
from __future__ import annotations

import operator
from itertools import accumulate, repeat

from pipec.compiler.ir import B, F, I, W, Program
from pipec.errors import BudgetError

# op -> change in live activations
_DELTA = {F: 1, B: -1, I: -1}
# op -> change in weight gradients waiting (split backward)
_WAITING_W_DELTA = {I: 1, W: -1}
_op_of = operator.itemgetter(1)


def _live_counts(row, delta=_DELTA):
    """The count after each instruction of one rank's list (an iterator); ``delta``: op -> change."""
    return accumulate(map(delta.get, map(_op_of, row), repeat(0)))


def peak_activations(program: Program) -> list[int]:
    """Peak live chunk activations per rank.

    Args:
        program: any program (only F, B and I count).
    Returns:
        one int per rank, 0 for a rank with no forward.
    """
    return [max(0, max(_live_counts(row), default=0)) for row in program.ranks]


def peak_waiting_w(row) -> int:
    """The most weight gradients waiting at once along one rank's list (I done, W not yet)."""
    return max(0, max(_live_counts(row, _WAITING_W_DELTA), default=0))


def check_memory(program: Program, budget: int | None) -> None:
    """Prove no rank holds more than ``budget`` activations at once.

    Args:
        program: any program.
        budget: the most live activations a rank may hold; None checks nothing.
    Raises:
        BudgetError: at the rank (lowest first) and the step where its count
            first goes above ``budget``.
    """
    if budget is None:
        return
    for rank, peak in enumerate(peak_activations(program)):
        if peak <= budget:
            continue
        step = next(step for step, live in enumerate(_live_counts(program.ranks[rank])) if live > budget)
        raise BudgetError(
            f"{budget + 1} activations alive here (forward done, backward pending), over the budget of "
            f"{budget}; this rank's peak is {peak}",
            rank, step, program.grid())


__all__ = ["check_memory", "peak_activations", "peak_waiting_w"]
