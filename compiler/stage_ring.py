"""The ring a context-parallel stage's group runs (``Program.stage_ring``), priced on the group's own ranks.

In a PP x CP composition every attention call of a stage's forward runs the
forward half of the stage ring over the stage's group, and its backward half
inside the stage's B (docs/compose.md, "PP x CP"). The simulator and the
traffic count price a stage's F and B with those halves:

* ``split_ring(ring)``: the ring's two halves as programs of their own: each
  ring rank's instructions of the ring steps up to the last one holding a
  forward attention block on any rank (the forward half: the KV round, a
  rank whose own blocks ended early still passing KV on), and the rest (the
  backward half: KV round again, the dK, dV partials home). A ring without
  its steps (``RingPlan.steps``: one read from a program file) is cut where
  each rank has waited its first n - 1 KV exchanges (the forward's hops: KV
  must reach every one of the n ranks) and run its last forward block.
  A ring whose forward half leaves an exchange open into its backward is
  refused: the two halves run in different computes.
* ``ring_halves(program, group, costs, sizes)``: both halves simulated on the
  group's ranks (ring rank i is member i, its device the member's device, so
  the cost file's ``node_size``, ``nic``, ``rails`` and ``contention`` price
  the real links): per member, how long each half takes from the moment every
  member joined it, the transfers it makes (relative to that moment, for link
  use) and the bytes it moves per value kind and link class.

One attention call per stage: a stage's F runs the forward half once, its B
the backward half once (a stage that is one transformer block's attention).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from pipec.compiler import ops
from pipec.compiler.costs import CostModel
from pipec.compiler.ir import SEQUENCE_SHARE, Program
from pipec.compiler.memory_counts import Number
from pipec.errors import UsageError

# The ring's forward attention blocks: the ring computes that read nothing another ring compute makes
# (AF; AB reads the statistics AF keeps).
_MADE = {use for op in ops.RING_COMPUTE_OPS for use in ops.RULES[op].writes}
RING_FORWARD_OPS = frozenset(op for op in ops.RING_COMPUTE_OPS if not _MADE & set(ops.RULES[op].reads))
# The exchange parts that move KV (a send or receive of a bundle, or the all_to_all that holds them).
_KV_PARTS = frozenset(op for op in ops.RING_PART_OPS
                      if (ops.RULES[op].carries or ops.RULES[op].reads[0]).kind == "kv")
# The computes of a context-parallel stage that run the ring's forward half (a forward, or a recompute
# that runs it again) and its backward half (a whole backward: split ones are refused by the placement).
STAGE_FORWARD_OPS = frozenset(ops.FORWARD_COMPUTE_OPS) | frozenset(ops.RECOMPUTE_BEFORE)
STAGE_BACKWARD_OPS = frozenset(ops.SPLITS)


@dataclass(frozen=True)
class RingHalves:
    """A stage ring's two halves on one group.

    Attributes:
        forward, backward: per member (ring rank order), the time from the half's start (every member
            joined) to the member's last instruction of it.
        forward_moves, backward_moves: the half's transfers, (src device, dst device, start, arrival),
            times relative to the half's start.
        forward_traffic, backward_traffic: the half's bytes per value kind and link class (``traffic``).
    """

    forward: tuple[Number, ...]
    backward: tuple[Number, ...]
    forward_moves: tuple[tuple[int, int, Number, Number], ...]
    backward_moves: tuple[tuple[int, int, Number, Number], ...]
    forward_traffic: dict[str, dict[str, Number]]
    backward_traffic: dict[str, dict[str, Number]]


def split_ring(ring: Program) -> tuple[Program, Program]:
    """The ring's (forward half, backward half), each a program of the ring's ranks (module docstring).

    Raises:
        UsageError: a ring whose forward half leaves an exchange unwaited, or posts one its backward waits.
    """
    plan = ring.rings
    steps = [[plan.step_of(rank, i, len(row)) for i in range(len(row))] for rank, row in enumerate(ring.ranks)]
    known = all(step is not None for row in steps for step in row)
    last_forward_step = max((step for row, marks in zip(ring.ranks, steps) for action, step in zip(row, marks)
                             if action.op in RING_FORWARD_OPS), default=-1) if known else None
    heads, tails = [], []
    for rank, row in enumerate(ring.ranks):
        if known:
            cut = next((i for i, step in enumerate(steps[rank]) if step > last_forward_step), len(row))
        else:
            cut = _after_forward_hops(row, ring.num_ranks - 1)
        head = row[:cut]
        open_exchanges = set()
        for action in head:
            category = ops.RULES[action.op].category
            if category == ops.EXCHANGE_OF:
                open_exchanges.add(action.mb)
            elif category == ops.EXCHANGE_WAIT_OF:
                open_exchanges.discard(action.mb)
        if open_exchanges:
            raise UsageError(f"the stage ring {ring.name or ''} leaves exchange {min(open_exchanges)} of ring rank "
                             f"{rank} open past its last forward block; a context-parallel stage runs the ring's "
                             "forward half inside its forward and the rest inside its backward")
        heads.append(head)
        tails.append(row[cut:])
    return replace(ring, ranks=heads), replace(ring, ranks=tails)


def _after_forward_hops(row, hops: int) -> int:
    """The index after both ``row``'s last forward block and the wait of its first ``hops`` KV exchanges."""
    last = max((i for i, action in enumerate(row) if action.op in RING_FORWARD_OPS), default=-1) + 1
    first: list[int] = []  # the numbers of the first ``hops`` KV exchanges posted
    waited: set[int] = set()
    for index, action in enumerate(row):
        category = ops.RULES[action.op].category
        if category == ops.EXCHANGE_OF and len(first) < hops and any(p.op in _KV_PARTS for p in action.parts):
            first.append(action.mb)
        elif category == ops.EXCHANGE_WAIT_OF and action.mb in first:
            waited.add(action.mb)
            if len(waited) == hops:
                return max(last, index + 1)
    return last


def ring_halves(program: Program, group: tuple[int, ...], costs: CostModel,
                sizes: Mapping[str, Number]) -> RingHalves:
    """``program.stage_ring``'s halves on ``group`` (a stage's members, ascending), priced by ``costs``."""
    # imported here: the simulator imports this module to price a stage's computes
    from pipec.compiler.simulate import _Simulation  # one run: its result and its network's transfers
    from pipec.compiler.traffic import node_map, traffic

    devices = [program.devices[r] for r in group] if program.devices else list(group)
    out = []
    for half in split_ring(program.stage_ring):
        placed = replace(half, devices=devices)
        run = _Simulation(placed, costs)
        result = run.run()
        ends = tuple(max((slot.end for slot in lane), default=0) for lane in result.timeline)
        out += [ends, tuple(run.network.moved), traffic(placed, sizes, node_map(placed, costs.node_size))]
    forward, forward_moves, forward_traffic, backward, backward_moves, backward_traffic = out
    return RingHalves(forward, backward, forward_moves, backward_moves, forward_traffic, backward_traffic)


def sequence_groups(program: Program) -> list[tuple[int, ...]]:
    """The groups of ``program``'s stages split by sequence (each once, in stage order)."""
    groups: list[tuple[int, ...]] = []
    for info in program.stages:
        if info.placement is not None and info.placement.split == SEQUENCE_SHARE and info.ranks not in groups:
            groups.append(tuple(info.ranks))
    return groups
