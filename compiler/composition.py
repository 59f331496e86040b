"""Compile a composition: the pipeline schedule it names, compiled and checked alone, placed on its mesh.

Contract: ``lower_composition(spec, costs)`` reads the target of the
composition's ``pipeline NAME(...) from "TARGET"`` as the command line reads
a target (a file relative to the composing file, else a shipped schedule's
name; through the guarded reader), resolves the schedule NAME there, checks
the arguments against its parameters, evaluates and compiles it with the
driver (its checks included), and places the result on the mesh with
``mesh_placement.place_on_mesh``. A context policy's ring (``context over AXIS
ring "TARGET"``) is read the same way, must be a sequence-ring schedule, and is
compiled (its checks included) with its ranks parameter set to the axis's
size; the ring's own ``require`` refusing that size is said at the policy.
It returns (compute-only, final) programs, both placed, named after the
composition and carrying its parameters; the final
program is not yet checked as a composed program (``driver.compile_spec``
does that). Every mistake of the composition is reported at its place in the
composing file; the named schedule's own errors at theirs, in its file.
"""
from __future__ import annotations

import os
from dataclasses import replace

from pipec.compiler.family import families_of, first_refusal
from pipec.compiler.mesh_placement import ContextParallel, DataParallel
from pipec.compiler.costs import CostModel
from pipec.compiler.driver import compile_spec, load_target, shipped_schedules, task_kinds
from pipec.compiler.ir import Mesh, Program
from pipec.dsl import ast, parse, resolve
from pipec.dsl.composition import PP_AXIS, CompositionSpec, is_composition
from pipec.dsl.limits import MAX_TASKS
from pipec.dsl.schedule import ResolvedSchedule, format_values
from pipec.errors import EvalError, RequireError, ResolveError, ScheduleError, UsageError

# The field a sequence ring's declarations keep (pipec.dsl.rings): what makes a schedule a ring schedule.
_RING_FAMILY = "rings"


