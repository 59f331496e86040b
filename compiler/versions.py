"""Weight versions: what a program's optimizer updates do to each stage's weights.

Asynchronous training (PipeDream) runs the optimizer update of a stage, U(s,
m), as a task in the order, between the forwards and backwards of other
microbatches, instead of once after a flush. Each update starts a new version
of the stage's weights: a forward runs on the stage's newest version, and
with weight stashing (``stash weights`` in the language, ``Program.weight_versions``)
its backward (and the recompute and weight-gradient halves of it) runs on the
version its forward used, kept until that backward is done. An update applies
every weight gradient the stage made since its previous update.

``version_plan`` walks every rank's list once and says, for each stage, the
version each microbatch ran on, the microbatches each update applies, which
backwards need a stashed (older) version and the most versions the stage
keeps at once; the version check, the simulator's report, the runtime and the
one-process emulation of the same staleness (``runtime/reference.py``) all
read it, so they agree on what the order means. Which ops run forward on the
weights, which backward, which make a weight gradient and which update comes
from the rule table (``ops.WEIGHT_PASS``, ``ops.GRADIENT_CONTRIBUTORS``,
``ops.UPDATE_OPS``).

A program without updates has no plan (None): its optimizer steps once after
the list, every forward and backward on the same weights.
"""
from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import NamedTuple

from pipec.compiler import ops
from pipec.compiler.family import first_refusal
from pipec.compiler.costs import CostModel
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import Number
from pipec.compiler.simulate import simulate
from pipec.errors import VersionError

# It reads only the compute ops' rule fields (which pass of the weights they run, whether they
# make a weight gradient or update), so it declares no per-op table (``ops.declare_pass``).

_FORWARD_USERS = frozenset(op for op, p in ops.WEIGHT_PASS.items() if p == ops.FORWARD)
_BACKWARD_USERS = frozenset(op for op, p in ops.WEIGHT_PASS.items() if p == ops.BACKWARD)
_CONTRIBUTORS = frozenset(ops.GRADIENT_CONTRIBUTORS)
_UPDATES = frozenset(ops.UPDATE_OPS)


class Update(NamedTuple):
    """One optimizer update of a stage: where it runs and what it applies.

    Attributes:
        rank, index: its place in the program.
        mb: the microbatch it is written after (``U(s, mb)``).
        applies: the microbatches whose weight gradients it applies, in the
            order their backwards ran.
    """

    rank: int
    index: int
    mb: int
    applies: tuple[int, ...]


class VersionPlan(NamedTuple):
    """What the updates of a program do (``version_plan``).

    Attributes:
        version_of: (stage, mb) -> the version of the stage's weights its
            forward ran on (0: the weights the list starts with; each update
            adds one), which its backward runs on too.
        updates: stage -> its updates, in order (update k makes version k + 1).
        stashed: the (stage, mb) whose backward runs after an update of the
            stage: on a kept older version.
        peak_versions: stage -> the most versions of its weights the stage
            keeps at once (the newest and those microbatches in flight ran on).
        bound: the most versions a stage may keep (``Program.weight_versions``;
            None: as many as the order needs).
    """

    version_of: dict[tuple[int, int], int]
    updates: dict[int, list[Update]]
    stashed: frozenset[tuple[int, int]]
    peak_versions: dict[int, int]
    bound: int | None

    def updates_per_stage(self) -> int:
        """The most updates any stage makes in one list."""
        return max((len(u) for u in self.updates.values()), default=0)


def has_updates(program: Program) -> bool:
    """Whether some rank's list holds an optimizer update (the program trains asynchronously)."""
    return any(action[1] in _UPDATES for row in program.ranks for action in row)


