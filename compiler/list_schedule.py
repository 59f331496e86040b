"""pipec's list scheduler: turn a ``GreedyPolicy`` into a per-rank order.

Contract: ``greedy_order(spec, costs)`` returns, for every rank, the tasks of
the activation-passing family placed on it, in the order a list scheduler
running the cost model would start them: whenever a rank is free it takes a
ready task (its dependencies done, plus transfer time from another rank) by
the policy's ``prefer``, ``priority``, ``inflight``, ``deferred``, ``warmup``
and ``in order`` rules, as docs/language.md, section 7, states them. On a
recomputed stage (``spec.recomputed``) a forward runs as the checkpointed
forward (FC), and the backward (B, or I) as the recompute then the backward,
back to back: the rank is busy for both (``ops.CHECKPOINTS``).

Guarantees: it is deterministic (same spec and costs, same order), and a
policy finishes under every non-negative cost model, because a forward also
waits while starting it could leave a started microbatch unable to finish
within every rank's in-flight limit (a banker's check, ``_Activations``: a V
that puts two of its stages on one rank needs two slots there at once). A
limit no order can meet is a ``ScheduleError`` naming the rank and the limit,
raised before scheduling. A ``warmup`` or an ``in order`` against the dataflow
can still wait for a task that never comes: then it raises ``ScheduleError``
at the order's span naming a rank, the task it waits for or holds ready, and
why (``_stall``).
"""
from __future__ import annotations

import heapq

from pipec.compiler import ops
from pipec.compiler.costs import CostModel
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import ScheduleError

_FORWARD, _BACKWARD = "F", ("B", "I")
# What a forward becomes on a recomputed stage, and the recompute that runs before its backward.
_CHECKPOINTED, _RECOMPUTE = ops.CHECKPOINTS[_FORWARD]


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
    return _ListScheduler(spec, costs or CostModel.unit()).run()


