"""Heuristic order search for sizes past the exact model (issue 27, item 3): local search from good seeds,
measured against an analytic lower bound.

Contract: ``heuristic_search`` returns an order of the program's tasks that does not deadlock and meets the
memory limits (``search_limits``), its makespan in the model every evaluator shares (``search.order_timing``,
equal to the simulator's), the lower bound of ``search_bound`` and their gap. It starts from every seed of
``search_seeds`` and anneals: a move takes one task of a rank's row to another place in it (an adjacent swap
is the shortest move), drawn mostly from the rank-order arcs of a critical path of the current order (in a
job shop only these moves can shorten it) and otherwise anywhere; a move that breaks a limit or deadlocks is
refused, one that lengthens the makespan is taken with the annealing's probability, and ties in makespan are
broken by the sum of every task's end (so a move that frees time somewhere is progress on a plateau).
Restarts begin alternately from the next-best seed and from the best order so far.

Deterministic: the same inputs and ``seed`` give the same order for a given ``evaluations`` budget (moves
tried are counted, not seconds); ``time_limit`` only stops it early. It stops at once when the makespan meets
the bound (then the order is proven optimal).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence

from pipec.compiler.costs import CostModel
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import Number
from pipec.compiler.search import FEASIBLE, OPTIMAL, TARGET, OrderTiming, SearchResult, order_timing, search_problem
from pipec.compiler.search_bound import lower_bound
from pipec.compiler.search_limits import CountLimit, row_fits, search_limits
from pipec.compiler.search_seeds import Rows, seed_orders
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import UsageError

HEURISTIC = "heuristic"
DEFAULT_EVALUATIONS = 20_000
# The longest single move, in positions along a row: far enough to carry a forward across a warm-up.
_REACH = 8
# The share of moves drawn from a critical path's rank-order arcs.
_CRITICAL_SHARE = 0.6
# The annealing's temperature, in units of the mean task length: from hot to cold over each restart.
_HOT, _COLD = 0.5, 0.005
_RESTARTS = 6


@dataclass(frozen=True)
class HeuristicResult(SearchResult):
    """A ``SearchResult`` whose bound is ``search_bound``'s (``OPTIMAL`` when the makespan meets it).

    Attributes (beyond ``SearchResult``'s):
        evaluations: the moves tried.
        method: which search produced the order (``heuristic``).
        seed_name: the seed the best order descends from.
        bound_reason: the relaxation that gives the bound (``search_bound.LowerBound.reason``).
        seeds: each seed tried, with its makespan in cost units.
    """

    evaluations: int = 0
    method: str = HEURISTIC
    seed_name: str = ""
    bound_reason: str = ""
    seeds: tuple[tuple[str, Fraction], ...] = ()


def heuristic_search(program: Program, costs: CostModel | None = None, memory: Sequence[int] | None = None, *,
                     byte_budget: Mapping[str, Number] | None = None, spec: ScheduleSpec | None = None,
                     hint: Sequence[Sequence[Action]] | None = None, seed: int = 0,
                     evaluations: int = DEFAULT_EVALUATIONS, time_limit: float = 30.0) -> HeuristicResult:
    """A fast order of ``program``'s tasks under ``costs``, ``memory`` and ``byte_budget`` (module docstring).

    Args:
        program: a compute-only activation-passing program (``lower_spec``'s first result); its own order is a seed.
        costs: the cost model (default: unit costs); its ``sizes`` price ``byte_budget``.
        memory: per rank, the most live saved activations (None: unlimited).
        byte_budget: size class -> the most bytes of its live counted values per rank (None: unlimited).
        spec: the evaluated target, for the list scheduler's seeds on its placement (None: no such seeds).
        hint: another order of the same tasks to start from.
        seed: the random generator's seed.
        evaluations: the most moves tried.
        time_limit: seconds after which the search stops with the best order so far.
    Raises:
        UsageError: an unsupported program, or no seed that meets the limits.
    """
    began = time.monotonic()
    costs = costs or CostModel.unit()
    problem = search_problem(program, costs, TARGET)
    timing = order_timing(problem)
    limits = search_limits(problem, memory, byte_budget, costs.sizes)
    bound = lower_bound(problem, limits)
    bound_ticks = int(bound.makespan * problem.scale)
    seeds = seed_orders(timing, limits, program.num_ranks, own=program.ranks, hint=hint, spec=spec, costs=costs)
    if not seeds:
        raise UsageError("pipec search: no starting order meets the memory limits (the target's, the list "
                         "scheduler's and the memory-keeping list schedule all break them); --method exact may "
                         "find one, or prove that none exists")
    priced = sorted(((timing.makespan(rows), i) for i, (_, rows) in enumerate(seeds)))
    annealer = _Annealer(timing, limits, random.Random(seed), began + time_limit, bound_ticks)
    best_name = seeds[priced[0][1]][0]
    best_rows = seeds[priced[0][1]][1]
    best = priced[0][0]
    for restart in range(_RESTARTS):
        if best <= bound_ticks or annealer.stopped(evaluations):
            break
        pick = priced[(restart // 2) % len(priced)][1] if restart % 2 == 0 else None
        start_name, start_rows = seeds[pick] if pick is not None else (best_name, best_rows)
        # restart r may have tried (r + 1)/_RESTARTS of the moves by its end: every move is spent, even when few
        rows, makespan = annealer.anneal(start_rows, evaluations * (restart + 1) // _RESTARTS)
        if makespan < best:
            best, best_rows, best_name = makespan, rows, start_name
    order = [[problem.tasks[t].action for t in row] for row in best_rows]
    found = Fraction(best, problem.scale)
    return HeuristicResult(order, OPTIMAL if best <= bound_ticks else FEASIBLE, found, min(bound.makespan, found),
                           time.monotonic() - began, annealer.tried, HEURISTIC, best_name, bound.reason,
                           tuple((seeds[i][0], Fraction(ms, problem.scale)) for ms, i in priced))


class _Annealer:
    """Simulated annealing over one order at a time (module docstring); counts every move it tries."""

    def __init__(self, timing: OrderTiming, limits: Sequence[CountLimit], rng: random.Random, deadline: float,
                 bound: int):
        self.timing, self.limits, self.rng, self.deadline, self.bound = timing, limits, rng, deadline, bound
        self.tried = 0
        self.mean_length = max(1.0, sum(timing.duration) / max(1, len(timing.duration)))

    def stopped(self, budget: int) -> bool:
        return self.tried >= budget or time.monotonic() > self.deadline

    def anneal(self, rows: Rows, budget: int) -> tuple[Rows, int]:
        """Anneal from ``rows`` until ``budget`` moves have been tried in all (or the deadline, or the bound):
        the best order met and its makespan in ticks."""
        timing, rng = self.timing, self.rng
        rows = [list(row) for row in rows]
        end = timing.ends(rows)
        makespan = max(end)
        tie = 1.0 / (len(end) * (makespan + 1))  # the sum of ends weighs less than one tick
        energy = makespan + sum(end) * tie
        best, best_rows = makespan, [list(row) for row in rows]
        moves = max(1, budget - self.tried)
        temperature = _HOT * self.mean_length
        cooling = (_COLD / _HOT) ** (1.0 / moves)
        position = _positions(rows, len(end))
        arcs = None
        while self.tried < budget and best > self.bound:
            if self.tried % 64 == 0 and time.monotonic() > self.deadline:
                break
            self.tried += 1
            temperature *= cooling
            if arcs is None:
                arcs = _critical_arcs(timing, rows, end, position, rng)
            rank, row = self._propose(rows, arcs)
            if row is None or not row_fits(self.limits, rank, row):
                continue
            trial = rows[:]
            trial[rank] = row
            trial_end = timing.ends(trial)
            if trial_end is None:
                continue
            trial_makespan = max(trial_end)
            trial_energy = trial_makespan + sum(trial_end) * tie
            worse = trial_energy - energy
            if worse > 0 and rng.random() >= math.exp(-worse / temperature):
                continue
            rows, end, makespan, energy, arcs = trial, trial_end, trial_makespan, trial_energy, None
            for i, t in enumerate(row):
                position[t] = i
            if makespan < best:
                best, best_rows = makespan, [list(r) for r in rows]
        return best_rows, best

    def _propose(self, rows: Rows, arcs: list[tuple[int, int]]) -> tuple[int, list[int] | None]:
        """A rank and its row after one move (None: no move drawn): on a critical arc (swap its two tasks, carry
        the later one earlier or the earlier one later, or exchange the later one with an earlier task of its
        kind) or anywhere (one task shifted, or two of a kind exchanged). Two tasks of one kind change every
        count alike, so exchanging them keeps the limits: the move left where memory is tight."""
        rng = self.rng
        if arcs and rng.random() < _CRITICAL_SHARE:
            rank, i = arcs[rng.randrange(len(arcs))]
            row = rows[rank][:]
            way = rng.random()
            if way < 0.4:
                row[i - 1], row[i] = row[i], row[i - 1]
            elif way < 0.6:
                row.insert(max(0, i - 1 - rng.randrange(_REACH)), row.pop(i))
            elif way < 0.8:
                row.insert(min(len(row), i + rng.randrange(_REACH)), row.pop(i - 1))
            else:
                return rank, self._exchange(row, i, range(i - 1, max(-1, i - 1 - 4 * _REACH), -1))
            return rank, row
        rank = rng.randrange(len(rows))
        row = rows[rank][:]
        if len(row) < 2:
            return rank, None
        i = rng.randrange(len(row))
        if rng.random() < 0.3:
            return rank, self._exchange(row, i, range(i + 1, min(len(row), i + 1 + 4 * _REACH)))
        j = min(len(row) - 1, max(0, i + rng.choice((-1, 1)) * (1 + rng.randrange(_REACH))))
        if i == j:
            return rank, None
        row.insert(j, row.pop(i))
        return rank, row

    def _exchange(self, row: list[int], i: int, places: range) -> list[int] | None:
        """``row`` (a copy, changed) with ``row[i]`` and the first task of its kind at ``places`` exchanged;
        None when there is none."""
        keys = self.timing.keys
        kind = keys[row[i]][0]
        j = next((j for j in places if keys[row[j]][0] == kind), None)
        if j is None:
            return None
        row[i], row[j] = row[j], row[i]
        return row


def _positions(rows: Rows, tasks: int) -> list[int]:
    """Per task, its place in its rank's row."""
    position = [0] * tasks
    for row in rows:
        for i, t in enumerate(row):
            position[t] = i
    return position


def _critical_arcs(timing: OrderTiming, rows: Rows, end: list[int], position: list[int],
                   rng: random.Random) -> list[tuple[int, int]]:
    """The rank-order arcs (rank, i: ``rows[rank][i - 1]`` then ``rows[rank][i]``) on one critical path of
    the order, walked back from a task that ends last through whichever constraint set each start (a tie
    between the rank's previous task and an input goes either way)."""
    duration, rank, inputs = timing.duration, timing.rank, timing.inputs
    t = max(range(len(end)), key=end.__getitem__)
    arcs = []
    while True:
        start = end[t] - duration[t]
        if start <= 0:
            return arcs
        r, i = rank[t], position[t]
        previous = rows[r][i - 1] if i > 0 and end[rows[r][i - 1]] == start else None
        via = next((m for m, delay in inputs[t] if end[m] + delay == start), None)
        if previous is not None:
            arcs.append((r, i))
        if previous is not None and (via is None or rng.random() < 0.5):
            t = previous
        elif via is not None:
            t = via
        else:
            return arcs
