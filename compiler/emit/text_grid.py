"""A ``Program`` as a readable text grid: one line per rank, steps in columns.

    schedule 1f1b (P=2, N=4): 2 ranks, 2 stages, 4 microbatches, 16 instructions
    rank 0 | 0F0  0SEND_F0  0F1  ...
    rank 1 | 1RECV_F0  1F0  ...

A sequence ring's header names its chunks, KV pieces, rings and routes
instead of stages and microbatches; its exchanges print with their parts
nested, ``((0SEND_KV0;1RECV_KV0)ALLTOALL_KV0)EXCHANGE0``.

Each column (step) is as wide as its widest token, so a step lines up across
ranks. Steps are positions in each rank's list, not times: the simulator's
timeline is what ``render`` draws.
"""
from __future__ import annotations

from pipec.compiler.defines import params_text
from pipec.compiler.family import families_of
from pipec.compiler.ir import Program
from pipec.errors import counted


def format_text_grid(program: Program) -> str:
    """The program's per-rank instruction lists as an aligned text grid.

    Args:
        program: any ``Program``.
    Returns:
        a header line naming the schedule and its parameters, then one line
        ``rank R | tok tok ...`` per rank (on a mesh ``rank R: pp P, dp D | ...``); ends with a newline.
    """
    grid = program.grid()
    columns = max((len(row) for row in grid), default=0)
    widths = [0] * columns
    for row in grid:
        for step, text in enumerate(row):
            if len(text) > widths[step]:
                widths[step] = len(text)
    labels = rank_labels(program)
    label_width = max((len(label) for label in labels), default=len("rank 0"))
    lines = [_header(program)]
    for label, row in zip(labels, grid):
        cells = " ".join(text.ljust(widths[step]) for step, text in enumerate(row))
        lines.append(f"{label:<{label_width}} | {cells}".rstrip())
    return "\n".join(lines) + "\n"


def rank_labels(program: Program) -> list[str]:
    """Per rank, how grids and timelines name it: ``rank 2``; on a mesh also where it sits
    (``Mesh.label``: ``rank 2: pp 1, dp 0``), so the lanes of a stage's group (ranks that differ along
    the data axis only, the last and contiguous one) read as one block."""
    if program.mesh is None:
        return [f"rank {rank}" for rank in range(program.num_ranks)]
    return [f"rank {rank}: {program.mesh.label(rank)}" for rank in range(program.num_ranks)]


def _header(program: Program) -> str:
    params = params_text(program.params)  # in the schedule's order, as check and simulate write them
    name = program.name or "(unnamed)"
    if params:
        name += f" ({params})"
    # what the program is made of, in its families' words (a sequence ring: chunks, pieces, rings, routes)
    shape = ", ".join(family.grid_shape_text(program) for family in families_of(program))
    return (f"schedule {name}: {counted(program.num_ranks, 'rank')}, {shape}, "
            f"{counted(program.instruction_count(), 'instruction')}")

