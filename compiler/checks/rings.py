"""Sequence rings' proof: run the program symbolically, every block, bundle and partial tracked.

``check_rings(program)`` runs a sequence-ring program (``Program.rings`` set;
ring, zigzag, TASP attention) on every rank at once, under the strictest
semantics the runtime may meet, and proves what the lists promise:

* **Mask coverage.** Every block the mask leaves visible (a query chunk
  against a KV piece: ``RingPlan.visible``) is computed exactly once forward
  (AF) and once backward (AB), on the rank holding its queries; no fully
  masked block is computed; no backward block of a query chunk runs before
  every forward block of that chunk (its backward needs the global output and
  log-sum-exp). ``CoverageError``.
* **Route consistency and buffer slots.** A block finds its KV bundle on its
  rank when it runs (its own, or one delivered by a waited exchange and not yet
  replaced); a rank sends only bundles it holds; under ``kv again`` a
  delivered bundle replaces the rank's previous one of its piece, which must
  not be in flight (a stale buffer reused while its send runs: the public
  code's silent corruption), and at most two received buffers per piece are
  alive (the one read and the one arriving). ``RouteError``.
* **Reduction completeness.** dQ stays on its query's rank (AB runs there);
  each AB adds its block's dK, dV to the rank's partial of the bundle; a
  received partial is added at its wait; a rank never sends its partial of a
  bundle while another partial of that bundle is arriving (that one would be
  left behind); at the end every bundle's home holds each contribution exactly
  once and no partial is left on another rank. ``RouteError``.
* **Matching.** Point-to-point parts meet FIFO per ordered pair and carry the
  same value (KV or dKV of one bundle); the k-th all_to_all is the same on
  every rank, and inside it every send meets the receive of its peer; both
  sides of a message move it alike (a send inside an all_to_all against a
  point-to-point receive is an error, the hang of mixed batching), and every
  part sits inside an exchange. ``MatchError``.
* **Deadlock freedom.** An EXCHANGE posts and goes on; its EXCHANGE_WAIT
  blocks until every part completed: a point-to-point part when both sides
  are posted (rendezvous), an all_to_all when every rank joined. A program
  that cannot finish is a ``DeadlockError`` naming the cycle of waits.

Each error names the rank, the instruction (step) and the block or bundle.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import NamedTuple

from pipec.compiler import ops
from pipec.compiler.checks.symbolic import SymbolicRun
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import kv_buffer_counts
from pipec.errors import CoverageError, DeadlockError, MatchError, RouteError, WellFormedError

ops.declare_pass("sequence rings", ops.OPS)  # runs the ring ops; any other op is refused by name

_SEND_OF = {ops.RECV_KV: ops.SEND_KV, ops.RECV_DKV: ops.SEND_DKV}
_P2P = frozenset((ops.SEND_KV, ops.RECV_KV, ops.SEND_DKV, ops.RECV_DKV))
_SENDS = frozenset((ops.SEND_KV, ops.SEND_DKV))
_ALLTOALL = frozenset((ops.ALLTOALL_KV, ops.ALLTOALL_DKV))


class RingReport(NamedTuple):
    """What running the program found.

    Attributes:
        peak_kv_buffers: per rank, the most received KV bundles alive at once (its own not counted).
        blocks: the visible blocks, each computed once forward and once backward.
    """

    peak_kv_buffers: list[int]
    blocks: int


def check_rings(program: Program) -> RingReport:
    """Prove a sequence-ring program (module docstring).

    Raises:
        CoverageError, RouteError, MatchError, DeadlockError, WellFormedError: the first violation found.
    """
    return _Run(program).run()


def block_text(plan, q: int, block: int) -> str:
    kv, piece = plan.unblock(block)
    return f"block (query chunk {q}, kv chunk {kv}, piece {piece})"


def _bundle_text(bundle: tuple[int, int]) -> str:
    return f"rank {bundle[0]}'s KV bundle of piece {bundle[1]}"


class _Part:
    __slots__ = ("rank", "step", "action", "exchange", "done", "content", "inside")

    def __init__(self, rank: int, step: int, action: Action, exchange: int, inside: str | None):
        self.rank, self.step, self.action, self.exchange = rank, step, action, exchange
        self.inside = inside      # the all_to_all op it rides, or None (point to point)
        self.done = False
        self.content = None       # a dKV send's partial (a Counter of contributions)


class _Rank:
    def __init__(self, rank: int, pieces: int):
        self.rank = rank
        self.pc = 0
        self.open: dict[int, list[_Part]] = {}
        self.received: dict[int, tuple[int, int] | None] = {p: None for p in range(pieces)}  # again: per piece
        self.kept: set[tuple[int, int]] = set()
        self.sending: Counter = Counter()      # bundle -> KV sends in flight
        self.partials: dict[tuple[int, int], Counter] = {}
        self.incoming: Counter = Counter()     # bundle -> dKV receives posted, not waited
        self.waiting_on = None


class _Run(SymbolicRun):
    def __init__(self, program: Program):
        super().__init__(program)
        self.plan = plan = program.rings
        self.P = program.num_ranks
        self.ranks = [_Rank(r, plan.pieces) for r in range(self.P)]
        self.channels: dict[tuple[int, int], tuple[deque, deque]] = {}
        self.meetings: dict[int, dict[int, _Part]] = {}
        self.joined: Counter = Counter()
        self.forward: dict[int, set[int]] = {q: set() for q in range(plan.chunks)}
        self.backward: dict[int, set[int]] = {q: set() for q in range(plan.chunks)}
        self.expected = {q: {plan.block(kv, p) for kv in range(plan.chunks) for p in range(plan.pieces)
                             if plan.visible(q, kv, p)} for q in range(plan.chunks)}

    # -- driver ------------------------------------------------------------------

    def run(self) -> RingReport:
        if len(self.program.ranks) != self.P or any(len(ring) != self.P or sorted(ring) != list(range(self.P))
                                                   for ring in self.plan.rings):
            raise self.error(WellFormedError, "every ring must visit each of the program's ranks once", 0, 0)
        self.execute(self.ranks)
        return RingReport(self.buffers(), sum(len(b) for b in self.expected.values()))

    def advance(self, state: _Rank) -> bool:
        row = self.program.ranks[state.rank]
        start = state.pc
        while state.pc < len(row):
            action = row[state.pc]
            rule = ops.RULES.get(action.op)
            if rule is None:
                raise self.error(WellFormedError, f"unknown op {action.op!r}", state.rank, state.pc)
            if action.op == ops.EXCHANGE:
                self.post(state, action)
            elif action.op == ops.EXCHANGE_WAIT:
                if not self.wait(state, action):
                    break
            elif action.op in ops.RING_COMPUTE_OPS:
                self.compute(state, action)
            elif action.op in ops.RING_PART_OPS:
                raise self.error(MatchError, f"{action.text()} stands outside an exchange: both sides of a "
                                 "message are posted alike, inside an EXCHANGE", state.rank, state.pc)
            else:
                raise self.error(WellFormedError, f"{action.text()} is not an instruction of the sequence ring "
                                 "family", state.rank, state.pc)
            state.pc += 1
        return state.pc != start

    # -- exchanges ---------------------------------------------------------------

    def post(self, state: _Rank, action: Action) -> None:
        if action.mb in state.open:
            raise self.error(MatchError, f"exchange {action.mb} is posted again before its wait", state.rank, state.pc)
        parts: list[_Part] = []
        state.open[action.mb] = parts
        for part in action.parts:
            if part.op in _ALLTOALL:
                collective = _Part(state.rank, state.pc, part, action.mb, None)
                parts.append(collective)
                for inner in part.parts:
                    if inner.op not in _P2P:
                        raise self.error(MatchError, f"{part.text()} holds {inner.text()}, which no all_to_all "
                                         "moves", state.rank, state.pc)
                    parts.append(self.post_part(state, _Part(state.rank, state.pc, inner, action.mb, part.op)))
                self.join(state, collective)
            elif part.op in _P2P:
                parts.append(self.post_part(state, _Part(state.rank, state.pc, part, action.mb, None)))
            else:
                raise self.error(MatchError, f"{part.text()} cannot be part of a sequence ring's exchange",
                                 state.rank, state.pc)

    def post_part(self, state: _Rank, part: _Part) -> _Part:
        action, plan = part.action, self.plan
        bundle = (action.stage, action.mb)
        if not (0 <= action.stage < self.P and 0 <= action.mb < plan.pieces and 0 <= action.peer < self.P) \
                or action.peer == state.rank:
            raise self.error(MatchError, f"{action.text()} names no bundle of this program or no other rank "
                             f"(peer {action.peer})", state.rank, state.pc)
        if action.op == ops.SEND_KV:
            if not self.holds(state, bundle):
                raise self.error(RouteError, f"{action.text()} sends {_bundle_text(bundle)}, which this rank does "
                                 "not hold now", state.rank, state.pc)
            state.sending[bundle] += 1
        elif action.op == ops.SEND_DKV:
            if state.incoming[bundle]:
                raise self.error(RouteError, f"{action.text()} sends this rank's partial of {_bundle_text(bundle)} "
                                 "while another partial of it is still arriving: that one would be left "
                                 "behind, its contributions lost", state.rank, state.pc)
            part.content = state.partials.pop(bundle, Counter())
        elif action.op == ops.RECV_DKV:
            state.incoming[bundle] += 1
        if part.inside is None:
            sender, receiver = (state.rank, action.peer) if action.op in _SENDS else (action.peer, state.rank)
            sends, recvs = self.channels.setdefault((sender, receiver), (deque(), deque()))
            (sends if action.op in _SENDS else recvs).append(part)
            self.match(sends, recvs)
        return part

    def match(self, sends: deque, recvs: deque) -> None:
        while sends and recvs:
            send, recv = sends.popleft(), recvs.popleft()
            if _SEND_OF[recv.action.op] != send.action.op or (send.action.stage, send.action.mb) != \
                    (recv.action.stage, recv.action.mb):
                raise self.error(MatchError, f"{recv.action.text()} from rank {send.rank} meets {send.action.text()}"
                                 f" (instruction {send.step} of rank {send.rank}): the messages between the two "
                                 "ranks are out of order or not the same value", recv.rank, recv.step,
                                 [(send.rank, send.step)])
            recv.content = send.content
            send.done = recv.done = True

    def join(self, state: _Rank, collective: _Part) -> None:
        k = self.joined[state.rank]
        self.joined[state.rank] += 1
        meeting = self.meetings.setdefault(k, {})
        meeting[state.rank] = collective
        if len(meeting) < self.P:
            return
        first = meeting[0]
        for rank, part in meeting.items():
            if (part.action.op, part.action.mb) != (first.action.op, first.action.mb):
                raise self.error(MatchError, f"the {k + 1}th all_to_all is {part.action.op} {part.action.mb} on rank "
                                 f"{rank} but {first.action.op} {first.action.mb} on rank 0", rank, part.step,
                                 [(0, first.step)])
        self.match_inside(meeting)
        for part in meeting.values():
            part.done = True

    def match_inside(self, meeting: dict[int, _Part]) -> None:
        """Inside one all_to_all: every send meets its peer's receive from this rank, in order."""
        parts = {rank: [p for p in self.ranks[rank].open[part.exchange] if p.inside is not None]
                 for rank, part in meeting.items()}
        for rank, mine in parts.items():
            for send in (p for p in mine if p.action.op in _SENDS):
                peer = send.action.peer
                takers = [p for p in parts[peer] if p.action.op not in _SENDS and p.action.peer == rank
                          and not p.done]
                if not takers:
                    raise self.error(MatchError, f"rank {rank}'s all_to_all sends {send.action.text()} to rank {peer}, "
                                     f"whose all_to_all takes nothing more from rank {rank}: both sides of a message "
                                     "must move it alike", rank, send.step, [(peer, meeting[peer].step)])
                recv = takers[0]
                if _SEND_OF[recv.action.op] != send.action.op or \
                        (send.action.stage, send.action.mb) != (recv.action.stage, recv.action.mb):
                    raise self.error(MatchError, f"inside the all_to_all, rank {peer}'s {recv.action.text()} from "
                                     f"rank {rank} meets its {send.action.text()}", peer, recv.step, [(rank, send.step)])
                recv.content = send.content
                send.done = recv.done = True
        for rank, mine in parts.items():
            left = next((p for p in mine if not p.done), None)
            if left is not None:
                raise self.error(MatchError, f"rank {rank}'s all_to_all expects {left.action.text()} from rank "
                                 f"{left.action.peer}, whose all_to_all does not send it: both sides of a message "
                                 "must move it alike", rank, left.step)

    def wait(self, state: _Rank, action: Action) -> bool:
        parts = state.open.get(action.mb)
        if parts is None:
            raise self.error(MatchError, f"{action.text()} waits for exchange {action.mb}, which this rank has not "
                             "posted (or already waited)", state.rank, state.pc)
        pending = [p for p in parts if not p.done]
        if pending:
            state.waiting_on = pending[0]
            return False
        state.waiting_on = None
        del state.open[action.mb]
        for part in parts:
            self.complete(state, part)
        return True

    def complete(self, state: _Rank, part: _Part) -> None:
        action = part.action
        bundle = (action.stage, action.mb)
        if action.op == ops.SEND_KV:
            state.sending[bundle] -= 1
        elif action.op == ops.RECV_KV:
            self.deliver(state, bundle)
        elif action.op == ops.RECV_DKV:
            state.incoming[bundle] -= 1
            state.partials.setdefault(bundle, Counter()).update(part.content or Counter())

    def deliver(self, state: _Rank, bundle: tuple[int, int]) -> None:
        if bundle[0] == state.rank:
            return
        if self.plan.kv == "kept":
            state.kept.add(bundle)
        else:
            old = state.received[bundle[1]]
            if old is not None and state.sending[old]:
                raise self.error(RouteError, f"{_bundle_text(bundle)} arrives into the buffer of "
                                 f"{_bundle_text(old)} while that one is still being sent: a stale buffer "
                                 "reused", state.rank, state.pc)
            state.received[bundle[1]] = bundle

    def holds(self, state: _Rank, bundle: tuple[int, int]) -> bool:
        return bundle[0] == state.rank or bundle in state.kept or state.received.get(bundle[1]) == bundle

    def buffers(self) -> list[int]:
        """Peak received KV bundles per rank (``memory_counts.kv_buffer_counts``, the count ``simulate``
        reports in bytes); under ``kv again`` at most two per piece: the one read and the one arriving."""
        plan, peaks = self.plan, []
        bound = None if plan.kv == "kept" else 2 * plan.pieces
        for rank, row in enumerate(self.program.ranks):
            peak = 0
            for step, live in enumerate(kv_buffer_counts(row, rank, plan.kv == "kept")):
                if bound is not None and live > bound:
                    raise self.error(RouteError, f"{live} received KV bundles are alive here, more than the two "
                                     f"buffers per piece a ring keeps ({bound}: one read, one arriving)", rank, step)
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    # -- blocks ------------------------------------------------------------------

    def compute(self, state: _Rank, action: Action) -> None:
        plan, q = self.plan, action.stage
        if not (0 <= q < plan.chunks and 0 <= action.mb < plan.chunks * plan.pieces):
            raise self.error(WellFormedError, f"{action.text()} names no block of {plan.chunks} chunks of "
                             f"{plan.pieces} pieces", state.rank, state.pc)
        what = block_text(plan, q, action.mb)
        if plan.holders[q] != state.rank:
            raise self.error(RouteError, f"{action.text()}: the {what} runs on rank {state.rank}, but the queries of "
                             f"chunk {q} live on rank {plan.holders[q]}", state.rank, state.pc)
        kv, piece = plan.unblock(action.mb)
        bundle = (plan.holders[kv], piece)
        if not plan.visible(q, kv, piece):
            raise self.error(CoverageError, f"{action.text()}: the {what} is masked out entirely; it must not be "
                             "computed", state.rank, state.pc)
        if not self.holds(state, bundle):
            raise self.error(RouteError, f"{action.text()}: the {what} needs {_bundle_text(bundle)}, which this rank "
                             "does not hold now", state.rank, state.pc)
        if action.op == ops.AF:
            if action.mb in self.forward[q]:
                raise self.error(CoverageError, f"{action.text()}: the {what} is computed twice forward",
                                 state.rank, state.pc)
            if self.backward[q]:
                raise self.error(CoverageError, f"{action.text()}: the {what} runs forward after a backward block of "
                                 f"chunk {q}, which used an output without it", state.rank, state.pc)
            self.forward[q].add(action.mb)
            return
        if action.mb in self.backward[q]:
            raise self.error(CoverageError, f"{action.text()}: the {what} is computed twice backward",
                             state.rank, state.pc)
        missing = sorted(self.expected[q] - self.forward[q])
        if missing:
            raise self.error(CoverageError, f"{action.text()}: the {what} runs backward before the forward of "
                             f"{block_text(plan, q, missing[0])}: a backward block needs its queries' global output "
                             "and log-sum-exp", state.rank, state.pc)
        self.backward[q].add(action.mb)
        state.partials.setdefault(bundle, Counter())[(q, kv, piece)] += 1

    # -- the end -----------------------------------------------------------------

    def finish(self) -> None:
        plan = self.plan
        for state in self.ranks:
            if state.open:
                number = next(iter(state.open))
                raise self.error(MatchError, f"exchange {number} is never waited", state.rank,
                                 len(self.program.ranks[state.rank]) - 1)
        for q in range(plan.chunks):
            rank = plan.holders[q]
            end = max(len(self.program.ranks[rank]) - 1, 0)
            for done, words in ((self.forward[q], "forward"), (self.backward[q], "backward")):
                missing = sorted(self.expected[q] - done)
                if missing:
                    raise self.error(CoverageError, f"the {block_text(plan, q, missing[0])} is never computed "
                                     f"{words} ({len(missing)} visible block{'s' if len(missing) > 1 else ''} of "
                                     f"chunk {q} missing)", rank, end)
        for state in self.ranks:
            end = max(len(self.program.ranks[state.rank]) - 1, 0)
            for bundle, partial in state.partials.items():
                if bundle[0] != state.rank and +partial:
                    q, kv, piece = next(iter(partial))
                    raise self.error(RouteError, f"the dK, dV partial of {_bundle_text(bundle)} is left on rank "
                                     f"{state.rank}, never sent home (it holds {sum(partial.values())} "
                                     f"contributions, e.g. of {block_text(plan, q, plan.block(kv, piece))})",
                                     state.rank, end)
        for state in self.ranks:
            end = max(len(self.program.ranks[state.rank]) - 1, 0)
            for piece in range(plan.pieces):
                bundle = (state.rank, piece)
                have = state.partials.get(bundle, Counter())
                want = Counter((q, kv, piece) for kv in plan.chunks_of(state.rank) for q in range(plan.chunks)
                               if plan.visible(q, kv, piece))
                for key in sorted(set(have) | set(want)):
                    if have[key] != want[key]:
                        got = "never reaches home" if have[key] == 0 else f"is folded in {have[key]} times"
                        raise self.error(RouteError, f"the dK, dV of {block_text(plan, key[0], plan.block(key[1], key[2]))} "
                                         f"{got} (rank {state.rank}'s {_bundle_text(bundle)} partial)",
                                         state.rank, end)

    def deadlock(self, stuck: list[_Rank]) -> DeadlockError:
        by_rank = {s.rank: s for s in stuck}
        lines, marks = [], []
        state, seen = stuck[0], []
        while state is not None and state.rank not in seen:
            seen.append(state.rank)
            action = self.program.ranks[state.rank][state.pc]
            part = state.waiting_on
            if part is None:
                lines.append(f"rank {state.rank} (step {state.pc}) is stuck at {action.text()}")
                others = []
            elif part.action.op in _ALLTOALL:
                k = self.joined[state.rank] - 1
                others = [r for r in range(self.P) if r not in self.meetings.get(k, {})]
                lines.append(f"rank {state.rank} (step {state.pc}) waits in {action.text()} for rank"
                             f"{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} to join "
                             f"{part.action.op}{part.action.mb}")
            else:
                others = [part.action.peer]
                lines.append(f"rank {state.rank} (step {state.pc}) waits in {action.text()} for "
                             f"{part.action.text()} to meet rank {part.action.peer}")
            marks.append((state.rank, state.pc))
            state = next((by_rank[r] for r in others if r in by_rank), None)
        first = stuck[0]
        return self.error(DeadlockError, "deadlock: " + "; ".join(lines), first.rank, first.pc, marks[1:])