def version_plan(program: Program) -> VersionPlan | None:
    """Walk every rank's list and say what its updates do to each stage's weights.

    Contract: ``program`` passed the well-formed check (every backward after
    its forward, on the same rank; every update after the backward it names).

    Args:
        program: an activation-passing program.
    Returns:
        the ``VersionPlan``, or None when no list holds an update.
    Raises:
        VersionError: at the first instruction (rank order, then list order)
            where a backward would run on a newer version than its forward
            because the stage keeps too few (``stash weights <= K``, or none
            declared); at an update in a weight-passing program; where a
            replicated stage is updated (its replicas' gradients are
            all-reduced after the list, not before an update); or at a
            backward whose weight gradient no later update applies.
    """
    if not has_updates(program):
        return None
    refusal = first_refusal(program, lambda family: family.refuse_updates())
    if refusal is not None:
        rank, index = next((r, i) for r, row in enumerate(program.ranks) for i, a in enumerate(row) if a[1] in _UPDATES)
        raise VersionError(f"{program.ranks[rank][index].text()} updates a stage inside the list, but {refusal}",
                           rank, index, program.grid())
    bound = program.weight_versions
    replicas = Counter(info.position for info in program.stages)
    replicated = {info.id for info in program.stages if replicas[info.position] > 1}
    version_of: dict[tuple[int, int], int] = {}
    updates: dict[int, list[Update]] = {}
    stashed: set[tuple[int, int]] = set()
    peak: dict[int, int] = {}
    for rank, row in enumerate(program.ranks):
        current: dict[int, int] = {}       # stage -> its newest version
        in_flight: defaultdict[int, _InFlight] = defaultdict(_InFlight)  # stage -> its microbatches in flight
        unapplied: dict[int, list[tuple[int, int]]] = {}  # stage -> (mb, index) of gradients not yet applied
        for index, action in enumerate(row):
            op, stage, mb = action[1], action[0], action[2]
            if op in _UPDATES:
                if stage in replicated:
                    raise VersionError(
                        f"{action.text()} updates stage {stage}, which is replicated: its replicas' weight "
                        "gradients are all-reduced after the list, so an update inside it would apply a part of "
                        "them (asynchronous updates need stages of one replica)", rank, index, program.grid())
                pending = unapplied.pop(stage, [])
                updates.setdefault(stage, []).append(Update(rank, index, mb, tuple(m for m, _ in pending)))
                current[stage] = current.get(stage, 0) + 1
            elif op in _FORWARD_USERS:
                version = current.get(stage, 0)
                version_of[stage, mb] = version
                in_flight[stage].start(mb, version)
            elif op in _BACKWARD_USERS:
                used = version_of.get((stage, mb), 0)
                newest = current.get(stage, 0)
                if bound is not None and newest - used >= bound:
                    raise VersionError(_too_new(program, action, stage, mb, used, newest, bound),
                                       rank, index, program.grid())
                if newest != used:
                    stashed.add((stage, mb))
                if op in _CONTRIBUTORS:
                    in_flight[stage].end(mb)
                    unapplied.setdefault(stage, []).append((mb, index))
            else:
                continue
            kept = in_flight[stage].versions_with(current.get(stage, 0))
            if kept > peak.get(stage, 0):
                peak[stage] = kept
        for stage, pending in sorted(unapplied.items()):
            mb, index = pending[0]
            raise VersionError(
                f"the weight gradient {row[index].text()} makes is never applied: no update of stage {stage} "
                f"follows it on rank {rank} (write U({program.stages[stage].position}, m) after the last backward "
                f"of the stage)", rank, index, program.grid())
    return VersionPlan(version_of, updates, frozenset(stashed), peak, bound)


class _InFlight:
    """One stage's microbatches whose forward ran and whose weight gradient is not made yet, with the
    version each ran on and how many ran on each version: the versions it keeps, in time independent
    of how many are in flight."""

    def __init__(self) -> None:
        self.version_of: dict[int, int] = {}
        self.riders: Counter = Counter()  # version -> microbatches in flight on it (only versions with some)

    def start(self, mb: int, version: int) -> None:
        """``mb``'s forward ran on ``version`` (a second forward of it, a recompute, replaces the first)."""
        self.end(mb)
        self.version_of[mb] = version
        self.riders[version] += 1

    def end(self, mb: int) -> None:
        """``mb``'s weight gradient is made: it no longer holds a version (nothing when it was not in flight)."""
        version = self.version_of.pop(mb, None)
        if version is not None:
            self.riders[version] -= 1
            if not self.riders[version]:
                del self.riders[version]

    def versions_with(self, newest: int) -> int:
        """How many versions the stage keeps: those of its microbatches in flight, and ``newest``."""
        return len(self.riders) + (newest not in self.riders)


def _too_new(program: Program, action, stage: int, mb: int, used: int, newest: int, bound: int) -> str:
    forward = next((a.text() for a in program.ranks[program.stages[stage].rank]
                    if a[0] == stage and a[2] == mb and a[1] in _FORWARD_USERS), f"the forward of ({stage}, {mb})")
    if bound == 1:
        keeps = ("the stage keeps no older version: declare `stash weights` (PipeDream's weight stashing), or "
                 "update only after the backwards of the microbatches in flight")
    else:
        keeps = (f"the stage keeps only its {bound} newest versions (`stash weights <= {bound}`): raise the bound, "
                 "or update less often")
    return (f"{action.text()} would run on version {newest} of stage {stage}'s weights, but its forward {forward} "
            f"ran on version {used}: {keeps}")


