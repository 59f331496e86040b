"""What ``pipec.Program.simulate()`` returns: the predicted step, as plain numbers.

A thin, stable view of the simulator's ``SimResult`` (``compiler/simulate.py``),
which stays reachable as ``Simulation.result`` for the timeline and the
per-rank slots; what is added here is what ``pipec simulate`` reports beside
it for asynchronous training (the weight versions and the makespan with a
flush after every update), so the command and the API compute it once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipec.compiler.memory_counts import Number
    from pipec.compiler.simulate import SimResult


@dataclass(frozen=True)
class Simulation:
    """A simulated training step.

    Attributes:
        result: the simulator's result (``compiler.simulate.SimResult``): per-rank stats and the timeline.
        versions: for a program with optimizer updates in its order, ``{"updates", "weight_versions",
            "stashed"}`` per stage (``compiler.versions.version_summary``); None otherwise.
        flushed_makespan: for such a program, the makespan of the same updates with a flush after each;
            None otherwise.
    """

    result: SimResult
    versions: dict[str, Any] | None = None
    flushed_makespan: Number | None = None

    @property
    def makespan(self) -> Number:
        """When the last instruction on any rank ends, in the cost model's unit (an int under integer costs)."""
        return self.result.makespan

    @property
    def bubble(self) -> float:
        """The bubble ratio: 1 - mean busy time / makespan."""
        return float(self.result.bubble_ratio)

    @property
    def bubble_text(self) -> str:
        """The bubble ratio as ``pipec simulate`` prints it: ``3/11 = 0.2727`` when a small exact fraction."""
        return self.result.bubble_text()

    @property
    def peak_activations(self) -> list[int]:
        """Per rank, the most chunk activations alive at once."""
        return [int(rank.peak_activations) for rank in self.result.ranks]

    @property
    def peak_bytes(self) -> list[dict[str, Number]] | None:
        """Per rank, size class -> peak bytes; None when the cost model gives no ``sizes``."""
        if not self.result.ranks or self.result.ranks[0].peak_bytes is None:
            return None
        return [dict(rank.peak_bytes or {}) for rank in self.result.ranks]

    def to_json(self) -> dict[str, Any]:
        """What ``pipec simulate --json`` prints, as a dict of plain numbers, lists and dicts."""
        from pipec.compiler.simulate import plain_number

        out = self.result.to_json()
        if self.versions is not None:
            out["versions"] = {**self.versions, "flushed_makespan": plain_number(self.flushed_makespan)}
        return out
