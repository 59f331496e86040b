"""Which search orders a target: exact (CP-SAT, ``search.search_order``), heuristic
(``search_heuristic.heuristic_search``), or ``auto``: exact up to ``EXACT_TASKS`` tasks, past it the heuristic
for half the time and then CP-SAT, hinted with the heuristic's order, for the rest (it keeps that order when
it finds none better, and its bound is kept when it beats the analytic one).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Mapping, Sequence

from pipec.compiler.costs import CostModel
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import Number
from pipec.compiler.search import CHOOSE, FEASIBLE, OPTIMAL, TARGET, SearchResult, search_order
from pipec.compiler.search_heuristic import DEFAULT_EVALUATIONS, HEURISTIC, heuristic_search
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import NoOrderFound, UsageError

EXACT, AUTO = "exact", "auto"
METHODS = (EXACT, HEURISTIC, AUTO)
# Past this many tasks ``auto`` starts with the heuristic: the exact model answers within a minute up to about
# here on two cores (docs/search.md).
EXACT_TASKS = 200
HEURISTIC_THEN_EXACT = "heuristic, then exact"


@dataclasses.dataclass(frozen=True)
class MethodResult:
    """A search's result and the method that produced its order.

    Attributes:
        result: the exact search's ``SearchResult`` or the heuristic's ``HeuristicResult``.
        method: ``exact``, ``heuristic``, or ``heuristic, then exact`` (auto past ``EXACT_TASKS``).
    """

    result: SearchResult
    method: str


def search_by_method(method: str, program: Program, costs: CostModel | None = None,
                     memory: Sequence[int] | None = None, *, byte_budget: Mapping[str, Number] | None = None,
                     recompute: str = TARGET, time_limit: float = 30.0, workers: int = 2,
                     hint: Sequence[Sequence[Action]] | None = None, spec: ScheduleSpec | None = None,
                     seed: int = 0, evaluations: int = DEFAULT_EVALUATIONS) -> MethodResult:
    """Search ``program``'s order by ``method`` (module docstring); the arguments are ``search_order``'s and
    ``heuristic_search``'s.

    Raises:
        UsageError: an unknown method; ``recompute=choose`` with the heuristic (it keeps the target's
            recomputed stages); whatever the search run raises.
    """
    if method not in METHODS:
        raise UsageError(f"--method takes {', '.join(METHODS)}: not {method!r}")
    tasks = sum(len(row) for row in program.ranks)
    if method == EXACT or (method == AUTO and (tasks <= EXACT_TASKS or recompute == CHOOSE)):
        return MethodResult(search_order(program, costs, memory, byte_budget=byte_budget, recompute=recompute,
                                         time_limit=time_limit, workers=workers, hint=hint), EXACT)
    if recompute != TARGET:
        raise UsageError("the heuristic keeps TARGET's recomputed stages: --recompute choose needs --method exact")
    share = time_limit / 2 if method == AUTO else time_limit
    found = heuristic_search(program, costs, memory, byte_budget=byte_budget, spec=spec, hint=hint, seed=seed,
                             evaluations=evaluations, time_limit=share)
    if method == HEURISTIC or found.status == OPTIMAL or importlib.util.find_spec("ortools") is None:
        return MethodResult(found, HEURISTIC)  # (auto without OR-Tools: the heuristic alone)
    try:
        exact = search_order(program, costs, memory, byte_budget=byte_budget, workers=workers, hint=found.order,
                             time_limit=max(1.0, time_limit - found.seconds))
    except NoOrderFound:  # CP-SAT ran out of time before it had read the hint into an order: the heuristic's stands
        return MethodResult(found, HEURISTIC)
    better = exact.makespan < found.makespan
    makespan = min(exact.makespan, found.makespan)
    bound = max(exact.bound, found.bound)
    return MethodResult(dataclasses.replace(
        found, order=exact.order if better else found.order, makespan=makespan, bound=bound,
        status=OPTIMAL if bound >= makespan else FEASIBLE,
        seconds=found.seconds + exact.seconds,
        bound_reason=found.bound_reason if bound == found.bound else "CP-SAT's bound"), HEURISTIC_THEN_EXACT)
