"""Where a recomputed stage's recompute runs, when the order leaves it out.

A stage that ``recompute stage s`` names runs a forward that keeps only its
input (FC: ``ops.CHECKPOINTS``), and before its backward a recompute (R) that
makes again, from that input, what a plain forward would have saved. A
schedule may write R itself (earlier, to fill a wait); for every FC the order
leaves without one, ``place_recomputes`` puts R immediately before the first
task that reads what R remakes (``ops.RECOMPUTE_BEFORE``: B, or I under
``backward split``), so R and the backward run back to back. The list
scheduler places its recomputes itself, where it prices them
(``list_schedule``); this pass then finds nothing to add.

Contract: ``place_recomputes(order)`` returns new per-rank task lists, the
input's with a recompute inserted for each (stage, mb) that has a
checkpointed forward and no recompute on its rank; nothing else moves, an
order that already has every recompute comes back equal, and the pass is
linear in the tasks. A checkpointed forward with no reader after it on its
rank (an order that runs the backward first) gets its recompute right after
it, so that the well-formedness check names the order's mistake (the backward
needs the recompute, which comes later) rather than a missing task.
"""
from __future__ import annotations

from pipec.compiler import ops

TaskTuple = tuple[str, int, int]  # (kind, stage id, microbatch), as the front end hands orders over

# checkpointed forward -> its recompute (FC -> R); recompute -> the readers it must precede (R -> B, I)
_RECOMPUTE_OF = {keeping: remaking for keeping, remaking in ops.CHECKPOINTS.values()}
_READER_OF = {reader: remaking for remaking, readers in ops.RECOMPUTE_BEFORE.items() for reader in readers}
_RECOMPUTES = frozenset(_RECOMPUTE_OF.values())


def place_recomputes(order: list[list[TaskTuple]]) -> list[list[TaskTuple]]:
    """Insert the recomputes an order leaves out (module docstring).

    Args:
        order: per rank, its (kind, stage id, mb) tasks in order; not modified.
    Returns:
        per rank, the same tasks with each missing recompute inserted before
        the first task that reads what it remakes.
    """
    return [_placed(row) if any(task[0] in _RECOMPUTE_OF for task in row) else list(row) for row in order]


def _placed(row: list[TaskTuple]) -> list[TaskTuple]:
    """One rank's tasks with the recomputes it owes inserted."""
    written = {task for task in row if task[0] in _RECOMPUTES}
    due: set[TaskTuple] = set()  # recomputes owed: their checkpointed forward ran, their reader has not
    out: list[TaskTuple] = []
    for task in row:
        kind, sid, mb = task
        remaking = _READER_OF.get(kind)
        if remaking is not None and (remaking, sid, mb) in due:
            due.discard((remaking, sid, mb))
            out.append((remaking, sid, mb))
        out.append(task)
        remaking = _RECOMPUTE_OF.get(kind)
        if remaking is not None and (remaking, sid, mb) not in written:
            due.add((remaking, sid, mb))
    if due:  # no reader after the forward: the recompute follows it, and the checks name the order
        late = out
        out = []
        for task in late:
            out.append(task)
            remaking = _RECOMPUTE_OF.get(task[0])
            if remaking is not None and (remaking, task[1], task[2]) in due:
                out.append((remaking, task[1], task[2]))
    return out


__all__ = ["place_recomputes"]
