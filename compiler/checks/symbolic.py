"""The one symbolic run: every rank's communication posted, matched, met and waited at once.

``prove_exchanges(program)`` runs ``program`` under the strictest semantics the
runtime may meet (rendezvous messages, atomic batches, collectives as meetings
of their communicator), whatever families its ops come from. The engine owns
what every family shares; each family registers a ``Semantics`` saying what its
ops mean (``checks/weights.py``, ``checks/rings.py``, ``checks/placement.py``),
so one run proves a program that mixes them: a hazard that shows only when two
families' communication interleaves on one rank is named here or nowhere.

The contract, for every family:

* An exchange part sits inside an EXCHANGE (or, posted and waited at once, in
  an instruction its family inlines: ``Semantics.inline``), and a family of the
  program has code for it; every instruction is one of the program's families'.
* Point-to-point parts meet FIFO per ordered pair and carry the same value on
  both sides; the k-th collective of a communicator (``Program.communicator_on``)
  is the same (``Semantics.signature``) on every member, and only members join.
* Posting never blocks but for a collective its family marks blocking (one
  stream: two communicators met in different orders hang here as on NCCL); an
  EXCHANGE_WAIT blocks until its parts complete. An instruction a family makes
  a rendezvous (``Semantics.rendezvous``: a context-parallel stage's compute,
  whose attention runs a ring over the stage's group) is one operation of its
  communicator, counted with the collectives posted there (the ring's
  exchanges share the communicator with the stage's gradient reductions, and
  gloo, like NCCL, matches a communicator's operations by issue order): every
  member's k-th operation is the same, and the rank blocks until every member
  has reached it. Ranks that cannot finish are a ``DeadlockError`` naming the
  cycle of waits.
* At the end every exchange is waited and every part matched; then each
  family's own end checks (``Semantics.finish``).

Errors name the rank and step, with the program's grid.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Iterable

from pipec.compiler import ops
from pipec.compiler.family import families_of, first_answer
from pipec.compiler.ir import Action, Program
from pipec.errors import DeadlockError, MatchError, WellFormedError


class Part:
    """One posted part of an exchange: its rank, where it was posted, its action, and whether it completed."""

    __slots__ = ("rank", "step", "action", "exchange", "done", "content", "peer_part", "sent_slot", "inside",
                 "meeting", "words")

    def __init__(self, rank: int, step: int, action: Action, exchange: int, inside: Part | None = None):
        self.rank, self.step, self.action, self.exchange = rank, step, action, exchange
        self.inside = inside     # the collective a point-to-point part rides (an all_to_all), or None
        self.done = False
        self.content = None      # what a send carries (the family's: a layer, a Counter of contributions)
        self.peer_part = None    # the matching part of a point-to-point, or what a collective handed back
        self.sent_slot = None    # the family's key of a buffer this part sends from
        self.meeting = None      # a collective's meeting
        self.words = None        # a rendezvous instruction's stand-in: what it meets for, in words


class Meeting:
    """The k-th collective of a communicator: who joined, with which part and signature."""

    __slots__ = ("communicator", "k", "joined", "done")

    def __init__(self, communicator, k: int):
        self.communicator, self.k = communicator, k
        self.joined: dict[int, tuple[Part, tuple]] = {}
        self.done = False

    def parts(self) -> dict[int, Part]:
        return {rank: part for rank, (part, _) in self.joined.items()}

    def absent(self) -> list[int]:
        return [r for r in self.communicator.ranks if r not in self.joined]


class RankState:
    """One rank's progress through its list and its open exchanges (the families keep their holdings)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pc = 0
        self.part_index = 0               # inside an EXCHANGE being posted
        self.posting = -1                 # the step of the EXCHANGE being posted
        self.blocked: Part | None = None  # its blocking collective posted, not yet met
        self.open: dict[int, tuple[int, list[Part]]] = {}   # exchange -> (posted at, its parts)
        self.count: Counter = Counter()   # communicator id -> collectives joined
        self.waiting_on: tuple[Part, list[int]] | None = None   # for the deadlock report: (part, ranks)
        self.turn: Part | None = None     # the rendezvous instruction it joined its communicator's count with


