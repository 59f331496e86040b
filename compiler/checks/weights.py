"""Weight passing's meaning in the one symbolic run: every copy and every gradient tracked.

``check_weights(program)`` proves a weight-passing program (``Program.weights``
set) with the engine of ``checks/symbolic.py``, which matches its messages,
meets its collectives in one order per communicator and names a deadlock
(a weight-passing collective holds its rank until every member posted it, as
on one NCCL stream). What this module adds, the meaning of the family's ops:

* **Route consistency.** Every task finds the weights of its layer on its
  rank when it runs: the owner's master (not under ``all_gather``), a
  delivered copy whose exchange was waited and that was not dropped, or,
  under ``ring``, the slot of its pass (forward: F; backward: B, I, W). A ring
  step hands each rank the slot its predecessor held, which must be the layer
  the taker names; a FILL copies the owner's master or another slot of the rank.
  A send and its receive carry the same (kind, layer, step).
* **Buffer slots.** Borrowed copies alive at once on a rank (from the post of
  the part that brings one to its FREE_W, or, for a ring slot, to the wait of
  the step that passes it on) stay within ``WeightPlan.buffers``, and a copy is
  dropped only after every send of it completed.
* **Reduction completeness.** Each contribution (a B or W of a layer on a
  microbatch) is added to the partial of its rank's ring slot or its rank's
  accumulator, never while that partial is in flight (posted and not waited: an
  add racing a send or a reduce); partials travel whole; at the end every
  layer's owner (every rank's shard under ``reduce_scatter``) holds each
  contribution exactly once, and no partial is left anywhere else.
* **Replicas on a mesh** (``compiler/weight_placement.py``). Each replica's
  owner of a layer all-reduces the layer's gradient over its data group
  (SYNC_GRAD, an op of stages on groups that this family claims) after the last
  fold into it, and folds nothing into it after (nor while it is in flight);
  at the end every replica's owner holds every replica's contributions once.

Each violation is a ``ProgramError`` (MatchError, DeadlockError, RouteError)
at the rank and instruction where it shows, naming the value.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from pipec.compiler import ops
from pipec.compiler.checks.symbolic import Meeting, Part, RankState, Semantics, prove_exchanges, register_semantics
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import weight_buffer_counts
from pipec.errors import MatchError, RouteError


class WeightReport(NamedTuple):
    """What running the program found.

    Attributes:
        peak_buffers: per rank, the most borrowed weight copies alive at once.
    """

    peak_buffers: list[int]


class _Holdings:
    """One rank's weight copies and gradient partials."""

    def __init__(self):
        self.copies: dict[tuple, int] = {}     # copy key -> layer, once present
        self.arriving: dict[tuple, int] = {}   # copy key -> layer, posted and not waited
        self.sending: Counter = Counter()      # copy key -> sends in flight
        self.partial = None                    # ring gradient slot: (layer, Counter) or None
        self.partial_arriving = False
        self.accumulated: dict[int, Counter] = {}
        self.in_flight: dict[int, int] = {}    # layer -> the exchange its accumulated partial travels in
        self.summed_at: dict[int, Part] = {}   # layer -> the reduce whose sum this rank (its root) took last
        self.synced: dict[int, Part] = {}      # layer -> its all-reduce over the data group (SYNC_GRAD), posted


def check_weights(program: Program) -> WeightReport:
    """Prove a weight-passing program (module docstring).

    Args:
        program: a program with ``weights`` set.
    Returns:
        the ``WeightReport``.
    Raises:
        MatchError, DeadlockError, RouteError: the first violation found.
    """
    return prove_exchanges(program)[ops.WEIGHT_PASSING]


_SHIFTS = (ops.SHIFT_F, ops.SHIFT_B, ops.SHIFT_G)
_COLLECTIVES = (ops.SHIFT_F, ops.SHIFT_B, ops.SHIFT_G, ops.BCAST_W, ops.REDUCE_G, ops.ALLGATHER_W,
                ops.REDUCESCATTER_G)


