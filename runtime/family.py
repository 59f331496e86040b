"""Workload families in the runtime: what the interpreter asks of a family, where it finds one, the one loop.

The runtime's side of ``compiler/family.py``. A family (activation passing,
weight passing, sequence rings) is a module that builds one ``RuntimeFamily``
and registers it with the kind of plan its programs carry
(``runtime/interpreter.py``: activation passing, the family of plan-less
programs; ``runtime/weights.py``; ``runtime/sequence.py``;
``runtime/tensor_parallel.py``). The interpreter,
the worker, checkpoints, clipping, the data source and the layer cutter never
test which family a program is: they ask ``runtime_family(program)`` (or the
rank context's ``family``) and call its hooks or read its attributes.

Every family's lists run through ``run_instructions``: one loop over a rank's
instructions, each handler looked up in the family's one table keyed by op
(``RuntimeFamily.handlers``; a test or ``--inject`` may add to a rank's copy).
A handler is ``(state, action, index) -> None``; ``state`` is the family's
per-rank state for the list being run (the interpreter's step, or a ring's
attention call) and has ``waited``, the seconds it spent waiting so far.

Every family's run goes through one training loop (``worker.train``): steps,
the loss, reports, checkpoints, resume and the trace are the loop's; what a
family builds on a rank and what one step runs there is its ``Trainer``
(``RuntimeFamily.trainer``).

The registry is filled when the family modules are imported; the lookups
import them on first use, so a module that only asks need not know them.
"""
from __future__ import annotations

import importlib
from time import perf_counter
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from pipec.compiler import ops
from pipec.compiler.family import runs_in_stages
from pipec.compiler.ir import ROW_SHARE, SEQUENCE_SHARE, Action, Program
from pipec.errors import PipecError, RuntimeFault
from pipec.runtime.user_code import failure_words, is_interrupt

# The modules that register a family, imported on the first lookup.
FAMILY_MODULES = ("pipec.runtime.interpreter", "pipec.runtime.weights", "pipec.runtime.sequence",
                  "pipec.runtime.tensor_parallel")

# A handler: (the family's per-rank state, the instruction, its index) -> None.
Handler = Callable[[Any, Action, int], None]
# A trace event: (index, start, end, waited) in perf_counter seconds, and optionally a fifth field
# naming the call the instruction ran in (a ring's ``attention 3's forward``).
Record = Callable[[tuple], None]


class RuntimeFamily:
    """One workload family's answers to what the runtime asks. Subclasses set or override what differs.

    Attributes:
        name: the family's name (``ops.FAMILIES``).
        label: how messages name its schedules (``weight-passing``); "" for activation passing.
        handlers: op -> handler, the family's one table (every op its lists may hold).
        part_posters: part op -> its poster inside an EXCHANGE (``runtime/exchange.py``).
        passes_activations: whether activations cross ranks between chunks (boundaries have wires).
        runs_chunks: whether a rank runs the model cut into the program's chunks (a sequence ring
            runs the whole model on every rank).
        takes_partition: whether a partition file's stages can cut the model for its programs.
        reads_whole_batch: whether every rank reads each step's whole batch as one microbatch
            (a sequence ring, which cuts the batch along the sequence instead).
        trainer: the family's ``Trainer`` class, ``(plan, rank, world, device)``; None for the interpreter's
            steps of the rank's instruction list (``runtime/list_trainer.py``: activation and weight passing,
            their compositions), which the worker's loop imports (the family modules sit below it).
        trains_on_groups: whether it trains its programs' stages placed on rank groups (weight passing on
            a mesh, ``compiler/weight_placement.py``); activation passing's are ``runtime/placed.py``'s.
    """

    name: str = ""
    label: str = ""
    handlers: Mapping[str, Handler] = {}
    part_posters: Mapping[str, Callable] = {}
    passes_activations: bool = True
    runs_chunks: bool = True
    takes_partition: bool = True
    reads_whole_batch: bool = False
    trains_on_groups: bool = False
    trainer: type[Trainer] | None = None

    def refusal_outside(self, op: str) -> str | None:
        """Why ``op``, one of this family's, cannot run in another family's program; None: no handler."""
        return None

    def check_model(self, spec, config, program: Program, name: str) -> None:
        """Raise ``UsageError`` when the model spec cannot train with ``program`` (before any worker joins)."""

    def refuse_run(self, run) -> str | None:
        """Why the family's runtime cannot take the run's options (a ``RunConfig``) yet, or None."""
        return None


class StepOutcome(NamedTuple):
    """What one training step of a rank gives the loop.

    Attributes:
        loss: what this rank adds to the batch's loss (the loop sums the ranks' onto rank 0): a 0-d tensor,
            or None for nothing.
        grad_norm: under ``--clip-grad-norm``, the global gradient norm before clipping; else None.
        events: the step's trace events, ``(index, start, end, waited[, call])`` per instruction and the optimizer
            step's with index ``len(row)`` (``runtime/trace.py``); empty when nothing is traced.
    """

    loss: Any
    grad_norm: float | None
    events: list


