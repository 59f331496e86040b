"""Exact order search for activation passing (issue 27): a CP-SAT job-shop model.

Given a compiled compute-only program (its placement and task set: F and B, or F, I and W, per
stage x microbatch, on one pipeline or several (BitPipe, Chimera: each pipeline's stages are stages
of their own, placed on their ranks, and each microbatch rides its route's pipeline); on a
recomputed stage FC and R in F's place), a cost model and limits on live
memory per rank, ``search_order`` finds the per-rank order that minimises the makespan of the model
below, or the best order found and the solver's lower bound when the time limit ends first.

The model (docs/search.md): one interval per task, sized by ``CostModel.compute``; per rank, no two
intervals overlap; a task starts after each input's producer (``ops.DEPENDENCIES``, at the stage
``StageTables.neighbour`` names) ends, plus ``CostModel.transfer`` when the producer is on another
device; per rank, the values a memory count counts (``memory_counts``: saved activations for
``memory``, each size class's counted values for ``byte_budget``) stay within the limit. Times are
integers: every cost is scaled by the least common denominator of the exact costs.

With ``recompute=CHOOSE`` the solver also chooses, per model chunk, the forward's alternative of the
per-stage task set (``ops.CHECKPOINTS``: F, or FC then R): each alternative's tasks are optional
intervals present exactly when their chunk's choice is theirs. One choice per chunk, not per stage:
the replicas of a chunk (one stage per pipeline) recompute together, as ``recompute stage s`` says
it of the position s along every pipeline.

OR-Tools is imported only when a search runs, so pipec works without it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from fractions import Fraction
from math import lcm
from typing import Mapping, Sequence

from pipec.compiler import ops
from pipec.compiler.costs import CostModel
from pipec.compiler.ir import Action, Program, stage_tables
from pipec.compiler.memory_counts import ACTIVATION_DELTA, SIZE_CLASS_DELTAS, Number, check_sizes
from pipec.errors import NoOrderFound, UsageError

# The largest time scale accepted: costs whose exact denominators need more are not a small grid.
MAX_SCALE = 10**6
OPTIMAL, FEASIBLE = "OPTIMAL", "FEASIBLE"
# What ``recompute`` takes: the target's own recomputed stages, or the solver's choice per stage.
TARGET, CHOOSE = "target", "choose"
# the ops that carry a microbatch forward: they read their PREV stage's value (F, FC)
_ENTRY_OPS = frozenset(op for op, deps in ops.DEPENDENCIES.items() if any(dep.where == ops.PREV for dep in deps))
# the per-stage alternatives of the forward (ops.CHECKPOINTS, F -> (FC, R)), both ways
_PLAIN_OF = {op: plain for plain, checkpointed in ops.CHECKPOINTS.items() for op in checkpointed}
_CHECKPOINTED_OPS = frozenset(_PLAIN_OF)


@dataclass(frozen=True)
class SearchResult:
    """What a search returns.

    Attributes:
        order: per rank, its compute tasks sorted by start time.
        status: ``OPTIMAL`` (proven) or ``FEASIBLE`` (the time limit ended first).
        makespan: the model's makespan of ``order``, in the cost model's units.
        bound: the solver's best lower bound on the makespan (== makespan when optimal).
        seconds: the solver's wall time.
        recomputed (property): the stages the order recomputes.
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

    @property
    def recomputed(self) -> list[int]:
        """The stages whose forward keeps only its input in ``order`` (FC, then R), ascending."""
        return sorted({a.stage for row in self.order for a in row if a.op in _CHECKPOINTED_OPS})


@dataclass(frozen=True)
class _Task:
    """A task of the model: its rank, its action, and the choice of its stage it belongs to (None: every
    choice; True: only when the stage recomputes; False: only when it does not)."""

    rank: int
    action: Action
    recomputes: bool | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        return self.action.op, self.action.stage, self.action.mb


def _cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise UsageError("pipec search needs OR-Tools: pip install 'pipec[search]'") from error
    return cp_model


def _refuse_unsupported(program: Program) -> None:
    if program.mesh is not None or any(stage.placement is not None for stage in program.stages):
        raise UsageError("pipec search orders plain pipelines (one or several, stages on single ranks): a "
                         "composition (mesh or group placement) is not searched yet")
    refuse_weight_versions(program)
    known = set(ops.DEPENDENCIES) - set(ops.IN_ORDER_COMPUTE_OPS)
    for row in program.ranks:
        for action in row:
            if action.op not in known:
                raise UsageError(f"pipec search orders activation passing's computes; {action.op} is not one")


