"""The orders a heuristic search starts from: the target's own, a hint, the list scheduler's under several
policies, and a list schedule of this module's own that keeps the memory limits as it goes.

Every seed is a list of task numbers per rank (``search.OrderTiming``'s numbering) that does not deadlock
and meets the limits (``search_limits``); one that does not is dropped, so a caller may try any policy.
"""
from __future__ import annotations

import dataclasses
from itertools import permutations, product
from typing import Callable, Sequence

from pipec.compiler.costs import CostModel
from pipec.compiler.ir import Action
from pipec.compiler.list_schedule import greedy_order
from pipec.compiler.search import OrderTiming, consumers_of
from pipec.compiler.search_limits import CountLimit, order_fits
from pipec.dsl.spec import GreedyPolicy, ScheduleSpec
from pipec.errors import PipecError, UsageError

Rows = list[list[int]]

# Among ready tasks of one kind, which goes first: (name, key of (kind, stage id, mb)); the list scheduler's
# ``priority``. Earlier microbatches first, deeper stages first (a V's second arm carries a microbatch home),
# or the other way round.
PRIORITIES: tuple[tuple[str, Callable[[str, int, int], tuple]], ...] = (
    ("mb, deeper stage", lambda kind, s, m: (m, -s)),
    ("mb, shallower stage", lambda kind, s, m: (m, s)),
    ("deeper stage, mb", lambda kind, s, m: (-s, m)),
)

# How many weight gradients a rank may leave waiting (split backward; the list scheduler's ``deferred``):
# (name, per rank for P ranks). Unbounded; ZB-V's r + 1; torch's ZB-V 2r + 1; one more. Waiting W's fill the
# bubbles a link's latency leaves, so the best limit differs with the costs (zbv at P = 8, N = 32 under a
# latency of 1/2 and 2P activations: 251, 247.5 and 245.5 from the last three).
DEFERRALS: tuple[tuple[str, Callable[[int], list[int] | None]], ...] = (
    ("W unbounded", lambda P: None),
    ("W waiting <= r + 1", lambda P: [r + 1 for r in range(P)]),
    ("W waiting <= 2r + 1", lambda P: [2 * r + 1 for r in range(P)]),
    ("W waiting <= 2r + 2", lambda P: [2 * r + 2 for r in range(P)]),
)


def seed_orders(timing: OrderTiming, limits: Sequence[CountLimit], ranks: int, *,
                own: Sequence[Sequence[Action]] | None = None, hint: Sequence[Sequence[Action]] | None = None,
                spec: ScheduleSpec | None = None, costs: CostModel | None = None) -> list[tuple[str, Rows]]:
    """Named starting orders that run to the end and meet ``limits``, without duplicates, in the order tried.

    Args:
        timing: the problem's arrays (task numbers, ranks, inputs).
        limits: the per-rank count limits every seed must meet.
        ranks: the number of ranks.
        own: the target's own order (``target``), if any.
        hint: another order of the same tasks (``hint``), if any.
        spec: the target's evaluated schedule: the list scheduler runs on its placement under every
            permutation of its kinds (``prefer``) and every ``PRIORITIES`` key, at the activation limit.
        costs: the cost model the list scheduler times tasks by.
    Raises:
        UsageError: ``hint`` holds a task the problem does not, or one twice.
    """
    tried: list[tuple[str, Rows | None]] = []
    if own is not None:
        tried.append(("target", _rows_of(timing, own)))
    if hint is not None:
        try:
            tried.append(("hint", timing.rows(hint)))
        except UsageError as error:
            raise UsageError(f"the hint: {error}") from None
    if spec is not None:
        tried += _list_scheduled(timing, limits, spec, costs)
    for prefer in _preferences(tuple(dict.fromkeys(op for op, _, _ in timing.keys))):
        for name, priority in PRIORITIES[:2]:
            rank_of = {kind: i for i, kind in enumerate(prefer)}
            keys = [(rank_of[op], *priority(op, stage, mb)) for op, stage, mb in timing.keys]
            label = f"own list: prefer {', '.join(prefer)}; {name}"
            tried.append((label, memory_list_rows(timing, limits, ranks, keys)))
    seeds, seen = [], set()
    for name, rows in tried:
        if rows is None or timing.ends(rows) is None or not order_fits(limits, rows):
            continue
        frozen = tuple(map(tuple, rows))
        if frozen not in seen:
            seen.add(frozen)
            seeds.append((name, rows))
    return seeds


