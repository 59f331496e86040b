"""Memory in bytes of a composed program (stages on rank groups, ``compiler/mesh_placement.py``), per member.

A member of a stage's group holds, in bytes per size class (docs/costs.md's
``sizes``; one ``weight`` value is one stage's whole weights):

* ``shard``: the shard of each sharded stage it belongs to, always: the
  cost file's ``shard`` bytes when it gives them, else the stage's weight
  bytes over the k members its weights are sharded over (the group's, or
  under HSDP its shard group's), rounded up (the runtime pads the flat
  weights at the end to a multiple of k: every shard is as large as the
  first);
* ``weight``: a sharded stage's whole weights from the compute whose GATHER
  made them to the RESHARD that drops them; the whole weights of every other
  stage it runs (replicated over its group, or on it alone), always;
* ``activation``, ``boundary``: each live counted value (what a forward
  saves, what an I leaves for its W, what a recomputed forward keeps) as the
  member's share of it, the class's bytes over k: member i of k holds rows
  share i of k of every microbatch (``ROW_SHARE``), or ring rank i's chunks
  of every sequence, a 1/k share of its tokens (``SEQUENCE_SHARE``, PP x CP;
  the stage ring's KV and dK, dV buffers live only inside a compute and are
  not counted here: docs/compose.md).

Nothing else changes from a plain program's count (the same rule-table
deltas); a plain program (no mesh, no group) is counted as before by
``memory_counts.peak_bytes``, which hands composed programs here.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Iterator, Mapping, Union

from pipec.compiler import ops
from pipec.compiler.ir import Action, Program

Number = Union[int, float]

_DELTAS = {size: ops.size_class_deltas(size) for size in ops.SIZE_CLASSES}
_GATHERS = frozenset(ops.GATHER_OPS)
_RESHARDS = frozenset(ops.RESHARD_OPS)


def composed(program: Program) -> bool:
    """Whether ``program`` is a composition on a mesh (or places a stage on a group): counted per member."""
    return program.mesh is not None or program.placed_on_groups


def placed_classes(program: Program, sizes: Mapping[str, Number]) -> tuple[str, ...]:
    """The size classes counted for ``program`` with ``sizes``: those sized, and ``shard`` where a sharded
    stage's shard is derived from the ``weight`` bytes."""
    derived = ops.SIZE_WEIGHT in sizes and any(info.placement is not None and info.placement.sharded
                                               for info in program.stages)
    return tuple(c for c in ops.SIZE_CLASSES if c in sizes or (c == ops.SIZE_SHARD and derived))


def may_size(size_class: str, sizes: Mapping[str, Number]) -> bool:
    """Whether a byte budget for ``size_class`` can be priced with ``sizes`` before the program is known: the
    class is sized, or it is ``shard`` and ``weight`` is (a sharded stage's shard is derived from it;
    ``unpriced`` says, once the program is compiled, whether it has such a stage)."""
    return size_class in sizes or (size_class == ops.SIZE_SHARD and ops.SIZE_WEIGHT in sizes)


def unpriced(program: Program, budget: Mapping[str, Number], sizes: Mapping[str, Number]) -> list[str]:
    """The classes of ``budget`` that ``sizes`` cannot price on ``program`` (counted per member when composed)."""
    known = placed_classes(program, sizes) if composed(program) else tuple(sizes)
    return [size_class for size_class in budget if size_class not in known]


def shard_members(program: Program, stage: int) -> int:
    """How many members sharded ``stage``'s weights are cut among: its group's, or under HSDP
    (``Placement.hybrid``) one shard group's."""
    placement = program.stages[stage].placement
    if placement is not None and placement.hybrid:
        return len(program.communicators[placement.shard_groups[0]].ranks)
    return len(program.stages[stage].ranks)