def refuse_weight_versions(program: Program) -> None:
    """Raise UsageError when ``program``'s order holds optimizer updates (``ops.UPDATE_OPS``: PipeDream's U).

    Where an update stands decides which weight version each later forward runs on, so reordering it
    changes the gradients, not only the time: a makespan-only search would change the training."""
    updates = sorted({a.op for row in program.ranks for a in row if a.op in ops.UPDATE_OPS})
    if updates:
        raise UsageError(f"pipec search does not reorder optimizer updates ({', '.join(updates)}): where an update "
                         "stands decides which weight version each later forward runs on, so another order trains "
                         "another model, not the same one faster (docs/search.md, weight versions)")


def _exact(value) -> Fraction:
    """A cost as a fraction: a float as the decimal it prints as (0.52 -> 13/25, not its binary expansion)."""
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def _scale(values: Sequence) -> int:
    scale = lcm(*(_exact(v).denominator for v in values)) if values else 1
    if scale > MAX_SCALE:
        raise UsageError(f"the costs need a time grid of 1/{scale}: pipec search takes at most 1/{MAX_SCALE}")
    return scale


def _task_set(program: Program, recompute: str) -> list[_Task]:
    """The model's tasks: the program's, or with ``CHOOSE`` both forward alternatives of every stage.

    Under ``CHOOSE`` a plain forward (F) or a checkpointed one (FC) of (stage, mb) becomes the plain
    forward, present when the stage does not recompute, and the checkpointed alternative's ops (FC, R),
    present when it does (the choice is its chunk's: ``search_order``); the program's own recomputes are
    dropped and remade from its forwards."""
    if recompute == TARGET:
        return [_Task(rank, action) for rank, row in enumerate(program.ranks) for action in row]
    if recompute != CHOOSE:
        raise UsageError(f"recompute takes {TARGET!r} or {CHOOSE!r}, not {recompute!r}")
    tasks = []
    for rank, row in enumerate(program.ranks):
        for action in row:
            plain = _PLAIN_OF.get(action.op, action.op)
            if plain not in ops.CHECKPOINTS:
                tasks.append(_Task(rank, action))
            elif action.op == plain or action.op == ops.CHECKPOINTS[plain][0]:  # one forward, however written
                tasks.append(_Task(rank, action._replace(op=plain), False))
                tasks += [_Task(rank, action._replace(op=op), True) for op in ops.CHECKPOINTS[plain]]
    return tasks


@dataclass(frozen=True)
class SearchProblem:
    """The model's data, shared by the exact search and by every evaluator of an order.

    Attributes:
        program: the compute-only program whose tasks are ordered.
        tasks: the model's tasks (``_task_set``).
        durations: per task, its length in ticks.
        inputs: per task, its inputs as (producer keys in ``ops.DEPENDENCIES`` order, the first present
            wins; the delay in ticks after that producer's end).
        scale: ticks per cost unit (the least common denominator of the exact costs and delays).
    """

    program: Program
    tasks: list[_Task]
    durations: list[int]
    inputs: list[list[tuple[list[tuple[str, int, int]], int]]]
    scale: int

    @property
    def horizon(self) -> int:
        """An upper bound on any order's makespan in ticks: every task and delay one after another."""
        return sum(self.durations) + sum(delay for mine in self.inputs for _, delay in mine)


