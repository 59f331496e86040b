"""Tables written as ``.pipe`` expressions, for the files a search writes (``compiler/families/*_search.py``).

A searched schedule is written for fixed sizes, so its tables (chunk -> holder, microbatch -> home,
layer -> owner, rank -> group) are literal. ``lookup_expression`` writes one as nested conditionals that
halve the index range at each level, so the nesting grows with the logarithm of the table's length and
stays far inside the parser's limit (``dsl.limits.MAX_NESTING``); runs of one value are one leaf, and the
identity is the index itself.
"""
from __future__ import annotations

from typing import Sequence


def lookup_expression(index: str, values: Sequence[int]) -> str:
    """A ``.pipe`` expression in the variable ``index`` whose value at ``index == i`` is ``values[i]``.

    Args:
        index: the variable's name (``c``, ``m``, ``l``, ``r``).
        values: the table, one or more integers.
    Returns:
        the expression: ``[0, 1, 1, 0]`` in ``c`` gives ``c < 1 ? 0 : (c < 3 ? 1 : 0)`` (runs merged).
    """
    if not values:
        raise ValueError("a table needs at least one value")
    if list(values) == list(range(len(values))):
        return index  # the identity, as a reader would write it
    runs: list[tuple[int, int]] = []  # (first index of the run, its value)
    for i, value in enumerate(values):
        if not runs or runs[-1][1] != value:
            runs.append((i, value))

    def over(low: int, high: int) -> str:  # runs[low:high]
        if high - low == 1:
            return str(runs[low][1])
        middle = (low + high) // 2
        return f"({index} < {runs[middle][0]} ? {over(low, middle)} : {over(middle, high)})"

    text = over(0, len(runs))
    return text[1:-1] if text.startswith("(") else text


def tuple_text(items: Sequence[int]) -> str:
    """``(a, b, c)``: a tuple as ``rings cycle`` writes one."""
    return "(" + ", ".join(map(str, items)) + ")"