class Semantics:
    """One family's meaning of its ops in the symbolic run; a family's prover module subclasses it.

    Attributes:
        family: the family (``ops.FAMILIES``) whose ops it gives meaning to.
        part_ops: the exchange parts it has code for (declared to ``tests/test_ops_table.py``).
        blocking: its collectives that hold the posting rank until every member joined.
        claims: parts of another family it gives its own meaning to where it applies (weight passing on
            a mesh: the owner's all-reduce of a layer's gradient over its data group, SYNC_GRAD); a subset
            of ``part_ops``.
    """

    family: str = ""
    part_ops: frozenset[str] = frozenset()
    blocking: frozenset[str] = frozenset()
    claims: frozenset[str] = frozenset()

    @classmethod
    def applies(cls, program: Program) -> bool:
        """Whether the family's ops in ``program`` need this run (activation passing's: only on rank groups)."""
        return True

    def inline(self, action: Action) -> tuple[Action, ...]:
        """The parts an instruction outside any exchange posts and waits at once (none: a plain step)."""
        return ()

    def __init__(self, run: SymbolicRun):
        self.run, self.program, self.error = run, run.program, run.error
        self.P = run.program.num_ranks

    def start(self) -> None:
        """Before any rank moves: the family's plan checked, what the end must show counted."""

    def step(self, state: RankState, action: Action) -> None:
        """A non-exchange instruction of ``state``'s rank (every family sees each one; most skip it)."""

    def rendezvous(self, action: Action, rank: int) -> tuple[int, str] | None:
        """Whether the non-exchange instruction ``action`` of ``rank`` is an operation of a communicator that
        every member runs (its signature, ``signature`` of its stand-in part, equal on every member):
        (the communicator's id, what it is in words), or None (a plain step)."""
        return None

    def post(self, state: RankState, part: Part) -> None:
        """A part of the family posted on its rank, before it is matched or met."""

    def value(self, action: Action) -> tuple:
        """What a point-to-point part carries, equal on both sides of a message."""
        return (ops.RULES[action.op].carries.kind, action.stage, action.mb)

    def value_text(self, value: tuple) -> str:
        kind, stage, mb = value
        return f"{ops.VALUE_KINDS[kind].words} of stage {stage} for step {mb}"

    def matched(self, send: Part, recv: Part) -> None:
        """A send met its receive: ``recv.content`` is set to what arrives."""
        recv.content = send.content

    def signature(self, part: Part) -> tuple:
        """What every member's k-th collective on a communicator must agree on."""
        return (part.action.op, part.action.mb)

    def complete(self, meeting: Meeting) -> None:
        """Every member joined a collective of the family (inner parts already matched)."""

    def arrive(self, state: RankState, part: Part) -> None:
        """A part's effects on its rank once the exchange holding it is waited."""

    def finish(self) -> None:
        """Every rank ended: the family's end checks."""

    def report(self):
        """What the run found, for the family's callers."""
        return None


_SEMANTICS: dict[str, type[Semantics]] = {}
# What an inlined instruction may post (a plain send or receive besides an exchange's parts), and the sends.
_INLINE_CATEGORIES = ops.EXCHANGE_PART_CATEGORIES + (ops.SEND, ops.RECV)
_SEND_CATEGORIES = (ops.PART_SEND, ops.SEND)


def register_semantics(semantics: type[Semantics]) -> type[Semantics]:
    """Make ``semantics`` the meaning of its family's ops in every symbolic run (a class decorator)."""
    _SEMANTICS[semantics.family] = semantics
    ops.declare_pass("prover", frozenset().union(*(s.part_ops for s in _SEMANTICS.values())),
                     leaves=tuple(c for c in ops.CATEGORIES if c not in ops.EXCHANGE_PART_CATEGORIES))
    return semantics


def proves_exchanges(program: Program) -> bool:
    """Whether any family of ``program`` gives meaning to exchanges (the symbolic run has work)."""
    return any(f.name in _SEMANTICS and _SEMANTICS[f.name].applies(program) for f in families_of(program))


def prove_exchanges(program: Program) -> dict[str, object]:
    """Run ``program`` symbolically (module docstring); family -> its semantics' report.

    Raises:
        MatchError, DeadlockError, RouteError, CoverageError, WellFormedError: the first violation found.
    """
    return SymbolicRun(program).run()


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _turn_text(part: Part) -> str:
    """How an operation of a communicator is named: its instruction, and a rendezvous's meaning."""
    return part.action.text() if part.words is None else f"{part.action.text()} ({part.words})"


