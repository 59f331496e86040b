"""Per-rank memory limits of a search as integer arrays, for checking many orders of one ``SearchProblem``.

A limit is a count the rule table defines (``memory_counts``: ``ACTIVATION_DELTA`` for ``--memory``, a size
class's ``SIZE_CLASS_DELTAS`` for ``--budget-bytes``, its bytes turned into a count by ``search.byte_caps``)
and a cap per rank. An order meets it when the running count along each rank's row, as
``memory_counts.live_counts`` walks it, never goes above the cap: the count ``pipec check --budget`` and
``--budget-bytes`` prove, so an order that passes here passes there.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Mapping, Sequence

from pipec.compiler.memory_counts import ACTIVATION_DELTA, SIZE_CLASS_DELTAS, Number
from pipec.compiler.search import SearchProblem, byte_caps
from pipec.errors import UsageError


@dataclass(frozen=True)
class CountLimit:
    """One counted kind of value under a cap per rank.

    Attributes:
        what: the count's name, for messages (``activations``, or a size class).
        delta: per task (``SearchProblem.tasks``' numbering), the change of the count at its step.
        caps: per rank, the most values alive at once.
    """

    what: str
    delta: list[int]
    caps: list[int]


def search_limits(problem: SearchProblem, memory: Sequence[int] | None = None,
                  byte_budget: Mapping[str, Number] | None = None, sizes: Mapping[str, Number] | None = None
                  ) -> list[CountLimit]:
    """The limits ``memory`` (per rank, live activations) and ``byte_budget`` (size class -> bytes per rank,
    each value weighing ``sizes[class]``) set on ``problem``'s orders; none for None.

    Raises:
        UsageError: ``memory`` not one limit per rank; a budgeted class ``sizes`` does not size, or that no
            value fits in (``search.byte_caps``).
    """
    ops = [task.action.op for task in problem.tasks]
    ranks = problem.program.num_ranks
    limits = []
    if memory is not None:
        if len(memory) != ranks:
            raise UsageError(f"--memory gives {len(memory)} limits for {ranks} ranks")
        limits.append(CountLimit("activations", [ACTIVATION_DELTA.get(op, 0) for op in ops], list(memory)))
    for size_class, cap in byte_caps(problem.tasks, byte_budget, sizes or {}).items():
        delta = SIZE_CLASS_DELTAS[size_class]
        limits.append(CountLimit(size_class, [delta.get(op, 0) for op in ops], [cap] * ranks))
    return limits


def row_fits(limits: Sequence[CountLimit], rank: int, row: Sequence[int]) -> bool:
    """Whether one rank's row (task numbers) keeps every count within its cap at every step."""
    for limit in limits:
        delta, cap = limit.delta, limit.caps[rank]
        if max(accumulate(delta[t] for t in row), default=0) > cap:
            return False
    return True


def order_fits(limits: Sequence[CountLimit], rows: Sequence[Sequence[int]]) -> bool:
    """Whether every rank's row keeps every count within its cap (``row_fits``)."""
    return all(row_fits(limits, rank, row) for rank, row in enumerate(rows))
