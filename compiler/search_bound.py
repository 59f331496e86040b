"""An analytic lower bound on the makespan of every order of a ``SearchProblem`` (what a heuristic's gap is
measured against when the exact model is too large to close).

Three relaxations, each a valid bound on its own; the bound is the largest:

* **critical path**: a microbatch's chain of dependencies with their link delays (``head`` + length + ``tail``
  of a task, where a task's head is the longest path of inputs before its start and its tail the longest
  path of consumers after its end).
* **one rank**: the tasks of a rank run one at a time, none before its head, and each is followed by at
  least its tail: Jackson's preemptive schedule with the longest tail first is the optimum of that
  relaxation (preemption only helps it), so its latest end plus tail bounds the makespan.
* **memory**: under a per-rank cap of M live values (``search_limits.CountLimit``), the k-th value made on a
  rank starts no earlier than the (k - M)-th value's end there has come, and a value lives at least the
  longest path from its maker's start to its ender's start: so the k-th maker starts at least
  ``c`` after the (k - M)-th, ``c`` being the least life plus ender length; the last maker is followed by
  its value's life, ender and tail. Taken over all a rank's values and over each stage's alone.

Dependencies join tasks of one microbatch only, so every path is a walk inside one microbatch's tasks.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from pipec.compiler.search import OrderTiming, SearchProblem, consumers_of, order_timing
from pipec.compiler.search_limits import CountLimit


@dataclass(frozen=True)
class LowerBound:
    """A lower bound on every order's makespan.

    Attributes:
        makespan: the bound, in cost units.
        reason: which relaxation gives it (``critical path``, ``rank R's work``, ``rank R's memory``).
    """

    makespan: Fraction
    reason: str


def lower_bound(problem: SearchProblem, limits: Sequence[CountLimit] = ()) -> LowerBound:
    """The largest of the module's three bounds for ``problem`` under ``limits``.

    Assumes every task of ``problem`` runs (the target's task set, not ``recompute=choose``'s alternatives).
    """
    timing = order_timing(problem)
    topo = topological(timing)
    heads, tails = _heads(timing, topo), _tails(timing, topo)
    duration = timing.duration
    best = (max((heads[t] + duration[t] + tails[t] for t in topo), default=0), "critical path")
    ranks = problem.program.num_ranks
    for rank in range(ranks):
        mine = [t for t in topo if timing.rank[t] == rank]
        work = _one_rank(sorted((heads[t], duration[t], tails[t]) for t in mine))
        best = max(best, (work, f"rank {rank}'s work"))
    for limit in limits:
        for rank in range(ranks):
            memory = _memory_chain(timing, topo, heads, tails, limit, rank)
            best = max(best, (memory, f"rank {rank}'s {limit.what} limit"))
    return LowerBound(Fraction(best[0], problem.scale), best[1])


def topological(timing: OrderTiming) -> list[int]:
    """The tasks in an order where every input's producer comes first (Kahn's)."""
    waits = [len(mine) for mine in timing.inputs]
    consumers = consumers_of(timing)
    order = [t for t, count in enumerate(waits) if count == 0]
    for t in order:  # grows while walked
        for consumer, _ in consumers[t]:
            waits[consumer] -= 1
            if waits[consumer] == 0:
                order.append(consumer)
    return order


def _heads(timing: OrderTiming, topo: list[int]) -> list[int]:
    """Per task, the longest path of inputs (lengths and delays) before it can start."""
    head, duration = [0] * len(topo), timing.duration
    for t in topo:
        head[t] = max((head[m] + duration[m] + delay for m, delay in timing.inputs[t]), default=0)
    return head


def _tails(timing: OrderTiming, topo: list[int]) -> list[int]:
    """Per task, the longest path of consumers (delays and lengths) that must follow its end."""
    tail, duration, consumers = [0] * len(topo), timing.duration, consumers_of(timing)
    for t in reversed(topo):
        tail[t] = max((delay + duration[c] + tail[c] for c, delay in consumers[t]), default=0)
    return tail


def _one_rank(jobs: list[tuple[int, int, int]]) -> int:
    """Jackson's preemptive schedule of (release, length, tail) jobs sorted by release: the least latest
    end-plus-tail any preemptive one-machine schedule reaches."""
    running: list[tuple[int, int]] = []  # (-tail, length left)
    now, best, i = 0, 0, 0
    while i < len(jobs) or running:
        if not running:
            now = max(now, jobs[i][0])
        while i < len(jobs) and jobs[i][0] <= now:
            heapq.heappush(running, (-jobs[i][2], jobs[i][1]))
            i += 1
        minus_tail, left = heapq.heappop(running)
        until = jobs[i][0] if i < len(jobs) else now + left
        ran = min(left, until - now)
        now += ran
        if left > ran:
            heapq.heappush(running, (minus_tail, left - ran))
        else:
            best = max(best, now - minus_tail)
    return best


def _memory_chain(timing: OrderTiming, topo: list[int], heads: list[int], tails: list[int], limit: CountLimit,
                  rank: int) -> int:
    """The memory bound (module docstring) of one rank under one limit: over all its values and over each
    stage's values alone; 0 when the cap holds them all."""
    values = _values(timing, topo, limit, rank)
    cap = limit.caps[rank]
    groups = [values] + [[v for v in values if v[0][1] == stage] for stage in sorted({v[0][1] for v in values})]
    best = 0
    for group in groups:
        if len(group) <= cap:
            continue
        best = max(best, _chain(timing, heads, tails, group, cap))
    return best


