"""Memory counts: how many counted values a rank holds at once, and how many bytes.

A value of a kind with a counter (``ops.ValueKind.counter``: the saved
activation, counted as ``"activations"``, what an I leaves for its W,
counted as ``"waiting_w"``, and the input a recomputed stage's forward keeps
for its recompute, counted as ``"kept_inputs"``) is alive on its stage's rank
from the compute that makes it (``ops.OpRule.writes``) to the compute that
ends it (``ops.OpRule.ends``). On a recomputed stage the saved activation
lives only from the recompute (R) to the backward, and the kept input from
the forward (FC) to R, so recomputation trades saved activations for kept
inputs, which are smaller (one stage boundary's tensor, size class
``boundary``). Walking a rank's list in order, a count goes up and
down by the rule table's ``ops.memory_deltas``; its maximum is the rank's
peak. A FREE drops storage but ends no use, so it does not count.

Bytes: given the bytes of one value of each size class (``ops.SIZE_CLASSES``),
the live bytes of a class are its live counted values times that size; the
peak per class is what ``peak_bytes`` reports.

Borrowed weight buffers (weight passing, counted as ``"weight_buffers"``)
follow the exchanges instead of the computes (``weight_buffer_counts``): a
copy of a layer is alive from the post of the part that brings it (RECV_W,
BCAST_W on a rank other than its root, ALLGATHER_W, a ring step that takes a
layer, a FILL) to its FREE_W, and a ring slot until the wait of the exchange
whose ring step passes it on. The weight check enforces the program's bound
on them with these counts.

A composed program (a mesh, or a stage on a group of ranks) is counted per
member by ``compiler/placed_memory.py`` instead: its shards, whole weights and
shares of each counted value; ``peak_bytes`` hands it there.

This module is neutral ground: the memory check (``checks/memory.py``) and the
simulator both read it, so the simulator imports no check.
"""
from __future__ import annotations

import operator
from itertools import accumulate, repeat
from typing import Iterable, Iterator, Mapping, Sequence, Union

from pipec.compiler import ops
from pipec.compiler.family import families_of
from pipec.compiler.ir import Action, Program, RingPlan
from pipec.compiler.ops import Use
from pipec.compiler.placed_memory import composed, placed_bytes, placed_classes, placed_peak_bytes
from pipec.errors import CostFileError

Number = Union[int, float]

# The counters of ``ops.VALUE_KINDS`` that have a count of their own.
ACTIVATIONS = ops.COUNT_ACTIVATIONS  # today's peak_activations: saved activations
WAITING_W = ops.COUNT_WAITING_W      # split backward: I done, W not yet
KEPT_INPUTS = ops.COUNT_KEPT_INPUTS  # recomputed stages: FC done, R not yet

# op -> change of the count, from the rule table
ACTIVATION_DELTA: dict[str, int] = ops.memory_deltas(ACTIVATIONS)
WAITING_W_DELTA: dict[str, int] = ops.memory_deltas(WAITING_W)
KEPT_INPUT_DELTA: dict[str, int] = ops.memory_deltas(KEPT_INPUTS)
# the ops that keep an input (FC): a program that runs none recomputes nothing
_KEEPS_INPUT = frozenset(op for op, delta in KEPT_INPUT_DELTA.items() if delta > 0)

_op_of = operator.itemgetter(1)


size_class_deltas = ops.size_class_deltas

# size class -> op -> change of its live counted values
SIZE_CLASS_DELTAS: dict[str, dict[str, int]] = {size: size_class_deltas(size) for size in ops.SIZE_CLASSES}


# Weight passing: the parts that bring a borrowed copy onto their rank (a
# broadcast only off its root, a ring step only when it takes a layer).
_BRINGS_COPY = frozenset(op for op in ops.EXCHANGE_PART_OPS
                         if Use("weight") in ops.RULES[op].writes or
                         (ops.RULES[op].carries == Use("weight") and ops.RULES[op].category == ops.PART_RECV))
_RING_STEPS = frozenset(ops.PASS_OF_SLOT_OP) - frozenset(ops.FILL_OF_PASS.values())


def _counted_right(op: str) -> bool:
    """Whether the counts above model ``op``: a compute by its rule's writes and ends; weight passing's
    ops by ``weight_buffer_counts``; any other op only if it brings no counted value onto its rank (a
    free drops storage, it ends no use)."""
    rule = ops.RULES[op]
    if rule.category in (ops.COMPUTE,) + ops.WEIGHT_CATEGORIES:
        return True
    brought = rule.writes + ((rule.carries,) if rule.category == ops.RECV and rule.carries else ())
    return all(ops.VALUE_KINDS[use.kind].counter is None for use in brought)


