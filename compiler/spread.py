"""How far a measurement's repeats spread, and whether the machine could have made them noise.

``pipec costs`` and ``pipec profile`` report medians; a median of repeats that spread widely, or
taken while ranks shared cores, is the machine's load as much as the model's cost (issue 25: two
identical chunks measured 23.65 ms and 2.16 ms on a busy machine). Both commands print the spread
(``Spread.text``) and the warnings ``noise_warnings`` gives. No torch here: ``pipec costs`` is a
compile-side command.
"""
from __future__ import annotations

import os
from statistics import median
from typing import NamedTuple, Sequence

# (max - min) / median above this is called large: repeats of one task on a quiet machine stay well
# within a factor 1.5 of each other; a busy one spreads them by several times.
LARGE_SPREAD = 0.5


class Spread(NamedTuple):
    """The minimum, median and maximum of some repeats (any unit)."""

    low: float
    middle: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        """The spread of ``values`` (at least one)."""
        return cls(min(values), median(values), max(values))

    @property
    def relative(self) -> float:
        """(max - min) / median: 0 for identical repeats; 0 when the median is 0."""
        return (self.high - self.low) / self.middle if self.middle > 0 else 0.0

    def range_text(self) -> str:
        """``min 0.21 / median 0.22 / max 0.31``."""
        return f"min {self.low:.4g} / median {self.middle:.4g} / max {self.high:.4g}"

    def text(self) -> str:
        """``min 0.21 / median 0.22 / max 0.31 (spread 45%)``."""
        return f"{self.range_text()} (spread {self.relative:.0%})"


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def noise_warnings(spreads: dict[str, Spread], processes: int, cores: int | None = None,
                   load: float | None = None) -> list[str]:
    """What makes these measurements noise, one sentence each (empty: nothing seen).

    Args:
        spreads: label -> the spread of its repeats; the widest one past ``LARGE_SPREAD`` is named.
        processes: the processes that measured at once (a run's ranks; 1 for a profile).
        cores: the cores they had (default: this process's, ``usable_cores``).
        load: the machine's one-minute load average before measuring, or None: a profile's
            single process shares its core when the load is at the core count.
    """
    cores = usable_cores() if cores is None else cores
    warnings = []
    if processes > cores:
        warnings.append(f"{processes} ranks shared {cores} core(s): their times include waiting for a core; "
                        "measure with at most one rank per core")
    elif load is not None and load + processes > cores:
        warnings.append(f"the machine was busy (load average {load:.2f} on {cores} core(s)): other processes "
                        "shared the cores; measure on a quiet machine")
    if spreads:
        label, widest = max(spreads.items(), key=lambda item: item[1].relative)
        if widest.relative > LARGE_SPREAD:
            warnings.append(f"{label}'s repeats spread {widest.relative:.0%} around their median ({widest.range_text()}): "
                            "a median of such repeats is the machine's noise as much as the model's cost")
    return warnings


def load_average() -> float | None:
    """The one-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