def search_problem(program: Program, costs: CostModel | None = None, recompute: str = TARGET) -> SearchProblem:
    """The model's tasks, their lengths and their inputs for ``program`` under ``costs`` (unit when None).

    Raises:
        UsageError: an unsupported program, an unknown ``recompute``, or costs too fine for the time grid.
    """
    _refuse_unsupported(program)
    costs = costs or CostModel.unit()
    tables = stage_tables(program)
    devices = program.devices or list(range(program.num_ranks))
    tasks = _task_set(program, recompute)
    where = {task.key: task for task in tasks}
    durations = [costs.compute(task.action.op, tables.chunk[task.action.stage]) for task in tasks]
    inputs = []
    for task in tasks:
        a, mine = task.action, []
        for dep in ops.DEPENDENCIES[a.op]:
            stage = tables.neighbour(dep.where)[a.stage]
            if stage < 0:
                continue  # no neighbour at a pipeline's end: nothing to wait for
            makers = [key for key in ((op, stage, a.mb) for op in dep.made_by) if key in where]
            if not makers:
                continue
            source = where[makers[0]].rank  # every alternative of a value is made on its stage's rank
            delay = 0 if devices[source] == devices[task.rank] else costs.transfer(devices[source], devices[task.rank],
                                                                                      dep.kind)
            mine.append((makers, delay))
        inputs.append(mine)
    scale = _scale([*durations, *(delay for mine in inputs for _, delay in mine)])

    def ticks(value) -> int:
        return int(_exact(value) * scale)

    return SearchProblem(program, tasks, [ticks(d) for d in durations],
                         [[(makers, ticks(delay)) for makers, delay in mine] for mine in inputs], scale)


def order_starts(problem: SearchProblem, order: Sequence[Sequence[Action]]) -> dict[tuple[str, int, int], int] | None:
    """Each task's earliest start in ticks when every rank runs ``order``'s row in its order, or None when
    the order deadlocks (a task waits on one that its own rank or a waiting rank runs later).

    A task starts when its rank's previous task ends and each input's producer (the first of its makers
    that ``order`` holds) has ended plus the link's delay: the model's timing of a fixed order, which the
    solver's optimum meets and the simulator re-prices. Priced on ``order_timing``'s integer arrays, in
    O(tasks) for an order whose ranks wait on one another a bounded number of times (``OrderTiming.ends``).

    Raises:
        UsageError: ``order`` holds a task the problem does not, or one twice.
    """
    timing, rows, ends = _priced(problem, order)
    if ends is None:
        return None
    duration, keys = timing.duration, timing.keys
    return {keys[t]: ends[t] - duration[t] for row in rows for t in row}


def order_makespan(problem: SearchProblem, order: Sequence[Sequence[Action]]) -> Fraction | None:
    """The model's makespan of ``order`` (``order_starts``' latest end) in cost units; None when it deadlocks."""
    _, rows, ends = _priced(problem, order)
    return None if ends is None else Fraction(max((ends[t] for row in rows for t in row), default=0), problem.scale)


def _priced(problem: SearchProblem, order: Sequence[Sequence[Action]]):
    """(the problem's arrays, ``order`` as task numbers, each task's end in ticks or None on a deadlock)."""
    timing = order_timing(problem)
    rows = timing.rows(order)
    return timing, rows, timing.ends(rows, timing.inputs_of_present(rows))


