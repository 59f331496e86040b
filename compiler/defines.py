"""Schedule parameters given on a command line: ``-D NAME=VALUE``.

A module of its own, with no imports from the rest of pipec, because two
programs read these options: the command line (``pipec check``, ``pipec
run``, ...) and the runtime's worker (``python -m pipec.runtime``), which must
not import the command line. Cheap to import: the CLI loads it for every
command, the compiler only when a command compiles.
"""
from __future__ import annotations

from pipec.compiler.guarded_read import is_plain_int, quote
from pipec.errors import UsageError, printable_name


def parse_defines(items: list[str]) -> dict[str, str]:
    """The ``-D NAME=VALUE`` options as parameter values.

    Args:
        items: the options' values, e.g. ``["P=4", "N=8"]``.
    Returns:
        ``{"P": "4", "N": "8"}``, names and values stripped; the schedule types the values.
    Raises:
        UsageError: an item without ``=``, an empty name or value, a name given
            twice, or a value that is neither an integer in ASCII digits
            (``guarded_read.is_plain_int``: not ``1_000``, ``٣``, ``³``, ``0x10``)
            nor ``true`` / ``false``. The schedule checks the value's range.
    """
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise UsageError(f"-D expects NAME=VALUE, got {quote(item)}")
        if name in out:
            raise UsageError(f"-D {quote(name) if not name.isprintable() else name} is given twice")
        value = value.strip()
        if not is_plain_int(value) and value.lower() not in _BOOLS:
            shown = name if name.isprintable() and len(name) <= 40 else quote(name, 40)
            raise UsageError(f"-D {shown}: the value must be an integer in ASCII digits (e.g. 4, -1) or true/false, "
                             f"got {quote(value, 40)}")
        out[name] = value
    return out


def value_text(value) -> str:
    """A parameter's value as the language and ``-D`` write it: ``4``, ``true``, ``false``."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def params_text(params: dict, separator: str = ", ") -> str:
    """Parameters as ``P=4, N=8, remat=false``."""
    # a program file's parameter names are the file's text: escaped (pipec.errors.printable_name)
    return separator.join(f"{printable_name(name)}={value_text(value)}" for name, value in params.items())


# What a bool parameter accepts besides integers (the schedule's _coerce: 1 / 0 are ints here).
_BOOLS = ("true", "false", "yes", "no")