class Trainer:
    """One rank's part of a run, as its family trains it; ``worker.train``, the one loop, drives it.

    A family's constructor ``(plan, rank, world, device)`` builds what the rank trains (its model or
    chunks, optimizer and data source) and restores ``plan.checkpoint``'s model and optimizer state; the
    loop restores the data position, then calls ``step`` once per training step and, when a checkpoint is
    due, gathers every rank's ``checkpoint_part`` for rank 0's ``merged_parts``.

    Attributes:
        context: names the rank's instructions: ``program``, ``rank``, ``row`` (a copy: ``--inject`` plants
            into it) and ``handlers`` (``worker.plant_injection``, ``worker.write_trace``).
        data: the batches (``data.BatchSource`` or one alike): ``batch(step)``, ``state_after(steps)``,
            ``restore(state)``, ``rows_per_microbatch``.
        modules: chunk -> the module this rank holds of it (the ``build`` report).
        batch_size: (samples, tokens) a step consumes, None where unknown (``report.batch_size``).
    """

    context: Any
    data: Any
    modules: dict
    batch_size: tuple = (None, None)

    def step(self, batch, iteration: int) -> StepOutcome:
        """Train step ``iteration`` (from 1) on ``batch`` (``data.batch(iteration - 1)``), the optimizer's
        step included."""
        raise NotImplementedError

    def checkpoint_part(self) -> dict:
        """What this rank contributes to a checkpoint: ``{"model": ..., "optimizer": ...}`` (CPU copies)."""
        raise NotImplementedError

    def merged_parts(self, parts: list[dict]) -> tuple[dict, dict]:
        """The whole model's state_dict and the named optimizer state from every rank's part (rank order)."""
        raise NotImplementedError


_BY_PLAN: dict[type, RuntimeFamily] = {}
_DEFAULT: list[RuntimeFamily] = []
# Ops the runtime names as not runnable yet, with why; ``pipec run`` and the worker refuse their programs.
NOT_RUNNABLE: dict[str, str] = {}
_LOADING: list[bool] = []


def register(family: RuntimeFamily, plan_type: type | None) -> RuntimeFamily:
    """Register ``family`` for programs holding a plan of ``plan_type`` (None: plan-less programs).

    The runtime's interpretation of the ops (``ops.declare_pass``, which ``tests/test_ops_table.py``
    reads) is every registered family's table and part posters, declared again at each registration.
    """
    if plan_type is None:
        _DEFAULT[:] = [family]
    else:
        _BY_PLAN[plan_type] = family
    known = [*_DEFAULT, *_BY_PLAN.values()]
    ops.declare_pass("runtime interpreter", {op for f in known for op in (*f.handlers, *f.part_posters)}
                     | set(NOT_RUNNABLE))
    return family


def load_families() -> None:
    """Import every family module (``FAMILY_MODULES``), once; each registers its family."""
    if not _LOADING:
        _LOADING.append(True)
        for module in FAMILY_MODULES:
            importlib.import_module(module)


def runtime_family(program: Program) -> RuntimeFamily:
    """The family that trains ``program``: the one of its plan, activation passing when it holds none."""
    load_families()
    found = [_BY_PLAN[type(plan)] for plan in program.plans if type(plan) in _BY_PLAN]
    return found[0] if found else _DEFAULT[0]


def families() -> list[RuntimeFamily]:
    """Every registered family, the default first."""
    load_families()
    return [*_DEFAULT, *_BY_PLAN.values()]


def refusal_outside(op: str, family: RuntimeFamily) -> str | None:
    """Why ``op``, which ``family``'s table lacks, cannot run there: the first other family's refusal, or None."""
    return next((why for other in families() if other is not family and op in other.handlers
                 for why in [other.refusal_outside(op)] if why is not None), None)


def run_instructions(state, row: Sequence[Action], handlers: Mapping[str, Handler], start: int, stop: int,
                     record: Record | None = None, synchronize: Callable[[], None] | None = None,
                     text: Callable[[int], str] | None = None) -> None:
    """Run instructions ``start`` .. ``stop - 1`` of ``row``, each through its op's handler: the one loop.

    Args:
        state: the family's per-rank state, passed to every handler; has ``waited`` (seconds).
        row: the rank's instruction list.
        handlers: op -> handler; every op of the range has one (the family checked the list).
        start, stop: the range.
        record: called with (index, start, end, waited) per instruction, perf_counter seconds; None: nothing kept.
        synchronize: called after every instruction when the trace must show device time, else None.
        text: index -> how a fault names that instruction (a ring's adds its call); None: its own text.
    Raises:
        RuntimeFault: a handler's own; or, for anything else an instruction raised (the model's forward,
            loss or backward fails, ``sys.exit`` included), one naming the rank, the instruction and the
            failure's innermost frame. A bare KeyboardInterrupt (Ctrl-C) propagates as it is.
    """
    for index in range(start, stop):
        action = row[index]
        begin = perf_counter()
        before = state.waited
        try:
            handlers[action[1]](state, action, index)
        except PipecError:
            raise
        except BaseException as error:  # the model's forward, loss or backward ran inside: name where it failed
            if is_interrupt(error):
                raise
            raise RuntimeFault(f"the instruction failed: {failure_words(error)}", state.rank, index,
                               action.text() if text is None else text(index)) from error
        if synchronize is not None:
            synchronize()
        if record is not None:
            record((index, begin, perf_counter(), state.waited - before))