class _ListScheduler:
    """One run of the list scheduler (module docstring): the ranks' queues, the events, the orders.

    A rank that waits is woken by the next event that may change its choice:
    every input landing on it (even one released while it was busy: it may be
    free by then) and every activation freed anywhere (the in-flight check
    looks at every rank). A W depends on its own rank's I alone, so the
    ``deferred`` limit (on I) never stalls a policy. Under ``in order`` a rank
    waits for its next task of the kind rather than take a later ready one (a
    list scheduler never waits for a better task by itself, and an order such
    as Megatron's interleaved one needs it to).
    """

    def __init__(self, spec: ScheduleSpec, costs: CostModel):
        policy = spec.policy
        self.spec, self.costs, self.policy = spec, costs, policy
        S, N, P = spec.num_stages, spec.num_microbatches, spec.num_ranks
        self.S, self.N, self.P = S, N, P
        self.stage_rank = stage_rank = [r for row in spec.placement for r in row]
        self.devices = spec.devices or list(range(P))
        self.kinds = kinds = ("F",) + spec.backward_kinds
        kind_rank = {k: i for i, k in enumerate(policy.prefer)}
        self.order_of_kinds = sorted(kinds, key=kind_rank.__getitem__)
        self.backward = "I" if spec.split_backward else "B"
        self.recomputed = spec.recomputed
        self.memory = _Activations(spec, stage_rank)
        self.memory.check_feasible()
        # remaining[kind][sid * N + m]: dependencies not yet finished.
        self.remaining = {k: bytearray(len(stage_rank) * N) for k in kinds}
        for m, p in enumerate(spec.mb_pipeline):
            for s in range(S):
                index = (p * S + s) * N + m
                self.remaining["F"][index] = 1 if s > 0 else 0
                self.remaining[self.backward][index] = 2 if s < S - 1 else 1
                if spec.split_backward:
                    self.remaining["W"][index] = 1
        self.ready = [{k: [] for k in kinds} for _ in range(P)]  # per rank, per kind: heap of (key, ready at, mb, sid)
        self.in_order = _InOrder(spec, stage_rank, kinds)
        self.pending = [[] for _ in range(P)]  # per rank: heap of (ready time, kind, sid, mb)
        self.left = [{k: 0 for k in kinds} for _ in range(P)]  # tasks of each kind not yet started
        riders = [spec.mb_pipeline.count(p) for p in range(spec.num_pipelines)]
        for sid, rank in enumerate(stage_rank):
            for k in kinds:
                self.left[rank][k] += riders[sid // S]
        self.deferral = policy.deferred or [None] * P
        self.deferred = [0] * P  # per rank: I started whose W has not
        self.forwards_started = [0] * P
        self.backwards_started = [0] * P
        self.orders: list[list[tuple[str, int, int]]] = [[] for _ in range(P)]
        self.busy = [False] * P
        self.events: list = []  # (time, seq, kind of event, payload)
        self.seq = 0

    def push_event(self, at: float, what: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, what, payload))

    def release(self, kind: str, sid: int, m: int, at: float) -> None:
        rank = self.stage_rank[sid]
        heapq.heappush(self.pending[rank], (at, kind, sid, m))
        # Wake the rank when the input lands, even if it is busy now: it may
        # be free by then, and nothing else would wake it.
        self.push_event(at, 1, rank)

    def allowed_kinds(self, rank: int):
        """Kinds the rank may start now, most preferred first (``warmup``: docs/language.md, section 7)."""
        warmup = self.policy.warmup[rank]
        if warmup is None:
            return self.order_of_kinds
        forwards, backwards = self.forwards_started[rank], self.backwards_started[rank]
        if self.left[rank]["F"] and forwards - warmup <= backwards:
            wanted = "F"  # warm-up, or the forward that opens a steady (F, B) pair
        elif self.left[rank][self.backward]:
            wanted = self.backward
        else:
            wanted = "F"
        # W (split backward) never delays the alternation: it fills waits.
        return (wanted, "W") if self.spec.split_backward else (wanted,)

    def take(self, rank: int, kind: str):
        """Pop the best task of ``kind`` the rank may start now, or None."""
        memory = self.memory
        if kind == "I" and self.deferral[rank] is not None and self.deferred[rank] >= self.deferral[rank]:
            return None
        if self.in_order.holds(kind):
            entry = self.in_order.next_ready(rank, kind)
            if entry is None or (kind == "F" and not memory.may_start(rank, entry[2])):
                return None
            return self.in_order.pop(rank, kind)
        queue = self.ready[rank][kind]
        if not queue:
            return None
        if kind != "F":
            return heapq.heappop(queue)
        # A forward the in-flight check refuses waits; a later one may pass.
        skipped, chosen = [], None
        while queue:
            entry = heapq.heappop(queue)
            if memory.may_start(rank, entry[2]):
                chosen = entry
                break
            skipped.append(entry)
            if not memory.has_room(rank):
                break
        for entry in skipped:
            heapq.heappush(queue, entry)
        return chosen

    def try_start(self, rank: int, now: float) -> None:
        heap = self.pending[rank]
        while heap and heap[0][0] <= now:
            at, kind, sid, m = heapq.heappop(heap)
            if not self.in_order.arrive(rank, kind, sid, m, at):
                heapq.heappush(self.ready[rank][kind], (self.policy.priority(kind, sid, m), at, m, sid))
        for kind in self.allowed_kinds(rank):
            entry = self.take(rank, kind)
            if entry is not None:
                _, _, m, sid = entry
                self.start(rank, kind, sid, m, now)
                return

    def start(self, rank: int, kind: str, sid: int, m: int, now: float) -> None:
        """Start task (kind, sid, m) on ``rank`` at ``now``: count it, record it, schedule its end."""
        S, costs, orders = self.S, self.costs, self.orders[rank]
        if kind == "I":
            self.deferred[rank] += 1
        elif kind == "W":
            self.deferred[rank] -= 1
        if kind == "F":
            self.memory.start(rank, m)
            self.forwards_started[rank] += 1
        elif kind == self.backward:
            self.backwards_started[rank] += 1
        self.left[rank][kind] -= 1
        duration = costs.compute(kind, sid % S)
        if sid % S not in self.recomputed:
            orders.append((kind, sid, m))
        elif kind == "F":
            orders.append((_CHECKPOINTED, sid, m))
            duration = costs.compute(_CHECKPOINTED, sid % S)
        else:
            if kind == self.backward:  # the recompute, then the backward that reads what it remade
                orders.append((_RECOMPUTE, sid, m))
                duration += costs.compute(_RECOMPUTE, sid % S)
            orders.append((kind, sid, m))
        self.busy[rank] = True
        self.push_event(now + duration, 0, (kind, sid, m))

    def transfer(self, src: int, dst: int, tensor: str):
        """The time a message takes between two ranks, priced between their devices."""
        return self.costs.transfer(self.devices[src], self.devices[dst], tensor)

    def run(self) -> list[list[tuple[str, int, int]]]:
        spec, S, N = self.spec, self.S, self.N
        for m, p in enumerate(spec.mb_pipeline):
            self.release("F", p * S, m, 0)
        for rank in range(self.P):
            self.try_start(rank, 0)
        events = self.events
        while events:
            # Settle everything that happens at `now` before any rank chooses, so
            # that a choice never misses a task released at the same instant.
            now = events[0][0]
            woken = set()
            freed = False
            while events and events[0][0] == now:
                _, _, what, payload = heapq.heappop(events)
                if what == 1:
                    woken.add(payload)
                    continue
                kind, sid, m = payload
                rank = self.stage_rank[sid]
                self.busy[rank] = False
                woken.add(rank)
                _finish(kind, sid, m, now, spec, self.remaining, self.release, self.transfer, self.stage_rank,
                        self.backward)
                if kind in _BACKWARD:
                    self.memory.free(rank, m)
                    freed = True
            if freed:
                # An activation freed on one rank may make another rank's
                # forward safe (the in-flight check looks at every rank).
                woken.update(range(self.P))
            for rank in sorted(woken):
                if not self.busy[rank]:
                    self.try_start(rank, now)
        total = sum(len(o) for o in self.orders)
        expected = (len(self.kinds) * S + len(self.recomputed)) * N
        if total != expected:
            raise _stall(spec, self.orders, self.ready, self.memory, self.in_order)
        return self.orders


