"""The rings a sequence-ring schedule's KV travels, searched (issue 27, item 4; docs/search.md).

What is free in a ring schedule (docs/rings.md): the holders are its placement and the mask its model,
so they stay; the order of blocks follows from the rings, since at step t a rank computes the blocks of
the bundles it holds then, which the rings decide; inside a step every block runs between the same post
and wait of the step's exchange, so their order changes no time. What is left to choose is the rings:
which rank each rank passes KV to. The candidates are the target's rings with the ranks relabelled
(every permutation of the ranks, each distinct ring set once, the target's own first): for one ring that
is every directed Hamiltonian cycle, (P - 1)! of them; for several (TASP's decomposition, ``shift 1, -1``)
every arc-disjoint set of the same shape. Each is written ``rings cycle (...)``, compiled, proved and
simulated (``family_search.best_candidate``); when every candidate was priced the best is optimal over
them. With every link alike every relabelling is priced the same (measured, not proven: docs/search.md);
a slow link, or two nodes, is where the choice pays.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from math import factorial
from typing import Iterator, Sequence

from pipec.compiler.costs import CostModel
from pipec.compiler.family_search import FEASIBLE, OPTIMAL, FamilySearch, best_candidate, shipped_makespan
from pipec.compiler.ir import Program, RingPlan
from pipec.compiler.pipe_literals import lookup_expression, tuple_text
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import UsageError

Rings = tuple[tuple[int, ...], ...]
# Up to this many ranks the distinct ring sets are counted before the search (P! relabellings to walk).
COUNTED_RANKS = 9


def refuse_ring_search(spec: ScheduleSpec) -> str | None:
    """Why ``spec``'s rings are not searched, or None: a written order names, at each step, the bundles its
    rings bring then, so it fixes them."""
    if spec.order is not None:
        return (f"{spec.name}'s order is written (`at step`): its blocks name the KV its rings bring at each step, so "
                "the rings are fixed by it; write the schedule without an order to search its rings")
    return None


def _from_zero(cycle: Sequence[int]) -> tuple[int, ...]:
    """``cycle`` turned to start at rank 0 (a ring written from another rank is the same ring)."""
    at = list(cycle).index(0)
    return tuple(cycle[at:]) + tuple(cycle[:at])


def ring_sets(rings: Rings) -> Iterator[Rings]:
    """Every distinct relabelling of ``rings`` (each ring turned to start at rank 0, in ring order): the
    target's own first, then in the order of the permutations of the ranks."""
    num_ranks = len(rings[0])
    seen = set()
    for relabel in itertools.permutations(range(num_ranks)):
        candidate = tuple(_from_zero([relabel[rank] for rank in ring]) for ring in rings)
        if candidate not in seen:
            seen.add(candidate)
            yield candidate


def count_ring_sets(rings: Rings) -> int | None:
    """How many ``ring_sets`` there are: (P - 1)! for one ring; counted for several up to ``COUNTED_RANKS``
    ranks; None past it."""
    if len(rings) == 1:
        return factorial(len(rings[0]) - 1)
    if len(rings[0]) > COUNTED_RANKS:
        return None
    return sum(1 for _ in ring_sets(rings))


def with_rings(spec: ScheduleSpec, plan: RingPlan, rings: Rings) -> ScheduleSpec:
    """``spec`` with its KV on ``rings`` (``rings cycle``), every piece where it was."""
    return replace(spec, rings=replace(spec.rings, rings="cycle", ring_args=rings, pieces=plan.pieces))


def search_rings(spec: ScheduleSpec, program: Program, costs: CostModel | None, *, time_limit: float,
                 candidates: int | None) -> FamilySearch:
    """The fastest ring set for ``spec`` (compiled: ``program``) among ``ring_sets``, under ``costs``.

    Raises:
        PipecError: the target breaks a rule of its family (its own check's error).
        UsageError: no candidate compiled (a pipec bug: the target's own rings are the first).
    """
    plan = program.rings
    shipped = shipped_makespan(spec, costs)
    walk = best_candidate((with_rings(spec, plan, rings) for rings in ring_sets(plan.rings)), costs, None,
                          time_limit=time_limit, cap=candidates)
    if walk.best is None:
        raise UsageError("pipec search: not even the target's own rings compiled as `rings cycle` (a pipec bug)")
    best_rings = walk.best.spec.rings.ring_args
    total = count_ring_sets(plan.rings)
    return FamilySearch(OPTIMAL if walk.exhausted else FEASIBLE, walk.best.makespan, None, shipped,
                        rings_to_pipe(spec, plan, best_rings), walk.tried, total,
                        "rings cycle " + ", ".join(map(tuple_text, best_rings)), walk.seconds)


def rings_to_pipe(spec: ScheduleSpec, plan: RingPlan, rings: Rings, name: str = "searched") -> str:
    """The ``.pipe`` text of ``spec``'s ring schedule with its KV on ``rings``, for its size only."""
    P = plan.num_ranks
    lines = [f"# Found by pipec search: the rings of {spec.name} for P = {P} only.",
             *(f"# the target's {line}" for line in [plan.note] if line),
             f"schedule {name}(P: ranks = {P}) {{",
             f'  require P == {P} : "these rings were searched for P = {P}"',
             f"  sequence chunks {plan.chunks}",
             f"  hold chunk c on rank {lookup_expression('c', plan.holders)}",
             f"  mask {'causal' if plan.causal else 'full'}",
             "  rings cycle " + ", ".join(map(tuple_text, rings)),
             f"  pieces {plan.pieces}",
             f"  kv {plan.kv}",
             f"  dkv {plan.dkv}",
             f"  transfer {plan.transfer}"]
    if spec.devices is not None:
        lines.append(f"  map rank r to device {lookup_expression('r', spec.devices)}")
    return "\n".join(lines + ["}", ""])