@register_semantics
class WeightSemantics(Semantics):
    family = ops.WEIGHT_PASSING
    part_ops = frozenset(_COLLECTIVES + (ops.SEND_W, ops.RECV_W, ops.SEND_G, ops.RECV_G, ops.FILL_F, ops.FILL_B,
                                         ops.SYNC_GRAD))
    blocking = frozenset(_COLLECTIVES)  # one stream: a rank's collectives run in its order
    claims = frozenset((ops.SYNC_GRAD,))  # the replicas' meeting folds into the owners' gradients

    def __init__(self, run):
        super().__init__(run)
        self.plan = self.program.weights
        self.held = [_Holdings() for _ in range(self.P)]
        self.scattered: dict[int, Counter] = {}
        self.expected: dict[int, Counter] = {}

    # -- helpers -----------------------------------------------------------------

    def layer(self, action: Action) -> int:
        if not 0 <= action.stage < len(self.program.stages):
            return -1
        return self.program.stages[action.stage].position

    def owns(self, rank: int, layer: int) -> bool:
        return self.plan.owns(rank, layer)

    def after_sync(self, state: RankState, what: str, layer: int, step: int) -> None:
        """Nothing folds into an owned layer's gradient once its all-reduce over the data group is posted."""
        synced = self.held[state.rank].synced.get(layer)
        if synced is None:
            return
        raise self.error(RouteError, f"{what} folds into layer {layer}'s gradient after {synced.action.text()} "
                         f"(step {synced.step}) all-reduced it over the data group: this fold misses the other "
                         "replicas (the all-reduce comes after the owner's last fold)", state.rank, step,
                         [(state.rank, synced.step)])

    def start(self) -> None:
        for row in self.program.ranks:
            for action in row:
                if action.op in ops.GRADIENT_CONTRIBUTORS and 0 <= action.stage < len(self.program.stages):
                    self.expected.setdefault(self.layer(action), Counter())[(self.layer(action), action.mb)] += 1

    def report(self) -> WeightReport:
        """Peak borrowed buffers per rank (``memory_counts``), checked against the program's bound."""
        peaks, bound = [], self.plan.buffers
        for rank, row in enumerate(self.program.ranks):
            peak = 0
            for step, live in enumerate(weight_buffer_counts(row, rank)):
                if bound is not None and live > bound:
                    raise self.error(RouteError, f"{live} borrowed weight buffers are alive here, more than the "
                                     f"program's bound of {bound} (buffers): a buffer would be overwritten while "
                                     "its copy is still used or sent", rank, step)
                peak = max(peak, live)
            peaks.append(peak)
        return WeightReport(peaks)

    def step(self, state: RankState, action: Action) -> None:
        category = ops.RULES[action.op].category
        if category == ops.COMPUTE:
            self.compute(state, action)
        elif category == ops.DROP_COPY:
            self.drop(state, action)

    # -- posts -------------------------------------------------------------------

    def post(self, state: RankState, part: Part) -> None:
        category = ops.RULES[part.action.op].category
        if category == ops.PART_LOCAL:
            self.fill(state, part)
        elif category == ops.PART_COLLECTIVE:
            part.content = self.contribution(state, part)
        else:
            self.post_p2p(state, part, category == ops.PART_SEND)

    def fill(self, state: RankState, part: Part) -> None:
        action = part.action
        layer, pass_ = self.layer(action), ops.PASS_OF_SLOT_OP[action.op]
        if layer < 0:
            raise self.error(RouteError, f"{action.text()}: no such stage", state.rank, part.step)
        held = layer in self.held[state.rank].copies.values()
        if not (self.owns(state.rank, layer) or held):
            raise self.error(RouteError, f"{action.text()} fills the {pass_} slot with layer {layer}, but this rank "
                             f"neither owns layer {layer} nor holds a copy of it", state.rank, part.step)
        self.allocate(state, (pass_, action.mb), layer, part.step, arriving=False)

    def allocate(self, state: RankState, key: tuple, layer: int, step: int, arriving: bool) -> None:
        h = self.held[state.rank]
        if key in h.copies or key in h.arriving:
            raise self.error(RouteError, f"{_copy_text(key, layer)} arrives while this rank still holds "
                             f"{_copy_text(key, h.copies.get(key, h.arriving.get(key)))}: a buffer "
                             "overwritten before it was dropped", state.rank, step)
        (h.arriving if arriving else h.copies)[key] = layer

    def post_p2p(self, state: RankState, part: Part, is_send: bool) -> None:
        action = part.action
        layer = self.layer(action)
        if layer < 0:
            raise self.error(MatchError, f"{action.text()}: stage {action.stage} out of range", state.rank, part.step)
        is_weight = ops.RULES[action.op].carries.kind == "weight"
        if is_send:
            part.content = self.outgoing(state, part, layer, is_weight)
        elif is_weight:
            self.allocate(state, ("W", layer, action.mb), layer, part.step, arriving=True)

    def outgoing(self, state: RankState, part: Part, layer: int, is_weight: bool):
        """What a send carries, checked at its post: a layer's weights, or a gradient partial."""
        action, h = part.action, self.held[state.rank]
        if is_weight:
            if self.owns(state.rank, layer):
                return layer
            key = next((k for k, v in h.copies.items() if v == layer and k[0] == "W"), None)
            if key is None:
                raise self.error(RouteError, f"{action.text()} sends layer {layer}'s weights, but this rank "
                                 f"neither owns layer {layer} nor holds a copy of it here", state.rank, part.step)
            h.sending[key] += 1
            part.sent_slot = key
            return layer
        if self.plan.gradients == "ring" and h.partial is not None and h.partial[0] == layer:
            content = h.partial[1]
            h.partial = None
            return content
        return self.lend_accumulated(state, part, layer)

    def lend_accumulated(self, state: RankState, part: Part, layer: int) -> Counter:
        h = self.held[state.rank]
        self.after_sync(state, part.action.text(), layer, part.step)
        if layer in h.in_flight:
            raise self.error(RouteError, f"{part.action.text()} takes layer {layer}'s gradient partial while "
                             f"exchange {h.in_flight[layer]} still has it in flight", state.rank, part.step)
        h.in_flight[layer] = part.exchange
        return Counter(h.accumulated.get(layer, ()))

    def value(self, action: Action) -> tuple:
        return (ops.RULES[action.op].carries.kind, self.layer(action), action.mb)

    def value_text(self, value: tuple) -> str:
        kind, layer, step = value
        return f"{ops.VALUE_KINDS[kind].words} of layer {layer} for step {step}"

    # -- collectives -------------------------------------------------------------

    def signature(self, part: Part) -> tuple:
        action = part.action
        return (action.op, self.layer(action) if action.op not in _SHIFTS else -1, action.mb, action.peer)

    def contribution(self, state: RankState, part: Part):
        """What a member brings to a collective, taken when it posts."""
        action, h = part.action, self.held[state.rank]
        op, layer = action.op, self.layer(action)
        if op in (ops.SHIFT_F, ops.SHIFT_B):
            pass_ = ops.PASS_OF_SLOT_OP[op]
            key = (pass_, action.mb - 1)
            if key in h.arriving:
                raise self.error(RouteError, f"{action.text()} passes on the {pass_} slot of step {action.mb - 1} "
                                 "before it arrived (its exchange is not waited)", state.rank, part.step)
            part.sent_slot = key if key in h.copies else None
            if layer >= 0:
                self.allocate(state, (pass_, action.mb), layer, part.step, arriving=True)
            return h.copies.get(key)
        if op == ops.SHIFT_G:
            if h.partial_arriving:
                raise self.error(RouteError, f"{action.text()} passes on a gradient partial that has not arrived",
                                 state.rank, part.step)
            content, h.partial = h.partial, None
            h.partial_arriving = layer >= 0
            return content
        if op == ops.BCAST_W:
            if action.peer == state.rank:
                if not (self.owns(state.rank, layer) or layer in h.copies.values()):
                    raise self.error(RouteError, f"{action.text()} broadcasts layer {layer}'s weights from this "
                                     f"rank, which neither owns the layer nor holds a copy of it here",
                                     state.rank, part.step)
                if not self.owns(state.rank, layer):
                    key = next(k for k, v in h.copies.items() if v == layer)
                    h.sending[key] += 1
                    part.sent_slot = key
                return layer
            self.allocate(state, ("W", layer, action.mb), layer, part.step, arriving=True)
            return None
        if op == ops.ALLGATHER_W:
            self.allocate(state, ("W", layer, action.mb), layer, part.step, arriving=True)
            return None
        if op == ops.SYNC_GRAD:
            if not self.owns(state.rank, layer):
                raise self.error(RouteError, f"{action.text()} all-reduces layer {layer}'s gradient over the data "
                                 "group on this rank, which does not own the layer (its owner holds the sum)",
                                 state.rank, part.step)
            if layer in h.in_flight:
                raise self.error(RouteError, f"{action.text()} all-reduces layer {layer}'s gradient over the data "
                                 f"group before exchange {h.in_flight[layer]}, which folds a partial of it into "
                                 "this owner, is waited: the all-reduce comes after the owner's last fold",
                                 state.rank, part.step)
            content = self.lend_accumulated(state, part, layer)
            h.synced[layer] = part
            return content
        return self.lend_accumulated(state, part, layer)  # REDUCE_G, REDUCESCATTER_G

    def complete(self, meeting: Meeting) -> None:
        """Every member joined: ring steps check what each rank takes; reductions sum."""
        parts = meeting.parts()
        first = next(iter(parts.values())).action
        if first.op in _SHIFTS:
            by = self.plan.ring_by
            for rank, part in parts.items():
                giver = parts.get((rank - by) % self.P)
                taken, layer = giver.content if giver else None, self.layer(part.action)
                if first.op == ops.SHIFT_G:
                    if layer >= 0 and (taken is None or taken[0] != layer):
                        raise self.error(RouteError, f"{part.action.text()} takes layer {layer}'s gradient "
                                         f"partial, but rank {giver.rank} passes {_partial_text(taken)}",
                                         rank, part.step, [(giver.rank, giver.step)])
                    if layer < 0 and taken is not None:
                        self.strand(giver, taken)
                    part.peer_part = taken if layer >= 0 else None
                elif layer >= 0 and taken != layer:
                    what = "nothing" if taken is None else f"layer {taken}"
                    raise self.error(RouteError, f"{part.action.text()} takes layer {layer} into its "
                                     f"{ops.PASS_OF_SLOT_OP[first.op]} slot of step {part.action.mb}, but rank "
                                     f"{giver.rank}'s slot of step {part.action.mb - 1} holds {what}",
                                     rank, part.step, [(giver.rank, giver.step)])
        elif first.op == ops.REDUCE_G:
            total = sum((part.content for part in parts.values()), Counter())
            root = parts.get(first.peer)
            if root is None:
                raise self.error(MatchError, f"{first.text()} reduces to rank {first.peer}, not a member",
                                 next(iter(parts)), next(iter(parts.values())).step)
            root.peer_part = total
        elif first.op == ops.SYNC_GRAD:  # every replica's owner takes the sum
            total = sum((part.content for part in parts.values()), Counter())
            for part in parts.values():
                part.peer_part = total
        elif first.op == ops.REDUCESCATTER_G:
            layer = self.layer(first)
            total = sum((part.content for part in parts.values()), Counter())
            self.scattered.setdefault(layer, Counter()).update(total)
        elif first.op == ops.BCAST_W:
            if first.peer not in parts:
                raise self.error(MatchError, f"{first.text()} broadcasts from rank {first.peer}, not a member",
                                 next(iter(parts)), next(iter(parts.values())).step)

    def strand(self, giver: Part, partial) -> None:
        """A ring step passes a partial nowhere: it stays with its holder, who must own the layer."""
        layer, content = partial
        if not self.owns(giver.rank, layer):
            raise self.error(RouteError, f"{giver.action.text()}: the partial of layer {layer} this rank holds "
                             f"({_contributions_text(content)}) goes nowhere: the next rank takes no partial and "
                             f"this rank does not own layer {layer}", giver.rank, giver.step)
        self.held[giver.rank].accumulated.setdefault(layer, Counter()).update(content)

    # -- waits -------------------------------------------------------------------

    def arrive(self, state: RankState, part: Part) -> None:
        """A part's effects on its rank once the exchange holding it is waited."""
        action, h = part.action, self.held[state.rank]
        op, layer = action.op, self.layer(action)
        if part.sent_slot is not None:
            if op in (ops.SHIFT_F, ops.SHIFT_B):
                h.copies.pop(part.sent_slot, None)
            else:
                h.sending[part.sent_slot] -= 1
        if op in (ops.SHIFT_F, ops.SHIFT_B, ops.RECV_W, ops.BCAST_W, ops.ALLGATHER_W):
            key = ((ops.PASS_OF_SLOT_OP[op], action.mb) if op in (ops.SHIFT_F, ops.SHIFT_B)
                   else ("W", layer, action.mb))
            if key in h.arriving:
                h.copies[key] = h.arriving.pop(key)
        elif op == ops.SHIFT_G:
            h.partial_arriving = False
            if part.peer_part is not None:
                h.partial = (part.peer_part[0], Counter(part.peer_part[1]))
        elif op == ops.RECV_G:
            if layer in h.in_flight:
                raise self.error(RouteError, f"{action.text()} adds the partial it received to layer {layer}'s, "
                                 f"which exchange {h.in_flight[layer]} is sending or reducing: the add races "
                                 "the transfer", state.rank, part.step)
            self.after_sync(state, action.text(), layer, part.step)
            h.accumulated.setdefault(layer, Counter()).update(part.peer_part.content)
        elif op == ops.SYNC_GRAD:
            h.in_flight.pop(layer, None)
            h.accumulated[layer] = Counter(part.peer_part)
        elif op in (ops.SEND_G, ops.REDUCE_G, ops.REDUCESCATTER_G):
            if h.in_flight.get(layer) == part.exchange:
                del h.in_flight[layer]
                h.accumulated.pop(layer, None)
            if op == ops.REDUCE_G and isinstance(part.peer_part, Counter):  # the root takes the sum
                self.after_sync(state, action.text(), layer, part.step)
                h.accumulated[layer] = part.peer_part
                h.summed_at[layer] = part

    # -- computes and drops ------------------------------------------------------

    def compute(self, state: RankState, action: Action) -> None:
        pass_ = ops.WEIGHT_PASS.get(action.op)
        if not 0 <= action.stage < len(self.program.stages):
            return  # the well-formed check names it
        layer = self.layer(action)
        if pass_ is not None:
            self.need_weights(state, action, layer, pass_)
        if action.op in ops.GRADIENT_CONTRIBUTORS:
            self.contribute(state, action, layer)

    def need_weights(self, state: RankState, action: Action, layer: int, pass_: str) -> None:
        h = self.held[state.rank]
        if self.plan.route == "ring":
            slots = {key: v for key, v in h.copies.items() if key[0] == pass_}
            if layer in slots.values():
                return
            held = ", ".join(f"layer {v} (step {k[1]})" for k, v in sorted(slots.items())) or "nothing"
            raise self.error(RouteError, f"{action.text()} runs layer {layer} {pass_}, but this rank's {pass_} "
                             f"slot holds {held} here", state.rank, state.pc)
        if self.owns(state.rank, layer) or any(k[0] == "W" and v == layer for k, v in h.copies.items()):
            return
        coming = [k for k, v in h.arriving.items() if v == layer]
        why = (f"its copy (step {coming[0][2]}) is posted but not waited" if coming
               else "no copy of it is here")
        raise self.error(RouteError, f"{action.text()} runs layer {layer}, but this rank does not own it and "
                         f"{why}", state.rank, state.pc)

    def contribute(self, state: RankState, action: Action, layer: int) -> None:
        h = self.held[state.rank]
        contribution = (layer, action.mb)
        if self.plan.gradients == "ring":
            if h.partial_arriving:
                raise self.error(RouteError, f"{action.text()} adds to a gradient partial that has not arrived",
                                 state.rank, state.pc)
            if h.partial is None:
                h.partial = (layer, Counter())
            elif h.partial[0] != layer:
                raise self.error(RouteError, f"{action.text()} adds layer {layer}'s weight gradient, but the "
                                 f"gradient partial its ring slot holds is layer {h.partial[0]}'s",
                                 state.rank, state.pc)
            h.partial[1][contribution] += 1
            return
        self.after_sync(state, action.text(), layer, state.pc)
        if layer in h.in_flight:
            raise self.error(RouteError, f"{action.text()} adds layer {layer}'s weight gradient while exchange "
                             f"{h.in_flight[layer]} is sending or reducing that partial: the add races the "
                             "transfer (wait for the exchange first)", state.rank, state.pc)
        h.accumulated.setdefault(layer, Counter())[contribution] += 1

    def drop(self, state: RankState, action: Action) -> None:
        h = self.held[state.rank]
        key = ("W", self.layer(action), action.mb)
        if key not in h.copies:
            what = "still arriving (its exchange is not waited)" if key in h.arriving else "not held"
            raise self.error(RouteError, f"{action.text()} drops a copy that is {what}", state.rank, state.pc)
        if h.sending[key]:
            raise self.error(RouteError, f"{action.text()} drops {_copy_text(key, key[1])} while a send of it is "
                             "in flight: its buffer would be overwritten before the send completed",
                             state.rank, state.pc)
        h.copies.pop(key, None)

    # -- the end -----------------------------------------------------------------

    def finish(self) -> None:
        for rank, h in enumerate(self.held):
            if h.partial is not None:
                layer, content = h.partial
                if not self.owns(rank, layer):
                    raise self.error(RouteError, f"the gradient partial of layer {layer} "
                                     f"({_contributions_text(content)}) ends on this rank, which does not own it",
                                     rank, self.run.end_of(rank))
                h.accumulated.setdefault(layer, Counter()).update(content)
        sharded = self.plan.owners is None
        for layer in sorted(set(self.expected) | {l for h in self.held for l in h.accumulated}):
            expected = self.expected.get(layer, Counter())
            for rank, h in enumerate(self.held):
                if layer in h.accumulated and (sharded or not self.owns(rank, layer)):
                    self.left_partial(rank, layer)
            if sharded:
                got, where = +self.scattered.get(layer, Counter()), "the shards of every rank"
                at = 0
            else:
                owners = [rank for rank in range(self.P) if self.owns(rank, layer)]  # one per replica on a mesh
                got, where, at = next(((+self.held[r].accumulated.get(layer, Counter()), f"its owner rank {r}", r)
                                       for r in owners if +self.held[r].accumulated.get(layer, Counter()) != expected),
                                      (expected, "", 0))
            if got != expected:
                missing, twice = expected - got, got - expected
                problem = (f"lacks {_contributions_text(missing)}" if missing
                           else f"holds {_contributions_text(twice)} more than once")
                raise self.error(RouteError, f"layer {layer}'s weight gradient at {where} {problem}: every "
                                 "microbatch's contribution must be folded in exactly once", at, self.run.end_of(at))

    def left_partial(self, rank: int, layer: int) -> None:
        """A partial on a rank that does not own its layer: the runtime faults on it even when it sums nothing."""
        held, reduce = +self.held[rank].accumulated[layer], self.held[rank].summed_at.get(layer)
        if not held and reduce is not None:  # a reduce the group ran again after its sum left
            raise self.error(RouteError, f"{reduce.action.text()} reduces layer {layer}'s gradient again after "
                             "its sum left this rank: this rank, which does not own the layer, is left with a "
                             "partial that is never sent on (the runtime faults at its end)", rank, reduce.step)
        raise self.error(RouteError, f"a partial of layer {layer}'s gradient ({_contributions_text(held)}) is left "
                         "on this rank, which does not own the layer: it never reached the owner",
                         rank, self.run.end_of(rank))


def _copy_text(key: tuple, layer) -> str:
    if key[0] == "W":
        return f"the copy of layer {layer} for step {key[2]}"
    return f"the {key[0]} slot of step {key[1]} (layer {layer})"


def _partial_text(partial) -> str:
    return "no partial" if partial is None else f"the partial of layer {partial[0]}"


def _contributions_text(content: Counter) -> str:
    mbs = sorted(mb for (_layer, mb), count in content.items() for _ in range(count))
    if not mbs:
        return "no microbatch's contribution"
    return "microbatch" + ("es " if len(mbs) != 1 else " ") + ", ".join(map(str, mbs))