class _InOrder:
    """The kinds a policy runs ``in order``: per rank, its tasks of each such
    kind sorted by (priority key, microbatch, stage), and which have arrived."""

    def __init__(self, spec: ScheduleSpec, stage_rank: list[int], kinds: tuple[str, ...]):
        policy, S = spec.policy, spec.num_stages
        self.kinds = frozenset(policy.in_order) & frozenset(kinds)
        self.sequence = [{k: [] for k in self.kinds} for _ in range(spec.num_ranks)]
        for m, p in enumerate(spec.mb_pipeline):
            for s in range(S):
                sid = p * S + s
                for kind in self.kinds:
                    self.sequence[stage_rank[sid]][kind].append((policy.priority(kind, sid, m), m, sid))
        for per_kind in self.sequence:
            for tasks in per_kind.values():
                tasks.sort()
        self.position = [{k: 0 for k in self.kinds} for _ in range(spec.num_ranks)]
        self.arrived = [{k: {} for k in self.kinds} for _ in range(spec.num_ranks)]  # (sid, mb) -> ready at

    def holds(self, kind: str) -> bool:
        return kind in self.kinds

    def arrive(self, rank: int, kind: str, sid: int, m: int, at) -> bool:
        """Record a task of an in-order kind as ready; False for any other kind."""
        if kind not in self.kinds:
            return False
        self.arrived[rank][kind][(sid, m)] = at
        return True

    def next_task(self, rank: int, kind: str):
        """(key, mb, sid) of the rank's next task of ``kind``, or None when all have run."""
        tasks, at = self.sequence[rank][kind], self.position[rank][kind]
        return tasks[at] if at < len(tasks) else None

    def next_ready(self, rank: int, kind: str):
        """The next task as a ready-heap entry (key, ready at, mb, sid) if it has arrived, else None."""
        task = self.next_task(rank, kind)
        if task is None:
            return None
        key, m, sid = task
        at = self.arrived[rank][kind].get((sid, m))
        return None if at is None else (key, at, m, sid)

    def pop(self, rank: int, kind: str):
        """Take the next task (it has arrived) and move on to the one after it."""
        entry = self.next_ready(rank, kind)
        del self.arrived[rank][kind][(entry[3], entry[2])]
        self.position[rank][kind] += 1
        return entry