def lower_composition(spec: CompositionSpec, costs: CostModel | None = None) -> tuple[Program, Program]:
    """The composition's (compute-only, final) programs, placed on its mesh; see the module docstring.

    Raises:
        ResolveError: TARGET not found or not readable, no schedule NAME in it, or NAME a composition
            itself (a cycle when it is this one), at the target or the name; a context policy's ring
            target likewise, or not a sequence-ring schedule.
        RequireError: the ring's own requirement refuses the context axis's size, at the policy.
        EvalError: an argument the schedule has no parameter for, or a value its parameter refuses.
        ScheduleError: a parameter left without a value, or a program the mesh cannot take (its pp axis
            is not the pipeline's ranks, ...), at the ``pipeline`` declaration.
        SourceError: the named schedule's own errors, in its file; ProgramError: its checks'.
    """
    node = spec.pipeline
    inner = _named_schedule(spec, node.name, node.name_span, node.target, node.target_span)
    compiled = compile_spec(inner.evaluate(_arguments(spec, inner, node)), costs=costs)
    policy = spec.policy
    mesh = Mesh(spec.mesh)
    if isinstance(policy, ast.ContextPolicy):
        data = ContextParallel(policy.axis, _ring_program(spec, policy, mesh.axis_size(policy.axis), costs))
    else:
        data = DataParallel(policy.axis, policy.sharded, policy.reshard_after_forward,
                            spec.replicas.axis if spec.replicas is not None else None)
    _check_task_limit(spec, compiled.compute, mesh.size // compiled.program.num_ranks)
    # the pipeline's family places it (weight passing x DP has a placement of its own): a policy no program of
    # the family takes is said at the policy, anything else at the `pipeline` declaration
    refusal = first_refusal(compiled.program, lambda family: family.refuse_mesh_policy(compiled.program, data))
    if refusal is not None:
        raise ScheduleError(refusal, spec.policy.span, spec.source)
    family = families_of(compiled.program)[0]
    try:
        compute, program = family.place_composed(compiled.compute, compiled.program, mesh, PP_AXIS, data, spec.name)
    except UsageError as error:
        raise ScheduleError(str(error), spec.pipeline.span, spec.source) from None
    return tuple(replace(each, params=dict(spec.params), source=spec.path) for each in (compute, program))


def _check_task_limit(spec: CompositionSpec, compute: Program, copies: int) -> None:
    """Refuse, at the ``pipeline`` declaration, a composition whose placed program would hold more than
    ``MAX_TASKS`` tasks: every member of a data group runs its pp rank's tasks, so placing multiplies
    them by the data axis's size (the named schedule alone was held to the limit)."""
    tasks = sum(1 for row in compute.ranks for action in row if action.is_compute)
    if tasks * copies > MAX_TASKS:
        raise EvalError(f"{spec.name} at {format_values(spec.params)} has {tasks * copies:,} tasks ({tasks:,} of "
                        f"the pipeline x {copies:,} ranks of each data group); pipec's limit is {MAX_TASKS:,}",
                        spec.pipeline.span, spec.source)


def _find_target(composing: str, target: str) -> str | None:
    """``target`` as the command line reads a target, but relative to the file ``composing``: a file there,
    else a shipped schedule's name (never a file of the current folder that happens to bear that name)."""
    beside = os.path.join(os.path.dirname(composing), target)
    if os.path.exists(beside):
        return beside
    return shipped_schedules().get(target)


def _ring_program(spec: CompositionSpec, policy: ast.ContextPolicy, size: int,
                  costs: CostModel | None) -> Program | None:
    """The context policy's ring schedule compiled for ``size`` ranks (its ranks parameter), checked; None for an
    axis of one rank, which splits no sequence (the pipeline runs as it is, as with a data axis of one), once
    the ring is found to be a sequence-ring schedule given no ranks."""
    ring = _named_schedule(spec, policy.ring, policy.ring_span, policy.target, policy.target_span)
    called = policy.ring or ring.node.name
    if ring.family.field != _RING_FAMILY:
        raise ResolveError(f"{called} in '{policy.target}' is not a sequence-ring schedule (it declares no "
                           "`sequence chunks`); a context axis runs each stage's attention through a ring: "
                           "ring_attention, zigzag_ring, tasp", policy.ring_span, spec.source)
    ranks = ring.ranks_param
    given = next((arg for arg in policy.args if arg.name == ranks), None)
    if given is not None:
        raise EvalError(f"{ranks} is the ring's ranks: the size of axis {policy.axis}, given by the mesh; leave it "
                        "out", given.name_span, spec.source)
    if size == 1:
        return None
    arguments = dict(_arguments(spec, ring, policy), **{ranks: size})
    refusal = ring.argument_refusal(ranks, size)
    if refusal is not None:
        raise EvalError(f"axis {policy.axis} has {size} ranks: {refusal}", policy.axis_span, spec.source)
    where = f"the ring {called} on axis {policy.axis} ({size} ranks)"
    try:
        ring_spec = ring.evaluate(arguments)
    except RequireError as error:  # the ring cannot take the axis's size: said where the axis is given to it
        raise RequireError(f"{where}: {error.message}", policy.span, spec.source) from None
    except (EvalError, ScheduleError) as error:  # a limit the axis's size passes in the ring's file: said here too
        raise type(error)(f"{where}: {error.message}{_written_at(error)}", policy.span, spec.source) from None
    return compile_spec(ring_spec, costs=costs).program


def _written_at(error) -> str:
    """`` (zigzag_ring.pipe:10:19)``: where in its own file a ring's error arose, or ''."""
    span = error.span
    return f" ({os.path.basename(span.file)}:{span.line}:{span.col})" if span is not None and span.file else ""


def _named_schedule(spec: CompositionSpec, name: str | None, name_span, target: str, target_span) -> ResolvedSchedule:
    """The schedule ``name`` (None: the first) of ``target``, parsed and resolved; a composition is refused
    (one pipeline is placed, and a ring is a schedule of its own)."""
    path = _find_target(spec.path, target)
    if path is None:
        raise ResolveError(f"no file '{target}' beside {spec.path} and no shipped schedule of that name "
                           f"(shipped: {', '.join(shipped_schedules())})", target_span, spec.source)
    try:
        shown, source, _ = load_target(path)
    except UsageError as error:  # a folder, a compiled program, too large, not UTF-8
        raise ResolveError(str(error), target_span, spec.source) from None
    module = parse(source, shown)
    schedule = module.schedule(name)
    if schedule is None:
        names = ", ".join(each.name for each in module.schedules) or "none"
        wanted = f"no schedule '{name}'" if name is not None else "no schedule"
        raise ResolveError(f"'{shown}' has {wanted} (it has {names})", name_span, spec.source)
    if is_composition(schedule):
        raise ResolveError(f"{schedule.name} in '{shown}' {_why_not_composed(spec, path, schedule)}", target_span,
                           spec.source)
    return resolve(schedule, shown, source, task_kinds())


def _why_not_composed(spec: CompositionSpec, path: str, schedule: ast.Schedule) -> str:
    """What to say of a composition named by a composition: a cycle when it is this one, or names it back."""
    if os.path.samefile(path, spec.path) and schedule.name == spec.schedule:
        return "composes itself (a cycle)"
    back = next((decl for decl in schedule.decls if isinstance(decl, ast.ComposedPipeline)), None)
    target = None if back is None else _find_target(path, back.target)
    if target is not None and os.path.samefile(target, spec.path) and back.name == spec.schedule:
        return f"composes {spec.schedule} back (a cycle)"
    return "is a composition itself; a composition places a pipeline schedule, one rank per stage"


def _arguments(spec: CompositionSpec, inner: ResolvedSchedule,
               node: ast.ComposedPipeline | ast.ContextPolicy) -> dict[str, int | bool]:
    """The arguments ``node`` (the pipeline or the ring) gives, each checked against the named schedule's
    parameter where it is written; the ring's ranks, which the axis gives, are not missing."""
    given = spec.arguments if isinstance(node, ast.ComposedPipeline) else spec.ring_arguments
    for arg in node.args:
        refusal = inner.argument_refusal(arg.name, given[arg.name])
        if refusal is not None:
            known = any(param.name == arg.name for param, _, _ in inner.params)
            raise EvalError(refusal, arg.value.span if known else arg.name_span, spec.source)
    missing = [param for param in inner.missing_arguments(given) if param.name != inner.ranks_param
               or isinstance(node, ast.ComposedPipeline)]
    if missing:
        listing = ", ".join(f"{param.name} ({param.type})" for param in missing)
        raise ScheduleError(f"schedule '{inner.node.name}' needs a value for {listing}: give "
                            f"`{missing[0].name} = EXPR` here", node.span, spec.source)
    return dict(given)