def _preferences(kinds: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The kind preferences tried: every permutation of up to three kinds (F, B; F, I, W), else (a recomputed
    stage's FC and R too) the table's order and its reverse, which keeps the tries few."""
    return list(permutations(kinds)) if len(kinds) <= 3 else [kinds, kinds[::-1]]


def _rows_of(timing: OrderTiming, order: Sequence[Sequence[Action]]) -> Rows | None:
    """``order`` as task numbers, or None when it does not hold exactly the problem's tasks."""
    try:
        rows = timing.rows(order)
    except UsageError:
        return None
    return rows if sum(map(len, rows)) == len(timing.keys) else None


def _list_scheduled(timing: OrderTiming, limits: Sequence[CountLimit], spec: ScheduleSpec,
                    costs: CostModel | None) -> list[tuple[str, Rows | None]]:
    """The list scheduler's orders of ``spec``'s placement: each kind preference x ``PRIORITIES`` x
    ``DEFERRALS`` (split backward), the in-flight limit at the activation cap (``None`` where there is none;
    other limits are checked after)."""
    P = spec.num_ranks
    caps = next((limit.caps for limit in limits if limit.what == "activations"), [None] * P)
    kinds = ("F",) + tuple(spec.backward_kinds)
    out = []
    deferrals = DEFERRALS if spec.split_backward else DEFERRALS[:1]
    for prefer, (name, priority), (waiting, deferred) in product(_preferences(kinds), PRIORITIES, deferrals):
        policy = GreedyPolicy(inflight=list(caps), warmup=[None] * P, prefer=prefer, priority=priority,
                              deferred=deferred(P))
        label = f"list scheduler: prefer {', '.join(prefer)}; {name}" + (f"; {waiting}" if spec.split_backward else "")
        try:
            order = greedy_order(dataclasses.replace(spec, order=None, policy=policy), costs)
        except PipecError:
            out.append((label, None))  # a limit this placement cannot meet by this policy
            continue
        out.append((label, _rows_of(timing, [[Action(sid, op, mb) for op, sid, mb in row] for row in order])))
    return out


def memory_list_rows(timing: OrderTiming, limits: Sequence[CountLimit], ranks: int, keys: Sequence) -> Rows | None:
    """A list schedule that keeps ``limits``: repeatedly the task that can start earliest (its inputs placed,
    its rank free, its count within every cap), ties broken by the smallest ``keys[task]``; None when every
    task left waits on a value no cap leaves room for.

    Args:
        timing: the problem's arrays.
        limits: the per-rank count limits.
        ranks: the number of ranks.
        keys: per task, its priority among tasks that can start at the same time.
    """
    inputs, rank, duration = timing.inputs, timing.rank, timing.duration
    consumers = consumers_of(timing)
    waits = [len(mine) for mine in inputs]
    ready = [0] * len(waits)  # the latest input's arrival, among inputs placed
    candidates = {t for t, count in enumerate(waits) if count == 0}
    counts = [[0] * ranks for _ in limits]
    free = [0] * ranks
    rows: Rows = [[] for _ in range(ranks)]
    for _ in range(len(waits)):
        best, best_key = None, None
        for t in candidates:
            r = rank[t]
            if any(counts[i][r] + limit.delta[t] > limit.caps[r] for i, limit in enumerate(limits)):
                continue
            key = (max(free[r], ready[t]), keys[t])
            if best_key is None or key < best_key:
                best, best_key = t, key
        if best is None:
            return None
        candidates.discard(best)
        r = rank[best]
        rows[r].append(best)
        end = free[r] = best_key[0] + duration[best]
        for i, limit in enumerate(limits):
            counts[i][r] += limit.delta[best]
        for consumer, delay in consumers[best]:
            ready[consumer] = max(ready[consumer], end + delay)
            waits[consumer] -= 1
            if waits[consumer] == 0:
                candidates.add(consumer)
    return rows