class _Activations:
    """The in-flight limits as a resource no order can deadlock on.

    A microbatch keeps the activation of each of its stages on a rank from
    that stage's forward until its backward, and all its forwards come before
    its first backward: so once started, it needs, on every rank, a slot for
    each of its forwards still to come while it holds the ones it has. A
    forward may start only if afterwards the microbatches started and not yet
    through their forwards can still all finish in some order, each within
    the slots left when the ones before it have finished (the banker's
    algorithm). Otherwise some rank would fill its limit with activations
    whose backwards wait on forwards it can no longer start.
    """

    def __init__(self, spec: ScheduleSpec, stage_rank: list[int]):
        P, S = spec.num_ranks, spec.num_stages
        self.spec = spec
        self.limit = spec.policy.inflight
        self.alive = [0] * P
        per_pipeline = []
        for p in range(spec.num_pipelines):
            counts = [0] * P
            for s in range(S):
                counts[stage_rank[p * S + s]] += 1
            per_pipeline.append(counts)
        self.need = [per_pipeline[p] for p in spec.mb_pipeline]  # per mb: slots per rank at its peak
        self.future = [list(counts) for counts in self.need]  # per mb: forwards per rank not started
        self.held = [[0] * P for _ in spec.mb_pipeline]  # per mb: activations alive per rank
        self.open: set[int] = set()  # started microbatches with forwards still to start
        self.limited = [r for r in range(P) if self.limit[r] is not None]

    def check_feasible(self) -> None:
        """Raise if a rank's limit is below what one microbatch alone needs there."""
        for rank in self.limited:
            m = max(range(len(self.need)), key=lambda mb: self.need[mb][rank], default=None)
            if m is None or self.need[m][rank] <= self.limit[rank]:
                continue
            spec, S = self.spec, self.spec.num_stages
            p = spec.mb_pipeline[m]
            stages = [s for s in range(S) if spec.placement[p][s] == rank]
            listed = ", ".join(str(s) for s in stages)
            raise ScheduleError(
                f"rank {rank}'s in-flight limit {self.limit[rank]} can never be met: one microbatch "
                f"(e.g. {m}) keeps {len(stages)} activations alive on it at once (stages {listed} live "
                f"there, and each keeps its activation until its backward, after the microbatch's last "
                f"forward); raise the limit to at least {len(stages)}",
                spec.order_span,
                spec.source,
            )

    def has_room(self, rank: int) -> bool:
        """The rank holds fewer activations than its limit."""
        limit = self.limit[rank]
        return limit is None or self.alive[rank] < limit

    def may_start(self, rank: int, m: int) -> bool:
        """A forward of ``m`` on ``rank`` keeps every limit reachable."""
        if not self.has_room(rank):
            return False
        if not self.limited:
            return True
        self._move(rank, m, 1)
        safe = self._safe(m)
        self._move(rank, m, -1)
        return safe

    def start(self, rank: int, m: int) -> None:
        """A forward of ``m`` starts on ``rank``."""
        self._move(rank, m, 1)
        self.alive[rank] += 1
        if any(self.future[m]):
            self.open.add(m)
        else:
            self.open.discard(m)

    def free(self, rank: int, m: int) -> None:
        """A backward of ``m`` on ``rank`` finished: its activation is gone."""
        self.held[m][rank] -= 1
        self.alive[rank] -= 1

    def _move(self, rank: int, m: int, step: int) -> None:
        self.future[m][rank] -= step
        self.held[m][rank] += step

    def _safe(self, m: int) -> bool:
        """Some order finishes every open microbatch (and ``m``) within the limits (banker's algorithm)."""
        # A microbatch through its forwards needs nothing more (its backwards
        # can always run): count its activations as already freed.
        waiting = [mb for mb in self.open | {m} if any(self.future[mb])]
        free = {r: self.limit[r] - sum(self.held[mb][r] for mb in waiting) for r in self.limited}
        while waiting:
            for i, m in enumerate(waiting):
                if all(self.future[m][r] <= free[r] for r in self.limited):
                    for r in self.limited:
                        free[r] += self.held[m][r]
                    waiting.pop(i)
                    break
            else:
                return False
        return True


