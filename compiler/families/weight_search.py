"""A weight-passing schedule's step grid, searched (issue 27, item 4; docs/search.md).

What is free in a weight-passing schedule (docs/weights.md): every rank runs every layer on its own
microbatches, so the tasks are fixed, and the placement (homes, owners, groups, routes) stays as the
target says. The grid is the choice: the step each task runs in (weights move between steps), the order
of a step's tasks, and how far ahead weights are fetched (``prefetch``). Two tasks of one layer in one
step share one fetch; a step moved later may let a fetch arrive in time.

The moves (``_moves``), on every rank at once (the i-th task of each, so a grid whose ranks run one
pattern, as the shipped ones do, keeps it: a group's ranks run the same layer in a step under ``staged``,
every rank under ``all_gather``) or on one rank: a task a step earlier or later, a task and every later
one, a microbatch's tasks, a task swapped with the next of its step, or another prefetch distance. A move
that puts a microbatch's tasks out of their order is not priced; one that breaks a route is refused by
the checks. From the target's grid (and the same with its empty steps removed, at every prefetch
distance), a seeded walk takes random moves from the best grid so far, ties moving it on, each grid
compiled, proved and simulated (``family_search.best_candidate``) until ``candidates``, the time limit,
or every neighbour of the best was priced: a heuristic, so the answer is FEASIBLE and has no bound.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from pipec.compiler.costs import CostModel
from pipec.compiler.family_search import FEASIBLE, FamilySearch, Priced, best_candidate, shipped_makespan
from pipec.compiler.ir import Program
from pipec.compiler.pipe_literals import lookup_expression
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import UsageError

# A task of a rank's grid: (op, layer, microbatch, step).
Cell = tuple[str, int, int, int]
# The prefetch distances tried: a ring slot cannot be passed on before it arrived (0 or 1); the other routes
# post a weight's last leg up to this many steps ahead (more costs buffers and, measured, no time).
MOST_PREFETCH = {"ring": 1}
DEFAULT_MOST_PREFETCH = 3
# The default cap on the candidates a walk prices, when the command gives none.
DEFAULT_CANDIDATES = 2000
# The walk ends when this many moves in a row from the best grid gave grids already priced.
STALE_MOVES = 20_000


@dataclass(frozen=True)
class Grid:
    """A candidate: each rank's tasks in list order, each with its step, and the prefetch distance."""

    rows: tuple[tuple[Cell, ...], ...]
    prefetch: int


def refuse_grid_search(spec: ScheduleSpec) -> str | None:
    """Why ``spec``'s step grid is not searched, or None."""
    if spec.recomputed:
        return f"{spec.name} recomputes stages: a weight-passing grid with recomputation is not searched"
    return None


def target_grid(spec: ScheduleSpec) -> Grid:
    """``spec``'s own grid."""
    return Grid(tuple(tuple((op, stage % spec.num_stages, mb, step) for (op, stage, mb), step in zip(row, steps))
                      for row, steps in zip(spec.order, spec.task_steps)), spec.weights.prefetch)


def grid_spec(spec: ScheduleSpec, grid: Grid) -> ScheduleSpec:
    """``spec`` with ``grid`` as its order and steps, and its prefetch distance."""
    order = [[(op, spec.stage_id(spec.mb_pipeline[mb], layer), mb) for op, layer, mb, _ in row] for row in grid.rows]
    steps = [[step for *_, step in row] for row in grid.rows]
    return replace(spec, order=order, task_steps=steps, weights=replace(spec.weights, prefetch=grid.prefetch))


def _in_order(cells: Sequence[Cell], before: Sequence[Cell]) -> tuple[Cell, ...] | None:
    """``cells`` sorted by step (a step's tasks in their order in ``before``), or None when that puts some
    microbatch's tasks out of the order ``before`` runs them in, or a step below 0."""
    position = {cell[:3]: i for i, cell in enumerate(before)}
    ordered = tuple(sorted(cells, key=lambda c: (c[3], position[c[:3]])))
    if ordered and ordered[0][3] < 0:
        return None
    for mb in {c[2] for c in cells}:
        if [c[:3] for c in ordered if c[2] == mb] != [c[:3] for c in before if c[2] == mb]:
            return None
    return ordered


