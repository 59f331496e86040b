"""Exact order search for activation passing (issue 27, first slice): a CP-SAT job-shop model.

Given a compiled compute-only program (its placement and task set: F and B, or F, I and W, per
stage x microbatch), a cost model and a per-rank limit on live activations, ``search_order`` finds
the per-rank order that minimises the makespan of the model below, or the best order found and the
solver's lower bound when the time limit ends first.

The model (docs/search.md): one interval per task, sized by ``CostModel.compute``; per rank, no two
intervals overlap; a task starts after each input's producer (``ops.DEPENDENCIES``, at the stage
``StageTables.neighbour`` names) ends, plus ``CostModel.transfer`` when the producer is on another
device; per rank, the activations alive at once (from the task that makes one, ``ACTIVATION_DELTA``
+1, to the end of the task that ends it, -1) stay within the limit. Times are integers: every cost
is scaled by the least common denominator of the exact costs.

OR-Tools is imported only when a search runs, so pipec works without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import lcm
from typing import Sequence

from pipec.compiler import ops
from pipec.compiler.costs import CostModel
from pipec.compiler.ir import Action, Program, stage_tables
from pipec.compiler.memory_counts import ACTIVATION_DELTA
from pipec.errors import UsageError

# The largest time scale accepted: costs whose exact denominators need more are not a small grid.
MAX_SCALE = 10**6
OPTIMAL, FEASIBLE = "OPTIMAL", "FEASIBLE"
# the ops that carry a microbatch forward: they read their PREV stage's value (F)
_ENTRY_OPS = frozenset(op for op, deps in ops.DEPENDENCIES.items() if any(dep.where == ops.PREV for dep in deps))


@dataclass(frozen=True)
class SearchResult:
    """What a search returns.

    Attributes:
        order: per rank, its compute tasks sorted by start time.
        status: ``OPTIMAL`` (proven) or ``FEASIBLE`` (the time limit ended first).
        makespan: the model's makespan of ``order``, in the cost model's units.
        bound: the solver's best lower bound on the makespan (== makespan when optimal).
        seconds: the solver's wall time.
    """

    order: list[list[Action]]
    status: str
    makespan: Fraction
    bound: Fraction
    seconds: float

    @property
    def gap(self) -> Fraction:
        """(makespan - bound) / makespan: 0 when proven optimal."""
        return (self.makespan - self.bound) / self.makespan if self.makespan else Fraction(0)


def _cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise UsageError("pipec search needs OR-Tools: pip install 'pipec[search]'") from error
    return cp_model


def _refuse_unsupported(program: Program) -> None:
    if program.mesh is not None or any(stage.placement is not None for stage in program.stages):
        raise UsageError("pipec search orders a plain pipeline: a composition (mesh or group placement) is not "
                         "searched yet")
    known = set(ops.DEPENDENCIES) - set(ops.IN_ORDER_COMPUTE_OPS)
    for row in program.ranks:
        for action in row:
            if action.op not in known:
                raise UsageError(f"pipec search orders activation passing's computes; {action.op} is not one")


def _exact(value) -> Fraction:
    """A cost as a fraction: a float as the decimal it prints as (0.52 -> 13/25, not its binary expansion)."""
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def _scale(values: Sequence) -> int:
    scale = lcm(*(_exact(v).denominator for v in values)) if values else 1
    if scale > MAX_SCALE:
        raise UsageError(f"the costs need a time grid of 1/{scale}: pipec search takes at most 1/{MAX_SCALE}")
    return scale


def search_order(program: Program, costs: CostModel | None = None, memory: Sequence[int] | None = None, *,
                 time_limit: float = 30.0, workers: int = 2) -> SearchResult:
    """The fastest per-rank order of ``program``'s tasks under ``costs`` and ``memory``.

    Args:
        program: a compute-only activation-passing program (``lower_spec``'s first result); its orders
            are ignored, only its tasks and placement are read.
        costs: the cost model (default: unit costs).
        memory: per rank, the most live activations (None: unlimited).
        time_limit: the solver's limit in seconds.
        workers: CP-SAT's worker threads.
    Raises:
        UsageError: OR-Tools missing, an unsupported program, or no order found within the limit.
    """
    cp_model = _cp_model()
    _refuse_unsupported(program)
    costs = costs or CostModel.unit()
    tables = stage_tables(program)
    devices = program.devices or list(range(program.num_ranks))
    tasks = [(rank, action) for rank, row in enumerate(program.ranks) for action in row]
    where = {(a.op, a.stage, a.mb): (rank, a) for rank, a in tasks}
    durations = [costs.compute(a.op, tables.chunk[a.stage]) for _, a in tasks]
    # each task's inputs: (producer key, delay after its end)
    inputs = []
    for rank, a in tasks:
        mine = []
        for dep in ops.DEPENDENCIES[a.op]:
            stage = tables.neighbour(dep.where)[a.stage]
            if stage < 0:
                continue  # no neighbour at a pipeline's end: nothing to wait for
            maker = next((key for key in ((op, stage, a.mb) for op in dep.made_by) if key in where), None)
            if maker is None:
                continue
            source = where[maker][0]
            delay = 0 if devices[source] == devices[rank] else costs.transfer(devices[source], devices[rank], dep.kind)
            mine.append((maker, delay))
        inputs.append(mine)
    scale = _scale([*durations, *(delay for mine in inputs for _, delay in mine)])

    def ticks(value) -> int:
        return int(_exact(value) * scale)

    horizon = sum(ticks(d) for d in durations) + sum(ticks(delay) for mine in inputs for _, delay in mine)
    model = cp_model.CpModel()
    start, end, interval = {}, {}, {}
    for (rank, a), duration in zip(tasks, durations):
        key = (a.op, a.stage, a.mb)
        start[key] = model.NewIntVar(0, horizon, f"s{key}")
        end[key] = model.NewIntVar(0, horizon, f"e{key}")
        interval[key] = model.NewIntervalVar(start[key], ticks(duration), end[key], f"i{key}")
    for (rank, a), mine in zip(tasks, inputs):
        for maker, delay in mine:
            model.Add(start[(a.op, a.stage, a.mb)] >= end[maker] + ticks(delay))
    for rank, row in enumerate(program.ranks):
        model.AddNoOverlap([interval[(a.op, a.stage, a.mb)] for a in row])
    # microbatches of one pipeline are interchangeable: they enter its first stage in order (symmetry breaking)
    for row in program.ranks:
        firsts = sorted((a for a in row if a.op in _ENTRY_OPS and tables.prev[a.stage] < 0), key=lambda a: (a.stage, a.mb))
        for a, b in zip(firsts, firsts[1:]):
            if a.stage == b.stage:
                model.Add(start[(a.op, a.stage, a.mb)] <= start[(b.op, b.stage, b.mb)])
    if memory is not None:
        _add_memory(model, program, memory, start, end, horizon)
    makespan = model.NewIntVar(0, horizon, "makespan")
    model.AddMaxEquality(makespan, list(end.values()))
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        what = "no order meets the memory limit" if status == cp_model.INFEASIBLE else \
            f"no order found within {time_limit} s"
        raise UsageError(f"pipec search: {what}")
    order = [sorted(row, key=lambda a: solver.Value(start[(a.op, a.stage, a.mb)])) for row in program.ranks]
    found = Fraction(int(solver.ObjectiveValue()), scale)
    bound = Fraction(int(round(solver.BestObjectiveBound())), scale)
    return SearchResult(order, OPTIMAL if status == cp_model.OPTIMAL else FEASIBLE, found, min(bound, found),
                        solver.WallTime())


def _add_memory(model, program: Program, memory: Sequence[int], start, end, horizon: int) -> None:
    """Per rank, a cumulative over the activations' lifetimes: from the start of the task that makes one
    (delta +1: F, or R on a recomputed stage) to the end of the task that ends it (delta -1: B, or W when
    split), the span over which the list walk of ``memory_counts.live_counts`` counts it."""
    if len(memory) != program.num_ranks:
        raise UsageError(f"--memory gives {len(memory)} limits for {program.num_ranks} ranks")
    for rank, row in enumerate(program.ranks):
        made = {(a.stage, a.mb): (a.op, a.stage, a.mb) for a in row if ACTIVATION_DELTA.get(a.op, 0) > 0}
        ended = {(a.stage, a.mb): (a.op, a.stage, a.mb) for a in row if ACTIVATION_DELTA.get(a.op, 0) < 0}
        lives = []
        for chunk, maker in made.items():
            size = model.NewIntVar(0, horizon, f"life{maker}")
            lives.append(model.NewIntervalVar(start[maker], size, end[ended[chunk]], f"live{maker}"))
        if lives:
            model.AddCumulative(lives, [1] * len(lives), memory[rank])