def _finish(kind, sid, m, now, spec, remaining, release, transfer, stage_rank, backward) -> None:
    """Mark (kind, sid, m) done at ``now`` and release the tasks waiting on it."""
    S, N = spec.num_stages, spec.num_microbatches
    s = sid % S
    rank = stage_rank[sid]

    def satisfy(next_kind: str, next_sid: int, tensor: str) -> None:
        index = next_sid * N + m
        remaining[next_kind][index] -= 1
        if remaining[next_kind][index] == 0:
            other = stage_rank[next_sid]
            delay = 0 if other == rank else transfer(rank, other, tensor)
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


def _stall(spec, orders, ready, memory, in_order) -> ScheduleError:
    """Explain why no rank can start anything although tasks remain.

    The in-flight check keeps limits reachable, so only a ``warmup``
    discipline (waiting for a kind of task that never comes) or an
    ``in order`` whose priority order contradicts the dataflow ends here.
    """
    policy, S = spec.policy, spec.num_stages
    for rank in range(spec.num_ranks):
        for kind in (k for k in policy.in_order if in_order.holds(k)):  # as written: F before B
            task = in_order.next_task(rank, kind)
            if task is not None and in_order.next_ready(rank, kind) is None:
                _, m, sid = task
                return ScheduleError(
                    f"the greedy policy stalls: rank {rank} has run {len(orders[rank])} tasks and waits for "
                    f"{kind}({sid % S}, {m}), the next {kind} of its `in order` (by priority), which can never "
                    f"become ready: the priority puts it before a task it depends on; change the priority",
                    spec.order_span,
                    spec.source,
                )
    for rank in range(spec.num_ranks):
        waiting = sorted((k, sid, m) for k, heap in ready[rank].items() for _, _, m, sid in heap)
        waiting += sorted((k, sid, m) for k, arrived in in_order.arrived[rank].items() for sid, m in arrived)
        if not waiting:
            continue
        kind, sid, m = waiting[0]
        task = f"{kind}({sid % S}, {m})"
        limit = policy.inflight[rank]
        if policy.warmup[rank] is not None:
            why = (
                f"its warm-up/alternation discipline (warmup {policy.warmup[rank]}) wants another kind of task "
                f"that can never become ready; change the warm-up count"
            )
            if limit is not None and memory.alive[rank] >= limit:
                why += f" or raise its in-flight limit {limit} ({memory.alive[rank]} activations alive)"
        else:
            why = "its policy does not allow it"
        done = len(orders[rank])
        return ScheduleError(
            f"the greedy policy stalls: rank {rank} has run {done} tasks and holds ready {task}, but {why}",
            spec.order_span,
            spec.source,
        )
    return ScheduleError("the greedy policy stalls: no rank holds a ready task", spec.order_span, spec.source)
