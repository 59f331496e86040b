"""Weight passing's proof: run the program symbolically, every copy and every gradient tracked.

``check_weights(program)`` runs a weight-passing program (``Program.weights``
set) on every rank at once, under the strictest semantics the runtime may
meet, and proves what the lists promise:

* **Matching.** Point-to-point parts (SEND_W/RECV_W, SEND_G/RECV_G) meet FIFO
  per ordered pair of ranks and carry the same value (kind, layer, step); a
  collective part meets on its communicator (``Program.communicator_on``), of
  which its rank is a member, and the k-th collective of a communicator is the
  same (op, layer, step, root) on every member.
* **Deadlock freedom.** An EXCHANGE posts its parts in list order: a
  point-to-point part never blocks, a collective part blocks the rank until
  every member has posted it (collectives of one rank run in its order, as on
  one NCCL stream: two communicators met in different orders by two ranks hang
  here as they would there). An EXCHANGE_WAIT blocks until every part of its
  exchange is complete: a receive until its send is posted and a send until
  its receive is (rendezvous). A program that cannot finish is a
  DeadlockError naming the cycle of waits.
* **Route consistency.** Every task finds the weights of its layer on its
  rank when it runs: the owner's master (not under ``all_gather``), a
  delivered copy whose exchange was waited and that was not dropped, or,
  under ``ring``, the slot of its pass (forward: F; backward: B, I, W). A ring
  step hands each rank the slot its predecessor held, which must be the layer
  the taker names; a FILL copies the owner's master or another slot of the rank.
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

Each violation is a ``ProgramError`` (MatchError, DeadlockError, RouteError)
at the rank and instruction where it shows, naming the value.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import NamedTuple

from pipec.compiler import ops
from pipec.compiler.checks.symbolic import SymbolicRun
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import weight_buffer_counts
from pipec.errors import DeadlockError, MatchError, RouteError

ops.declare_pass("weight passing", ops.OPS)  # computes read weights; every weight op is run; others skipped

_SEND, _RECV, _COLLECTIVE, _LOCAL = ops.PART_SEND, ops.PART_RECV, ops.PART_COLLECTIVE, ops.PART_LOCAL


class WeightReport(NamedTuple):
    """What running the program found.

    Attributes:
        peak_buffers: per rank, the most borrowed weight copies alive at once.
    """

    peak_buffers: list[int]


class _Part:
    """One posted part: its rank, where it was posted, its action, and whether it is complete."""

    __slots__ = ("rank", "step", "action", "exchange", "done", "content", "peer_part", "sent_slot")

    def __init__(self, rank: int, step: int, action: Action, exchange: int):
        self.rank, self.step, self.action, self.exchange = rank, step, action, exchange
        self.done = False
        self.content = None      # what a send carries (a layer, or a Counter of contributions)
        self.peer_part = None    # the matching part of a point-to-point
        self.sent_slot = None    # the slot key a ring step passed on


class _Meeting:
    """The k-th collective of a communicator: who joined, with what."""

    __slots__ = ("members", "joined", "done")

    def __init__(self, members: tuple[int, ...]):
        self.members = members
        self.joined: dict[int, tuple[_Part, tuple]] = {}
        self.done = False


class _Rank:
    """One rank's progress and holdings."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pc = 0
        self.part_index = 0              # inside an EXCHANGE being posted
        self.posting = -1                # the step of the EXCHANGE being posted
        self.open: dict[int, tuple[int, list[_Part]]] = {}   # exchange -> (posted at, its parts)
        self.copies: dict[tuple, int] = {}     # copy key -> layer, once present
        self.arriving: dict[tuple, int] = {}   # copy key -> layer, posted and not waited
        self.sending: Counter = Counter()      # copy key -> sends in flight
        self.partial = None                    # ring gradient slot: (layer, Counter) or None
        self.partial_arriving = False
        self.accumulated: dict[int, Counter] = {}
        self.in_flight: dict[int, int] = {}    # layer -> the exchange its accumulated partial travels in
        self.count: Counter = Counter()        # communicator id -> collectives joined
        self.waiting_on = None                 # for the deadlock report: (what, ranks)


def check_weights(program: Program) -> WeightReport:
    """Prove a weight-passing program (module docstring).

    Args:
        program: a program with ``weights`` set.
    Returns:
        the ``WeightReport``.
    Raises:
        MatchError, DeadlockError, RouteError: the first violation found.
    """
    return _Run(program).run()


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


