"""Tensor parallelism's declaration (Megatron-LM's MLP; docs/ir.md, "Adding a family"): resolved, checked, evaluated.

``tensor parallel layers E`` makes a schedule tensor-parallel: E MLP blocks,
each split across every rank. It lays the schedule out (one stage per layer,
one pipeline) and the compiler derives every rank's order and all-reduces,
so a tensor-parallel schedule holds its parameters (ranks, microbatches),
``let``, ``def``, ``require`` and this one declaration; every other family's
declaration, and a written order, is refused where it is written.

Contract: ``resolve_decl`` compiles the declaration; ``check_schedule``
reports what needs no parameter value (one declaration, nothing foreign);
``layout`` evaluates it with the parameters, raising ``EvalError`` at the
expression when the layer count is below 1 or the program past pipec's task
limit. The front end hands the compiler a ``TensorSpec`` in
``ScheduleSpec.family_declarations["tensor"]``.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipec.dsl import ast
from pipec.dsl.evaluate import INT
from pipec.dsl.families import Declared, Layout, register
from pipec.dsl.limits import BYTES_PER_TASK_TEXT, MAX_TASKS
from pipec.dsl.rings import OTHER_DECLS, RING_DECLS
from pipec.errors import EvalError

FIELD = "tensor"
# What a tensor-parallel schedule cannot hold: the pipelines' declarations, the rings', any order.
_FOREIGN = OTHER_DECLS + RING_DECLS + (ast.ExplicitOrder,)
_REFUSALS = {
    ast.Recompute: "`recompute stage` belongs to activation passing: a tensor-parallel schedule keeps one "
                   "microbatch's activations at a time and recomputes none",
    ast.Stash: "`stash weights` belongs to activation passing: under tensor parallelism every rank steps its "
               "slices after the list",
}


@dataclass(frozen=True)
class TensorSpec:
    """An evaluated ``tensor parallel layers E``: ``layers`` MLP blocks, each split across every rank."""

    layers: int


class _TensorParallel(Declared):
    """Tensor parallelism's declaration: it lays the schedule out (a stage per layer), and the order is derived."""

    field = FIELD
    decls = (ast.TensorParallel,)
    derives_layout = True
    foreign = _FOREIGN

    def declares(self, schedule):
        return any(isinstance(decl, ast.TensorParallel) for decl in schedule.decls)

    def resolve_decl(self, schedule, decl, scope):
        resolver, held = schedule.resolver, schedule.family_decls
        if schedule.family is not self:
            resolver.error("`tensor parallel layers` makes a schedule tensor-parallel; it cannot stand in a "
                           "schedule of another family", decl.span)
        elif FIELD in held:
            resolver.error(f"`tensor parallel` is already declared at line {held[FIELD][0].span.line}", decl.span)
        else:
            held[FIELD] = (decl, resolver.expect(decl.layers, scope, INT, "a number of layers"))

    def check_schedule(self, schedule, node):
        if schedule.family is not self:
            return
        first = schedule.family_decls[FIELD][0]
        for decl in node.decls:
            if isinstance(decl, _FOREIGN):
                schedule.resolver.error(
                    f"a tensor-parallel schedule (`tensor parallel` at line {first.span.line}) is laid out by its "
                    "layers and its order derived: it cannot hold this declaration", decl.span)

    def refusal(self, decl):
        return _REFUSALS.get(type(decl))

    def evaluated(self, spec):
        return spec.family_declarations.get(FIELD)

    def keep(self, spec, declared):
        spec.family_declarations[FIELD] = declared

    def layout(self, schedule, env, P, label):
        node, layers_fn = schedule.family_decls[FIELD]
        layers = layers_fn(env)
        if layers < 1:
            raise EvalError(f"`tensor parallel layers` needs at least 1 layer, got {layers}", node.layers.span,
                            schedule.source)
        N = next(env[slot] for param, slot, _ in schedule.params if param.name == schedule.microbatches_param)
        tasks = 2 * layers * P * N
        if tasks > MAX_TASKS:
            raise EvalError(f"{label} has {tasks:,} tasks (a forward and a backward per layer, microbatch and "
                            f"rank); pipec's limit is {MAX_TASKS:,} tasks ({BYTES_PER_TASK_TEXT})",
                            node.layers.span, schedule.source)
        return Layout(TensorSpec(layers), [0] * layers, node.span)


register(_TensorParallel())
