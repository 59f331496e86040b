"""Compositions: a schedule built from a shipped (or the user's) pipeline schedule, on a mesh of rank axes.

A composing schedule holds only ``mesh``, ``pipeline NAME(ARG = E, ...) from
"TARGET"``, one policy for its stages' groups (``replicate over AXIS``, ``shard
over AXIS [reshard after forward]``, or ``context over AXIS ring "TARGET"``:
the stages' sequences split over AXIS, their attention a ring schedule) or,
for HSDP, one ``shard`` and one ``replicate`` line over two different axes
(weights sharded over the first, the shards replicated over the second),
``require`` and ``let``. The front end resolves
and evaluates it like any schedule (its parameters, requirements and lets,
the mesh's sizes and the pipeline's and the ring's arguments, each an
expression of the parameters) into a ``CompositionSpec``; reading the targets,
compiling the named schedules and placing the pipeline on the mesh is the driver's
(``pipec.compiler.composition``), since only the compiler knows where
targets live and how a program is placed.

Contract: ``is_composition(schedule)`` says whether a parsed schedule is one
(it holds a composition's declaration); ``resolve_composition`` returns a
``ResolvedComposition`` whose ``evaluate(defines)`` gives the
``CompositionSpec``, or raises every resolution error at once (another
family's declaration, a missing or second mesh, pipeline or policy, a data
or context axis that is not the mesh's, a context policy beside a data one
(PP x CP x DP is not built), ...), each at its place.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from pipec.dsl import ast
from pipec.dsl.evaluate import INT, KEY, Fn, Resolver, Scope
from pipec.dsl.limits import MAX_RANKS
from pipec.dsl.schedule import ResolvedSchedule, format_values
from pipec.dsl.spec import TaskKinds
from pipec.errors import EvalError, SourceErrors

# The mesh axis the composed pipeline runs along (ir.Mesh's name for it in every composed program).
PP_AXIS = "pp"

# The declarations that make a schedule a composition, and the others it may hold beside them.
_COMPOSING = (ast.Mesh, ast.ComposedPipeline, ast.DataPolicy, ast.ContextPolicy)
_ALSO_ALLOWED = (ast.Require, ast.Let)
_WORD = re.compile(r"[A-Za-z_]\w*")
_WORDS = {ast.Mesh: "mesh", ast.ComposedPipeline: "pipeline ... from", ast.DataPolicy: "replicate|shard over",
          ast.ContextPolicy: "context over"}


def is_composition(schedule: ast.Schedule) -> bool:
    """Whether ``schedule`` declares a composition (a ``mesh``, a ``pipeline ... from`` or a data policy)."""
    return any(isinstance(decl, _COMPOSING) for decl in schedule.decls)


@dataclass
class CompositionSpec:
    """An evaluated composition: what the driver compiles and places.

    Attributes:
        name, path, source: the composing schedule's (the composed program's name, messages).
        schedule: its name in its file (``name`` is the file's for a shipped one).
        params: its parameter values (the composed program's ``params``).
        mesh: (axis, size) pairs, outermost first (``ir.Mesh``'s axes).
        arguments: the composed pipeline's parameter values, by name.
        pipeline: the ``pipeline ... from`` declaration (its name, target and the spans of errors).
        policy: the policy of the stages' groups: a data policy (its axis, sharded or not, reshard after
            forward; for HSDP the ``shard`` one) or a context policy (its axis and ring schedule).
        replicas: HSDP's ``replicate over`` line (the axis the shards are replicated over), else None.
        ring_arguments: a context policy's ring arguments, by name (its ranks are the axis's size).
    """

    name: str
    schedule: str
    path: str
    source: str
    params: dict[str, int | bool]
    mesh: tuple[tuple[str, int], ...]
    arguments: dict[str, int | bool]
    pipeline: ast.ComposedPipeline
    policy: ast.DataPolicy | ast.ContextPolicy
    replicas: ast.DataPolicy | None = None
    ring_arguments: dict[str, int | bool] = field(default_factory=dict)


@dataclass
class ResolvedComposition(ResolvedSchedule):
    """A composing schedule resolved: its parameters, lets and requires as any schedule's
    (``ResolvedSchedule``), and the closures of its mesh sizes and pipeline (and ring) arguments."""

    mesh: ast.Mesh | None = None
    mesh_sizes: list[Fn] = field(default_factory=list)
    pipeline: ast.ComposedPipeline | None = None
    arguments: list[tuple[ast.PipelineArg, Fn]] = field(default_factory=list)
    policy: ast.DataPolicy | None = None
    replicas: ast.DataPolicy | None = None  # HSDP's replicate line (``policy`` is then its shard line)
    refused_policy: bool = False  # a policy line was refused: which axis it meant is unknown
    context: ast.ContextPolicy | None = None
    ring_arguments: list[tuple[ast.PipelineArg, Fn]] = field(default_factory=list)

    def evaluate(self, defines: dict[str, str | int | bool] | None = None) -> CompositionSpec:
        """Evaluate with parameter values (as ``ResolvedSchedule.evaluate``).

        Raises:
            UsageError: an unknown or ill-typed parameter value.
            RequireError: a ``require`` is false.
            EvalError: an axis of size below 1, or a mesh of more than ``MAX_RANKS`` ranks, located.
        """
        env = self.resolver.new_env()
        values = self._bind_params(env, dict(defines or {}))
        self._run_scalar_steps(env, values)
        sizes = []
        for axis, size_fn in zip(self.mesh.axes, self.mesh_sizes):
            size = size_fn(env)
            if size < 1:
                raise EvalError(f"axis {axis.name} has {size} ranks at {format_values(values)}; an axis has at "
                                "least 1", axis.size.span, self.source)
            sizes.append(size)
        if math.prod(sizes) > MAX_RANKS:
            shown = " x ".join(f"{axis.name} {size:,}" for axis, size in zip(self.mesh.axes, sizes))
            raise EvalError(f"the mesh has {shown} ranks at {format_values(values)}: more than pipec's limit of "
                            f"{MAX_RANKS:,} ranks", self.mesh.span, self.source)
        return CompositionSpec(
            name=self.name, schedule=self.node.name, path=self.path, source=self.source, params=values,
            mesh=tuple((axis.name, size) for axis, size in zip(self.mesh.axes, sizes)),
            arguments={arg.name: fn(env) for arg, fn in self.arguments}, pipeline=self.pipeline,
            policy=self.context or self.policy, replicas=self.replicas,
            ring_arguments={arg.name: fn(env) for arg, fn in self.ring_arguments},
        )


def resolve_composition(schedule: ast.Schedule, path: str, source: str, tasks: TaskKinds) -> ResolvedComposition:
    """Resolve a composing schedule (``is_composition``).

    Args:
        schedule: the parsed schedule.
        path, source: for messages.
        tasks: the task kinds (kept for ``ResolvedSchedule``'s sake; a composition orders no task).
    Returns:
        the ``ResolvedComposition``.
    Raises:
        SourceErrors: every resolution error found, at once (a single one as a ``ResolveError``).
    """
    resolver = Resolver(path, source)
    out = ResolvedComposition(schedule, path, source, resolver, tasks=tasks)
    scope = Scope()
    out.resolve_params(schedule, scope)
    for decl in schedule.decls:
        if isinstance(decl, _ALSO_ALLOWED):
            out.resolve_scalar(decl, scope)
        elif isinstance(decl, _COMPOSING):
            if _first_of_kind(out, decl):
                _RESOLVERS[type(decl)](out, decl, scope)
        else:
            word = _WORD.match(source.split("\n")[decl.span.line - 1], decl.span.col - 1)
            resolver.error(f"a composition holds only mesh, pipeline ... from, replicate|shard over, context over, "
                           f"require and let; `{word.group(0) if word else '?'}` belongs in a pipeline's own schedule "
                           "(the one `pipeline` names)", decl.span)
    _check_complete(out, schedule)
    if resolver.errors:
        if len(resolver.errors) == 1:
            raise resolver.errors[0]
        raise SourceErrors(resolver.errors)
    return out


def _first_of_kind(out: ResolvedComposition, decl: ast.Node) -> bool:
    """True for the first mesh, pipeline or policy (the caller resolves it); a second is an error at it, naming
    the first's line, except a second data policy, which ``_hybrid_pair`` takes or refuses (False either way)."""
    if isinstance(decl, ast.DataPolicy) and out.policy is not None:
        return _hybrid_pair(out, decl)
    first = {ast.Mesh: out.mesh, ast.ComposedPipeline: out.pipeline, ast.DataPolicy: out.policy,
             ast.ContextPolicy: out.context}[type(decl)]
    if first is not None:
        out.resolver.error(f"a composition has one `{_WORDS[type(decl)]}`; another is at line {first.span.line}",
                           decl.span)
        return False
    return True


def _hybrid_pair(out: ResolvedComposition, decl: ast.DataPolicy) -> bool:
    """A second (or third) data policy: HSDP's other half when it is of the other kind on another axis (the
    ``shard`` line then is ``policy``, the ``replicate`` line ``replicas``); an error at it otherwise."""
    held = [each for each in (out.policy, out.replicas) if each is not None]
    same_kind = next((each for each in held if each.sharded == decl.sharded), None)
    if same_kind is not None:
        word = "shard" if decl.sharded else "replicate"
        out.resolver.error(f"a composition has one `{word} over`; another is at line {same_kind.span.line}",
                           decl.span)
        return False
    same_axis = next((each for each in held if each.axis == decl.axis), None)
    if same_axis is not None:
        out.resolver.error(f"axis {decl.axis} has a data policy already (line {same_axis.span.line}): a hybrid "
                           "composition shards over one axis and replicates the shards over another",
                           decl.axis_span)
        out.refused_policy = True
        return False
    _check_reshard(out, decl)
    out.policy, out.replicas = (decl, out.policy) if decl.sharded else (out.policy, decl)
    return False


def _resolve_mesh(out: ResolvedComposition, decl: ast.Mesh, scope: Scope) -> None:
    out.mesh = decl
    seen: dict[str, ast.MeshAxis] = {}
    for axis in decl.axes:
        if axis.name in seen:
            out.resolver.error(f"the mesh has axis {axis.name} twice", axis.name_span)
        seen.setdefault(axis.name, axis)
        out.mesh_sizes.append(out.resolver.expect(axis.size, scope, INT, f"the size of axis {axis.name}"))
    if PP_AXIS not in seen:
        out.resolver.error(f"the mesh needs the pipeline's axis, `{PP_AXIS}` (`mesh {PP_AXIS} = P, dp = D`): "
                           f"the composed pipeline's ranks run along it", decl.span)


def _resolve_pipeline(out: ResolvedComposition, decl: ast.ComposedPipeline, scope: Scope) -> None:
    out.pipeline = decl
    out.arguments = _resolve_arguments(out, decl.args, scope)


def _resolve_context(out: ResolvedComposition, decl: ast.ContextPolicy, scope: Scope) -> None:
    out.context = decl
    out.ring_arguments = _resolve_arguments(out, decl.args, scope)


def _resolve_arguments(out: ResolvedComposition, args: tuple[ast.PipelineArg, ...],
                       scope: Scope) -> list[tuple[ast.PipelineArg, Fn]]:
    """The closures of a named schedule's arguments; one given twice, or a tuple, is an error at it."""
    seen: set[str] = set()
    closures = []
    for arg in args:
        if arg.name in seen:
            out.resolver.error(f"{arg.name} is given twice", arg.name_span)
        seen.add(arg.name)
        fn, type_ = out.resolver.expr(arg.value, scope)
        if type_ == KEY:
            out.resolver.error("a parameter's value is an integer or a boolean, not a tuple", arg.value.span)
        closures.append((arg, fn))
    return closures


def _resolve_policy(out: ResolvedComposition, decl: ast.DataPolicy, scope: Scope) -> None:
    out.policy = decl
    _check_reshard(out, decl)


def _check_reshard(out: ResolvedComposition, decl: ast.DataPolicy) -> None:
    if decl.reshard_after_forward and not decl.sharded:
        out.resolver.error("`reshard after forward` drops the weights a sharded stage gathered; a replicated "
                           "stage keeps its whole weights (write `shard over ... reshard after forward`)", decl.span)


_RESOLVERS = {ast.Mesh: _resolve_mesh, ast.ComposedPipeline: _resolve_pipeline, ast.DataPolicy: _resolve_policy,
              ast.ContextPolicy: _resolve_context}


def _check_complete(out: ResolvedComposition, schedule: ast.Schedule) -> None:
    """A composition needs a mesh, a pipeline and one policy, and the policy's axis is a mesh axis besides pp."""
    error = out.resolver.error
    if out.context is not None and out.policy is not None:
        # each stage's group would be a cp x dp grid: its rows split over dp and its sequences over cp
        error(f"PP x CP x DP is not built: a composition splits its stages over one axis, by sequence "
              f"(`context over`) or by rows (`{'shard' if out.policy.sharded else 'replicate'} over` at line "
              f"{out.policy.span.line}); drop one", out.context.span)
        return
    if out.mesh is None:
        error(f"a composition needs a mesh: `mesh {PP_AXIS} = EXPR, dp = EXPR` (its rank axes, outermost first)",
              schedule.span)
    if out.pipeline is None:
        error("a composition needs the pipeline it places: `pipeline NAME(PARAM = EXPR, ...) from \"TARGET\"`",
              schedule.span)
    policy = out.context or out.policy
    if policy is None:
        error("a composition needs a policy for its stages' groups: `replicate over AXIS`, `shard over AXIS "
              "[reshard after forward]` or `context over AXIS ring \"TARGET\"`", schedule.span)
    if out.mesh is None or policy is None:
        return
    names = [axis.name for axis in out.mesh.axes]
    policies = [out.context] if out.context is not None else [each for each in (out.policy, out.replicas)
                                                              if each is not None]
    kind = "context" if out.context is not None else "data"
    wrong = [each for each in policies if each.axis == PP_AXIS or each.axis not in names]
    for policy in wrong:
        error(f"the {kind} axis cannot be the pipeline's axis, {PP_AXIS}" if policy.axis == PP_AXIS else
              f"{policy.axis} is not an axis of the mesh (line {out.mesh.span.line}: {', '.join(names)})",
              policy.axis_span)
    if wrong:
        return  # which axis was meant is unknown: the others are not said to be unused
    if PP_AXIS not in names or out.refused_policy:
        return  # said at the mesh, or at the refused line (the axis it meant is not said to be unused)
    for axis in out.mesh.axes:
        if axis.name in (PP_AXIS, *(each.axis for each in policies)):
            continue
        if out.replicas is None:
            error(f"axis {axis.name} is used by nothing: a composition runs the pipeline along {PP_AXIS} and "
                  f"replicates, shards or splits the sequences of its stages over one other axis "
                  f"({policies[0].axis})", axis.name_span)
        else:
            error(f"axis {axis.name} is used by nothing: a hybrid composition runs the pipeline along {PP_AXIS}, "
                  f"shards its stages' weights over {out.policy.axis} and replicates the shards over "
                  f"{out.replicas.axis}", axis.name_span)
