"""Lowering of a sequence-ring schedule (ring, zigzag, TASP attention) into per-rank instructions.

Contract: ``ring_plan(spec.rings, P)`` turns the evaluated declarations into a
``RingPlan`` (the rings themselves from ``compiler/rings.py``);
``lower_rings(spec)`` returns the whole ``Program``: the per-rank order of
attention blocks, forward then backward, with the exchanges that move KV and
dK, dV partials as the plan's ``kv``, ``dkv`` and ``transfer`` say. The
result is unchecked: ``checks.rings`` proves it.

The derived order is systolic, so that KV moves during compute: at each of
the n steps of a pass, rank r computes every visible block of its queries
against the bundles it holds then, while the exchange that brings step t + 1's
KV, posted before step t's blocks, is waited only after them. After n - 1 ring
steps every bundle has visited every rank once, so every visible block is
computed exactly once. A schedule may write the blocks instead (``spec.order``
with ``spec.task_steps``: ``written_steps``, ``lower_plan``); the exchanges
stay the same. docs/rings.md, section 2, describes the order and what each of
``kv again`` / ``kept``, ``dkv behind`` / ``direct`` and ``transfer
all_to_all`` moves.
"""
from __future__ import annotations

from dataclasses import replace
from math import gcd

from pipec.compiler import ops
from pipec.compiler.ir import Action, Program, RingPlan, StageInfo, build_program
from pipec.compiler.rings import hamiltonian_rings, rail_rings, verify_decomposition
from pipec.dsl.spec import RingSpec, ScheduleSpec
from pipec.errors import EvalError, UsageError

# The ring family's lowering emits its own ops and interprets none: no pass to declare (``ops.declare_pass``).


def ring_plan(spec: RingSpec, num_ranks: int) -> RingPlan:
    """The ``RingPlan`` of evaluated ring declarations on ``num_ranks`` ranks.

    Raises:
        UsageError: rings the ranks cannot form (the front end checks the
            declarations; this guards programs built by hand).
    """
    note = ""
    if spec.rings == "shift":
        cycles = tuple(_shift_ring(by, num_ranks) for by in spec.ring_args)
        if not cycles or len({cycle[1:2] for cycle in cycles}) != len(cycles):
            raise UsageError(f"rings shift {', '.join(map(str, spec.ring_args))}: one or more distinct offsets "
                             f"modulo {num_ranks}, each a ring")
    elif spec.rings == "cycle":
        cycles = tuple(tuple(cycle) for cycle in spec.ring_args)
        try:
            verify_decomposition(num_ranks, cycles, complete=False)
        except ValueError as error:
            raise UsageError(f"rings cycle: {error}") from None
        if not cycles:
            raise UsageError("rings cycle: one or more rings, each listing every rank once")
    elif spec.rings == "hamilton":
        found = hamiltonian_rings(num_ranks)
        cycles, note = found.cycles, found.note
    elif spec.rings == "rails":
        nodes, per_node = spec.ring_args
        if nodes * per_node != num_ranks:
            raise UsageError(f"rail rings of {nodes} x {per_node} ranks do not cover {num_ranks} ranks")
        found = rail_rings(nodes, per_node)
        cycles, note = found.cycles, found.note
    else:
        raise UsageError(f"unknown rings {spec.rings!r}")
    if note:
        note = f"rings: {note}; KV uses the {len(cycles)} rings found"
    pieces = spec.pieces if spec.pieces is not None else len(cycles)
    return RingPlan(spec.chunks, tuple(spec.holders), pieces, tuple(tuple(c) for c in cycles), spec.causal,
                    spec.kv, spec.dkv, spec.transfer, note)


def _shift_ring(by: int, num_ranks: int) -> tuple[int, ...]:
    """The ring r -> r + by from rank 0, which must visit every rank."""
    if gcd(by % num_ranks, num_ranks) != 1:
        raise UsageError(f"rings shift {by} does not visit every one of {num_ranks} ranks")
    return tuple(i * by % num_ranks for i in range(num_ranks))