def _moved_row(row: tuple[Cell, ...], kind: int, i: int) -> tuple[Cell, ...] | None:
    """``row`` after move ``kind`` at its task ``i`` (0, 1: that task a step earlier, later; 2, 3: it and every
    later task; 4: swapped with the next task of its step; 5, 6: every task of its microbatch), or None when the
    move is not valid there."""
    if i >= len(row):
        return None
    if kind >= 5:
        mb, delta = row[i][2], (-1, 1)[kind - 5]
        return _in_order([(op, layer, m, step + delta if m == mb else step) for op, layer, m, step in row], row)
    if kind == 4:
        if i + 1 < len(row) and row[i][3] == row[i + 1][3] and row[i][2] != row[i + 1][2]:
            return row[:i] + (row[i + 1], row[i]) + row[i + 2:]
        return None
    delta = (-1, 1)[kind % 2]
    moved = [(op, layer, mb, step + delta) if j == i or (kind >= 2 and j > i) else (op, layer, mb, step)
             for j, (op, layer, mb, step) in enumerate(row)]
    return _in_order(moved, row)


def _moves(grid: Grid, most_prefetch: int, rng: random.Random) -> Iterator[Grid]:
    """Random neighbours of ``grid``, endlessly: on every rank at once (the i-th task of each) or on one rank,
    a task a step earlier or later, a task and every later one a step earlier or later, a task swapped with
    the next one of its step, a microbatch's tasks a step earlier or later; or another prefetch distance. Only
    valid grids are yielded."""
    while True:
        kind = rng.randrange(8)
        if kind == 7:
            prefetch = rng.randrange(most_prefetch + 1)
            if prefetch != grid.prefetch:
                yield Grid(grid.rows, prefetch)
            continue
        i = rng.randrange(max(map(len, grid.rows)))
        ranks = range(len(grid.rows)) if rng.random() < 0.5 else [rng.randrange(len(grid.rows))]
        rows = list(grid.rows)
        for rank in ranks:
            rows[rank] = _moved_row(grid.rows[rank], kind, i)
        if all(row is not None for row in rows):
            yield Grid(tuple(rows), grid.prefetch)


def _closed(grid: Grid) -> Grid:
    """``grid`` with every step no rank runs a task in removed (each later task moved up)."""
    used = sorted({cell[3] for row in grid.rows for cell in row})
    renumber = {step: i for i, step in enumerate(used)}
    return Grid(tuple(tuple((op, layer, mb, renumber[step]) for op, layer, mb, step in row) for row in grid.rows),
                grid.prefetch)


def search_grid(spec: ScheduleSpec, program: Program, costs: CostModel | None, memory: Sequence[int] | None, *,
                time_limit: float, candidates: int | None, seed: int = 0) -> FamilySearch:
    """A fast step grid for ``spec`` (compiled: ``program``) under ``costs`` and ``memory``, by a walk of
    random moves from the target's grid (``Grid``, ``_moves``).

    Raises:
        UsageError: the grid is not searched (``refuse_grid_search``), or no candidate fits ``memory``.
    """
    refusal = refuse_grid_search(spec)
    if refusal is not None:
        raise UsageError(f"pipec search: {refusal}")
    _refuse_unmeetable(spec, memory)
    shipped = shipped_makespan(spec, costs)  # priced without the memory limits, which it may break
    target = target_grid(spec)
    most_prefetch = MOST_PREFETCH.get(spec.weights.route, DEFAULT_MOST_PREFETCH)
    rng = random.Random(seed)  # so that a search with a candidate cap repeats itself
    state = {"best": None, "last": None}  # the best priced grid so far, and the grid just handed out

    def on_priced(priced: Priced | None) -> None:
        if priced is not None and (state["best"] is None or priced.makespan <= state["best"][1]):
            state["best"] = (state["last"], priced.makespan)  # ties move the walk on

    def grids() -> Iterator[ScheduleSpec]:
        seen = set()
        for grid in _seeds(target, most_prefetch):
            if grid not in seen:
                seen.add(grid)
                state["last"] = grid
                yield grid_spec(spec, grid)
        stale = 0
        while stale < STALE_MOVES:  # every neighbour of the best tried: the walk ends
            start = state["best"][0] if state["best"] is not None else target
            grid = next(_moves(start, most_prefetch, rng))
            if grid in seen:
                stale += 1
                continue
            stale = 0
            seen.add(grid)
            state["last"] = grid
            yield grid_spec(spec, grid)

    cap = candidates if candidates is not None else DEFAULT_CANDIDATES
    walk = best_candidate(grids(), costs, memory, time_limit=time_limit, cap=cap, on_priced=on_priced)
    if walk.best is None:
        raise UsageError(f"pipec search: none of the {walk.tried} step grids tried fits the memory limits")
    found = walk.best.spec
    steps = 1 + max(step - row[0] for row in found.task_steps for step in row)
    return FamilySearch(FEASIBLE, walk.best.makespan, None, shipped, grid_to_pipe(found), walk.tried, None,
                        f"prefetch {found.weights.prefetch}, {steps} steps per rank", walk.seconds)