# The ops the memory counts have a rule for (what the memory pass declares).
COUNTED_OPS: tuple[str, ...] = tuple(op for op in ops.OPS if _counted_right(op))


def live_counts(row: Iterable[Action], delta: Mapping[str, int]) -> Iterator[int]:
    """The count after each instruction of one rank's list.

    Args:
        row: one rank's instructions.
        delta: op -> change of the count (ops absent: no change).
    Returns:
        an iterator of running counts, one per instruction.
    """
    return accumulate(map(delta.get, map(_op_of, row), repeat(0)))


def peak_count(row: Iterable[Action], delta: Mapping[str, int]) -> int:
    """The most values counted by ``delta`` alive at once along one rank's list (0 for none)."""
    return max(0, max(live_counts(row, delta), default=0))


def first_step_over(row: Iterable[Action], delta: Mapping[str, int], limit: Number) -> int | None:
    """The first step after which the count goes above ``limit``, or None when it never does."""
    return next((step for step, live in enumerate(live_counts(row, delta)) if live > limit), None)


def peak_activations(program: Program) -> list[int]:
    """Peak live saved activations per rank (the ``"activations"`` counter).

    Args:
        program: any program (only the computes that make or end a saved
            activation count: F, B and I).
    Returns:
        one int per rank, 0 for a rank with no forward.
    """
    return [peak_count(row, ACTIVATION_DELTA) for row in program.ranks]


def holds_more_activations(program: Program, limits: Sequence[int] | None) -> bool:
    """Whether some rank of ``program`` holds more saved activations at once than its limit (None: no limits):
    the check every searched order is held to after it is written."""
    return limits is not None and any(peak > limit for peak, limit in zip(peak_activations(program), limits))


def peak_waiting_w(row: Iterable[Action]) -> int:
    """The most weight gradients waiting at once along one rank's list (I done, W not yet)."""
    return peak_count(row, WAITING_W_DELTA)


def peak_kept_inputs(row: Iterable[Action]) -> int:
    """The most inputs kept for a recompute at once along one rank's list (FC done, R not yet)."""
    return peak_count(row, KEPT_INPUT_DELTA)


def recomputes(program: Program) -> bool:
    """Whether some rank runs a forward that keeps only its input (a recomputed stage's FC)."""
    return any(action[1] in _KEEPS_INPUT for row in program.ranks for action in row)


def weight_buffer_counts(row: Iterable[Action], rank: int) -> Iterator[int]:
    """The borrowed weight buffers alive after each instruction of one rank's list (module docstring).

    Args:
        row: rank ``rank``'s instructions.
        rank: whose list it is (a broadcast's root brings itself nothing).
    Returns:
        an iterator of running counts, one per instruction.
    """
    live = 0
    slots: set[tuple[str, int]] = set()       # ring slots held: (pass, step)
    passing: dict[int, list[tuple[str, int]]] = {}  # exchange -> the slots its ring steps pass on
    for action in row:
        op = action.op
        if op == ops.EXCHANGE:
            passed = passing.setdefault(action.mb, [])
            for part in action.parts:
                if part.op in _RING_STEPS:
                    passed.append((ops.PASS_OF_SLOT_OP[part.op], part.mb - 1))
                    if part.stage >= 0:
                        slots.add((ops.PASS_OF_SLOT_OP[part.op], part.mb))
                        live += 1
                elif part.op in _BRINGS_COPY and not (part.op == ops.BCAST_W and part.peer == rank):
                    if part.op in ops.FILL_OF_PASS.values():
                        slots.add((ops.PASS_OF_SLOT_OP[part.op], part.mb))
                    live += 1
        elif op == ops.EXCHANGE_WAIT:
            for slot in passing.pop(action.mb, ()):
                if slot in slots:
                    slots.discard(slot)
                    live -= 1
        elif op in ops.DROP_COPY_OPS:
            live -= 1
        yield live


