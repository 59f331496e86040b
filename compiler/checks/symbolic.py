"""The driver the symbolic executors share (``checks/weights.py``, ``checks/rings.py``).

Each runs a program on every rank at once: a rank advances while its next
instruction can proceed (``advance``), the ranks take turns until none moves,
and ranks left with instructions are a deadlock (``deadlock`` names it);
otherwise ``finish`` checks what must hold at the end. A subclass supplies the
three, and per-rank states with ``rank`` and ``pc``.
"""
from __future__ import annotations


class SymbolicRun:
    """What both executors do the same way: locating errors, and running to a fixed point."""

    def __init__(self, program) -> None:
        self.program = program
        self.grid = None  # the program's grid, drawn once, when the first error needs it

    def error(self, cls, message: str, rank: int, step: int, marks=()):
        """A ``cls`` (a ``ProgramError``) at (rank, step), with the program's grid."""
        if self.grid is None:
            self.grid = self.program.grid()
        return cls(message, rank, step, self.grid, marks)

    def execute(self, ranks: list) -> None:
        """Advance every rank until none can move, then name a deadlock or check the end (``finish``)."""
        moved = True
        while moved:
            moved = False
            for state in ranks:
                if self.advance(state):
                    moved = True
        stuck = [state for state in ranks if state.pc < len(self.program.ranks[state.rank])]
        if stuck:
            raise self.deadlock(stuck)
        self.finish()

    def advance(self, state) -> bool:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def deadlock(self, stuck: list):  # pragma: no cover
        raise NotImplementedError

    def finish(self) -> None:  # pragma: no cover
        raise NotImplementedError