def ring_program(plan: RingPlan, ranks: list[list[Action]], name: str = "", params: dict | None = None,
                 source: str = "") -> Program:
    """A ``Program`` of the ring family around per-rank instruction lists.

    Stages are the query chunks (stage c: chunk c on its holder, a pipeline of
    its own); ``mb`` of a block ranges over ``chunks * pieces``.
    """
    stages = [StageInfo(c, rank, c, 0) for c, rank in enumerate(plan.holders)]
    blocks = plan.chunks * plan.pieces
    return build_program(name, plan.num_ranks, blocks, stages, [[c] for c in range(plan.chunks)], [0] * blocks,
                         ranks, plans=(plan,), params=dict(params or {}), source=source)


def lower_rings(spec: ScheduleSpec) -> Program:
    """The program of an evaluated ring schedule (module docstring): its written order's, or the derived one."""
    try:
        plan = ring_plan(spec.rings, spec.num_ranks)
    except UsageError as error:  # rings the search refuses: a value error of the written `rings`
        if spec.rings.rings_span is None:
            raise
        raise EvalError(str(error), spec.rings.rings_span, spec.source) from None
    written = None if spec.order is None else written_steps(plan, spec.order, spec.task_steps)
    return lower_plan(plan, spec.name, spec.params, spec.path, written)


def written_steps(plan: RingPlan, order: list[list[tuple[str, int, int]]],
                  steps: list[list[int]] | None) -> list[list[list[Action]]]:
    """A written order's blocks by rank and step: ``[rank][step]``, 2n steps (forward, then backward).

    Args:
        order: per rank its blocks ``(kind, query chunk, block)``, as written.
        steps: per rank the step of each block (same lengths).
    Raises:
        UsageError: an order of another shape, a step outside 0..2n-1, a kind
            of no pass or at a step of the other pass (the front end refuses
            each where it is written; this guards specs built by hand).
    """
    n = plan.num_ranks
    if steps is None or len(order) != n or len(steps) != n or any(len(o) != len(s) for o, s in zip(order, steps)):
        raise UsageError(f"a ring's written order needs, for each of its {n} ranks, its blocks and the step of each")
    out: list[list[list[Action]]] = []
    for rank, (tasks, at) in enumerate(zip(order, steps)):
        row: list[list[Action]] = [[] for _ in range(2 * n)]
        for (kind, q, block), step in zip(tasks, at):
            if not 0 <= step < 2 * n:
                raise UsageError(f"rank {rank}'s {kind} of query chunk {q} is at step {step}, outside 0..{2 * n - 1}")
            if (kind, step < n) not in ((ops.AF, True), (ops.AB, False)):
                raise UsageError(f"rank {rank}'s {kind} of query chunk {q} at step {step}: a ring's steps 0..{n - 1} "
                                 f"run {ops.AF}, its steps {n}..{2 * n - 1} {ops.AB}")
            row[step].append(Action(q, kind, block))
        out.append(row)
    return out


def lower_plan(plan: RingPlan, name: str = "", params: dict | None = None, source: str = "",
               written: list[list[list[Action]]] | None = None) -> Program:
    """The program of a ``RingPlan`` (module docstring); ``written``: the blocks of each rank's steps
    (``written_steps``), or None for the derived order.

    With a written order a step's blocks are exactly the ones written at it, in written order; the
    exchanges are the derived order's, at the same places. Whether each block finds its KV, and whether
    every visible block is computed once each way, is the check's to say.
    """
    lowerings = [_Lowering(plan, rank, None if written is None else written[rank]) for rank in range(plan.num_ranks)]
    rows = [lowering.run() for lowering in lowerings]
    plan = replace(plan, steps=tuple(tuple(lowering.steps) for lowering in lowerings))
    return ring_program(plan, rows, name, params, source)


