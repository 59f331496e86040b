"""Traffic: the bytes a program moves in one training step, per value kind and per link class.

``traffic(program, sizes, node_of)`` counts, from the instruction lists alone
(no timing), what crosses links:

* a point-to-point message (a send, or a send inside a batch or an exchange)
  moves one value of its kind over the link from its rank to its peer (a
  sequence ring's KV or dKV bundle: one piece of each chunk of its holder,
  ``RingPlan.bundle_share``; a member of a stage on a group of k, its share:
  1/k of the value, ``member_share``); an all_to_all moves each of its sends so;
* a ring step moves, on each link r -> r + ring_by, the slot the next rank
  takes (nothing where that rank takes nothing);
* a collective of n ranks runs as a ring over its members in rank order
  (``network.ring_hops``, the hops the simulator prices): a broadcast or a
  reduce moves the value over the n - 1 hops of a chain from (or to) its root,
  an all-gather or a reduce-scatter moves (n - 1) / n of it over each of the n
  hops, an all-reduce twice that. A collective moves the whole of one value
  (``whole_value_kind``): what an all-gather makes (a stage's ``GATHER``: its
  weights from the members' shards), what a reduce-scatter reduces (a stage's
  ``REDUCE_GRAD``: its weight gradient), the value an all-reduce sums (a
  stage's ``SYNC_GRAD``, or under HSDP the member's shard of its gradient,
  ``SYNC_SHARD``, over the replica group: a ``shard`` value, its bytes the
  cost file's or derived, ``placed_memory.with_shard_size``); each collective
  counted once, on the first member of its communicator;
* a context-parallel composition's stage ring (``Program.stage_ring``) moves,
  for every compute of a stage split by sequence (one meeting of its group,
  counted once), what the ring's forward half (a forward, a recompute) or
  backward half (a backward) moves on the group, ring rank i as member i
  (``stage_ring.split_ring``): its KV bundles and dK, dV partials.

A link is ``intra`` when its two ranks sit on one node, else ``inter``. The
value of a kind weighs ``sizes[its size class]`` bytes (0 when the cost file
gives that class no size). The result is {kind: {"intra": bytes, "inter":
bytes}} with every kind that moved, the same on every run: the report
``simulate --json`` prints as ``traffic``.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable, Mapping, NamedTuple

from pipec.compiler import ops
from pipec.compiler.family import Family, families_of, first_answer
from pipec.compiler.ir import SEQUENCE_SHARE, Action, Program
from pipec.compiler.memory_counts import Number
from pipec.compiler.network import ALL_GATHER, BROADCAST, REDUCE, REDUCE_SCATTER, ring_hops
from pipec.compiler.stage_ring import STAGE_BACKWARD_OPS, STAGE_FORWARD_OPS, split_ring
from pipec.compiler.placed_memory import with_shard_size
from pipec.errors import UsageError

INTRA, INTER = "intra", "inter"

# Collectives run as rings over their members (``network.ring_hops``, the hops the simulator
# prices): op -> (its ring, how many times it goes round). An all-reduce is a reduce-scatter
# and an all-gather.
_RING_OF = {
    ops.BCAST_W: (BROADCAST, 1),
    ops.REDUCE_G: (REDUCE, 1),
    ops.ALLGATHER_W: (ALL_GATHER, 1),
    ops.GATHER: (ALL_GATHER, 1),
    ops.REDUCESCATTER_G: (REDUCE_SCATTER, 1),
    ops.ALLREDUCE_GRAD: (REDUCE_SCATTER, 2),
    ops.ALLREDUCE_TF: (REDUCE_SCATTER, 2),
    ops.ALLREDUCE_TB: (REDUCE_SCATTER, 2),
    ops.SYNC_GRAD: (REDUCE_SCATTER, 2),
    ops.REDUCE_GRAD: (REDUCE_SCATTER, 1),
    ops.SYNC_SHARD: (REDUCE_SCATTER, 2),
}
_ROOTED = frozenset({ops.BCAST_W, ops.REDUCE_G})
_RING_STEPS = (ops.SHIFT_F, ops.SHIFT_B, ops.SHIFT_G)
_SENDS = frozenset(ops.SEND_OPS) | frozenset(op for op in ops.EXCHANGE_PART_OPS if ops.RULES[op].category == ops.PART_SEND)
# What the traffic count has a rule for: messages, ring steps and collectives by the tables
# above, batches and exchanges (and an all_to_all) by their parts; every other op moves
# nothing over a link: computes, receives (counted at their sends), waits, fills, frees.
ops.declare_pass("traffic", _SENDS | set(_RING_STEPS) | set(_RING_OF)
                 | {op for op, rule in ops.RULES.items() if rule.category in (ops.BATCH_OF, ops.EXCHANGE_OF)}
                 | {ops.ALLTOALL_KV, ops.ALLTOALL_DKV},
                 leaves=(ops.COMPUTE, ops.RECV, ops.PART_RECV, ops.COLLECTIVE_WAIT, ops.EXCHANGE_WAIT_OF, ops.FREE,
                         ops.DROP_COPY, ops.PART_LOCAL))


def whole_value_kind(op: str) -> str | None:
    """The value kind whose whole one collective ``op`` moves: what a reduce-scatter reads (a stage's whole
    weight gradient, of which each member keeps its shard's sum), what every other collective makes (an
    all-gather: the whole weights from the members' shards); None for an op that moves no value."""
    rule = ops.RULES[op]
    if _RING_OF.get(op, (None, 0)) == (REDUCE_SCATTER, 1):
        return rule.reads[0].kind
    if rule.carries:
        return rule.carries.kind
    return rule.writes[0].kind if rule.writes else None


def member_share(program: Program) -> Fraction | int:
    """The share of each microbatch a rank computes and sends: 1 where every stage is on one rank; 1/k
    where every stage is on a group of k ranks (member i of k runs rows [i/k, (i+1)/k) of each microbatch).

    Raises:
        UsageError: stages on groups of different sizes, or some on one rank and some on groups: a
            message between them would carry pieces of several shares, which pipec does not price yet.
    """
    sizes = sorted({len(info.ranks) for info in program.stages})
    if len(sizes) > 1:
        raise UsageError(f"{program.name or 'this program'} places its stages on groups of "
                         f"{' and '.join(map(str, sizes))} ranks; the simulator and the traffic count take "
                         "stages that all sit on groups of one size")
    return Fraction(1, sizes[0]) if sizes and sizes[0] > 1 else 1


def traffic(program: Program, sizes: Mapping[str, Number], node_of: Callable[[int], int]) -> dict[str, dict[str, Number]]:
    """Bytes moved in one step of ``program``, per value kind and link class (module docstring).

    Args:
        program: any program.
        sizes: size class -> bytes of one value of it.
        node_of: rank -> its node.
    Returns:
        kind -> {"intra": bytes, "inter": bytes}, kinds in the rule table's order.
    """
    # Shares are summed per kind and link (whole values as integers, pieces as Fractions) and
    # weighed once at the end: bytes = size x shares, exact, with one multiplication per kind
    # instead of one per message (a step holds hundreds of thousands of messages).
    whole: dict[tuple[str, str], int] = {}
    pieces: dict[tuple[str, str], Fraction] = {}

    def add(kind: str, src: int, dst: int, share: Fraction | int) -> None:
        key = (kind, INTRA if node_of(src) == node_of(dst) else INTER)
        if share == 1:
            whole[key] = whole.get(key, 0) + 1
        else:
            pieces[key] = pieces.get(key, 0) + share

    _count_program(program, add)
    if program.stage_ring is not None:
        _count_stage_rings(program, add)
    return _weighed(whole, pieces, with_shard_size(program, sizes))


def _count_program(program: Program, add: Callable) -> None:
    """``add`` what every instruction of ``program`` moves."""
    families = families_of(program)
    sharing = [family for family in families if type(family).value_share is not Family.value_share]
    count = _Counter(program, sharing, families, member_share(program), add, set())
    for rank, row in enumerate(program.ranks):
        for action in row:
            for part in action.parts or (action,):  # a compute's sub-steps (a GATHER) are collectives
                _count(count, rank, part)


def _count_stage_rings(program: Program, add: Callable) -> None:
    """``add`` what the stage ring's halves move, once per meeting of a group split by sequence (counted on
    its first member, whose list holds every compute of the group's stages)."""
    halves = []
    for half in split_ring(program.stage_ring):
        moves: list[tuple] = []
        _count_program(half, lambda kind, src, dst, share, moves=moves: moves.append((kind, src, dst, share)))
        halves.append(moves)
    forward, backward = halves
    for rank, row in enumerate(program.ranks):
        for action in row:
            if not action.is_compute or not 0 <= action.stage < len(program.stages):
                continue
            placement = program.stages[action.stage].placement
            if placement is None or placement.split != SEQUENCE_SHARE or rank != placement.ranks[0]:
                continue
            moves = forward if action.op in STAGE_FORWARD_OPS else backward if action.op in STAGE_BACKWARD_OPS else ()
            for kind, src, dst, share in moves:
                add(kind, placement.ranks[src], placement.ranks[dst], share)


class _Counter(NamedTuple):
    """What ``_count`` reads: the program, the families that answer value_share (the rest would say None)
    and all of them, the share of a value a member of a stage's group sends (``member_share``), where
    bytes go (``add``) and the collectives counted so far."""

    program: Program
    sharing: list[Family]
    families: list[Family]
    member: Fraction | int
    add: Callable
    seen: set


def _weighed(whole: Mapping[tuple[str, str], int], pieces: Mapping[tuple[str, str], Fraction],
             sizes: Mapping[str, Number]) -> dict[str, dict[str, Number]]:
    """kind -> {"intra", "inter"} bytes: each kind's summed shares times its size, kinds in the rule
    table's order (a kind that moved lists both links)."""
    moved: dict[str, dict[str, Number]] = {}
    for kind in ops.VALUE_KINDS:
        keys = [(kind, link) for link in (INTRA, INTER)]
        if not any(key in whole or key in pieces for key in keys):
            continue
        size = Fraction(sizes.get(ops.VALUE_KINDS[kind].size_class, 0))
        moved[kind] = {link: _plain(size * (whole.get((kind, link), 0) + pieces.get((kind, link), 0)))
                       for kind, link in keys}
    return moved


def _count(count: _Counter, rank: int, part: Action) -> None:
    """Add what ``part`` on ``rank`` moves."""
    program, sharing, families, add, seen = count.program, count.sharing, count.families, count.add, count.seen
    op = part.op
    rule = ops.RULES.get(op)
    if rule is None:
        return
    if op in _SENDS:
        kind = rule.carries.kind
        share = first_answer(sharing, lambda family: family.value_share(program, part, kind)) if sharing else None
        add(kind, rank, part.peer, count.member if share is None else share)
    elif part.parts:  # an all_to_all of a sequence ring: its sends, each over its own link
        for inner in part.parts:
            _count(count, rank, inner)
    elif op in _RING_STEPS:
        giver = first_answer(families, lambda family: family.ring_step_giver(program, rank))
        if part.stage >= 0 and giver is not None:  # this rank takes a slot: it crossed the link from its giver
            add(rule.reads[0].kind, giver, rank, 1)
    elif op in _RING_OF:
        communicator = program.communicator_on(part, rank)
        if communicator is None:
            return
        if rule.communicator in (ops.STAGE_GROUP, ops.SHARD_REPLICAS):  # listed on every member, each once
            if rank != communicator.ranks[0]:
                return
        else:
            layer = program.stages[part.stage].position if 0 <= part.stage < len(program.stages) else -1
            key = (communicator.id, op, layer, part.mb)
            if key in seen:  # one collective, counted once (every member lists it)
                return
            seen.add(key)
        ring, rounds = _RING_OF[op]
        hops, share, _steps = ring_hops(ring, communicator.ranks, part.peer if op in _ROOTED else None)
        kind = whole_value_kind(op)
        for src, dst in hops:
            add(kind, src, dst, share * rounds)


def _plain(value: Fraction) -> Number:
    return int(value) if value.denominator == 1 else float(value)


def node_map(program: Program, node_size: int = 0) -> Callable[[int], int]:
    """Rank -> node: ``node_size`` consecutive devices per node (the cost file's ``links.node_size``;
    the ranks mapped through the program's devices); without one, a weight-passing program's
    groups, else one node."""
    if node_size:
        devices = program.devices or list(range(program.num_ranks))
        return lambda rank: devices[rank] // node_size
    grouped = next((by for by in map(lambda family: family.node_of(program), families_of(program)) if by), None)
    return grouped or (lambda rank: 0)
