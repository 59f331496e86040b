"""Sequence rings' meaning in the one symbolic run: every block, bundle and partial tracked.

``check_rings(program)`` proves a sequence-ring program (``Program.rings`` set:
ring, zigzag, TASP attention) and returns its ``RingReport``. The engine of
``checks/symbolic.py`` runs it: it matches the messages (FIFO per pair over
kind and bundle; a send inside an all_to_all against a point-to-point receive,
the hang of mixed batching, is a ``MatchError``), meets the all_to_alls (an
EXCHANGE_WAIT waits until every rank joined) and names a deadlock. This module
adds the family's meaning of its ops (``RingSemantics``): the KV bundles and
dK, dV partials each rank holds, from which it proves mask coverage (every
visible block, ``RingPlan.visible``, once each way on its query's rank, and a
chunk's backward blocks after all its forward ones: they need its global
output and log-sum-exp; ``CoverageError``), route consistency and buffer slots
(a block finds its bundle, no buffer replaced while its send runs: the public
code's silent corruption; ``RouteError``), reduction completeness (every
contribution home exactly once; ``RouteError``) and the two halves the runtime
runs apart (every forward block of a rank before its backward's first
instruction, ``ring_halves``, ``CoverageError``; forward halves whose messages
and all_to_alls meet only each other, ``MatchError``). docs/rings.md, section 3,
lists every hazard; each error names the rank, the instruction (its index in
the rank's list, with its ring step beside it where the lowering recorded it)
and the block or bundle.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from pipec.compiler import ops
from pipec.compiler.checks.symbolic import Part, RankState, Semantics, prove_exchanges, register_semantics
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import kv_buffer_counts
from pipec.compiler.ring_halves import forward_end
from pipec.errors import CoverageError, MatchError, RouteError, WellFormedError


# Why a ring's list is proved as two halves.
_HALVES = "a rank runs its list's forward half in the model's forward and the rest in its backward"


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
    return prove_exchanges(program)[ops.SEQUENCE_RING]


def block_text(plan, q: int, block: int) -> str:
    kv, piece = plan.unblock(block)
    return f"block (query chunk {q}, kv chunk {kv}, piece {piece})"


def _bundle_text(bundle: tuple[int, int]) -> str:
    return f"rank {bundle[0]}'s KV bundle of piece {bundle[1]}"


class _Holdings:
    """One rank's KV bundles and dK, dV partials."""

    def __init__(self, pieces: int):
        self.received: dict[int, tuple[int, int] | None] = {p: None for p in range(pieces)}  # again: per piece
        self.kept: set[tuple[int, int]] = set()
        self.sending: Counter = Counter()      # bundle -> KV sends in flight
        self.sending_in: Counter = Counter()   # (bundle, exchange) -> those of them posted in that exchange
        self.partials: dict[tuple[int, int], Counter] = {}
        self.incoming: Counter = Counter()     # bundle -> dKV receives posted, not waited