class _Run(SymbolicRun):
    def __init__(self, program: Program):
        super().__init__(program)
        self.plan = program.weights
        self.P = program.num_ranks
        self.ranks = [_Rank(r) for r in range(self.P)]
        self.channels: dict[tuple[int, int], tuple[deque, deque]] = {}
        self.meetings: dict[tuple[int, int], _Meeting] = {}
        self.scattered: dict[int, Counter] = {}
        self.expected: dict[int, Counter] = {}

    # -- helpers -----------------------------------------------------------------

    def layer(self, action: Action) -> int:
        if not 0 <= action.stage < len(self.program.stages):
            return -1
        return self.program.stages[action.stage].position

    def owns(self, rank: int, layer: int) -> bool:
        owners = self.plan.owners
        return owners is not None and 0 <= layer < len(owners) and owners[layer] == rank

    # -- driver ------------------------------------------------------------------

    def run(self) -> WeightReport:
        for rank, row in enumerate(self.program.ranks):
            for action in row:
                if action.op in ops.GRADIENT_CONTRIBUTORS and 0 <= action.stage < len(self.program.stages):
                    self.expected.setdefault(self.layer(action), Counter())[(self.layer(action), action.mb)] += 1
        self.execute(self.ranks)
        return WeightReport(self.buffers())

    def buffers(self) -> list[int]:
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
        return peaks

    def advance(self, state: _Rank) -> bool:
        """Run ``state``'s rank until it blocks or ends; whether it moved."""
        row = self.program.ranks[state.rank]
        start = (state.pc, state.part_index)
        while state.pc < len(row):
            action = row[state.pc]
            category = ops.RULES[action.op].category if action.op in ops.RULES else None
            if category == ops.EXCHANGE_OF:
                if not self.post(state, action):
                    break
            elif category == ops.EXCHANGE_WAIT_OF:
                if not self.wait(state, action):
                    break
            elif category == ops.COMPUTE:
                self.compute(state, action)
            elif category == ops.DROP_COPY:
                self.drop(state, action)
            elif category in ops.EXCHANGE_PART_CATEGORIES:
                raise self.error(MatchError, f"{action.text()} is a part of an exchange and must sit inside an "
                                 "EXCHANGE", state.rank, state.pc)
            state.pc += 1
            state.part_index = 0
            state.waiting_on = None
        return (state.pc, state.part_index) != start

    # -- exchanges ---------------------------------------------------------------

    def post(self, state: _Rank, action: Action) -> bool:
        """Post the parts of an EXCHANGE from where the rank stopped; False when a collective blocks it."""
        number = action.mb
        if state.posting != state.pc:  # not resuming a blocked post
            if number in state.open:
                raise self.error(MatchError, f"exchange {number} is posted again before it was waited",
                                 state.rank, state.pc)
            state.open[number] = (state.pc, [])
            state.posting = state.pc
        parts = state.open[number][1]
        while state.part_index < len(action.parts):
            action_part = action.parts[state.part_index]
            if len(parts) <= state.part_index:
                part = _Part(state.rank, state.pc, action_part, number)
                parts.append(part)
                self.post_part(state, part)
            part = parts[state.part_index]
            if ops.RULES[part.action.op].category == _COLLECTIVE and not part.done:
                return False
            state.part_index += 1
        return True

    def post_part(self, state: _Rank, part: _Part) -> None:
        action = part.action
        rule = ops.RULES.get(action.op)
        if rule is None or rule.category not in ops.EXCHANGE_PART_CATEGORIES:
            raise self.error(MatchError, f"an exchange may only hold sends, receives, ring steps, fills and "
                             f"collectives of weight passing, not {action.text()}", state.rank, state.pc)
        if rule.category == _LOCAL:
            self.fill(state, part)
            part.done = True
        elif rule.category in (_SEND, _RECV):
            self.post_p2p(state, part, rule.category == _SEND)
        else:
            self.join(state, part)

    def fill(self, state: _Rank, part: _Part) -> None:
        action = part.action
        layer, pass_ = self.layer(action), ops.PASS_OF_SLOT_OP[action.op]
        if layer < 0:
            raise self.error(RouteError, f"{action.text()}: no such stage", state.rank, part.step)
        held = layer in state.copies.values()
        if not (self.owns(state.rank, layer) or held):
            raise self.error(RouteError, f"{action.text()} fills the {pass_} slot with layer {layer}, but this rank "
                             f"neither owns layer {layer} nor holds a copy of it", state.rank, part.step)
        self.allocate(state, (pass_, action.mb), layer, part.step, arriving=False)

    def allocate(self, state: _Rank, key: tuple, layer: int, step: int, arriving: bool) -> None:
        if key in state.copies or key in state.arriving:
            raise self.error(RouteError, f"{_copy_text(key, layer)} arrives while this rank still holds "
                             f"{_copy_text(key, state.copies.get(key, state.arriving.get(key)))}: a buffer "
                             "overwritten before it was dropped", state.rank, step)
        (state.arriving if arriving else state.copies)[key] = layer

    def release(self, state: _Rank, key: tuple) -> None:
        state.copies.pop(key, None)

    def post_p2p(self, state: _Rank, part: _Part, is_send: bool) -> None:
        action = part.action
        peer, layer = action.peer, self.layer(action)
        if not 0 <= peer < self.P or peer == state.rank or layer < 0:
            raise self.error(MatchError, f"{action.text()}: peer {peer} or stage {action.stage} out of range",
                             state.rank, part.step)
        is_weight = ops.RULES[action.op].carries.kind == "weight"
        if is_send:
            part.content = self.outgoing(state, part, layer, is_weight)
        elif is_weight:
            self.allocate(state, ("W", layer, action.mb), layer, part.step, arriving=True)
        key = (state.rank, peer) if is_send else (peer, state.rank)
        sends, recvs = self.channels.setdefault(key, (deque(), deque()))
        mine, theirs = (sends, recvs) if is_send else (recvs, sends)
        if theirs:
            other = theirs.popleft()
            self.match(other if is_send is False else part, part if is_send is False else other)
        else:
            mine.append(part)

    def outgoing(self, state: _Rank, part: _Part, layer: int, is_weight: bool):
        """What a send carries, checked at its post: a layer's weights, or a gradient partial."""
        action = part.action
        if is_weight:
            if self.owns(state.rank, layer):
                return layer
            key = next((k for k, v in state.copies.items() if v == layer and k[0] == "W"), None)
            if key is None:
                raise self.error(RouteError, f"{action.text()} sends layer {layer}'s weights, but this rank "
                                 f"neither owns layer {layer} nor holds a copy of it here", state.rank, part.step)
            state.sending[key] += 1
            part.sent_slot = key
            return layer
        if self.plan.gradients == "ring" and state.partial is not None and state.partial[0] == layer:
            content = state.partial[1]
            state.partial = None
            return content
        return self.lend_accumulated(state, part, layer)

    def lend_accumulated(self, state: _Rank, part: _Part, layer: int) -> Counter:
        if layer in state.in_flight:
            raise self.error(RouteError, f"{part.action.text()} takes layer {layer}'s gradient partial while "
                             f"exchange {state.in_flight[layer]} still has it in flight", state.rank, part.step)
        state.in_flight[layer] = part.exchange
        return Counter(state.accumulated.get(layer, ()))

    def match(self, send: _Part, recv: _Part) -> None:
        value_send = (ops.RULES[send.action.op].carries.kind, self.layer(send.action), send.action.mb)
        value_recv = (ops.RULES[recv.action.op].carries.kind, self.layer(recv.action), recv.action.mb)
        if value_send != value_recv:
            raise self.error(
                MatchError, f"{recv.action.text()} from rank {send.rank} gets {send.action.text()} (rank "
                f"{send.rank}, step {send.step}): messages are matched in order per pair of ranks, and these "
                f"carry different values ({_value_text(value_send)} against {_value_text(value_recv)})",
                recv.rank, recv.step, [(send.rank, send.step)])
        send.peer_part, recv.peer_part = recv, send
        send.done = recv.done = True

    # -- collectives -------------------------------------------------------------

    def join(self, state: _Rank, part: _Part) -> None:
        action = part.action
        communicator = self.program.communicator_on(action, state.rank)
        if communicator is None or state.rank not in communicator.ranks:
            raise self.error(MatchError, f"{action.text()} meets on no communicator of the program that has rank "
                             f"{state.rank}", state.rank, part.step)
        k = state.count[communicator.id]
        state.count[communicator.id] += 1
        meeting = self.meetings.setdefault((communicator.id, k), _Meeting(communicator.ranks))
        signature = (action.op, self.layer(action) if action.op not in _SHIFTS else -1, action.mb,
                     action.peer)
        for other, (other_part, other_signature) in meeting.joined.items():
            if other_signature != signature:
                raise self.error(
                    MatchError, f"the {_ordinal(k + 1)} collective on {_communicator_text(communicator)} is "
                    f"{action.text()} here but {other_part.action.text()} on rank {other} (step "
                    f"{other_part.step}): every member must meet its collectives in the same order",
                    state.rank, part.step, [(other, other_part.step)])
            break
        meeting.joined[state.rank] = (part, signature)
        part.content = self.contribution(state, part)
        if len(meeting.joined) == len(meeting.members):
            self.complete(meeting)
        else:
            state.waiting_on = ("collective", [r for r in meeting.members if r not in meeting.joined], action)

    def contribution(self, state: _Rank, part: _Part):
        """What a member brings to a collective, taken when it posts."""
        action = part.action
        op, layer = action.op, self.layer(action)
        if op in (ops.SHIFT_F, ops.SHIFT_B):
            pass_ = ops.PASS_OF_SLOT_OP[op]
            key = (pass_, action.mb - 1)
            if key in state.arriving:
                raise self.error(RouteError, f"{action.text()} passes on the {pass_} slot of step {action.mb - 1} "
                                 "before it arrived (its exchange is not waited)", state.rank, part.step)
            part.sent_slot = key if key in state.copies else None
            if layer >= 0:
                self.allocate(state, (pass_, action.mb), layer, part.step, arriving=True)
            return state.copies.get(key)
        if op == ops.SHIFT_G:
            if state.partial_arriving:
                raise self.error(RouteError, f"{action.text()} passes on a gradient partial that has not arrived",
                                 state.rank, part.step)
            content, state.partial = state.partial, None
            state.partial_arriving = layer >= 0
            return content
        if op == ops.BCAST_W:
            if action.peer == state.rank:
                if not (self.owns(state.rank, layer) or layer in state.copies.values()):
                    raise self.error(RouteError, f"{action.text()} broadcasts layer {layer}'s weights from this "
                                     f"rank, which neither owns the layer nor holds a copy of it here",
                                     state.rank, part.step)
                if not self.owns(state.rank, layer):
                    key = next(k for k, v in state.copies.items() if v == layer)
                    state.sending[key] += 1
                    part.sent_slot = key
                return layer
            self.allocate(state, ("W", layer, action.mb), layer, part.step, arriving=True)
            return None
        if op == ops.ALLGATHER_W:
            self.allocate(state, ("W", layer, action.mb), layer, part.step, arriving=True)
            return None
        return self.lend_accumulated(state, part, layer)  # REDUCE_G, REDUCESCATTER_G

    def complete(self, meeting: _Meeting) -> None:
        """Every member joined: each part is done; ring steps check what each rank takes."""
        meeting.done = True
        parts = {rank: part for rank, (part, _) in meeting.joined.items()}
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
        elif first.op == ops.REDUCESCATTER_G:
            layer = self.layer(first)
            total = sum((part.content for part in parts.values()), Counter())
            self.scattered.setdefault(layer, Counter()).update(total)
        elif first.op == ops.BCAST_W:
            if first.peer not in parts:
                raise self.error(MatchError, f"{first.text()} broadcasts from rank {first.peer}, not a member",
                                 next(iter(parts)), next(iter(parts.values())).step)
        for part in parts.values():
            part.done = True

    def strand(self, giver: _Part, partial) -> None:
        """A ring step passes a partial nowhere: it stays with its holder, who must own the layer."""
        layer, content = partial
        if not self.owns(giver.rank, layer):
            raise self.error(RouteError, f"{giver.action.text()}: the partial of layer {layer} this rank holds "
                             f"({_contributions_text(content)}) goes nowhere: the next rank takes no partial and "
                             f"this rank does not own layer {layer}", giver.rank, giver.step)
        self.ranks[giver.rank].accumulated.setdefault(layer, Counter()).update(content)

    # -- waits -------------------------------------------------------------------

    def wait(self, state: _Rank, action: Action) -> bool:
        number = action.mb
        if number not in state.open:
            raise self.error(MatchError, f"{action.text()} waits for exchange {number}, which this rank has not "
                             "posted (or already waited)", state.rank, state.pc)
        posted_at, parts = state.open[number]
        pending = [part for part in parts if not part.done]
        if pending:
            peers = sorted({part.action.peer for part in pending})
            state.waiting_on = ("wait", peers, pending[0].action)
            return False
        del state.open[number]
        for part in parts:
            self.arrive(state, part)
        return True

    def arrive(self, state: _Rank, part: _Part) -> None:
        """A part's effects on its rank once the exchange holding it is waited."""
        action = part.action
        op, layer = action.op, self.layer(action)
        if part.sent_slot is not None:
            if op in (ops.SHIFT_F, ops.SHIFT_B):
                self.release(state, part.sent_slot)
            else:
                state.sending[part.sent_slot] -= 1
        if op in (ops.SHIFT_F, ops.SHIFT_B, ops.RECV_W, ops.BCAST_W, ops.ALLGATHER_W):
            key = ((ops.PASS_OF_SLOT_OP[op], action.mb) if op in (ops.SHIFT_F, ops.SHIFT_B)
                   else ("W", layer, action.mb))
            if key in state.arriving:
                state.copies[key] = state.arriving.pop(key)
        elif op == ops.SHIFT_G:
            state.partial_arriving = False
            if part.peer_part is not None:
                state.partial = (part.peer_part[0], Counter(part.peer_part[1]))
        elif op == ops.RECV_G:
            if layer in state.in_flight:
                raise self.error(RouteError, f"{action.text()} adds the partial it received to layer {layer}'s, "
                                 f"which exchange {state.in_flight[layer]} is sending or reducing: the add races "
                                 "the transfer", state.rank, part.step)
            state.accumulated.setdefault(layer, Counter()).update(part.peer_part.content)
        elif op in (ops.SEND_G, ops.REDUCE_G, ops.REDUCESCATTER_G):
            if state.in_flight.get(layer) == part.exchange:
                del state.in_flight[layer]
                state.accumulated.pop(layer, None)
            if op == ops.REDUCE_G and isinstance(part.peer_part, Counter):  # the root takes the sum
                state.accumulated[layer] = part.peer_part

    # -- computes and drops ------------------------------------------------------

    def compute(self, state: _Rank, action: Action) -> None:
        pass_ = ops.WEIGHT_PASS.get(action.op)
        if not 0 <= action.stage < len(self.program.stages):
            return  # the well-formed check names it
        layer = self.layer(action)
        if pass_ is not None:
            self.need_weights(state, action, layer, pass_)
        if action.op in ops.GRADIENT_CONTRIBUTORS:
            self.contribute(state, action, layer)

    def need_weights(self, state: _Rank, action: Action, layer: int, pass_: str) -> None:
        if self.plan.route == "ring":
            slots = {key: v for key, v in state.copies.items() if key[0] == pass_}
            if layer in slots.values():
                return
            held = ", ".join(f"layer {v} (step {k[1]})" for k, v in sorted(slots.items())) or "nothing"
            raise self.error(RouteError, f"{action.text()} runs layer {layer} {pass_}, but this rank's {pass_} "
                             f"slot holds {held} here", state.rank, state.pc)
        if self.owns(state.rank, layer) or any(k[0] == "W" and v == layer for k, v in state.copies.items()):
            return
        coming = [k for k, v in state.arriving.items() if v == layer]
        why = (f"its copy (step {coming[0][2]}) is posted but not waited" if coming
               else "no copy of it is here")
        raise self.error(RouteError, f"{action.text()} runs layer {layer}, but this rank does not own it and "
                         f"{why}", state.rank, state.pc)

    def contribute(self, state: _Rank, action: Action, layer: int) -> None:
        contribution = (layer, action.mb)
        if self.plan.gradients == "ring":
            if state.partial_arriving:
                raise self.error(RouteError, f"{action.text()} adds to a gradient partial that has not arrived",
                                 state.rank, state.pc)
            if state.partial is None:
                state.partial = (layer, Counter())
            elif state.partial[0] != layer:
                raise self.error(RouteError, f"{action.text()} adds layer {layer}'s weight gradient, but the "
                                 f"gradient partial its ring slot holds is layer {state.partial[0]}'s",
                                 state.rank, state.pc)
            state.partial[1][contribution] += 1
            return
        if layer in state.in_flight:
            raise self.error(RouteError, f"{action.text()} adds layer {layer}'s weight gradient while exchange "
                             f"{state.in_flight[layer]} is sending or reducing that partial: the add races the "
                             "transfer (wait for the exchange first)", state.rank, state.pc)
        state.accumulated.setdefault(layer, Counter())[contribution] += 1

    def drop(self, state: _Rank, action: Action) -> None:
        key = ("W", self.layer(action), action.mb)
        if key not in state.copies:
            what = "still arriving (its exchange is not waited)" if key in state.arriving else "not held"
            raise self.error(RouteError, f"{action.text()} drops a copy that is {what}", state.rank, state.pc)
        if state.sending[key]:
            raise self.error(RouteError, f"{action.text()} drops {_copy_text(key, key[1])} while a send of it is "
                             "in flight: its buffer would be overwritten before the send completed",
                             state.rank, state.pc)
        self.release(state, key)

    # -- the end -----------------------------------------------------------------

    def finish(self) -> None:
        for state in self.ranks:
            if state.open:
                number, (posted_at, _) = next(iter(state.open.items()))
                raise self.error(MatchError, f"exchange {number} is never waited", state.rank, posted_at)
        for (src, dst), (sends, recvs) in self.channels.items():
            left = sends or recvs
            if left:
                part = left[0]
                raise self.error(MatchError, f"{part.action.text()} is never matched: rank "
                                 f"{dst if part.rank == src else src} posts no counterpart", part.rank, part.step)
        for state in self.ranks:
            if state.partial is not None:
                layer, content = state.partial
                if not self.owns(state.rank, layer):
                    raise self.error(RouteError, f"the gradient partial of layer {layer} "
                                     f"({_contributions_text(content)}) ends on this rank, which does not own it",
                                     state.rank, len(self.program.ranks[state.rank]) - 1)
                state.accumulated.setdefault(layer, Counter()).update(content)
        sharded = self.plan.owners is None
        for layer in sorted(set(self.expected) | {l for s in self.ranks for l in s.accumulated}):
            expected = self.expected.get(layer, Counter())
            for state in self.ranks:
                held = +state.accumulated.get(layer, Counter())
                if held and (sharded or not self.owns(state.rank, layer)):
                    raise self.error(RouteError, f"a partial of layer {layer}'s gradient "
                                     f"({_contributions_text(held)}) is left on this rank, which does not own "
                                     "the layer: it never reached the owner", state.rank,
                                     len(self.program.ranks[state.rank]) - 1)
            if sharded:
                got, where = +self.scattered.get(layer, Counter()), "the shards of every rank"
                at = 0
            else:
                owner = self.plan.owners[layer]
                got, where, at = +self.ranks[owner].accumulated.get(layer, Counter()), f"its owner rank {owner}", owner
            if got != expected:
                missing, twice = expected - got, got - expected
                problem = (f"lacks {_contributions_text(missing)}" if missing
                           else f"holds {_contributions_text(twice)} more than once")
                raise self.error(RouteError, f"layer {layer}'s weight gradient at {where} {problem}: every "
                                 "microbatch's contribution must be folded in exactly once",
                                 at, len(self.program.ranks[at]) - 1)

    def deadlock(self, stuck: list[_Rank]) -> DeadlockError:
        by_rank = {s.rank: s for s in stuck}
        lines, marks = [], []
        start = stuck[0]
        seen, state = [], start
        while state is not None and state.rank not in seen:
            seen.append(state.rank)
            what = state.waiting_on
            action = self.program.ranks[state.rank][state.pc]
            others = what[1] if what else []
            if what and what[0] == "collective":
                lines.append(f"rank {state.rank} (step {state.pc}) waits in {what[2].text()} for rank"
                             f"{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} to join")
            elif what:
                lines.append(f"rank {state.rank} (step {state.pc}) waits in {action.text()} for "
                             f"{what[2].text()} to meet rank {', '.join(map(str, others))}")
            else:
                lines.append(f"rank {state.rank} (step {state.pc}) is stuck at {action.text()}")
            marks.append((state.rank, state.pc))
            state = next((by_rank[r] for r in others if r in by_rank), None)
        return self.error(DeadlockError, "deadlock: " + "; ".join(lines), start.rank, start.pc, marks[1:])


_SHIFTS = (ops.SHIFT_F, ops.SHIFT_B, ops.SHIFT_G)


def _copy_text(key: tuple, layer) -> str:
    if key[0] == "W":
        return f"the copy of layer {layer} for step {key[2]}"
    return f"the {key[0]} slot of step {key[1]} (layer {layer})"


def _value_text(value: tuple) -> str:
    kind, layer, step = value
    return f"{ops.VALUE_KINDS[kind].words} of layer {layer} for step {step}"


def _partial_text(partial) -> str:
    return "no partial" if partial is None else f"the partial of layer {partial[0]}"


def _contributions_text(content: Counter) -> str:
    mbs = sorted(mb for (_layer, mb), count in content.items() for _ in range(count))
    return "microbatch" + ("es " if len(mbs) != 1 else " ") + ", ".join(map(str, mbs))


def _communicator_text(communicator) -> str:
    return f"communicator {communicator.id} ({communicator.purpose} {communicator.key}: ranks " \
           f"{', '.join(map(str, communicator.ranks))})"
