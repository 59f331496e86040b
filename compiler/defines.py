"""Schedule parameters given on a command line: ``-D NAME=VALUE``.

A module of its own, with no imports from the rest of pipec, because two
programs read these options: the command line (``pipec check``, ``pipec
run``, ...) and the runtime's worker (``python -m pipec.runtime``), which must
not import the command line. Cheap to import: the CLI loads it for every
command, the compiler only when a command compiles.
"""
from __future__ import annotations

from pipec.errors import UsageError


def parse_defines(items: list[str]) -> dict[str, str]:
    """The ``-D NAME=VALUE`` options as parameter values.

    Args:
        items: the options' values, e.g. ``["P=4", "N=8"]``.
    Returns:
        ``{"P": "4", "N": "8"}``, names and values stripped; the schedule types the values.
    Raises:
        UsageError: an item without ``=``, an empty name or value, or a name given twice.
    """
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise UsageError(f"-D expects NAME=VALUE, got {item!r}")
        if name in out:
            raise UsageError(f"-D {name} is given twice")
        out[name] = value.strip()
    return out