@register_semantics
class RingSemantics(Semantics):
    """The sequence-ring family's ops for the one prover: what each rank holds, and what each op may do with it.

    * Routes and buffer slots: a block finds its KV bundle on its rank when it runs (its own, or
      one delivered by a waited exchange and not yet replaced); a rank sends only bundles it holds;
      under ``kv again`` a delivered bundle replaces the rank's previous one of its piece, which
      must not be in flight (a stale buffer reused while its send runs), and at most two received
      buffers per piece are alive (the one read and the one arriving).
    * Reductions: dQ stays on its query's rank (AB runs there); each AB adds its block's dK, dV to
      the rank's partial of the bundle; a received partial is added at its wait; a rank never
      sends its partial of a bundle while another partial of that bundle is arriving (that one
      would be left behind); at the end every bundle's home holds each contribution exactly once
      and no partial is left on another rank.
    * Messages: both sides carry a KV or dKV of one bundle and move it alike.
    """

    family = ops.SEQUENCE_RING
    part_ops = frozenset((ops.SEND_KV, ops.RECV_KV, ops.SEND_DKV, ops.RECV_DKV, ops.ALLTOALL_KV, ops.ALLTOALL_DKV))

    def __init__(self, run):
        super().__init__(run)
        self.plan = plan = self.program.rings
        self.held = [_Holdings(plan.pieces) for _ in range(self.P)]
        self.forward: dict[int, set[int]] = {q: set() for q in range(plan.chunks)}
        self.backward: dict[int, set[int]] = {q: set() for q in range(plan.chunks)}
        self.expected = {q: {plan.block(kv, p) for kv in range(plan.chunks) for p in range(plan.pieces)
                             if plan.visible(q, kv, p)} for q in range(plan.chunks)}

    def start(self) -> None:
        if len(self.program.ranks) != self.P or any(len(ring) != self.P or sorted(ring) != list(range(self.P))
                                                   for ring in self.plan.rings):
            raise self.error(WellFormedError, "every ring must visit each of the program's ranks once", 0, 0)

    def report(self) -> RingReport:
        return RingReport(self.buffers(), sum(len(b) for b in self.expected.values()))

    def step(self, state: RankState, action: Action) -> None:
        if action.op in ops.RING_COMPUTE_OPS:
            self.compute(state, action)

    # -- exchanges ---------------------------------------------------------------

    def post(self, state: RankState, part: Part) -> None:
        action, plan, h = part.action, self.plan, self.held[state.rank]
        if ops.RULES[action.op].category == ops.PART_COLLECTIVE:
            return  # an all_to_all brings what its sends and receives carry
        bundle = (action.stage, action.mb)
        if not (0 <= action.stage < self.P and 0 <= action.mb < plan.pieces):
            raise self.error(MatchError, f"{action.text()} names no bundle of this program", state.rank, state.pc)
        if action.op == ops.SEND_KV:
            if not self.holds(state, bundle):
                raise self.error(RouteError, f"{action.text()} sends {_bundle_text(bundle)}, which this rank does "
                                 "not hold now", state.rank, state.pc)
            h.sending[bundle] += 1
            h.sending_in[(bundle, part.exchange)] += 1
        elif action.op == ops.SEND_DKV:
            if h.incoming[bundle]:
                raise self.error(RouteError, f"{action.text()} sends this rank's partial of {_bundle_text(bundle)} "
                                 "while another partial of it is still arriving: that one would be left "
                                 "behind, its contributions lost", state.rank, state.pc)
            part.content = h.partials.pop(bundle, Counter())
        elif action.op == ops.RECV_DKV:
            h.incoming[bundle] += 1

    def value_text(self, value: tuple) -> str:
        kind, holder, piece = value
        return f"{ops.VALUE_KINDS[kind].words} of {_bundle_text((holder, piece))}"

    def arrive(self, state: RankState, part: Part) -> None:
        action, h = part.action, self.held[state.rank]
        bundle = (action.stage, action.mb)
        if action.op == ops.SEND_KV:
            h.sending[bundle] -= 1
            h.sending_in[(bundle, part.exchange)] -= 1
        elif action.op == ops.RECV_KV:
            self.deliver(state, bundle, part.exchange)
        elif action.op == ops.RECV_DKV:
            h.incoming[bundle] -= 1
            self.merge(h, bundle, part.content or Counter())

    @staticmethod
    def merge(h, bundle: tuple[int, int], arrived: Counter) -> None:
        """Add an arrived partial (the sender gave it up: ``post`` popped it) to this rank's of ``bundle``, the
        smaller into the larger: a partial riding its ring grows by each rank's contributions, and adding it
        whole at every hop made the proof quadratic in the ranks."""
        mine = h.partials.get(bundle)
        if mine is None or len(mine) < len(arrived):
            mine, arrived = arrived, mine
            h.partials[bundle] = mine
        if arrived:
            mine.update(arrived)

    def deliver(self, state: RankState, bundle: tuple[int, int], exchange: int) -> None:
        """A received bundle takes its piece's buffer (``kv again``): no send of the old one may still run.

        A send posted in the receive's own exchange has completed with it
        (one wait completes every part), whichever part the exchange lists first.
        """
        if bundle[0] == state.rank:
            return
        h = self.held[state.rank]
        if self.plan.kv == "kept":
            h.kept.add(bundle)
        else:
            old = h.received[bundle[1]]
            if old is not None and h.sending[old] - h.sending_in[(old, exchange)]:
                raise self.error(RouteError, f"{_bundle_text(bundle)} arrives into the buffer of "
                                 f"{_bundle_text(old)} while that one is still being sent: a stale buffer "
                                 "reused", state.rank, state.pc)
            h.received[bundle[1]] = bundle

    def holds(self, state: RankState, bundle: tuple[int, int]) -> bool:
        h = self.held[state.rank]
        return bundle[0] == state.rank or bundle in h.kept or h.received.get(bundle[1]) == bundle

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

    def compute(self, state: RankState, action: Action) -> None:
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
            self.forward_missing(state, action, what, missing)
        self.backward[q].add(action.mb)
        self.held[state.rank].partials.setdefault(bundle, Counter())[(q, kv, piece)] += 1

    def forward_missing(self, state: RankState, action: Action, what: str, missing: list[int]) -> None:
        """A backward block of a chunk some of whose forward blocks have not run.

        Every block of a chunk runs on its holder, so a forward block not later
        in this rank's list is never computed: named as such, not as an order
        the user could fix by moving it.
        """
        plan, q = self.plan, action.stage
        later = set(self.program.ranks[state.rank][state.pc + 1:])
        never = [block for block in missing if Action(q, ops.AF, block) not in later]
        if never:
            count = f"{len(never)} visible block{'s' if len(never) > 1 else ''} of chunk {q}"
            raise self.error(CoverageError, f"{action.text()}: the {block_text(plan, q, never[0])} is never computed "
                             f"forward ({count} missing), and the {what} needs its queries' global output and "
                             "log-sum-exp", state.rank, state.pc)
        raise self.error(CoverageError, f"{action.text()}: the {what} runs backward before the forward of "
                         f"{block_text(plan, q, missing[0])}: a backward block needs its queries' global output "
                         "and log-sum-exp", state.rank, state.pc)

    # -- the end -----------------------------------------------------------------

    def finish(self) -> None:
        plan = self.plan
        for q in range(plan.chunks):
            rank = plan.holders[q]
            end = max(len(self.program.ranks[rank]) - 1, 0)
            for done, words in ((self.forward[q], "forward"), (self.backward[q], "backward")):
                missing = sorted(self.expected[q] - done)
                if missing:
                    raise self.error(CoverageError, f"the {block_text(plan, q, missing[0])} is never computed "
                                     f"{words} ({len(missing)} visible block{'s' if len(missing) > 1 else ''} of "
                                     f"chunk {q} missing)", rank, end)
        for rank, h in enumerate(self.held):
            end = self.run.end_of(rank)
            for bundle, partial in h.partials.items():
                if bundle[0] != rank and +partial:
                    q, kv, piece = next(iter(partial))
                    raise self.error(RouteError, f"the dK, dV partial of {_bundle_text(bundle)} is left on rank "
                                     f"{rank}, never sent home (it holds {sum(partial.values())} "
                                     f"contributions, e.g. of {block_text(plan, q, plan.block(kv, piece))})",
                                     rank, end)
        for rank, h in enumerate(self.held):
            end = self.run.end_of(rank)
            for piece in range(plan.pieces):
                bundle = (rank, piece)
                have = h.partials.get(bundle, Counter())
                want = Counter((q, kv, piece) for kv in plan.chunks_of(rank) for q in range(plan.chunks)
                               if plan.visible(q, kv, piece))
                for key in sorted(set(have) | set(want)):
                    if have[key] != want[key]:
                        got = "never reaches home" if have[key] == 0 else f"is folded in {have[key]} times"
                        raise self.error(RouteError, f"the dK, dV of {block_text(plan, key[0], plan.block(key[1], key[2]))} "
                                         f"{got} (rank {rank}'s {_bundle_text(bundle)} partial)",
                                         rank, end)
        self.check_halves()

    def check_halves(self) -> None:
        """Every rank's list splits into a forward half and a backward half (``ring_halves``), and the forward
        halves complete alone. The runtime runs every rank's forward half in the model's forward and the rest
        in its backward, so no forward block may come after the backward's first instruction (though each
        chunk's blocks alone are in order), and no message of a forward half may meet a backward half: the
        whole program's messages match in order per pair of ranks (and its all_to_alls in order), so the
        forward halves hold as many of each pair's messages on both sides, and as many all_to_alls."""
        ends = []
        for rank, row in enumerate(self.program.ranks):
            halves = forward_end(row)
            if halves.problem is not None:
                index, why = halves.problem
                raise self.error(CoverageError, f"{row[index].text()}: {why} ({_HALVES})", rank, index,
                                 [(rank, halves.end)] if halves.end != index else [])
            ends.append(halves.end)
        sides: dict[tuple[int, int], list[list[int]]] = {}  # (sender, receiver) -> [the sender's steps, the receiver's]
        meetings = []  # per rank, the steps of its forward half's all_to_alls
        for rank, (row, end) in enumerate(zip(self.program.ranks, ends)):
            meetings.append([])
            for step in range(end):
                for part in row[step].parts if row[step].op == ops.EXCHANGE else ():
                    category = ops.RULES[part.op].category
                    if category == ops.PART_COLLECTIVE:
                        meetings[rank].append(step)
                    elif category in (ops.PART_SEND, ops.PART_RECV):
                        sending = category == ops.PART_SEND
                        pair = (rank, part.peer) if sending else (part.peer, rank)
                        sides.setdefault(pair, [[], []])[0 if sending else 1].append(step)
        for (sender, receiver), (sent, received) in sorted(sides.items()):
            if len(sent) != len(received):
                rank, steps = (sender, sent) if len(sent) > len(received) else (receiver, received)
                raise self.error(MatchError, f"{self.program.ranks[rank][steps[-1]].text()}: rank {sender}'s forward "
                                 f"half sends {len(sent)} message(s) to rank {receiver}, whose forward half receives "
                                 f"{len(received)}: a message of one half would meet the other ({_HALVES})",
                                 rank, steps[-1])
        counts = [len(steps) for steps in meetings]
        if len(set(counts)) > 1:
            rank = counts.index(max(counts))
            raise self.error(MatchError, f"{self.program.ranks[rank][meetings[rank][-1]].text()}: rank {rank}'s "
                             f"forward half holds {max(counts)} all_to_all(s), rank {counts.index(min(counts))}'s "
                             f"{min(counts)}: an all_to_all of one half would meet the other's ({_HALVES})",
                             rank, meetings[rank][-1])
