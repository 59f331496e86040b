"""Lower a weight-passing schedule: every weight and gradient movement, placed at step boundaries.

In the weight-passing family every rank keeps its own microbatches and runs
every layer on them (the compute program has one pipeline per rank, so every
activation hand-off is local); what moves is weights, to the ranks that run a
layer, and weight gradients, back to the layer's owner. The schedule's order is
cut into steps (``at step t``); weights move between steps.

Contract: ``insert_weight_exchanges(compute, spec)`` returns ``compute`` with,
on every rank, at each step boundary b (before the computes of step b): the
wait of the ahead exchange posted K boundaries earlier (K = the prefetch
distance), the ahead lane's ``EXCHANGE`` (legs due K boundaries later), and the
due lane's ``EXCHANGE`` and its ``EXCHANGE_WAIT`` (legs needed before step b);
the waits still open follow the last step; then ``weight_hazards`` moves a
drop after the sends from its copy and a gradient wait before the next add to
its partial (K >= 2 leaves both open across steps). An exchange's number
(``Action.mb``) is ``2 * boundary + lane``, the same on every rank. Every leg
comes from the plan's weight and gradient routes; docs/weights.md, sections 2
and 3, says where each leg goes. Route mistakes in the order (a group running
different layers under ``staged``, a ring diagonal pinned to two layers) are
``ScheduleError``s at the order, naming the rank, the step and the layers. The
result is unchecked here: ``checks.weights`` proves it (and any program read
from a file) by running it symbolically.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import NamedTuple

from pipec.compiler import routes
from pipec.compiler.ir import NO_PEER, Action, Program, WeightPlan, weight_communicators
from pipec.compiler.ops import (
    ALLGATHER_W,
    BACKWARD,
    BCAST_W,
    EXCHANGE,
    EXCHANGE_WAIT,
    FILL_OF_PASS,
    FORWARD,
    FREE_W,
    GRADIENT_CONTRIBUTORS,
    RECV_G,
    RECV_W,
    REDUCE_G,
    REDUCESCATTER_G,
    SEND_G,
    SEND_W,
    SHIFT_G,
    SHIFT_OF_PASS,
    WEIGHT_PASS,
)
from pipec.compiler.routes import ALL_GATHER, BROADCAST, REDUCE, REDUCE_SCATTER, Hop, Leg
from pipec.compiler.weight_hazards import separate_transfers
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import ScheduleError

# Lanes of a boundary: legs due before its step, and legs posted ahead (K >= 1).
DUE, AHEAD = 0, 1
# What a route's legs become for each value moved: a hop's send and receive, a group step's collective.
WEIGHTS, GRADIENTS = "weights", "gradients"
_HOP_OPS = {WEIGHTS: (SEND_W, RECV_W), GRADIENTS: (SEND_G, RECV_G)}
_GROUP_OPS = {(WEIGHTS, BROADCAST): BCAST_W, (WEIGHTS, ALL_GATHER): ALLGATHER_W,
              (GRADIENTS, REDUCE): REDUCE_G, (GRADIENTS, REDUCE_SCATTER): REDUCESCATTER_G}
PASSES = (FORWARD, BACKWARD)

# Lowering reads which computes use weights (and in which pass) and which
# contribute gradients from the rule table; it makes the exchange ops and keeps
# every other op where it is. A family's lowering interprets no op, so it
# declares no pass (``ops.declare_pass``).


class _Leg(NamedTuple):
    """One part on one rank, at a boundary and lane (the same for every rank of the leg)."""

    boundary: int
    lane: int
    rank: int
    action: Action


class _Order(NamedTuple):
    """What the order uses, per rank and step.

    Attributes:
        uses: ``uses[r][t]`` pass -> the layers rank r runs in that pass at step t.
        layers: ``layers[r][t]``: every layer rank r runs at step t, any pass.
        contributes: ``contributes[r][t]``: the layers whose gradient r adds to at step t.
    """

    uses: list[list[dict[str, list[int]]]]
    layers: list[list[set[int]]]
    contributes: list[list[set[int]]]


def insert_weight_exchanges(compute: Program, spec: ScheduleSpec) -> Program:
    """Add the exchanges of a weight-passing schedule (module docstring; docs/weights.md, sections 2 and 3).

    Args:
        compute: the compute-only program of ``spec`` (one pipeline per rank,
            its lists in the order of ``spec.order``).
        spec: the evaluated schedule; ``spec.weights`` and ``spec.task_steps`` set.
    Returns:
        a new Program with the exchanges, ``weights`` (the ``WeightPlan``) and
        the weight communicators.
    Raises:
        ScheduleError: the order asks for something its routes cannot do.
    """
    weights, steps = spec.weights, spec.task_steps
    num_steps = 1 + max((t for row in steps for t in row), default=-1)
    # posting further ahead than the order has steps posts everything at the start: the same program
    prefetch = min(weights.prefetch, num_steps)
    plan = WeightPlan(
        owners=weights.owners, groups=tuple(weights.groups), route=weights.route, ring_by=weights.ring_by,
        gradients=weights.gradients, prefetch=prefetch, buffers=weights.buffers, num_steps=num_steps)
    lowering = _Lowering(compute, spec, plan)
    legs = lowering.weight_legs() + lowering.gradient_legs()
    ranks = _assemble(compute, steps, legs, lowering.frees, plan)
    return replace(compute, ranks=ranks, weights=plan,
                   communicators=weight_communicators(plan, compute.num_ranks))


class _Lowering:
    """One lowering: the order's uses, and the legs each route makes of them."""

    def __init__(self, compute: Program, spec: ScheduleSpec, plan: WeightPlan):
        self.spec, self.plan = spec, plan
        self.P, self.T, self.K = compute.num_ranks, plan.num_steps, plan.prefetch
        self.spacing = max(self.K, 1)
        self.lane = AHEAD if self.K >= 1 else DUE
        # (rank, layer) -> that rank's stage of the layer: parts name a layer by it
        self.stage_of = {}
        for stage in compute.stages:
            self.stage_of.setdefault((stage.rank, stage.position), stage.id)
        self.order = _uses(compute, spec.task_steps, self.T)
        # (rank, step, FREE_W): a delivered copy dropped after that step's computes
        self.frees: list[tuple[int, int, Action]] = []

    # -- errors ------------------------------------------------------------------

    def error(self, message: str) -> ScheduleError:
        return ScheduleError(message, self.spec.order_span, self.spec.source)

    # -- parts -------------------------------------------------------------------

    def part(self, rank: int, op: str, layer: int, step: int, peer: int = NO_PEER) -> Action:
        stage = -1 if layer < 0 else self.stage_of[(rank, layer)]
        return Action(stage, op, step, peer)

    def hop(self, send_op: str, recv_op: str, src: int, dst: int, layer: int, step: int,
            boundary: int, lane: int) -> list[_Leg]:
        """A send on ``src`` and its receive on ``dst`` (same boundary and lane: FIFO per pair holds)."""
        return [_Leg(boundary, lane, src, self.part(src, send_op, layer, step, dst)),
                _Leg(boundary, lane, dst, self.part(dst, recv_op, layer, step, src))]

    def collective(self, op: str, members, layer: int, step: int, boundary: int, lane: int,
                   root: int = NO_PEER) -> list[_Leg]:
        return [_Leg(boundary, lane, r, self.part(r, op, layer, step, root)) for r in members]

    def keep(self, ranks, layer: int, step: int, running: list[set[int]] | None = None) -> None:
        """``ranks`` hold a copy of ``layer`` delivered for ``step`` while they run it on consecutive
        steps (``running``: the layers run per step; each rank's own when None), then drop it."""
        for r in ranks:
            layers = running if running is not None else self.order.layers[r]
            last = step
            while last + 1 < self.T and layer in layers[last + 1]:
                last += 1
            self.frees.append((r, last, self.part(r, FREE_W, layer, step)))

    def weight_boundaries(self, step: int, legs: int) -> list[int]:
        """Where the legs of a delivery needed at ``step`` are posted, first leg first."""
        last = step - self.K
        return [last - (legs - 1 - i) * self.spacing for i in range(legs)]

    def gradient_boundaries(self, step: int, legs: int) -> list[int]:
        """Where the legs of a gradient made at ``step`` are posted, first leg first."""
        return [step + 1 + i * self.spacing for i in range(legs)]

    # -- weights -----------------------------------------------------------------

    def weight_legs(self) -> list[_Leg]:
        if self.P == 1:  # one rank owns every layer: nothing moves
            return []
        return {"direct": self.direct_weights, "staged": self.staged_weights,
                "all_gather": self.gathered_weights, "ring": self.ring_weights}[self.plan.route]()

    def placed(self, legs: tuple[Leg, ...], value: str, layer: int, step: int,
               boundaries: list[int]) -> list[_Leg]:
        """A route's legs (``routes.py``) as parts: leg i of the route at ``boundaries[i]``.

        A ``Hop`` is a send and its receive of the value (weights or a gradient
        partial); a ``GroupStep`` the value's collective on every rank of it.
        """
        out: list[_Leg] = []
        for leg, boundary in zip(legs, boundaries):
            if isinstance(leg, Hop):
                send_op, recv_op = _HOP_OPS[value]
                out += self.hop(send_op, recv_op, leg.src, leg.dst, layer, step, boundary, self.lane)
            else:
                root = leg.root if leg.root >= 0 else NO_PEER
                out += self.collective(_GROUP_OPS[value, leg.op], leg.ranks, layer, step, boundary, self.lane, root)
        return out

    def direct_weights(self) -> list[_Leg]:
        out: list[_Leg] = []
        owners, layers = self.plan.owners, self.order.layers
        for r in range(self.P):
            for t in range(self.T):
                for layer in sorted(layers[r][t]):
                    if t and layer in layers[r][t - 1]:
                        continue  # r keeps the copy it ran at step t - 1
                    legs = routes.direct(owners[layer], (r,))
                    out += self.placed(legs, WEIGHTS, layer, t, self.weight_boundaries(t, len(legs)))
                    if legs:
                        self.keep((r,), layer, t)
        return out

    def shared_layers(self, ranks: tuple[int, ...], t: int, what: str) -> list[int]:
        """The layers ``ranks`` run at step t, which must be the same for every rank that runs any."""
        found: tuple[int, set[int]] | None = None
        for r in ranks:
            used = self.order.layers[r][t]
            if not used:
                continue
            if found is None:
                found = (r, used)
            elif used != found[1]:
                raise self.error(
                    f"rank {r}, step {t}: {what} gives every rank of {_ranks_text(ranks)} the same layers in a "
                    f"step, but rank {found[0]} runs {_layers_text(found[1])} and rank {r} runs "
                    f"{_layers_text(used)}")
        return sorted(found[1]) if found else []

    def staged_weights(self) -> list[_Leg]:
        out: list[_Leg] = []
        plan = self.plan
        for group in sorted(set(plan.groups)):
            members = plan.group_ranks(group)
            running = [set().union(*(self.order.layers[r][t] for r in members)) for t in range(self.T)]
            before: list[int] = []
            for t in range(self.T):
                now = self.shared_layers(members, t, "weights staged (a broadcast inside the group)")
                for layer in now:
                    if layer in before:
                        continue  # the group keeps the copy it ran at step t - 1
                    owner = plan.owners[layer]
                    legs = routes.staged_broadcast(owner, members, plan.staging_rank(owner, group))
                    out += self.placed(legs, WEIGHTS, layer, t, self.weight_boundaries(t, len(legs)))
                    self.keep([r for r in members if r != owner], layer, t, running)
                before = now
        return out

    def gathered_weights(self) -> list[_Leg]:
        out: list[_Leg] = []
        everyone = tuple(range(self.P))
        running = [set().union(*(self.order.layers[r][t] for r in everyone)) for t in range(self.T)]
        before: list[int] = []
        for t in range(self.T):
            now = self.shared_layers(everyone, t, "weights all_gather (a collective of every rank)")
            for layer in now:
                if layer not in before:
                    legs = routes.all_gather(everyone)
                    out += self.placed(legs, WEIGHTS, layer, t, self.weight_boundaries(t, len(legs)))
                    self.keep(everyone, layer, t, running)
            before = now
        return out

    # -- the ring ----------------------------------------------------------------

    def at(self, diagonal: int, t: int) -> int:
        """The rank that holds ``diagonal``'s slot at step t."""
        return (diagonal + self.plan.ring_by * t) % self.P

    def diagonals(self) -> dict[str, dict[int, tuple[int, list[tuple[int, int]]]]]:
        """pass -> diagonal -> (its layer, its uses as (step, rank) in step order)."""
        by, P = self.plan.ring_by, self.P
        out: dict[str, dict[int, tuple[int, list[tuple[int, int]]]]] = {p: {} for p in PASSES}
        for t in range(self.T):
            for r in range(P):
                for pass_, layers in self.order.uses[r][t].items():
                    if len(layers) > 1:
                        raise self.error(
                            f"rank {r}, step {t}: weights ring keeps one {pass_} slot per rank, but this step "
                            f"runs {_layers_text(layers)} {pass_}")
                    layer = layers[0]
                    diagonal = (r - by * t) % P
                    pinned = out[pass_].get(diagonal)
                    if pinned is None:
                        out[pass_][diagonal] = (layer, [(t, r)])
                    elif pinned[0] != layer:
                        first_t, first_r = pinned[1][0]
                        raise self.error(
                            f"rank {r}, step {t}: runs layer {layer} {pass_}, but the {pass_} ring slot it holds "
                            f"then carries layer {pinned[0]} (rank {first_r} runs it at step {first_t}; each step "
                            f"every slot moves from rank q to q + {self.plan.ring_by})")
                    else:
                        pinned[1].append((t, r))
        return out

    def ring_weights(self) -> list[_Leg]:
        if self.K > 1:
            raise self.error(
                f"weights ring passes each slot one rank per step, so a slot can be sent on at most one step "
                f"before its use (prefetch 0 or 1), not {self.K}")
        out: list[_Leg] = []
        diagonals = self.diagonals()
        owners, K = self.plan.owners, self.K
        fills: list[_Leg] = []
        # pass -> diagonal -> (step its slot is first filled, its last use)
        live: dict[str, dict[int, tuple[int, int]]] = {p: {} for p in PASSES}
        for pass_ in PASSES:  # forward first: a backward slot may start from a forward one
            other = BACKWARD if pass_ == FORWARD else FORWARD
            for diagonal, (layer, used) in sorted(diagonals[pass_].items()):
                (t0, r0), last = used[0], used[-1][0]
                owner = owners[layer]
                if r0 == owner or self.forks(live, diagonals, other, r0, t0, layer):
                    start = t0
                else:
                    passes_owner = [t for t in range(t0 + 1) if self.at(diagonal, t) == owner]
                    if passes_owner:
                        start = passes_owner[-1]  # the owner copies its master into the slot then
                    else:  # the owner sends r0 a copy one leg earlier, and r0 fills the slot from it
                        start = t0
                        hop, _fill = self.weight_boundaries(t0, 2)
                        out += self.placed(routes.direct(owner, (r0,)), WEIGHTS, layer, t0, [hop])
                        self.frees.append((r0, t0 - K, self.part(r0, FREE_W, layer, t0)))
                live[pass_][diagonal] = (start, last)
                filler = self.at(diagonal, start)
                fills.append(_Leg(start - K, self.lane, filler, self.part(filler, FILL_OF_PASS[pass_], layer, start)))
        out += fills
        everyone = range(self.P)
        for t in range(1, self.T):
            for pass_ in PASSES:
                moving = {self.at(d, t): diagonals[pass_][d][0] for d, (start, last) in live[pass_].items()
                          if start <= t - 1 and t <= last}
                if moving:
                    (b,) = self.weight_boundaries(t, 1)
                    out += [_Leg(b, self.lane, r, self.part(r, SHIFT_OF_PASS[pass_], moving.get(r, -1), t))
                            for r in everyone]
        return out

    def forks(self, live, diagonals, other: str, rank: int, t0: int, layer: int) -> bool:
        """Whether ``rank``'s ``other`` slot holds ``layer`` at step t0 - 1 or t0 and is there when
        this slot of step t0 is filled (boundary t0 - K): then the slot starts as a copy of it."""
        for s in (t0 - 1, t0):
            diagonal = (rank - self.plan.ring_by * s) % self.P
            pinned = diagonals[other].get(diagonal)
            span = live[other].get(diagonal)
            if pinned is None or span is None or pinned[0] != layer or not span[0] <= s <= span[1]:
                continue
            # The fill sits in the exchange of boundary t0 - K. A filled source is there from its own
            # fill (boundary s - K, earlier in the same exchange at the latest); a shifted one from
            # its wait: before the exchanges of boundary s when prefetching, after them when not.
            available = s - self.K if span[0] == s else (s if self.K else s + 1)
            if available <= t0 - self.K:
                return True
        return False

    # -- gradients ---------------------------------------------------------------

    def gradient_legs(self) -> list[_Leg]:
        if self.P == 1:
            return []
        return {"direct": self.direct_gradients, "reduce": self.reduced_gradients,
                "reduce_scatter": self.scattered_gradients, "ring": self.ring_gradients}[self.plan.gradients]()

    def run_ends(self, contributes: list[set[int]]) -> list[tuple[int, int]]:
        """(step, layer) for each run of consecutive steps in which ``contributes`` holds the layer, at its last step."""
        return [(t, layer) for t in range(self.T) for layer in sorted(contributes[t])
                if t + 1 >= self.T or layer not in contributes[t + 1]]

    def direct_gradients(self) -> list[_Leg]:
        out: list[_Leg] = []
        for r in range(self.P):
            for t, layer in self.run_ends(self.order.contributes[r]):
                legs = routes.direct(r, (self.plan.owners[layer],))  # nothing on the owner
                out += self.placed(legs, GRADIENTS, layer, t, self.gradient_boundaries(t, len(legs)))
        return out

    def reduced_gradients(self) -> list[_Leg]:
        # Reduces first: where an owner's group reduces a layer in the exchange that also brings
        # the owner another group's sum, the reduce completes first and the sum is added after it.
        reduces: list[_Leg] = []
        hops: list[_Leg] = []
        plan = self.plan
        for group in sorted(set(plan.groups)):
            members = plan.group_ranks(group)
            together = [set().union(*(self.order.contributes[r][t] for r in members)) for t in range(self.T)]
            for t, layer in self.run_ends(together):
                owner = plan.owners[layer]
                legs = routes.reduce_to_owner(members, owner, plan.staging_rank(owner, group))
                placed = self.placed(legs, GRADIENTS, layer, t, self.gradient_boundaries(t, len(legs)))
                for leg in placed:
                    (reduces if leg.action.op == REDUCE_G else hops).append(leg)
        return reduces + hops

    def scattered_gradients(self) -> list[_Leg]:
        out: list[_Leg] = []
        everyone = tuple(range(self.P))
        together = [set().union(*(self.order.contributes[r][t] for r in everyone)) for t in range(self.T)]
        for t, layer in self.run_ends(together):
            legs = routes.reduce_scatter(everyone)
            out += self.placed(legs, GRADIENTS, layer, t, self.gradient_boundaries(t, len(legs)))
        return out

    def ring_gradients(self) -> list[_Leg]:
        out: list[_Leg] = []
        by, P = self.plan.ring_by, self.P
        made: dict[int, tuple[int, list[int]]] = {}  # backward diagonal -> (layer, steps it gets a contribution)
        for t in range(self.T):
            for r in range(P):
                for layer in sorted(self.order.contributes[r][t]):
                    diagonal = (r - by * t) % P
                    made.setdefault(diagonal, (layer, []))[1].append(t)
        spans: dict[int, tuple[int, int]] = {}
        for diagonal, (layer, at_steps) in sorted(made.items()):
            first, last = at_steps[0], at_steps[-1]
            spans[diagonal] = (first, last)
            holder, owner = self.at(diagonal, last), self.plan.owners[layer]
            if holder != owner:
                (b,) = self.gradient_boundaries(last, 1)
                out += self.hop(SEND_G, RECV_G, holder, owner, layer, last, b, self.lane)
        for t in range(1, self.T):
            moving = {self.at(d, t): made[d][0] for d, (first, last) in spans.items() if first <= t - 1 and t <= last}
            if moving:  # due lane: step t adds to what arrives
                out += [_Leg(t, DUE, r, self.part(r, SHIFT_G, moving.get(r, -1), t)) for r in range(P)]
        return out


