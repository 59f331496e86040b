"""From a target (a path or a shipped schedule's name) to a checked program.

Contract: ``compile_target(target, defines)`` runs every phase in order,
parse -> resolve -> evaluate -> order -> compute program -> communication ->
liveness -> checks (on the final program, frees included), and returns a
``Compiled`` with the intermediate results a caller may want (spec,
compute-only program, final program). Each phase is a pure function of the one
before; a failure raises the ``PipecError`` of the phase that found it. The
front end resolves schedules against the rule table's task kinds
(``task_kinds``), so it knows no task by name. A composition (a schedule that
places another on a mesh, ``pipec.dsl.composition``) evaluates to a
``CompositionSpec``; lowering it compiles the schedule it names with these
same phases, checks included, and places the result on the mesh
(``pipec.compiler.composition``); the placed program is then checked like
any other.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from typing import Mapping

from pipec.compiler.checks import check_all
from pipec.compiler.costs import CostModel
from pipec.compiler.family import families_of, family_of_spec, first_refusal
from pipec.compiler.guarded_read import SOURCE, looks_like_program, read_text, shown_path
from pipec.compiler.ir import Program
from pipec.compiler.liveness import insert_frees
from pipec.compiler.memory_counts import Number, check_sizes
from pipec.compiler.placed_memory import may_size, unpriced
from pipec.compiler.ops import ACTIVATION_PASSING, COMPUTE_OPS, FAMILY_TASKS, RING_COMPUTE_OPS, RULES, UPDATE_OPS
from pipec.dsl import ResolvedSchedule, ScheduleSpec, parse, resolve
from pipec.dsl.composition import CompositionSpec
from pipec.dsl.spec import TaskKinds
from pipec.errors import UsageError


@dataclass
class Compiled:
    """What one compilation produced.

    Attributes:
        spec: the evaluated schedule (a composition's ``CompositionSpec``).
        compute: the compute-only program (what the schedule ordered; a composition's, placed on its mesh).
        program: the final program: communication, checks passed, frees.
    """

    spec: ScheduleSpec | CompositionSpec
    compute: Program
    program: Program


def shipped_schedules() -> dict[str, str]:
    """Shipped schedule names (the ``.pipe`` file stems) -> their paths."""
    folder = resources.files("pipec.schedules")
    out = {}
    for entry in folder.iterdir():
        if entry.name.endswith(".pipe"):
            out[entry.name[: -len(".pipe")]] = str(entry)
    return dict(sorted(out.items()))


def load_target(target: str) -> tuple[str, str, str | None]:
    """Find a schedule's source.

    Args:
        target: a path to a ``.pipe`` file or a shipped name, optionally
            followed by ``:NAME`` to pick one schedule of a file that has several.
    Returns:
        (path, source text, schedule name or None for the file's first).
    Raises:
        UsageError: no such file or shipped schedule; not a regular file, over
            ``guarded_read.SOURCE``'s size limit, not UTF-8, or JSON (a compiled program).
    """
    name = None
    path = target
    if not os.path.exists(target) and ":" in target:
        path, name = target.rsplit(":", 1)
    if not os.path.exists(path):
        shipped = shipped_schedules()
        if path not in shipped:
            listing = ", ".join(shipped) or "none"
            raise UsageError(f"no file or shipped schedule named '{shown_path(path)}' (shipped: {listing})")
        path = shipped[path]
    if os.path.isdir(path):
        raise UsageError(f"'{path}' is a folder, not a .pipe file")
    if looks_like_program(path):  # by content: a .pipe file never starts with '{'
        raise UsageError(f"'{path}' is JSON (a compiled program, as `pipec compile --format json` writes, or "
                         "another JSON file), not a .pipe schedule; `pipec check` and `pipec render` take a "
                         "compiled program")
    # the one guarded reader: a regular file (a FIFO or a device is refused at once), at most SOURCE.limit bytes
    source = read_text(path, SOURCE)
    return _display_path(path), source, name


def lasting_target(target: str) -> str:
    """``target`` as it still names the same schedule from another folder: a
    file's path made absolute (``:NAME`` kept); a shipped name as it is."""
    if os.path.exists(target):
        return os.path.abspath(target)
    path, sep, name = target.rpartition(":")
    if sep and os.path.exists(path):
        return f"{os.path.abspath(path)}:{name}"
    return target


def _display_path(path: str) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def task_kinds(family: str = ACTIVATION_PASSING) -> TaskKinds:
    """The task vocabulary the front end resolves schedules against, from the rule table.

    A task set with one alternative is always run; one with modes is the
    ``backward`` declaration's choice; one with an empty alternative is
    optional; one chosen per stage runs its first alternative (F) except on a
    recomputed stage, where the first's op becomes the second alternative (FC
    then R: ``TaskKinds.recompute``).
    The sequence ring family's computes (AF, AB) come along, for a ring's
    written order: forward the ones that read no value a compute of the family
    makes, backward the others (AB reads the statistics AF makes).
    """
    always: list[str] = []
    backward: dict[str, tuple[str, ...]] = {}
    optional: list[str] = []
    recompute: dict[str, tuple[str, str]] = {}
    for task_set in FAMILY_TASKS[family]:
        if () in task_set.alternatives:
            optional += [op for alternative in task_set.alternatives for op in alternative]
        elif task_set.modes:
            backward.update(zip(task_set.modes, task_set.alternatives))
        else:
            always += task_set.alternatives[0]
            if task_set.per_stage:
                (plain,), (keeping, remaking) = task_set.alternatives
                recompute[plain] = (keeping, remaking)
    in_family = set(always) | set(optional) | {op for kinds in backward.values() for op in kinds} \
        | {op for kinds in recompute.values() for op in kinds}
    made = {use for op in RING_COMPUTE_OPS for use in RULES[op].writes}
    ring_forward = tuple(op for op in RING_COMPUTE_OPS if not made & set(RULES[op].reads))
    ring_backward = tuple(op for op in RING_COMPUTE_OPS if op not in ring_forward)
    return TaskKinds(tuple(op for op in COMPUTE_OPS if op in in_family), tuple(always), backward, tuple(optional),
                     ring_forward, ring_backward, recompute, tuple(op for op in UPDATE_OPS if op in in_family))


def resolve_target(target: str) -> ResolvedSchedule:
    """Parse and resolve the schedule a target names."""
    path, source, name = load_target(target)
    module = parse(source, path)
    schedule = module.schedule(name)
    if schedule is None:
        if name is None:
            raise UsageError(f"'{path}' defines no schedule")
        names = ", ".join(s.name for s in module.schedules)
        raise UsageError(f"'{path}' has no schedule '{name}' (it has {names})")
    resolved = resolve(schedule, path, source, task_kinds())  # a composition's too (dsl.composition)
    if name is None and not os.path.exists(target) and target in shipped_schedules():
        resolved.called = target  # a shipped schedule goes by its file's name, as the user typed it
    return resolved


def lower_spec(spec: ScheduleSpec | CompositionSpec, costs: CostModel | None = None) -> tuple[Program, Program]:
    """Order and lower an evaluated schedule, unchecked.

    Returns:
        (compute-only program, program with communication). Evaluation already
        proved every task present once, in range and at home; an order whose
        dependencies cannot be met is kept as it is for the checks to name.
        A composition's pipeline is compiled and checked alone; its placement
        on the mesh is what is left unchecked.
    """
    if isinstance(spec, CompositionSpec):
        # imported here: the composition compiles its pipeline with this module's functions
        from pipec.compiler.composition import lower_composition

        return lower_composition(spec, costs)
    return family_of_spec(spec).lower(spec, costs)


def compile_spec(
    spec: ScheduleSpec | CompositionSpec,
    *,
    costs: CostModel | None = None,
    memory_budget: int | None = None,
    byte_budget: Mapping[str, Number] | None = None,
) -> Compiled:
    """Order and lower an evaluated schedule, and check the final program (after the last pass).

    Args:
        spec: the evaluated schedule.
        costs: the cost model that orders list-scheduled ranks; its ``sizes``
            (bytes of one value per size class) price ``byte_budget``.
        memory_budget: the most live activations per rank, or None.
        byte_budget: size class -> the most bytes of live values of that
            class per rank, or None; every class it names needs a size in ``costs``.
    Raises:
        UsageError: a byte budget for a class the cost model gives no size (checked before compiling; a
            ``shard`` budget priced by the ``weight`` size, once the program shows a sharded stage).
        CostFileError: an unknown size class in the budget.
    """
    sizes = costs.sizes if costs is not None else {}
    if byte_budget is not None:
        check_sizes(byte_budget)
        missing = [size_class for size_class in byte_budget if not may_size(size_class, sizes)]
        if missing:
            raise UsageError(f"a byte budget for {missing[0]!r} needs its size: the cost model gives none (sizes)")
    compute, program = lower_spec(spec, costs)
    missing = unpriced(program, byte_budget or {}, sizes)
    if missing:  # a shard budget priced by the weight bytes, on a program without a sharded stage
        raise UsageError(f"a byte budget for {missing[0]!r} needs its size: {program.name or 'the program'} shards "
                         "no stage's weights, so the weight size gives none (sizes)")
    if memory_budget is not None or byte_budget is not None:
        refusal = first_refusal(program, lambda family: family.refuse_memory_budget(spec.name))
        if refusal is not None:
            raise UsageError(refusal)
    # a placed program (a composition's) holds the frees its pipeline was given before it was placed
    if program.mesh is None and all(family.frees_values for family in families_of(program)):
        program = insert_frees(program)
    check_all(program, semantics="rendezvous", memory_budget=memory_budget, byte_budget=byte_budget, sizes=sizes)
    return Compiled(spec, compute, program)


def compile_target(
    target: str,
    defines: dict | None = None,
    *,
    costs: CostModel | None = None,
    memory_budget: int | None = None,
    byte_budget: Mapping[str, Number] | None = None,
) -> Compiled:
    """Compile a target with parameter values; see the module docstring and ``compile_spec``."""
    spec = resolve_target(target).evaluate(defines or {})
    return compile_spec(spec, costs=costs, memory_budget=memory_budget, byte_budget=byte_budget)