@dataclass(frozen=True)
class OrderTiming:
    """A ``SearchProblem`` as integer arrays, for pricing many orders of its tasks (``order_timing``).

    Tasks are numbered as ``problem.tasks``; an order is given as ``rows``: per rank, task numbers.

    Attributes:
        keys: per task, its (op, stage, mb).
        index: (op, stage, mb) -> task number.
        rank: per task, its rank.
        duration: per task, its length in ticks.
        makers: per task, per input: (the producers' numbers, ``ops.DEPENDENCIES`` order; the delay in ticks).
        inputs: per task, (producer, delay) per input when the order holds every task (each input's first maker).
    """

    keys: list[tuple[str, int, int]]
    index: dict[tuple[str, int, int], int]
    rank: list[int]
    duration: list[int]
    makers: list[tuple[tuple[tuple[int, ...], int], ...]]
    inputs: list[tuple[tuple[int, int], ...]]

    def rows(self, order: Sequence[Sequence[Action]]) -> list[list[int]]:
        """``order`` as task numbers.

        Raises:
            UsageError: ``order`` holds a task the problem does not, or one twice.
        """
        index = self.index
        try:
            rows = [[index[(a.op, a.stage, a.mb)] for a in row] for row in order]
        except KeyError as missing:
            op, stage, mb = missing.args[0]
            raise UsageError(f"the order holds {op}({stage}, {mb}): not a task of the searched target") from None
        if sum(map(len, rows)) != len(set().union(*rows)):
            raise UsageError("the order holds a task twice: not a task of the searched target")
        return rows

    def inputs_of_present(self, rows: Sequence[Sequence[int]]) -> list[tuple[tuple[int, int], ...]]:
        """Per task, (producer, delay) per input, the producer the first maker ``rows`` holds (an input none of
        whose makers it holds is not waited for): ``inputs`` when ``rows`` holds every task."""
        if sum(map(len, rows)) == len(self.keys):
            return self.inputs
        held = set().union(*rows)
        return [tuple((next(m for m in makers if m in held), delay) for makers, delay in mine
                      if any(m in held for m in makers)) for mine in self.makers]

    def ends(self, rows: Sequence[Sequence[int]], inputs: Sequence[tuple[tuple[int, int], ...]] | None = None
             ) -> list[int] | None:
        """Per task, its end in ticks when each rank runs its row in order and every task starts as early as its
        rank and its inputs allow (-1 for a task ``rows`` does not hold); None when the order deadlocks.

        Each pass runs every rank as far as its inputs have ended; a pass that ends no task is a deadlock.
        A pipeline's ranks wait on one another about once per microbatch and stage, so a walk costs a few
        passes over the ranks beyond one visit of each task.
        """
        inputs = self.inputs if inputs is None else inputs
        duration = self.duration
        end = [-1] * len(duration)
        heads = [0] * len(rows)
        free = [0] * len(rows)
        left = sum(map(len, rows))
        while left:
            placed = left
            for r, row in enumerate(rows):
                h, at, size = heads[r], free[r], len(row)
                while h < size:
                    t = row[h]
                    ready = at
                    for maker, delay in inputs[t]:
                        done = end[maker]
                        if done < 0:
                            break
                        if done + delay > ready:
                            ready = done + delay
                    else:
                        at = end[t] = ready + duration[t]
                        h += 1
                        continue
                    break
                left -= h - heads[r]
                heads[r], free[r] = h, at
            if left == placed:
                return None
        return end

    def makespan(self, rows: Sequence[Sequence[int]]) -> int | None:
        """The latest end of ``rows`` (holding every task) in ticks; None when it deadlocks."""
        end = self.ends(rows)
        return None if end is None else max(end, default=0)


def order_timing(problem: SearchProblem) -> OrderTiming:
    """``problem``'s ``OrderTiming``, built once per problem and kept while the problem lives."""
    key = id(problem)
    kept = _TIMINGS.get(key)
    if kept is not None and kept[0]() is problem:
        return kept[1]
    keys = [task.key for task in problem.tasks]
    index = {k: i for i, k in enumerate(keys)}
    makers = [tuple((tuple(index[m] for m in producers), delay) for producers, delay in mine)
              for mine in problem.inputs]
    timing = OrderTiming(keys, index, [task.rank for task in problem.tasks], list(problem.durations), makers,
                         [tuple((producers[0], delay) for producers, delay in mine) for mine in makers])
    _TIMINGS[key] = (weakref.ref(problem, lambda _, key=key: _TIMINGS.pop(key, None)), timing)
    return timing


# id(problem) -> (a weak reference to it, its timing): a SearchProblem holds lists, so it is not hashable
_TIMINGS: dict[int, tuple[weakref.ref, OrderTiming]] = {}


def consumers_of(timing: OrderTiming) -> list[list[tuple[int, int]]]:
    """Per task, (consumer, delay) for every task that takes one of its outputs as an input."""
    consumers: list[list[tuple[int, int]]] = [[] for _ in timing.inputs]
    for t, mine in enumerate(timing.inputs):
        for maker, delay in mine:
            consumers[maker].append((t, delay))
    return consumers