class _Lowering:
    """One rank's list. Every rank builds its exchanges in the same sequence, so numbers agree."""

    def __init__(self, plan: RingPlan, rank: int, written: list[list[Action]] | None = None):
        self.plan, self.rank = plan, rank
        self.n = plan.num_ranks
        self.row: list[Action] = []
        self.steps: list[int] = []  # the ring step of each instruction of ``row``
        self.exchanges = 0
        self.written = written  # the blocks of each of the 2n steps, or None: derived

    def blocks(self, step: int, op: str) -> list[Action]:
        """The blocks of ``step`` of the ``op`` pass: the written ones, or every visible one (``blocks_at``)."""
        if self.written is None:
            return self.blocks_at(step, op)
        return self.written[step if op == ops.AF else self.n + step]

    def holder_at(self, piece: int, step: int) -> int:
        """Whose bundle of ``piece`` this rank holds at ``step`` of a pass: ``step`` hops back on its ring."""
        ring = self.plan.ring_of(piece)
        return ring[(ring.index(self.rank) - step) % self.n]

    def blocks_at(self, step: int, op: str) -> list[Action]:
        """Every visible block of this rank's queries against the bundles it holds at ``step``."""
        plan, out = self.plan, []
        for q in plan.chunks_of(self.rank):
            for piece in range(plan.pieces):
                for kv in plan.chunks_of(self.holder_at(piece, step)):
                    if plan.visible(q, kv, piece):
                        out.append(Action(q, op, plan.block(kv, piece)))
        return out

    def exchange(self, parts: list[Action], kind: str) -> int | None:
        """Post ``parts`` as one exchange (a batch, or one all_to_all); its number, or None when empty."""
        if not parts:
            return None
        number = self.exchanges
        self.exchanges += 1
        if self.plan.transfer == "all_to_all":
            collective = ops.ALLTOALL_KV if kind == "kv" else ops.ALLTOALL_DKV
            parts = [Action(-1, collective, number, -1, tuple(parts))]
        self.row.append(Action(-1, ops.EXCHANGE, number, -1, tuple(parts)))
        return number

    def wait(self, number: int | None) -> None:
        if number is not None:
            self.row.append(Action(-1, ops.EXCHANGE_WAIT, number))

    def shift(self, step: int, send: str, recv: str) -> list[Action]:
        """Every ring's move after ``step``: send the bundle held at ``step``, take the one of ``step`` + 1.
        A ring of one rank moves nothing: that rank holds every bundle and every partial is home."""
        parts = []
        if self.n == 1:
            return parts
        for piece in range(self.plan.pieces):
            parts.append(Action(self.holder_at(piece, step), send, piece, self.plan.next_on(piece, self.rank)))
            parts.append(Action(self.holder_at(piece, step + 1), recv, piece, self.plan.prev_on(piece, self.rank)))
        return parts

    def at_step(self, step: int) -> None:
        """The instructions appended since the last call belong to ring step ``step``."""
        self.steps += [step] * (len(self.row) - len(self.steps))

    def run(self) -> list[Action]:
        last = self.n - 1
        for step in range(self.n):  # forward
            moving = self.exchange(self.shift(step, ops.SEND_KV, ops.RECV_KV), "kv") if step < last else None
            self.row += self.blocks(step, ops.AF)
            self.wait(moving)
            self.at_step(step)
        partials = None
        for step in range(self.n):  # backward
            moving = None
            if self.plan.kv == "again" and step < last:
                moving = self.exchange(self.shift(step, ops.SEND_KV, ops.RECV_KV), "kv")
            self.row += self.blocks(step, ops.AB)
            self.wait(moving)
            if self.plan.dkv == "behind":
                self.wait(partials)  # step's incoming partial folded before this rank's leaves
                partials = self.exchange(self.shift(step, ops.SEND_DKV, ops.RECV_DKV), "dkv")
            self.at_step(self.n + step)
        if self.plan.dkv == "direct":
            partials = self.exchange(self.direct_partials(), "dkv")
        self.wait(partials)
        self.at_step(2 * self.n - 1)
        return self.row

    def direct_partials(self) -> list[Action]:
        """``dkv direct``: this rank's partial of each other rank's bundle it added to goes home; its own
        bundles' partials come from every rank that added to them. Sends first, in holder order."""
        plan, sends, recvs = self.plan, [], []
        for piece in range(plan.pieces):
            for other in range(self.n):
                if other == self.rank:
                    continue
                if _adds_to(plan, self.rank, other, piece):
                    sends.append(Action(other, ops.SEND_DKV, piece, other))
                if _adds_to(plan, other, self.rank, piece):
                    recvs.append(Action(self.rank, ops.RECV_DKV, piece, other))
        return sends + recvs


def _adds_to(plan: RingPlan, rank: int, holder: int, piece: int) -> bool:
    """Whether ``rank``'s queries see some key of ``holder``'s bundle of ``piece`` (so it has a partial of it)."""
    return any(plan.visible(q, kv, piece) for q in plan.chunks_of(rank) for kv in plan.chunks_of(holder))