# ------------------------------------------------------------ stages on rank groups


def placed_refusal(program: Program) -> str | None:
    """Why the runtime cannot train ``program``'s stages on rank groups, or None (also for a program with none).

    It trains an activation-passing pipeline whose every stage sits on a group of one size k, holding
    no replica all-reduce: what ``mesh_placement.place_on_mesh`` makes (PP x DP, PP x FSDP, PP x CP); and a
    family's that trains on groups (``RuntimeFamily.trains_on_groups``: TawPipe x DP). A context-parallel one
    (stages split by ``SEQUENCE_SHARE``) needs its ``stage_ring``, a sequence ring of k ranks, and a backward
    that is not split (each attention's ring backward runs once, inside B).
    """
    if not program.placed_on_groups:
        return None
    placed = next(info for info in program.stages if info.placement is not None)
    where = (f"{program.name or 'this program'} places stage {placed.id} on the group of ranks "
             f"{', '.join(map(str, placed.placement.ranks))}")
    if program.plans and not runtime_family(program).trains_on_groups:
        return (f"{where} and is not an activation-passing pipeline; the runtime trains stages on rank groups "
                "only in activation passing (PP x DP, PP x FSDP) yet")
    sizes = {len(info.ranks) for info in program.stages}
    if len(sizes) > 1 or any(info.placement is None for info in program.stages):
        return (f"{where}, but its stages sit on groups of different sizes ({', '.join(map(str, sorted(sizes)))}); "
                "the runtime hands member i of one group to member i of the next, so every stage needs a group "
                "of one size")
    if any(a.op == ops.ALLREDUCE_GRAD for row in program.ranks for a in row):
        return (f"{where} and holds a replica all-reduce (ALLREDUCE_GRAD), which the runtime defines for one-rank "
                "stages only")
    return _context_refusal(program, where, sizes.pop())


def _context_refusal(program: Program, where: str, members: int) -> str | None:
    """Why a program whose stages split each sequence over their groups (PP x CP) cannot train, or None
    (also for one that splits rows)."""
    splits = {info.placement.split for info in program.stages}
    ring = program.stage_ring
    if splits == {ROW_SHARE} and ring is None:
        return None
    if splits != {SEQUENCE_SHARE} or ring is None:
        return (f"{where}; its stages split their values by {' and '.join(sorted(splits))} with "
                f"{'a' if ring is not None else 'no'} stage ring, and the runtime trains stages that all split "
                "rows (PP x DP) or all split each sequence through the program's stage ring (PP x CP)")
    if not runs_in_stages(ring) or ring.num_ranks != members:
        return (f"{where}, and its stage ring {ring.name or ''} is not a sequence ring of {members} ranks, one per "
                "member of a stage's group")
    if len({len(ring.rings.chunks_of(r)) for r in range(members)}) > 1:
        return (f"{where}, and its stage ring {ring.name or ''} gives its ranks unequal shares of a sequence; a "
                "stage's members hand each other equal shares")
    parts = {part for pieces in ops.SPLITS.values() for part in pieces}  # I, W: a split backward's parts
    split = next((a for row in program.ranks for a in row if a.op in parts), None)
    if split is not None:
        return (f"{where} and splits its backward ({split.text()}); a context-parallel stage runs each attention's "
                "ring backward once, inside a whole backward B")
    return None


def share_of(program: Program, rank: int) -> tuple[int, int] | None:
    """(i, k): ``rank`` takes share i of k of every microbatch, as its stages' placements state it
    (``Placement.shares``; the prover proved a rank's stages state one share), or None."""
    if not program.placed_on_groups:
        return None
    for info in program.stages:
        if rank in info.ranks:
            return info.placement.share_of(rank), len(info.ranks)
    return None


def row_shares(program: Program) -> int:
    """k: how many shares a microbatch's rows are cut into (1 for a program with no stage on a group, or whose
    stages split each sequence instead)."""
    return _shares(program, ROW_SHARE)


def token_shares(program: Program) -> int:
    """C: how many shares each sequence of a microbatch is cut into along dimension 1 (PP x CP: member i
    keeps ring rank i's chunks of ``Program.stage_ring``); 1 for any other program."""
    return _shares(program, SEQUENCE_SHARE)


def _shares(program: Program, split: str) -> int:
    if not program.placed_on_groups:
        return 1
    return max((len(info.ranks) for info in program.stages if info.placement.split == split), default=1)


__all__ = ["FAMILY_MODULES", "Handler", "Record", "RuntimeFamily", "StepOutcome", "Trainer", "families",
           "load_families", "placed_refusal", "refusal_outside", "register", "row_shares", "share_of",
           "run_instructions", "runtime_family", "token_shares"]