def _seeds(shipped: Grid, most_prefetch: int) -> Iterator[Grid]:
    """The grids priced before the walk: the target's, then with its empty steps removed, each at every
    prefetch distance."""
    for grid in (shipped, _closed(shipped)):
        yield grid
        for prefetch in range(most_prefetch + 1):
            yield Grid(grid.rows, prefetch)


def _refuse_unmeetable(spec: ScheduleSpec, memory: Sequence[int] | None) -> None:
    """Raise UsageError when no grid can meet ``memory``: a rank runs every layer's forward of a microbatch
    before its backward of the last layer, so it holds that microbatch's activation of every layer."""
    if memory is None:
        return
    least = spec.num_stages
    short = [rank for rank, limit in enumerate(memory) if limit < least and spec.order[rank]]
    if short:
        raise UsageError(f"pipec search: --memory {memory[short[0]]} on rank {short[0]} cannot be met: under weight "
                         f"passing a rank runs all {least} layers' forwards of a microbatch before the last layer's "
                         f"backward, so it holds {least} activations at once in any grid")


def grid_to_pipe(spec: ScheduleSpec, name: str = "searched") -> str:
    """The ``.pipe`` text of the weight-passing ``spec`` with its order as literal steps, for its size only."""
    weights = spec.weights
    P, N = spec.num_ranks, spec.num_microbatches
    route = f"ring by {weights.ring_by}" if weights.route == "ring" else weights.route
    lines = [f"# Found by pipec search: a step grid of {spec.name} for P = {P}, N = {N} only.",
             f"schedule {name}(P: ranks = {P}, N: microbatches = {N}) {{",
             f'  require P == {P} : "this grid was searched for P = {P}"',
             f'  require N == {N} : "this grid was searched for N = {N}"',
             f"  stages {spec.num_stages}",
             f"  home microbatch m on rank {lookup_expression('m', spec.mb_pipeline)}"]
    if weights.owners is not None:
        lines.append(f"  own layer l on rank {lookup_expression('l', weights.owners)}")
    if any(weights.groups):
        lines.append(f"  group rank r in {lookup_expression('r', weights.groups)}")
    lines += [f"  weights {route}", f"  gradients {weights.gradients}", f"  prefetch {weights.prefetch}"]
    if weights.buffers is not None:
        lines.append(f"  buffers {weights.buffers}")
    if spec.split_backward:
        lines.append("  backward split")
    if spec.devices is not None:
        lines.append(f"  map rank r to device {lookup_expression('r', spec.devices)}")
    lines.append("  order rank r {")
    for rank, (row, steps) in enumerate(zip(spec.order, spec.task_steps)):
        lines.append(f"    {'if' if rank == 0 else '} else if'} r == {rank} {{")
        by_step: dict[int, list[str]] = {}
        for (op, stage, mb), step in zip(row, steps):
            by_step.setdefault(step, []).append(f"{op}({stage % spec.num_stages}, {mb})")
        lines += [f"      at step {step} {{ {' '.join(tasks)} }}" for step, tasks in by_step.items()]
    lines += ["    }", "  }", "}", ""]
    return "\n".join(lines)
