"""A searched order written as an explicit-order ``.pipe`` (``order rank r { if r == k { ... } }``).

The text fixes P and N with ``require`` (the order lists tasks literally, for these sizes only) and
writes the placement stage by stage, so ``pipec check`` proves it and it compiles to exactly the
order given. A single pipeline without recomputation (what ``compiler/search.py`` orders today).
"""
from __future__ import annotations

from pipec.compiler.ir import Action, Program
from pipec.errors import UsageError

# ops a backward-split program runs (I: input gradient) and that the language writes as is
_SPLIT_OPS = frozenset({"I", "W"})


def order_to_pipe(program: Program, order: list[list[Action]], name: str = "searched") -> str:
    """The ``.pipe`` text of ``program``'s placement with ``order`` as its explicit order."""
    if len(program.pipelines) > 1 or any(s.pipeline for s in program.stages):
        raise UsageError("pipec search writes one pipeline's orders: several pipelines are not written yet")
    ops = {a.op for row in order for a in row}
    if not ops <= {"F", "B", "I", "W"}:
        raise UsageError(f"pipec search writes F, B, I and W: this order has {sorted(ops - {'F', 'B', 'I', 'W'})}")
    P, N = program.num_ranks, program.num_microbatches
    lines = [
        f"# Found by pipec search: an explicit order for P = {P}, N = {N} only.",
        f"schedule {name}(P: ranks = {P}, N: microbatches = {N}) {{",
        f'  require P == {P} : "this order was searched for P = {P}"',
        f'  require N == {N} : "this order was searched for N = {N}"',
        f"  stages {len(program.stages)}",
    ]
    lines += [f"  place stage s on rank {stage.rank} when s == {stage.id}" for stage in program.stages]
    if ops & _SPLIT_OPS:
        lines.append("  backward split")
    lines.append("  order rank r {")
    for rank, row in enumerate(order):
        tasks = " ".join(f"{a.op}({a.stage}, {a.mb})" for a in row)
        lines.append(f"    {'if' if rank == 0 else '} else if'} r == {rank} {{ {tasks}")
    lines += ["    }", "  }", "}", ""]
    return "\n".join(lines)