def _values(timing: OrderTiming, topo: list[int], limit: CountLimit, rank: int):
    """The rank's values a limit counts one at a time, as ((op, stage, mb) of the maker, maker, ender, life):
    a task that adds one paired with the next task of its stage and microbatch (in dataflow order) that
    removes one, ``life`` the longest path from the maker's start to the ender's start."""
    position = {t: i for i, t in enumerate(topo)}
    chains: dict[tuple[int, int], list[int]] = {}
    for t in topo:
        if timing.rank[t] == rank and limit.delta[t]:
            _, stage, mb = timing.keys[t]
            chains.setdefault((stage, mb), []).append(t)
    consumers = consumers_of(timing)
    values = []
    for chain in chains.values():
        for i, maker in enumerate(chain):
            if limit.delta[maker] != 1:
                continue
            ender = next((t for t in chain[i + 1:] if limit.delta[t] < 0), None)
            if ender is not None and limit.delta[ender] == -1:
                values.append((timing.keys[maker], maker, ender, _longest(timing, consumers, position, maker, ender)))
    return values


def _longest(timing: OrderTiming, consumers, position: dict[int, int], source: int, target: int) -> int:
    """The longest path of dependencies from ``source``'s start to ``target``'s start (0 when none)."""
    reach, stack = {source}, [source]
    while stack:
        for c, _ in consumers[stack.pop()]:
            if c not in reach and position[c] <= position[target]:
                reach.add(c)
                stack.append(c)
    at = {source: 0}
    for t in sorted(reach, key=position.__getitem__):
        if t not in at:
            continue
        for c, delay in consumers[t]:
            if c in reach:
                at[c] = max(at.get(c, 0), at[t] + timing.duration[t] + delay)
    return at.get(target, 0)


def _chain(timing: OrderTiming, heads: list[int], tails: list[int], values, cap: int) -> int:
    """The memory bound over one group of values under ``cap`` (module docstring)."""
    duration = timing.duration
    makers = sorted(heads[maker] for _, maker, _, _ in values)
    step = min(duration[maker] for _, maker, _, _ in values)
    cycle = min(life + duration[ender] for _, _, ender, life in values)
    finish = min(life + duration[ender] + tails[ender] for _, _, ender, life in values)
    starts: list[int] = []
    for k, head in enumerate(makers):
        at = head
        if starts:
            at = max(at, starts[-1] + step)
        if k >= cap:
            at = max(at, starts[k - cap] + cycle)
        starts.append(at)
    return starts[-1] + finish
