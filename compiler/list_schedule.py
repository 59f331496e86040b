"""pipec's list scheduler: turn a ``GreedyPolicy`` into a per-rank order.

Contract: ``greedy_order(spec, costs)`` returns, for every rank, the tasks of
the activation-passing family placed on it, in the order a list scheduler
running the cost model would start them:

* whenever a rank is free, it considers the tasks whose inputs are ready at
  that moment (dependencies done, plus transfer time from another rank);
* it takes the first kind in ``policy.prefer`` that has a ready task, and
  among that kind's ready tasks the smallest ``policy.priority`` key
  (ties broken by microbatch, then stage);
* a forward may start only while the rank holds fewer chunk activations than
  its in-flight limit (a forward started whose backward, B or I, has not
  finished); an I only while fewer of its weight gradients wait than its
  ``deferred`` limit (an I started whose W has not). A W depends on its own
  rank's I alone, so that limit never stalls a policy;
* with a ``warmup`` count, a rank follows 1F1B's discipline instead of taking
  whatever is ready: its first ``warmup`` tasks are forwards, then it strictly
  alternates one forward and one backward (waiting for the one it wants) and
  drains what is left; with split backward, W tasks fill those waits.

It is deterministic: same spec and costs, same order. If the policy stalls
(tasks remain but no rank can start any: typically an in-flight limit too small
for the dataflow), it raises ``ScheduleError`` at the order's span naming a
rank, the tasks it holds ready and why it cannot run them.
"""
from __future__ import annotations

import heapq

from pipec.compiler.costs import CostModel
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import ScheduleError

_FORWARD, _BACKWARD = "F", ("B", "I")


def greedy_order(spec: ScheduleSpec, costs: CostModel | None = None) -> list[list[tuple[str, int, int]]]:
    """List-schedule the spec's tasks under its policy.

    Args:
        spec: an evaluated schedule whose ``policy`` is set.
        costs: op costs and transfer times; unit costs when None.
    Returns:
        per rank, the (kind, stage id, microbatch) tasks in start order.
    Raises:
        ScheduleError: the policy cannot finish the schedule.
    """
    policy = spec.policy
    costs = costs or CostModel.unit()
    S, N, P = spec.num_stages, spec.num_microbatches, spec.num_ranks
    stage_rank = [r for row in spec.placement for r in row]
    kinds = ("F",) + spec.backward_kinds
    kind_rank = {k: i for i, k in enumerate(policy.prefer)}
    order_of_kinds = sorted(kinds, key=kind_rank.__getitem__)
    backward = "I" if spec.split_backward else "B"

    # remaining[kind][sid * N + m]: dependencies not yet finished.
    remaining = {k: bytearray(len(stage_rank) * N) for k in kinds}
    for m, p in enumerate(spec.mb_pipeline):
        for s in range(S):
            sid = p * S + s
            index = sid * N + m
            remaining["F"][index] = 1 if s > 0 else 0
            remaining[backward][index] = 2 if s < S - 1 else 1
            if spec.split_backward:
                remaining["W"][index] = 1

    ready = [{k: [] for k in kinds} for _ in range(P)]  # per rank, per kind: heap of (key, ready at, mb, sid)
    pending = [[] for _ in range(P)]  # per rank: heap of (ready time, kind, sid, mb)
    left = [{k: 0 for k in kinds} for _ in range(P)]  # tasks of each kind not yet started
    riders = [spec.mb_pipeline.count(p) for p in range(spec.num_pipelines)]
    for sid, rank in enumerate(stage_rank):
        for k in kinds:
            left[rank][k] += riders[sid // S]
    priority = policy.priority
    limit = policy.inflight
    warmup = policy.warmup
    deferral = policy.deferred or [None] * P
    deferred = [0] * P  # per rank: I started whose W has not
    alive = [0] * P
    forwards_started = [0] * P
    backwards_started = [0] * P
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(P)]
    busy = [False] * P
    events: list = []  # (time, seq, kind of event, payload)
    seq = 0

    def release(kind: str, sid: int, m: int, at: float) -> None:
        nonlocal seq
        rank = stage_rank[sid]
        heapq.heappush(pending[rank], (at, kind, sid, m))
        if not busy[rank]:
            seq += 1
            heapq.heappush(events, (at, seq, 1, rank))  # wake the rank when the input lands

    for m, p in enumerate(spec.mb_pipeline):
        release("F", p * S, m, 0)

    def allowed_kinds(rank: int):
        """Kinds the rank may start now, most preferred first (see module docstring)."""
        if warmup[rank] is None:
            return order_of_kinds
        forwards, backwards = forwards_started[rank], backwards_started[rank]
        if left[rank]["F"] and forwards - warmup[rank] <= backwards:
            wanted = "F"  # warm-up, or the forward that opens a steady (F, B) pair
        elif left[rank][backward]:
            wanted = backward
        else:
            wanted = "F"
        # W (split backward) never delays the alternation: it fills waits.
        return (wanted, "W") if spec.split_backward else (wanted,)

    def try_start(rank: int, now: float) -> None:
        nonlocal seq
        heap = pending[rank]
        while heap and heap[0][0] <= now:
            at, kind, sid, m = heapq.heappop(heap)
            heapq.heappush(ready[rank][kind], (priority(kind, sid, m), at, m, sid))
        for kind in allowed_kinds(rank):
            queue = ready[rank][kind]
            if not queue:
                continue
            if kind == "F" and limit[rank] is not None and alive[rank] >= limit[rank]:
                continue
            if kind == "I" and deferral[rank] is not None and deferred[rank] >= deferral[rank]:
                continue
            _, _, m, sid = heapq.heappop(queue)
            if kind == "I":
                deferred[rank] += 1
            elif kind == "W":
                deferred[rank] -= 1
            if kind == "F":
                alive[rank] += 1
                forwards_started[rank] += 1
            elif kind == backward:
                backwards_started[rank] += 1
            left[rank][kind] -= 1
            orders[rank].append((kind, sid, m))
            busy[rank] = True
            seq += 1
            heapq.heappush(events, (now + costs.compute(kind, sid % S), seq, 0, (kind, sid, m)))
            return

    for rank in range(P):
        try_start(rank, 0)
    while events:
        # Settle everything that happens at `now` before any rank chooses, so
        # that a choice never misses a task released at the same instant.
        now = events[0][0]
        woken = set()
        while events and events[0][0] == now:
            _, _, what, payload = heapq.heappop(events)
            if what == 1:
                woken.add(payload)
                continue
            kind, sid, m = payload
            rank = stage_rank[sid]
            busy[rank] = False
            woken.add(rank)
            _finish(kind, sid, m, now, spec, remaining, release, costs, stage_rank, backward)
            if kind in _BACKWARD:
                alive[rank] -= 1
        for rank in sorted(woken):
            if not busy[rank]:
                try_start(rank, now)

    total = sum(len(o) for o in orders)
    expected = len(kinds) * N * S
    if total != expected:
        raise _stall(spec, orders, ready, pending, alive)
    return orders