def version_summary(program: Program, plan: VersionPlan) -> dict:
    """What ``pipec check`` and ``simulate`` report of a plan, per stage id.

    Returns:
        {"updates": updates per stage, "weight_versions": the most versions each
        stage keeps at once, "stashed": backwards that run on an older version}.
    """
    stages = range(len(program.stages))
    return {"updates": [len(plan.updates.get(s, ())) for s in stages],
            "weight_versions": [plan.peak_versions.get(s, 1) for s in stages],
            "stashed": len(plan.stashed)}


def flushed_equivalent(program: Program, plan: VersionPlan) -> list[Program]:
    """The same training with a flush at every update: one compute-only program per minibatch.

    A minibatch is what one update of the last stage applies. Each program
    keeps, of every rank's list, the compute tasks of that minibatch's
    microbatches (and their updates) in their order, so the sum of their
    makespans is the time the same updates take when each minibatch drains
    the pipeline before the next starts: the throughput the order gains by not
    flushing is that sum over its own makespan (``flushed_makespan``). Its
    microbatches are renumbered 0..k-1 in ascending order (the program has k),
    so that simulating it costs its own size, not the whole program's.

    Args:
        program: a program of one pipeline with updates (``plan`` is its plan).
        plan: its version plan.
    Returns:
        one program per update of the last stage, in order; minibatches whose
        programs are equal share one object.
    """
    distinct, order = _flushed_minibatches(program, plan)
    return [distinct[index] for index in order]


def flushed_makespan(program: Program, plan: VersionPlan, costs: CostModel | None = None) -> Number:
    """The makespan of the same updates with a flush after each: the sum, in update order, of the
    makespans of ``flushed_equivalent``'s programs under ``costs``, each distinct one simulated once.

    Args:
        program: a program of one pipeline with updates.
        plan: its version plan.
        costs: the cost model (unit costs when None).
    Returns:
        the sum (0 when the last stage makes no update).
    """
    distinct, order = _flushed_minibatches(program, plan)
    makespans = [simulate(each, costs).makespan for each in distinct]
    return sum(makespans[index] for index in order)


def _flushed_minibatches(program: Program, plan: VersionPlan) -> tuple[list[Program], list[int]]:
    """The distinct programs of ``flushed_equivalent`` and, per update of the last stage in order, the
    index of its program among them; one pass over the lists (each task joins the minibatches its
    microbatch belongs to)."""
    last = program.pipelines[0][-1]
    groups = [sorted(frozenset(update.applies)) for update in plan.updates.get(last, ())]
    joins: dict[int, list[tuple[int, int]]] = {}  # mb -> (minibatch, the mb's number in it)
    for group, members in enumerate(groups):
        for number, mb in enumerate(members):
            joins.setdefault(mb, []).append((group, number))
    rows = [[[] for _ in program.ranks] for _ in groups]
    for rank, row in enumerate(program.ranks):
        for action in row:
            if action.mb in joins and action.is_compute:
                stage, op, _, peer, parts = action
                for group, number in joins[action.mb]:
                    rows[group][rank].append(Action(stage, op, number, peer, parts))
    distinct: dict[tuple, int] = {}
    programs: list[Program] = []
    order = []
    for members, group_rows in zip(groups, rows):
        mb_pipeline = [program.mb_pipeline[mb] for mb in members]
        key = (tuple(map(tuple, group_rows)), tuple(mb_pipeline))
        if key not in distinct:
            distinct[key] = len(programs)
            programs.append(dataclasses.replace(program, ranks=group_rows, num_microbatches=len(members),
                                                mb_pipeline=mb_pipeline, communicators=list(program.communicators)))
        order.append(distinct[key])
    return programs, order


def staleness_note(program: Program) -> str | None:
    """One line on the learning rate an asynchronous program needs, or None for a program without updates.

    Each stage updates several times a step, each update on gradients computed on weights up to
    (its peak versions - 1) updates old; a learning rate set for one update per step of N
    microbatches' mean overshoots (PipeDream at P = 4, N = 32 on the built-in model's SGD 0.2:
    loss 1.05, then 0.78, then 4.82). docs/runtime.md, "Learning rate under staleness".
    """
    plan = version_plan(program)
    if plan is None:
        return None
    summary = version_summary(program, plan)
    updates, stale = max(summary["updates"]), max(summary["weight_versions"]) - 1
    return (f"{program.name} is asynchronous: up to {updates} updates per stage a step, gradients up to {stale} "
            f"update(s) stale; a learning rate tuned for one synchronous update a step is too large here: lower it "
            f"(by about the staleness) or warm it up (docs/runtime.md, \"Learning rate under staleness\")")