def shard_bytes(program: Program, stage: int, sizes: Mapping[str, Number]) -> Number:
    """One member's shard of sharded ``stage`` (module docstring)."""
    if ops.SIZE_SHARD in sizes:
        return sizes[ops.SIZE_SHARD]
    whole, k = sizes[ops.SIZE_WEIGHT], shard_members(program, stage)
    return -(-whole // k) if isinstance(whole, int) else whole / k


def with_shard_size(program: Program, sizes: Mapping[str, Number]) -> Mapping[str, Number]:
    """``sizes`` with a ``shard`` size for a collective that moves one (HSDP's SYNC_SHARD): as given, else
    the first sharded stage's ``shard_bytes`` (a composition's stages are sharded alike); ``sizes`` itself
    when it has one, or no weight size, or the program no sharded stage."""
    if ops.SIZE_SHARD in sizes or ops.SIZE_WEIGHT not in sizes:
        return sizes
    stage = next((info.id for info in program.stages if info.placement is not None and info.placement.sharded), None)
    return sizes if stage is None else {**sizes, ops.SIZE_SHARD: shard_bytes(program, stage, sizes)}


def placed_bytes(program: Program, rank: int, sizes: Mapping[str, Number]) -> Iterator[dict[str, Fraction]]:
    """Live bytes per counted class on ``rank``: first before its list runs, then after each instruction.

    Args:
        program: a composed program (``composed``).
        rank: whose list.
        sizes: size class -> bytes of one value of it (``check_sizes`` already proved them).
    Returns:
        an iterator of len(row) + 1 dicts, class (``placed_classes``) -> bytes (a Fraction: shares).
    """
    classes = placed_classes(program, sizes)
    live = dict.fromkeys(classes, Fraction(0))
    weight = Fraction(sizes.get(ops.SIZE_WEIGHT, 0))
    for info in program.stages:
        if rank not in info.ranks:
            continue
        if info.placement is not None and info.placement.sharded:
            if ops.SIZE_SHARD in live:
                live[ops.SIZE_SHARD] += Fraction(shard_bytes(program, info.id, sizes))
        elif ops.SIZE_WEIGHT in live:
            live[ops.SIZE_WEIGHT] += weight
    yield dict(live)
    for action in program.ranks[rank]:
        _apply(program, action, live, sizes, weight)
        yield dict(live)


def _apply(program: Program, action: Action, live: dict, sizes: Mapping[str, Number], weight: Fraction) -> None:
    """``live`` after ``action``: its rule-table deltas as this member's share, its gathers and reshards."""
    if action.op in _RESHARDS and ops.SIZE_WEIGHT in live:
        live[ops.SIZE_WEIGHT] -= weight
        return
    if action.op not in ops.COMPUTE_OPS or not 0 <= action.stage < len(program.stages):
        return
    share = Fraction(1, len(program.stages[action.stage].ranks))
    for size_class in live:
        delta = _DELTAS[size_class].get(action.op, 0)
        if delta and size_class in sizes:
            live[size_class] += delta * Fraction(sizes[size_class]) * share
    if ops.SIZE_WEIGHT in live and any(part.op in _GATHERS for part in action.parts):
        live[ops.SIZE_WEIGHT] += weight


def plain(value: Fraction) -> Number:
    """An exact count as an int when whole, else a float (what ``simulate --json`` prints)."""
    return int(value) if value.denominator == 1 else float(value)


def placed_peak_bytes(program: Program, sizes: Mapping[str, Number]) -> list[dict[str, Number]]:
    """Per rank, class -> the most bytes of it live at once (``placed_bytes``)."""
    out = []
    for rank in range(program.num_ranks):
        peaks: dict[str, Fraction] = {}
        for live in placed_bytes(program, rank, sizes):
            for size_class, value in live.items():
                peaks[size_class] = max(peaks.get(size_class, value), value)
        out.append({size_class: plain(value) for size_class, value in peaks.items()})
    return out


def first_over(program: Program, rank: int, size_class: str, sizes: Mapping[str, Number],
               limit: Number) -> tuple[int, Number] | None:
    """(step, live bytes) where ``size_class``'s bytes on ``rank`` first go above ``limit`` (step 0 for what
    the rank holds before its list runs: its shards and whole weights), or None."""
    for index, live in enumerate(placed_bytes(program, rank, sizes)):
        if live.get(size_class, 0) > limit:
            return max(index - 1, 0), plain(live[size_class])
    return None
