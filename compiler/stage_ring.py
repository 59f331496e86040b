"""The ring a context-parallel stage's group runs (``Program.stage_ring``), priced on the group's own ranks.

In a PP x CP composition every attention call of a stage's forward runs the
forward half of the stage ring over the stage's group, and its backward half
inside the stage's B (docs/compose.md, "PP x CP"). The simulator and the
traffic count price a stage's F and B with those halves:

* ``split_ring(ring)``: the ring's two halves as programs of their own, each
  rank's list cut where the runtime cuts it (``ring_halves.forward_end``: the
  forward half holds every forward block and the KV round, and closes every
  exchange it posts; the rest is the backward half: KV round again, the dK,
  dV partials home). A list that cannot be cut so is refused (the prover
  names it first).
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
from pipec.compiler.ring_halves import forward_end
from pipec.errors import UsageError

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
    """The ring's (forward half, backward half), each a program of the ring's ranks: every rank's list cut
    where the runtime cuts it (``ring_halves.forward_end``), so the price is of what runs.

    Raises:
        UsageError: a ring rank's list that cannot be cut so (an exchange left open into the backward, a
            forward block after the backward's first instruction): the prover names it at the rank.
    """
    heads, tails = [], []
    for rank, row in enumerate(ring.ranks):
        cut, problem = forward_end(row)
        if problem is not None:
            raise UsageError(f"the stage ring {ring.name or ''}'s ring rank {rank} cannot run its forward half "
                             f"inside a stage's forward and the rest inside its backward: at instruction "
                             f"{problem[0]}, {problem[1]}")
        heads.append(row[:cut])
        tails.append(row[cut:])
    return replace(ring, ranks=heads), replace(ring, ranks=tails)


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
