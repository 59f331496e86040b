"""Where a sequence-ring rank's list splits into its forward half and its backward half.

A ring program's list runs inside a model: its forward half in the attention's
forward, the rest in autograd's backward (``runtime/rings.py``,
``RingAttention``), so nothing of the backward may be needed before the model's
backward starts. The lowering puts every forward instruction (AF blocks, the
forward KV exchanges and their waits) before every backward one. The backward
starts at its first AB, or earlier at the post of an exchange still open there
(the backward's first KV exchange, posted before its first blocks); the forward
half must leave no exchange open and hold every AF. The prover
(``checks/rings.py``) refuses a list that cannot be split; the runtime splits
where this says.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from pipec.compiler import ops
from pipec.compiler.ir import Action


class Halves(NamedTuple):
    """A rank's list cut in two.

    Attributes:
        end: the index of the backward's first instruction (the length of the forward half).
        problem: (index, why) where the list cannot be cut so, or None.
    """

    end: int
    problem: tuple[int, str] | None = None


def forward_end(row: Sequence[Action]) -> Halves:
    """Where ``row`` (one rank's list of a ring program) stops being forward (module docstring)."""
    first_ab = next((i for i, action in enumerate(row) if action.op == ops.AB), len(row))
    posted: dict[int, int] = {}
    waited: dict[int, int] = {}
    for index, action in enumerate(row):
        if action.op == ops.EXCHANGE:
            posted.setdefault(action.mb, index)
        elif action.op == ops.EXCHANGE_WAIT:
            waited.setdefault(action.mb, index)
    for number, index in posted.items():
        if number not in waited:
            return Halves(index, (index, f"exchange {number} is never waited"))
    end = min([first_ab] + [index for number, index in posted.items() if index < first_ab <= waited[number]])
    # no exchange of the forward half may still be open at its end
    while any(index < end <= waited[number] for number, index in posted.items()):
        end = min(index for number, index in posted.items() if index < end <= waited[number])
    late = next((i for i in range(end, len(row)) if row[i].op == ops.AF), None)
    if late is not None:
        return Halves(end, (late, f"a forward block comes after the backward's first instruction (step {end}): "
                                  "this list cannot run its forward and its backward apart"))
    return Halves(end)
