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

    The table is read modulo its shortest period T (``m % 4`` for BitPipe's route), and its runs of one
    value become a balanced tree of ``index < k ? ... : ...``, so the depth is the logarithm of the runs'
    count, whatever the table's length.

    Args:
        index: the variable's name (``c``, ``m``, ``l``, ``r``).
        values: the table, one or more integers.
    Returns:
        the expression: ``[0, 1, 1, 0]`` in ``c`` gives ``c < 1 ? 0 : (c < 3 ? 1 : 0)`` (runs merged);
        ``[0, 0, 1, 1] * 2`` in ``m`` gives ``m % 4 < 2 ? 0 : 1``.
    """
    if not values:
        raise ValueError("a table needs at least one value")
    if list(values) == list(range(len(values))):
        return index  # the identity, as a reader would write it
    count = len(values)
    period = next(t for t in range(1, count + 1)
                  if count % t == 0 and all(values[i] == values[i % t] for i in range(count)))
    read = index if period == count else f"{index} % {period}"
    runs: list[tuple[int, int]] = []  # (first index of the run, its value) within one period
    for i, value in enumerate(values[:period]):
        if not runs or runs[-1][1] != value:
            runs.append((i, value))

    def over(low: int, high: int) -> str:  # runs[low:high]
        if high - low == 1:
            return str(runs[low][1])
        middle = (low + high) // 2
        return f"({read} < {runs[middle][0]} ? {over(low, middle)} : {over(middle, high)})"

    text = over(0, len(runs))
    return text[1:-1] if text.startswith("(") else text


def tuple_text(items: Sequence[int]) -> str:
    """``(a, b, c)``: a tuple as ``rings cycle`` writes one."""
    return "(" + ", ".join(map(str, items)) + ")"