def _finish(kind, sid, m, now, spec, remaining, release, costs, stage_rank, backward) -> None:
    """Mark (kind, sid, m) done at ``now`` and release the tasks waiting on it."""
    S, N = spec.num_stages, spec.num_microbatches
    s = sid % S
    rank = stage_rank[sid]

    def satisfy(next_kind: str, next_sid: int, tensor: str) -> None:
        index = next_sid * N + m
        remaining[next_kind][index] -= 1
        if remaining[next_kind][index] == 0:
            other = stage_rank[next_sid]
            delay = 0 if other == rank else costs.transfer(rank, other, tensor)
            release(next_kind, next_sid, m, now + delay)

    if kind == "F":
        if s + 1 < S:
            satisfy("F", sid + 1, "act")
        satisfy(backward, sid, "act")
    elif kind in _BACKWARD:
        if s > 0:
            satisfy(backward, sid - 1, "grad")
        if kind == "I":
            satisfy("W", sid, "grad")


def _stall(spec, orders, ready, pending, alive) -> ScheduleError:
    """Explain why no rank can start anything although tasks remain."""
    policy = spec.policy
    for rank in range(spec.num_ranks):
        waiting = sorted((k, sid, m) for k, heap in ready[rank].items() for _, _, m, sid in heap)
        if not waiting:
            continue
        kind, sid, m = waiting[0]
        task = f"{kind}({sid % spec.num_stages}, {m})"
        limit = policy.inflight[rank]
        if kind == "F" and limit is not None and alive[rank] >= limit:
            why = (
                f"its in-flight limit {limit} is reached ({alive[rank]} activations alive) and no backward "
                f"that would free one can run anywhere; raise the limit"
            )
        elif policy.warmup[rank] is not None:
            why = (
                f"its warm-up/alternation discipline (warmup {policy.warmup[rank]}) wants another kind of task "
                f"that can never become ready; change the warm-up count"
            )
        else:
            why = "its policy does not allow it"
        done = len(orders[rank])
        return ScheduleError(
            f"the greedy policy stalls: rank {rank} has run {done} tasks and holds ready {task}, but {why}",
            spec.order_span,
            spec.source,
        )
    return ScheduleError("the greedy policy stalls: no rank holds a ready task", spec.order_span, spec.source)
