"""Memory: how many microbatches' activations a rank holds at once, and how many bytes.

The counts come from ``compiler/memory_counts.py`` (shared with the
simulator), which reads the rule table: a saved activation is alive on its
stage's rank from the compute that makes it (F) to the one that ends it (B,
or, when the backward is split, I: the W that follows needs only the layer
inputs, which the runtime keeps in a smaller stash, counted apart as the
weight gradients waiting). On a recomputed stage the forward (FC) keeps only
its input, counted apart as a kept input until the recompute (R) makes the
saved activation again, just before the backward. The count is in activations of one chunk for one
microbatch; chunks of different sizes are the cost model's business.

``check_memory`` proves a count budget (activations per rank) and, given the
bytes of one value of each size class, a budget in bytes per size class; in
bytes every counted value counts at its class's size (the stash an I leaves
is activation-sized, like the saved activation; a kept input is
boundary-sized).
"""
from __future__ import annotations

from typing import Mapping

from pipec.compiler import ops
from pipec.compiler.ir import Program
from pipec.compiler.memory_counts import (
    ACTIVATION_DELTA,
    COUNTED_OPS,
    SIZE_CLASS_DELTAS,
    Number,
    check_sizes,
    first_step_over,
    live_counts,
    peak_activations,
    peak_bytes,
    peak_kept_inputs,
    peak_waiting_w,
)
from pipec.compiler.placed_memory import composed, first_over, placed_peak_bytes, unpriced
from pipec.errors import BudgetError

ops.declare_pass("memory", COUNTED_OPS)


def check_memory(
    program: Program,
    budget: int | None,
    *,
    byte_budget: Mapping[str, Number] | None = None,
    sizes: Mapping[str, Number] | None = None,
) -> None:
    """Prove no rank holds more than ``budget`` activations, or more than ``byte_budget`` bytes, at once.

    Args:
        program: any program.
        budget: the most live activations a rank may hold; None checks nothing.
        byte_budget: size class (``ops.SIZE_*``) -> the most bytes of live
            values of that class a rank may hold; None checks nothing.
        sizes: size class -> bytes of one value of it; required with
            ``byte_budget`` for every class it names.
    Raises:
        BudgetError: at the rank (lowest first) and the step where its count
            first goes above ``budget``; then, for bytes, at the rank (lowest
            first) and the first step where a class goes above its budget.
        ValueError: a byte budget without the sizes of its classes, or an
            unknown size class.
    """
    if budget is not None:
        _check_count_budget(program, budget)
    if byte_budget is not None:
        _check_byte_budget(program, byte_budget, sizes or {})


def _check_count_budget(program: Program, budget: int) -> None:
    """Raise at the first rank, and its first step, where live activations exceed ``budget``."""
    for rank, peak in enumerate(peak_activations(program)):
        if peak <= budget:
            continue
        step = first_step_over(program.ranks[rank], ACTIVATION_DELTA, budget)
        raise BudgetError(
            f"{budget + 1} activations alive here (forward done, backward pending), over the budget of "
            f"{budget}; this rank's peak is {peak}",
            rank, step, program.grid())


def _check_byte_budget(program: Program, byte_budget: Mapping[str, Number], sizes: Mapping[str, Number]) -> None:
    """Raise at the first rank, and its first step, where a class's live bytes exceed its budget."""
    check_sizes(byte_budget)
    missing = unpriced(program, byte_budget, sizes)
    if missing:
        raise ValueError(f"a byte budget for {missing} needs the bytes of one value of each (sizes)")
    if composed(program):
        _check_placed_budget(program, byte_budget, sizes)
        return
    sizes = {size_class: sizes[size_class] for size_class in byte_budget}
    for rank, peaks in enumerate(peak_bytes(program, sizes)):
        over = [size_class for size_class, peak in peaks.items() if peak > byte_budget[size_class]]
        if not over:
            continue
        # the class that goes over first names the step
        firsts = [_first_over(program.ranks[rank], size_class, sizes[size_class], byte_budget[size_class])
                  for size_class in over]
        step, size_class, live = min(firsts)
        size, limit = sizes[size_class], byte_budget[size_class]
        raise BudgetError(
            f"{live * size} bytes of {size_class}-sized values alive here ({live} of {size} bytes), over the "
            f"{size_class} budget of {limit} bytes; this rank's peak is {peaks[size_class]} bytes",
            rank, step, program.grid())


def _check_placed_budget(program: Program, byte_budget: Mapping[str, Number], sizes: Mapping[str, Number]) -> None:
    """A composed program's budget, per member (``compiler/placed_memory.py``): its shards, whole weights and
    shares of activations; raise at the first rank and its first step where a class goes above it."""
    for rank, peaks in enumerate(placed_peak_bytes(program, sizes)):
        found = [(where, size_class) for size_class in byte_budget
                 if (where := first_over(program, rank, size_class, sizes, byte_budget[size_class])) is not None]
        if not found:
            continue
        (step, live), size_class = min(found)
        held = {ops.SIZE_WEIGHT: "the whole weights of the stages this member holds now",
                ops.SIZE_SHARD: "this member's shards"}.get(size_class, "this member's shares of the values")
        raise BudgetError(
            f"{live} bytes of {size_class}-sized values alive here ({held}), over the {size_class} budget of "
            f"{byte_budget[size_class]} bytes; this rank's peak is {peaks[size_class]} bytes",
            rank, step, program.grid())


def _first_over(row, size_class: str, size: Number, limit: Number) -> tuple[int, str, int]:
    """(step, size class, live values) where the class's live bytes first go above ``limit`` along ``row``."""
    lives = live_counts(row, SIZE_CLASS_DELTAS[size_class])
    return next((step, size_class, live) for step, live in enumerate(lives) if live * size > limit)


__all__ = ["check_memory", "peak_activations", "peak_bytes", "peak_kept_inputs", "peak_waiting_w"]
