"""What a family's own search returns, and the loop that prices its candidates (issue 27, item 4).

A family that ``searches_itself`` (``compiler/family.py``: sequence rings, weight passing) has no job-shop
model: its order follows from a few discrete choices (the rings KV travels; which step each task of a
step grid runs in). Its search generates candidate schedules, each an evaluated ``ScheduleSpec`` of the
same tasks, and ``best_candidate`` compiles, proves and simulates every one with the real compiler and
simulator, keeping the fastest that fits the memory limits. ``FamilySearch`` says what was found, how
many candidates were priced, and whether that was all of them (the only case a search may call its
answer optimal: optimal over the candidates, which the family's docs define).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterable, Sequence

from pipec.compiler.costs import CostModel
from pipec.compiler.driver import compile_spec
from pipec.compiler.memory_counts import holds_more_activations
from pipec.compiler.search import FEASIBLE, OPTIMAL  # one status vocabulary for every search
from pipec.compiler.simulate import simulate
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import PipecError


@dataclass(frozen=True)
class FamilySearch:
    """The answer of a family's search.

    Attributes:
        status: ``OPTIMAL`` when every candidate of the family's space was priced (optimal over that
            space), else ``FEASIBLE``.
        makespan: the simulated makespan of the best candidate.
        bound: a lower bound on any candidate's makespan, or None (a heuristic has none).
        shipped: the simulated makespan of the target's own schedule (the first candidate).
        text: the best candidate as a ``.pipe`` file's text.
        tried: the candidates compiled, proved and simulated.
        total: how many candidates the space holds, or None when it is not counted.
        choice: one line saying what was chosen (the rings, the step grid's prefetch), for the CLI.
        seconds: the search's wall time.
    """

    status: str
    makespan: Fraction
    bound: Fraction | None
    shipped: Fraction
    text: str
    tried: int
    total: int | None
    choice: str
    seconds: float


@dataclass(frozen=True)
class Priced:
    """A candidate that compiled, passed every check and fits the memory limits, with its simulated makespan."""

    spec: ScheduleSpec
    makespan: Fraction


def price(spec: ScheduleSpec, costs: CostModel | None, memory: Sequence[int] | None) -> Priced | None:
    """``spec`` compiled, proved (``compile_spec``'s checks) and simulated under ``costs``; None when a check
    refuses it or it holds more live activations on some rank than ``memory`` allows."""
    try:
        compiled = compile_spec(spec, costs=costs)
    except PipecError:
        return None  # the candidate breaks a rule of its family: not a schedule
    if holds_more_activations(compiled.program, memory):
        return None
    return Priced(spec, Fraction(simulate(compiled.program, costs).makespan))


@dataclass(frozen=True)
class Walk:
    """What ``best_candidate`` saw: the best priced candidate (None when none fits), how many were priced, and
    whether the candidates ran out."""

    best: Priced | None
    tried: int
    exhausted: bool
    seconds: float


def best_candidate(candidates: Iterable[ScheduleSpec], costs: CostModel | None, memory: Sequence[int] | None, *,
                   time_limit: float, cap: int | None, on_priced: Callable[[Priced | None], None] | None = None
                   ) -> Walk:
    """Price ``candidates`` in order until they run out, ``cap`` were priced or ``time_limit`` seconds passed.

    Ties keep the earlier candidate, so the target's own schedule (given first) wins unless another is
    strictly faster. ``on_priced`` is told each result (a generator that walks from its best so far reads it).
    """
    began = time.monotonic()
    best = None
    tried = 0
    exhausted = True
    for spec in candidates:
        if (cap is not None and tried >= cap) or (tried and time.monotonic() - began > time_limit):
            exhausted = False
            break
        priced = price(spec, costs, memory)
        tried += 1
        if priced is not None and (best is None or priced.makespan < best.makespan):
            best = priced
        if on_priced is not None:
            on_priced(priced)
    return Walk(best, tried, exhausted, time.monotonic() - began)


def shipped_makespan(spec: ScheduleSpec, costs: CostModel | None) -> Fraction:
    """The simulated makespan of the target's own schedule, compiled and checked as every command does (so a
    target that breaks a rule is refused with the check's own error, before any candidate is priced)."""
    return Fraction(simulate(compile_spec(spec, costs=costs).program, costs).makespan)
