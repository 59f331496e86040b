"""A searched order written as an explicit-order ``.pipe`` (``order rank r { if r == k { ... } }``).

The text fixes P and N with ``require`` (the order lists tasks literally, for these sizes only) and
writes the placement stage by stage, so ``pipec check`` proves it and it compiles to exactly the
order given. One pipeline or several (BitPipe, Chimera): with several it declares ``pipelines K``,
the route of every microbatch and the placement of each pipeline's stages, and a task is written
with its stage's position along its microbatch's pipeline, as the language reads ``F(s, m)``. A
device map (``map rank r to device``) is written whenever the target has one, so links are priced
between the same devices. A recomputed stage's forward (FC) is written as the plain forward it
replaces (F) under ``recompute stage s when s == k or ...`` (positions, so every replica of a
chunk), and its recompute (R) where the search put it, so the compiler places no recompute of its own.
"""
from __future__ import annotations

from pipec.compiler.family import families_of
from pipec.compiler.pipe_literals import lookup_expression
from pipec.compiler.ir import Action, Program
from pipec.compiler.driver import task_kinds
from pipec.compiler.ops import ACTIVATION_PASSING
from pipec.errors import UsageError

# ops a backward-split program runs (I: input gradient) and that the language writes as is
_SPLIT_OPS = frozenset({"I", "W"})


# the language's words: a recomputed stage's forward (FC) is written as the plain one (F) it becomes there,
# its recompute (R) as is
_WRITTEN_AS = task_kinds().checkpointed
_RECOMPUTES = frozenset(task_kinds().recomputes)
_WRITTEN_OPS = frozenset({"F", "B"}) | _SPLIT_OPS | frozenset(_WRITTEN_AS) | _RECOMPUTES


def refuse_unwritable(program: Program, final: Program | None = None) -> None:
    """Raise UsageError unless ``order_to_pipe`` can write ``program``'s tasks (checked before a search).

    ``final``: the lowered program ``program`` is the compute-only form of, whose family plans say what
    it is (a compute-only program may hold none); ``program`` itself when None."""
    whole = final if final is not None else program
    others = sorted({family.name for family in families_of(whole)} - {ACTIVATION_PASSING})
    if others or whole.mesh is not None:
        raise UsageError(f"order_to_pipe writes activation passing's orders (one pipeline or several); not "
                         f"{', '.join(others) or 'a mesh'} (a family that searches itself writes its own answer: "
                         f"Family.search)")
    extra = {a.op for row in program.ranks for a in row} - _WRITTEN_OPS
    if extra:
        raise UsageError(f"pipec search writes F, B, I and W tasks (FC and R on recomputed stages): this program has "
                         f"{', '.join(sorted(extra))}")


def order_to_pipe(program: Program, order: list[list[Action]], name: str = "searched") -> str:
    """The ``.pipe`` text of ``program``'s placement with ``order`` as its explicit order.

    Args:
        program: the compute-only program searched (its stages, pipelines, routes and device map are written).
        order: per rank, its compute tasks (global stage ids, as ``Program`` holds them).
        name: the schedule's name.
    Returns:
        the text of one schedule that compiles to ``program``'s placement with exactly ``order``.
    """
    refuse_unwritable(program)
    ops = {a.op for row in order for a in row}
    P, N = program.num_ranks, program.num_microbatches
    lines = [
        f"# Found by pipec search: an explicit order for P = {P}, N = {N} only.",
        f"schedule {name}(P: ranks = {P}, N: microbatches = {N}) {{",
        f'  require P == {P} : "this order was searched for P = {P}"',
        f'  require N == {N} : "this order was searched for N = {N}"',
        f"  stages {program.num_chunks}",
    ]
    if len(program.pipelines) > 1:
        lines += [f"  pipelines {len(program.pipelines)}",
                  f"  route microbatch m to pipeline {lookup_expression('m', program.mb_pipeline)}"]
        lines += [f"  place stage s of pipeline p on rank {stage.rank} when p == {stage.pipeline} and s == "
                  f"{stage.position}" for stage in program.stages]
    else:
        lines += [f"  place stage s on rank {stage.rank} when s == {stage.position}" for stage in program.stages]
    if program.devices is not None and list(program.devices) != list(range(P)):
        lines.append(f"  map rank r to device {lookup_expression('r', program.devices)}")
    if ops & _SPLIT_OPS:
        lines.append("  backward split")
    position = [stage.position for stage in program.stages]
    recomputed = sorted({position[a.stage] for row in order for a in row if a.op in _WRITTEN_AS})
    if recomputed:
        lines.append("  recompute stage s when " + " or ".join(f"s == {chunk}" for chunk in recomputed))
    lines.append("  order rank r {")
    for rank, row in enumerate(order):
        tasks = " ".join(f"{_WRITTEN_AS.get(a.op, a.op)}({position[a.stage]}, {a.mb})" for a in row)
        lines.append(f"    {'if' if rank == 0 else '} else if'} r == {rank} {{ {tasks}")
    lines += ["    }", "  }", "}", ""]
    return "\n".join(lines)