def search_order(program: Program, costs: CostModel | None = None, memory: Sequence[int] | None = None, *,
                 byte_budget: Mapping[str, Number] | None = None, recompute: str = TARGET,
                 time_limit: float = 30.0, workers: int = 2,
                 hint: Sequence[Sequence[Action]] | None = None) -> SearchResult:
    """The fastest per-rank order of ``program``'s tasks under ``costs``, ``memory`` and ``byte_budget``.

    Args:
        program: a compute-only activation-passing program (``lower_spec``'s first result); its orders
            are ignored, only its tasks and placement are read.
        costs: the cost model (default: unit costs); its ``sizes`` price ``byte_budget``.
        memory: per rank, the most live saved activations (what ``pipec check --budget`` counts; None:
            unlimited).
        byte_budget: size class -> the most bytes of live counted values of that class per rank (what
            ``pipec check --budget-bytes`` counts; None: unlimited).
        recompute: ``TARGET`` (the program's recomputed stages) or ``CHOOSE`` (the solver chooses per
            model chunk, for every replica of it at once; among the fastest orders, one with the fewest
            recomputed chunks).
        time_limit: the solver's limit in seconds.
        workers: CP-SAT's worker threads.
        hint: an order of the same tasks to start from (a known schedule's, or a heuristic's): the solver
            is given its times (``order_starts``) as a first solution, which it keeps when it finds no
            better one within the limit; an order that breaks the limits is only a hint the solver repairs.
    Raises:
        UsageError: OR-Tools missing, an unsupported program, a byte budget for a class the costs do not
            size, a hint with tasks the target does not have or that deadlocks, or no order found within
            the limit; the solver rejecting the model (a pipec bug), named as such.
    """
    cp_model = _cp_model()
    costs = costs or CostModel.unit()
    problem = search_problem(program, costs, recompute)
    tasks, horizon = problem.tasks, problem.horizon
    where = {task.key: task for task in tasks}
    tables = stage_tables(program)
    model = cp_model.CpModel()
    # one choice per model chunk: its replicas (a stage of each pipeline) recompute together, as the language's
    # `recompute stage s` names positions along every pipeline, so the written file says what was searched
    choice = {chunk: model.NewBoolVar(f"recompute{chunk}")
              for chunk in sorted({tables.chunk[t.action.stage] for t in tasks if t.recomputes is not None})}

    def present(task: _Task) -> list:
        return _present(choice, tables.chunk[task.action.stage], task.recomputes)

    start, end, interval = {}, {}, {}
    for task, duration in zip(tasks, problem.durations):
        key = task.key
        start[key] = model.NewIntVar(0, horizon, f"s{key}")
        end[key] = model.NewIntVar(0, horizon, f"e{key}")
        if task.recomputes is None:
            interval[key] = model.NewIntervalVar(start[key], duration, end[key], f"i{key}")
        else:
            interval[key] = model.NewOptionalIntervalVar(start[key], duration, end[key], *present(task), f"i{key}")
    for task, mine in zip(tasks, problem.inputs):
        for makers, delay in mine:
            earlier = []  # makers listed first that are present win
            for maker in makers:
                model.Add(start[task.key] >= end[maker] + delay).OnlyEnforceIf(
                    present(task) + present(where[maker]) + [lit.Not() for lit in earlier])
                if not present(where[maker]):
                    break  # always made: the makers after it never count
                earlier += present(where[maker])
    for rank in range(program.num_ranks):
        model.AddNoOverlap([interval[t.key] for t in tasks if t.rank == rank])
    # microbatches of one pipeline are interchangeable: they enter its first stage in order (symmetry breaking).
    # Each pipeline's first stage is a stage of its own, so this orders each pipeline's microbatches apart;
    # two microbatches of different pipelines are not interchangeable (other stages, other ranks).
    firsts = sorted((t for t in tasks if t.action.op in _ENTRY_OPS and tables.prev[t.action.stage] < 0),
                    key=lambda t: (t.action.stage, t.action.op, t.action.mb))
    for a, b in zip(firsts, firsts[1:]):
        if (a.action.stage, a.action.op) == (b.action.stage, b.action.op):
            model.Add(start[a.key] <= start[b.key]).OnlyEnforceIf(present(a))
    if memory is not None:
        if len(memory) != program.num_ranks:
            raise UsageError(f"--memory gives {len(memory)} limits for {program.num_ranks} ranks")
        _add_count_limit(model, tasks, ACTIVATION_DELTA, memory, start, choice, tables.chunk, horizon,
                         "activations")
    for size_class, limit in byte_caps(tasks, byte_budget, costs.sizes).items():
        _add_count_limit(model, tasks, SIZE_CLASS_DELTAS[size_class], [limit] * program.num_ranks, start, choice,
                         tables.chunk, horizon, size_class)
    makespan = model.NewIntVar(0, horizon, "makespan")
    for task in tasks:
        model.Add(makespan >= end[task.key]).OnlyEnforceIf(present(task))
    if hint is not None:
        _add_hint(model, problem, hint, start, end, choice, tables.chunk, makespan)
    # among the fastest orders, one with the fewest recomputed chunks (a recompute the makespan does not need
    # only spends compute); the count weighs less than one tick of the makespan, so it only breaks ties
    weight = len(choice) + 1
    model.Minimize(makespan * weight + sum(choice.values()) if choice else makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    status = solver.Solve(model)
    if status == cp_model.MODEL_INVALID:  # the model pipec built is wrong: say so, not "no order found"
        raise UsageError(f"pipec search: the solver rejected the model it was given (a pipec bug): "
                         f"{model.Validate() or solver.StatusName(status)}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        what = "no order meets the memory limits" if status == cp_model.INFEASIBLE else \
            f"no order found within {time_limit} s"
        raise NoOrderFound(f"pipec search: {what}")
    chosen = [t for t in tasks if all(solver.BooleanValue(lit) for lit in present(t))]
    order = [sorted((t.action for t in chosen if t.rank == rank),
                    key=lambda a: solver.Value(start[(a.op, a.stage, a.mb)])) for rank in range(program.num_ranks)]
    found = Fraction(solver.Value(makespan), problem.scale)
    # objective = makespan * weight + recomputed chunks (< weight): floor(bound / weight) bounds the makespan
    bound = Fraction(int(round(solver.BestObjectiveBound())) // weight, problem.scale)
    return SearchResult(order, OPTIMAL if status == cp_model.OPTIMAL else FEASIBLE, found, min(bound, found),
                        solver.WallTime())


def _add_hint(model, problem: SearchProblem, hint: Sequence[Sequence[Action]], start, end,
              choice: Mapping[int, object], chunk_of: Sequence[int], makespan) -> None:
    """Give the solver ``hint``'s times as a first solution: every start, end and chunk choice, and its makespan.

    Each variable is hinted once (CP-SAT rejects a model whose hint names a variable twice): the values are
    gathered per variable first, a chunk's choice from every stage of it the hint recomputes.

    Raises:
        UsageError: the hint holds a task the problem does not, or deadlocks.
    """
    try:
        starts = order_starts(problem, hint)
    except UsageError as error:
        raise UsageError(f"the hint: {error}") from None
    if starts is None:
        raise UsageError("the hint's order deadlocks: a task waits on one its rank or a waiting rank runs later")
    index = {task.key: i for i, task in enumerate(problem.tasks)}
    values: dict[int, tuple[object, int]] = {}  # variable index -> (variable, value)

    def give(variable, value: int) -> None:
        values.setdefault(variable.Index(), (variable, value))

    for key, at in starts.items():
        give(start[key], at)
        give(end[key], at + problem.durations[index[key]])
    recomputed = {chunk_of[k[1]] for k in starts if k[0] in _CHECKPOINTED_OPS}
    for chunk, chosen in choice.items():
        give(chosen, int(chunk in recomputed))
    give(makespan, max((at + problem.durations[index[k]] for k, at in starts.items()), default=0))
    for variable, value in values.values():
        model.AddHint(variable, value)


def byte_caps(tasks: Sequence[_Task], byte_budget: Mapping[str, Number] | None,
               sizes: Mapping[str, Number]) -> dict[str, int]:
    """Size class -> the most live counted values of it a rank may hold under ``byte_budget``.

    Every value of a class weighs its class's size (``memory_counts.peak_bytes``), so a budget of B bytes
    is a count: the largest k with k * size <= B, compared as the check compares (``live * size > limit``),
    which keeps the model's integers exact. Classes no task here counts, and free ones, need no limit.

    Raises:
        UsageError: a budgeted class that the tasks count and ``sizes`` does not size.
    """
    if not byte_budget:
        return {}
    check_sizes(byte_budget)
    counted = {t.action.op for t in tasks}
    caps = {}
    for size_class, limit in byte_budget.items():
        if not counted & set(SIZE_CLASS_DELTAS[size_class]):
            continue
        if size_class not in sizes:
            raise UsageError(f"a byte budget for {size_class!r} needs its size: the cost model gives none (sizes)")
        size = sizes[size_class]
        if not size:
            continue
        cap = int(_exact(limit) / _exact(size))
        while (cap + 1) * size <= limit:  # the check's own arithmetic decides at the edge
            cap += 1
        while cap > 0 and cap * size > limit:
            cap -= 1
        rises = any(SIZE_CLASS_DELTAS[size_class].get(t.action.op, 0) > 0 for t in tasks if t.recomputes is None)
        if cap == 0 and rises:  # a value every order makes: none fits (an optional one is left out instead)
            raise UsageError(f"pipec search: a budget of {limit} bytes for {size_class} holds no value of it "
                             f"({size} bytes each)")
        caps[size_class] = min(cap, len(tasks))  # more than every value at once limits nothing
    return caps


def _add_count_limit(model, tasks: Sequence[_Task], delta: Mapping[str, int], limits: Sequence[int], start,
                     choice: Mapping[int, object], chunk_of: Sequence[int], horizon: int, what: str) -> None:
    """Per rank, a cumulative over the spans in which the values ``delta`` counts are alive (``_lifetimes``),
    at most ``limits[rank]`` at once: exactly the count ``memory_counts.live_counts`` walks. A rank counts the
    values of every stage it runs, of whichever pipeline; a span of a choice is present with its chunk's."""
    for rank, limit in enumerate(limits):
        spans, demands = [], []
        for first, then, count, stage, recomputes in _lifetimes([t for t in tasks if t.rank == rank], delta):
            stop = start[then] if then is not None else horizon  # never ended: alive to the list's end
            size = model.NewIntVar(0, horizon, f"{what}{first}")
            when = _present(choice, chunk_of[stage], recomputes)
            if when:
                spans.append(model.NewOptionalIntervalVar(start[first], size, stop, when[0], f"{what}{first}"))
            else:
                spans.append(model.NewIntervalVar(start[first], size, stop, f"{what}{first}"))
            demands.append(count)
        if spans:  # a limit past every value the rank makes binds nothing (and stays within the solver's int64)
            model.AddCumulative(spans, demands, min(limit, sum(demands)))


def _lifetimes(row: Sequence[_Task], delta: Mapping[str, int]):
    """The spans over which one rank's values counted by ``delta`` are alive, as (task key, the key of the
    task that ends the span or None, live count, stage, the stage's choice the span belongs to or None).

    A value lives on its stage's rank, so the count of one (stage, mb) changes only at its own tasks,
    which its dataflow orders (FC, R, I, W): after each task that changes it, the count holds until the
    start of the next such task. The list walk counts a value from its maker's step up to its ender's,
    which in time is [start of the maker, start of the ender), since tasks on a rank never overlap; an I
    that ends a saved activation and makes a stash of the same class (net 0) changes nothing. Under
    ``CHOOSE`` each choice of the stage has its own spans, present with it.
    """
    chunks: dict[tuple[int, int], list[_Task]] = {}
    for task in row:
        chunks.setdefault((task.action.stage, task.action.mb), []).append(task)
    for (stage, _), chunk in chunks.items():
        for recomputes in sorted({t.recomputes for t in chunk} - {None}) or [None]:
            tasks = [t for t in chunk if t.recomputes in (None, recomputes)]
            chain = _dataflow_order([t for t in tasks if delta.get(t.action.op, 0)], {t.action.op for t in tasks})
            count = 0
            for task, following in zip(chain, chain[1:] + [None]):
                count += delta[task.action.op]
                if count > 0:
                    yield task.key, following.key if following else None, count, stage, recomputes


def _dataflow_order(tasks: list[_Task], ran: set[str]) -> list[_Task]:
    """``tasks`` (of one stage and microbatch, whose ops are ``ran``) in the order their own-stage inputs
    (``ops.DEPENDENCIES`` at SELF, the first maker that ran) force.

    Raises:
        UsageError: two of them the dataflow leaves unordered (then no span follows from the rule table).
    """
    def before(op: str) -> set[str]:
        out = set()
        for dep in ops.DEPENDENCIES[op]:
            maker = next((m for m in dep.made_by if m in ran and m != op), None) if dep.where == ops.SELF else None
            if maker is not None:
                out |= {maker} | before(maker)
        return out

    ancestors = {t.action.op: before(t.action.op) for t in tasks}
    chain = sorted(tasks, key=lambda t: len(ancestors[t.action.op]))
    for a, b in zip(chain, chain[1:]):
        if a.action.op not in ancestors[b.action.op]:
            raise UsageError(f"pipec search counts memory along each microbatch's dataflow: {a.action.op} and "
                             f"{b.action.op} of one stage and microbatch are not ordered by it")
    return chain


def _present(choice: Mapping[int, object], chunk: int, recomputes: bool | None) -> list:
    """The literals under which a task (or span) of a stage of ``chunk`` that belongs to ``recomputes`` is in
    the order: none when it belongs to every choice."""
    if recomputes is None:
        return []
    chosen = choice[chunk]
    return [chosen if recomputes else chosen.Not()]