def communicator_text(communicator) -> str:
    return (f"communicator {communicator.id} ({communicator.purpose} {communicator.key}: ranks "
            f"{', '.join(map(str, communicator.ranks))})")


class SymbolicRun:
    """The engine: per-rank progress, channels, meetings, waits, the deadlock cycle and the end."""

    def __init__(self, program: Program):
        self.program = program
        self.grid = None  # the program's grid, drawn once, when the first error needs it
        families = families_of(program)
        self.runs_ops_of = frozenset(name for f in families for name in f.runs_ops_of)
        self.family_names = [f.name for f in families]
        # the program's families, then those whose ops they run (activation passing's placed stages under
        # weight passing on a mesh), each where its semantics applies
        names = list(dict.fromkeys([f.name for f in families] + sorted(self.runs_ops_of)))
        self.semantics = [_SEMANTICS[name](self) for name in names
                          if name in _SEMANTICS and _SEMANTICS[name].applies(program)]
        self.of_family = {s.family: s for s in self.semantics}
        self.claimed = {op: s for s in self.semantics for op in s.claims}
        self.ranks = [RankState(r) for r in range(program.num_ranks)]
        self.channels: dict[tuple[int, int], tuple[deque, deque]] = {}
        self.meetings: dict[tuple[int, int], Meeting] = {}
        # A family whose schedules write steps of their own (a ring's `at step`): the list index is an "instruction".
        self.writes_steps = [family for family in families if family.writes_own_steps]
        self.index_word = "instruction" if self.writes_steps else "step"

    def error(self, cls, message: str, rank: int, step: int, marks=()):
        """A ``cls`` (a ``ProgramError``) at (rank, step), with the program's grid (and a ring's step)."""
        if self.grid is None:
            self.grid = self.program.grid()
        error = cls(message, rank, step, self.grid, marks)
        error.index_word = self.index_word
        if self.writes_steps and 0 <= rank < len(self.program.ranks):
            error.written_step = first_answer(self.writes_steps,
                                              lambda family: family.written_step(self.program, rank, step))
        return error

    def end_of(self, rank: int) -> int:
        return max(len(self.program.ranks[rank]) - 1, 0)

    # -- driver ------------------------------------------------------------------

    def run(self) -> dict[str, object]:
        for semantics in self.semantics:
            semantics.start()
        moved = True
        while moved:
            moved = False
            for state in self.ranks:
                if self.advance(state):
                    moved = True
        stuck = [state for state in self.ranks if state.pc < len(self.program.ranks[state.rank])]
        if stuck:
            raise self.mixed_batching() or self.deadlock(stuck)
        self.finish()
        return {s.family: s.report() for s in self.semantics}

    def advance(self, state: RankState) -> bool:
        """Run ``state``'s rank until it blocks or ends; whether it moved."""
        row = self.program.ranks[state.rank]
        start = (state.pc, state.part_index)
        while state.pc < len(row):
            action = row[state.pc]
            rule = ops.RULES.get(action.op)
            if rule is None:
                raise self.error(WellFormedError, f"unknown op {action.op!r}", state.rank, state.pc)
            if rule.category == ops.EXCHANGE_OF:
                if not self.post(state, action):
                    break
            elif rule.category == ops.EXCHANGE_WAIT_OF:
                if not self.wait(state, action):
                    break
            elif rule.category in ops.EXCHANGE_PART_CATEGORIES:
                raise self.error(MatchError, f"{action.text()} stands outside an exchange: a part of an exchange "
                                 "sits inside an EXCHANGE, where both sides of a message are posted alike",
                                 state.rank, state.pc)
            elif rule.family not in self.runs_ops_of:
                raise self.error(WellFormedError, f"{action.text()} is an instruction of {rule.family}, which "
                                 f"this program ({', '.join(self.family_names)}) does not run", state.rank, state.pc)
            else:
                if not self.meet(state, action) or not self.post_inline(state, action):
                    break
                for semantics in self.semantics:
                    semantics.step(state, action)
            state.pc += 1
            state.part_index = 0
            state.waiting_on = None
        return (state.pc, state.part_index) != start

    # -- exchanges ---------------------------------------------------------------

    def post(self, state: RankState, action: Action) -> bool:
        """Post the parts of an EXCHANGE from where the rank stopped; False while a blocking collective waits."""
        number = action.mb
        if state.posting != state.pc:  # not resuming a blocked post
            if number in state.open:
                raise self.error(MatchError, f"exchange {number} is posted again before it was waited",
                                 state.rank, state.pc)
            state.open[number] = (state.pc, [])
            state.posting = state.pc
        return self.post_parts(state, number, action.parts)

    def meet(self, state: RankState, action: Action) -> bool:
        """Whether ``state``'s rank may run ``action``: not a rendezvous, or every member of its communicator
        reached it as the same operation of the communicator's count (``Semantics.rendezvous``)."""
        part = state.turn
        if part is None or part.step != state.pc:
            found = next(((s, found) for s in self.semantics for found in (s.rendezvous(action, state.rank),)
                          if found), None)
            if found is None:
                return True
            semantics, (communicator_id, words) = found
            part = Part(state.rank, state.pc, action, -1)
            part.words, state.turn = words, part
            self.take_turn(state, self.program.communicators[communicator_id], part, semantics.signature(part))
        absent = part.meeting.absent()
        if absent:
            state.waiting_on = (part, absent)
            return False
        part.meeting.done = part.done = True
        return True

    def post_inline(self, state: RankState, action: Action) -> bool:
        """An instruction whose family inlines parts (a message of a placed stage, a compute's sub-steps):
        its parts posted in order, then waited, before the instruction itself; False while they wait."""
        actions = next((found for found in (s.inline(action) for s in self.semantics) if found), ())
        if not actions:
            return True
        number = -1 - state.pc  # an exchange of its own, numbered apart from every EXCHANGE's
        if state.posting != state.pc:
            state.open[number] = (state.pc, [])
            state.posting = state.pc
        return self.post_parts(state, number, actions) and self.complete(state, number)

    def post_parts(self, state: RankState, number: int, actions: tuple[Action, ...]) -> bool:
        """Post ``actions`` into open exchange ``number`` from where the rank stopped."""
        parts = state.open[number][1]
        while state.part_index < len(actions):
            part, state.blocked = state.blocked, None
            if part is None:
                part = self.post_part(state, actions[state.part_index], number, parts)
            if part.action.op in self.semantics_of(part).blocking and not part.done:
                state.blocked = part
                state.waiting_on = (part, part.meeting.absent())
                return False
            state.part_index += 1
        return True

    def semantics_of(self, part: Part) -> Semantics:
        action = part.action
        rule = ops.RULES.get(action.op)
        semantics = self.claimed.get(action.op) or (self.of_family.get(rule.family) if rule is not None else None)
        categories = ops.EXCHANGE_PART_CATEGORIES if part.exchange >= 0 else _INLINE_CATEGORIES
        if rule is None or rule.category not in categories or semantics is None \
                or action.op not in semantics.part_ops:
            raise self.error(MatchError, f"{action.text()} cannot be part of an exchange of this program: an "
                             f"exchange may only hold sends, receives, collectives and copies of its families "
                             f"({', '.join(self.family_names)})", part.rank, part.step)
        return semantics

    def post_part(self, state: RankState, action: Action, number: int, parts: list[Part]) -> Part:
        part = Part(state.rank, state.pc, action, number)
        semantics = self.semantics_of(part)
        parts.append(part)
        category = ops.RULES[action.op].category
        if category == ops.PART_COLLECTIVE:
            inner = [Part(state.rank, state.pc, p, number, inside=part) for p in action.parts]
            for p in inner:
                if ops.RULES.get(p.action.op) is None or \
                        ops.RULES[p.action.op].category not in (ops.PART_SEND, ops.PART_RECV):
                    raise self.error(MatchError, f"{action.text()} holds {p.action.text()}, which no collective "
                                     "moves: it may only hold sends and receives", state.rank, state.pc)
                self.semantics_of(p).post(state, p)
                self.check_peer(p)
            parts.extend(inner)
            self.join(state, part, semantics)
        elif category == ops.PART_LOCAL:
            semantics.post(state, part)
            part.done = True
        else:
            self.check_peer(part)
            semantics.post(state, part)
            self.post_p2p(part)
        return part

    def check_peer(self, part: Part) -> None:
        peer = part.action.peer
        if not 0 <= peer < len(self.ranks) or peer == part.rank:
            raise self.error(MatchError, f"{part.action.text()}: peer {peer} is no other rank of the program",
                             part.rank, part.step)

    def post_p2p(self, part: Part) -> None:
        is_send = ops.RULES[part.action.op].category in _SEND_CATEGORIES
        peer = part.action.peer
        sends, recvs = self.channels.setdefault((part.rank, peer) if is_send else (peer, part.rank),
                                                (deque(), deque()))
        mine, theirs = (sends, recvs) if is_send else (recvs, sends)
        if theirs:
            other = theirs.popleft()
            self.match(part if is_send else other, other if is_send else part)
        else:
            mine.append(part)

    def match(self, send: Part, recv: Part) -> None:
        semantics = self.semantics_of(send)
        value_send, value_recv = semantics.value(send.action), self.semantics_of(recv).value(recv.action)
        if value_send != value_recv:
            raise self.error(
                MatchError, f"{recv.action.text()} from rank {send.rank} gets {send.action.text()} (rank "
                f"{send.rank}, {self.index_word} {send.step}): messages are matched in order per pair of ranks, "
                f"and these carry different values ({semantics.value_text(value_send)} against "
                f"{semantics.value_text(value_recv)})", recv.rank, recv.step, [(send.rank, send.step)])
        send.peer_part, recv.peer_part = recv, send
        semantics.matched(send, recv)
        send.done = recv.done = True

    # -- collectives -------------------------------------------------------------

    def join(self, state: RankState, part: Part, semantics: Semantics) -> None:
        action = part.action
        communicator = self.program.communicator_on(action, state.rank)
        if communicator is None or state.rank not in communicator.ranks:
            raise self.error(MatchError, f"{action.text()} meets on no communicator of the program that has rank "
                             f"{state.rank}", state.rank, part.step)
        meeting = self.take_turn(state, communicator, part, semantics.signature(part))
        semantics.post(state, part)  # what the member brings, taken once its place in the order is proven
        if len(meeting.joined) == len(communicator.ranks):
            self.match_inside(meeting)
            meeting.done = True
            semantics.complete(meeting)
            for member in meeting.parts().values():
                member.done = True

    def take_turn(self, state: RankState, communicator, part: Part, signature: tuple) -> Meeting:
        """``part`` joins its rank's next operation on ``communicator``: the same (``signature``) as every other
        member's operation of that count, or a ``MatchError`` naming the first disagreement."""
        k = state.count[communicator.id]
        state.count[communicator.id] += 1
        meeting = self.meetings.setdefault((communicator.id, k), Meeting(communicator, k))
        part.meeting = meeting
        for other, (other_part, other_signature) in meeting.joined.items():
            if other_signature != signature:
                raise self.error(
                    MatchError, f"the {_ordinal(k + 1)} collective on {communicator_text(communicator)} is "
                    f"{_turn_text(part)} here but {_turn_text(other_part)} on rank {other} ({self.index_word} "
                    f"{other_part.step}): every member must meet its collectives in the same order",
                    state.rank, part.step, [(other, other_part.step)])
            break
        meeting.joined[state.rank] = (part, signature)
        return meeting

    def match_inside(self, meeting: Meeting) -> None:
        """Inside one collective (an all_to_all): every send meets its peer's receive from this rank, in order."""
        inner = {rank: [p for p in self.ranks[rank].open[part.exchange][1] if p.inside is part]
                 for rank, part in meeting.parts().items()}
        for rank, mine in inner.items():
            for send in (p for p in mine if ops.RULES[p.action.op].category == ops.PART_SEND):
                peer = send.action.peer
                takers = [p for p in inner.get(peer, ()) if ops.RULES[p.action.op].category == ops.PART_RECV
                          and p.action.peer == rank and not p.done]
                if not takers:
                    raise self.error(MatchError, f"rank {rank}'s {meeting.parts()[rank].action.op} sends "
                                     f"{send.action.text()} to rank {peer}, whose takes nothing more from rank "
                                     f"{rank}: both sides of a message must move it alike", rank, send.step,
                                     [(peer, meeting.parts()[peer].step)] if peer in inner else [])
                self.match(send, takers[0])
        for rank, mine in inner.items():
            left = next((p for p in mine if not p.done), None)
            if left is not None:
                raise self.error(MatchError, f"rank {rank}'s {meeting.parts()[rank].action.op} expects "
                                 f"{left.action.text()} from rank {left.action.peer}, whose does not send it: both "
                                 "sides of a message must move it alike", rank, left.step)

    # -- waits -------------------------------------------------------------------

    def wait(self, state: RankState, action: Action) -> bool:
        number = action.mb
        if number not in state.open:
            raise self.error(MatchError, f"{action.text()} waits for exchange {number}, which this rank has not "
                             "posted (or already waited)", state.rank, state.pc)
        return self.complete(state, number)

    def complete(self, state: RankState, number: int) -> bool:
        """Whether every part of open exchange ``number`` completed (then each arrives); else the rank waits."""
        _, parts = state.open[number]
        pending = [part for part in parts if not part.done]
        if pending:
            others = set()
            for part in pending:
                others.update(part.meeting.absent() if part.meeting is not None else (part.action.peer,))
            first = next((p for p in pending if p.inside is None), pending[0])
            state.waiting_on = (first, sorted(others))
            return False
        del state.open[number]
        for part in parts:
            self.semantics_of(part).arrive(state, part)
        return True

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
        for semantics in self.semantics:
            semantics.finish()

    def mixed_batching(self) -> MatchError | None:
        """A message one side posts point to point and the other inside a collective (an all_to_all).

        Neither side ever completes, so the run stops as a deadlock would; its
        cause is a matching one, named here at the point-to-point side with the
        other side's collective marked.
        """
        for state in self.ranks:
            for _, parts in state.open.values():
                for part in parts:
                    if part.done or part.inside is not None or part.meeting is not None:
                        continue
                    other = self.inner_counterpart(part)
                    if other is not None:
                        return self.error(
                            MatchError, f"{part.action.text()} on rank {part.rank} is a point-to-point message, but "
                            f"rank {other.rank} moves its side, {other.action.text()}, inside "
                            f"{other.inside.action.text()} ({self.index_word} {other.step}): both sides of a "
                            "message must move it alike", part.rank, part.step, [(other.rank, other.step)])
        return None

    def inner_counterpart(self, part: Part) -> Part | None:
        """The pending part inside a peer's collective that would take (or give) ``part``'s message, if any."""
        rule = ops.RULES[part.action.op]
        if rule.category not in (ops.PART_SEND, ops.PART_RECV):
            return None
        peer, is_send = part.action.peer, rule.category == ops.PART_SEND
        if not 0 <= peer < len(self.ranks):
            return None
        for _, parts in self.ranks[peer].open.values():
            for other in parts:
                if other.inside is not None and not other.done and other.action.peer == part.rank \
                        and (ops.RULES[other.action.op].category == ops.PART_SEND) != is_send:
                    return other
        return None

    def deadlock(self, stuck: list[RankState]) -> DeadlockError:
        by_rank = {s.rank: s for s in stuck}
        lines, marks = [], []
        start = stuck[0]
        seen, state = [], start
        while state is not None and state.rank not in seen:
            seen.append(state.rank)
            action = self.program.ranks[state.rank][state.pc]
            part, others = state.waiting_on or (None, [])
            if part is None:
                lines.append(f"rank {state.rank} ({self.index_word} {state.pc}) is stuck at {action.text()}")
            elif part.words is not None:
                lines.append(f"rank {state.rank} ({self.index_word} {state.pc}) waits in {action.text()} for "
                             f"{_ranks_text(others)} to join {part.words}")
            elif part.meeting is not None:
                lines.append(f"rank {state.rank} ({self.index_word} {state.pc}) waits in {action.text()} for "
                             f"{_ranks_text(others)} to join {part.action.text()}")
            else:
                lines.append(f"rank {state.rank} ({self.index_word} {state.pc}) waits in {action.text()} for "
                             f"{part.action.text()} to meet {_ranks_text(others)}")
            marks.append((state.rank, state.pc))
            state = next((by_rank[r] for r in others if r in by_rank), None)
        return self.error(DeadlockError, "deadlock: " + "; ".join(lines), start.rank, start.pc, marks[1:])