def _uses(compute: Program, steps: list[list[int]], num_steps: int) -> _Order:
    """Per rank and step: the layers run in each pass, all of them, and those contributed to."""
    P = compute.num_ranks
    uses = [[{} for _ in range(num_steps)] for _ in range(P)]
    layers = [[set() for _ in range(num_steps)] for _ in range(P)]
    contributes = [[set() for _ in range(num_steps)] for _ in range(P)]
    for r, row in enumerate(compute.ranks):
        for action, t in zip(row, steps[r]):
            layer = compute.stages[action.stage].position
            pass_ = WEIGHT_PASS.get(action.op)
            if pass_ is not None:
                in_pass = uses[r][t].setdefault(pass_, [])
                if layer not in in_pass:
                    in_pass.append(layer)
                layers[r][t].add(layer)
            if action.op in GRADIENT_CONTRIBUTORS:
                contributes[r][t].add(layer)
    return _Order(uses, layers, contributes)


def _assemble(compute: Program, steps: list[list[int]], legs: list[_Leg], frees: list[tuple[int, int, Action]],
              plan: WeightPlan) -> list[list[Action]]:
    """Each rank's list: per boundary, the waits, exchanges and computes of the module docstring
    (docs/weights.md, section 2), and after a step's computes the copies that step last ran."""
    K = plan.prefetch
    first = min([leg.boundary for leg in legs] + [0])
    last = max([leg.boundary for leg in legs] + [plan.num_steps - 1])
    parts: dict[tuple[int, int, int], list[Action]] = defaultdict(list)  # (rank, boundary, lane) -> parts
    for leg in legs:
        parts[(leg.rank, leg.boundary, leg.lane)].append(leg.action)
    dropped: dict[tuple[int, int], list[Action]] = defaultdict(list)  # (rank, step) -> FREE_W after it
    for rank, step, action in frees:
        dropped[(rank, step)].append(action)
    ranks = []

    def layer_of(action: Action) -> int:
        return compute.stages[action.stage].position if action.stage >= 0 else -1

    for r, row in enumerate(compute.ranks):
        by_step: dict[int, list[Action]] = defaultdict(list)
        for action, t in zip(row, steps[r]):
            by_step[t].append(action)
        out: list[Action] = []
        open_ahead: list[tuple[int, int]] = []  # (boundary, exchange number) not yet waited

        def number(boundary: int, lane: int) -> int:
            return 2 * (boundary - first) + lane

        for b in range(first, last + 1):
            while open_ahead and open_ahead[0][0] + K <= b:
                out.append(Action(-1, EXCHANGE_WAIT, open_ahead.pop(0)[1]))
            ahead = parts.get((r, b, AHEAD))
            if ahead:
                out.append(Action(-1, EXCHANGE, number(b, AHEAD), NO_PEER, tuple(ahead)))
                open_ahead.append((b, number(b, AHEAD)))
            due = parts.get((r, b, DUE))
            if due:
                out.append(Action(-1, EXCHANGE, number(b, DUE), NO_PEER, tuple(due)))
                out.append(Action(-1, EXCHANGE_WAIT, number(b, DUE)))
            out.extend(by_step.get(b, ()))
            out.extend(dropped.get((r, b), ()))
        out.extend(Action(-1, EXCHANGE_WAIT, n) for _, n in open_ahead)
        # with K >= 2 a drop or an add placed by steps can race a transfer still open: move them apart
        ranks.append(separate_transfers(out, r, layer_of, plan.owners))
    return ranks


def _layers_text(layers) -> str:
    layers = sorted(layers)
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(map(str, layers))


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
