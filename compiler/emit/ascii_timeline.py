"""A simulated timeline as text: one lane per rank, one column per time unit.

    rank 0 | 0F0 0F1 0F2 ... ... 0B0 --- 0F3 0B1 ---
    rank 1 | ... 1F0 1F1 1B0 --- ...
    task labels: 2F3 = stage 2, op F, microbatch 3 (as in torch's schedule CSV)

Each compute slot prints its text form (``ir.LABEL_SCHEME``) in its first column and
dashes in the rest; dots are idle time (a bubble). Meant for terminals and for
costs that are whole numbers (the unit costs); other costs are scaled so that
the shortest operation takes one column.
"""
from __future__ import annotations

from pipec.compiler.ir import LABEL_SCHEME
from pipec.compiler.simulate import SimResult


def format_timeline(result: SimResult, max_columns: int = 400, labels: list[str] | None = None) -> str:
    """Args: result: a simulation; max_columns: lanes longer than this are cut with "..."; labels: per rank,
    its lane's label (``text_grid.rank_labels(program)`` names a mesh's ranks by coordinate; default
    ``rank R``).
    Returns: one line per rank, ending with a newline."""
    durations = [s.end - s.start for lane in result.timeline for s in lane if not s.is_comm and s.end > s.start]
    unit = min(durations) if durations else 1
    columns = int(round(result.makespan / unit)) if unit else 0
    shown = min(columns, max_columns)
    lanes = []
    texts = [[(s.action.text(), s) for s in lane if not s.is_comm] for lane in result.timeline]
    width = max((len(label) for lane in texts for label, _ in lane), default=2)
    for lane in texts:
        cells = ["." * width] * shown
        for label, slot in lane:
            first, last = int(round(slot.start / unit)), int(round(slot.end / unit))
            for column in range(first, min(last, shown)):
                cells[column] = (label if column == first else "-" * width).ljust(width)
        lanes.append(" ".join(cells) + (" ..." if columns > shown else ""))
    labels = labels or [f"rank {r}" for r in range(len(lanes))]
    label_width = max((len(label) for label in labels), default=len("rank 0"))
    rows = [f"{label:<{label_width}} | {lane}" for label, lane in zip(labels, lanes)]
    return "\n".join(rows + [LABEL_SCHEME]) + "\n"