def kv_buffer_counts(row: Iterable[Action], rank: int, kept: bool) -> Iterator[int]:
    """The received KV bundles alive after each instruction of one rank's sequence-ring list.

    A receive's buffer lives from the post of its exchange; at the exchange's
    wait it becomes the bundle held for its piece, which under ``kv again``
    (``kept`` False) drops the one held before; under ``kv kept`` nothing is
    dropped. The rank's own bundles are its inputs, not counted.

    Args:
        row: rank ``rank``'s instructions.
        rank: whose list it is.
        kept: the plan's ``kv`` is ``kept``.
    Returns:
        an iterator of running counts, one per instruction.
    """
    live = 0
    held: set[int] = set()                          # pieces with a received bundle held
    arriving: dict[int, list[int]] = {}             # exchange -> the pieces its receives bring
    for action in row:
        if action.op == ops.EXCHANGE:
            pieces = arriving.setdefault(action.mb, [])
            for part in action.parts:
                for leaf in part.parts or (part,):
                    if leaf.op == ops.RECV_KV and leaf.stage != rank:
                        pieces.append(leaf.mb)
                        live += 1
        elif action.op == ops.EXCHANGE_WAIT:
            for piece in arriving.pop(action.mb, ()):
                if not kept and piece in held:
                    live -= 1
                held.add(piece)
        yield live


def peak_kv_bytes(program: Program, plan: RingPlan, kv_size: Number) -> list[Number]:
    """Per rank, the most bytes of keys and values alive at once: its own chunks' and the received
    bundles' (``plan``: the program's rings; ``kv_size``: one chunk's K and V; ``RingPlan.bundle_share``)."""
    out = []
    for rank, row in enumerate(program.ranks):
        received = max(kv_buffer_counts(row, rank, plan.kv == "kept"), default=0)
        share = plan.bundle_share(rank)  # every rank holds as many chunks: every bundle weighs the same
        total = (len(plan.chunks_of(rank)) + received * share) * kv_size
        out.append(int(total) if total.denominator == 1 else float(total))
    return out


def peak_weight_buffers(program: Program) -> list[int]:
    """Per rank, the most borrowed weight buffers alive at once (0 for activation passing)."""
    return [max(weight_buffer_counts(row, rank), default=0) for rank, row in enumerate(program.ranks)]


def check_sizes(sizes: Mapping[str, Number]) -> None:
    """Reject a size table with an unknown class or a negative size.

    Raises:
        CostFileError: naming the bad entry and the known classes (a size table or a byte budget is
            the user's, given to the API or read from a file: pipec's own error, never a ValueError).
    """
    for size_class, size in sizes.items():
        if size_class not in ops.SIZE_CLASSES:
            raise CostFileError(f"unknown size class {size_class!r}; expected one of {', '.join(ops.SIZE_CLASSES)}")
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0:
            raise CostFileError(f"size class {size_class!r}: {size!r} bytes per value is not a non-negative number")


def peak_bytes(program: Program, sizes: Mapping[str, Number]) -> list[dict[str, Number]]:
    """Peak bytes of live counted values per rank, per size class.

    All values of a class have one size, so a class's peak bytes are its size
    times its peak count of live values.

    Args:
        program: any program.
        sizes: size class (``ops.SIZE_*``) -> bytes of one value of it; the
            classes given are the ones reported.
    Returns:
        per rank, size class -> peak bytes (0 where nothing of the class lives).
    Raises:
        CostFileError: an unknown size class or a negative size.
    """
    check_sizes(sizes)
    if composed(program):  # members of groups: their shares, and their stages' weights (placed_bytes)
        return placed_peak_bytes(program, sizes)
    families = families_of(program)
    counted = next((peaks for peaks in (family.peak_bytes(program, sizes) for family in families) if peaks), None)
    if counted is not None:  # a family that counts its memory its own way (a ring: its keys and values)
        return counted
    buffers = next((peaks for peaks in (family.borrowed_buffers(program) for family in families) if peaks is not None),
                   [0] * len(program.ranks))
    return [{size_class: size * (peak_count(row, SIZE_CLASS_DELTAS[size_class])
                                 + (borrowed if size_class == ops.SIZE_WEIGHT else 0))
             for size_class, size in sizes.items()}
            for row, borrowed in zip(program.ranks, buffers)]


__all__ = [
    "ACTIVATIONS",
    "composed",
    "placed_bytes",
    "placed_classes",
    "placed_peak_bytes",
    "ACTIVATION_DELTA",
    "COUNTED_OPS",
    "SIZE_CLASS_DELTAS",
    "KEPT_INPUTS",
    "KEPT_INPUT_DELTA",
    "WAITING_W",
    "WAITING_W_DELTA",
    "check_sizes",
    "first_step_over",
    "holds_more_activations",
    "live_counts",
    "peak_activations",
    "peak_bytes",
    "peak_count",
    "peak_kept_inputs",
    "peak_kv_bytes",
    "recomputes",
    "kv_buffer_counts",
    "peak_waiting_w",
    "peak_weight_buffers",
    "weight_buffer_counts",
    "size_class_deltas",
]
