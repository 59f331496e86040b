"""Route policies: how a value gets from its producer to the ranks that use it.

A program never writes a send by hand. Lowering knows, from the rule table,
which value a task makes and which ranks read it (in the order they read
it); a route policy turns that into legs, and lowering turns legs into
instructions (a ``Hop`` into a SEND on its source and a RECV on its
destination; a ``GroupStep`` into one collective on every member of its
communicator).

Policies, each a pure function of the producer rank and the consumers:

* ``direct``: one hop from the producer to each other rank that reads the
  value (today's activation and gradient hand-off; a consumer on the
  producer's own rank is a local hand-off, no leg).
* ``ring``: a chain through the consumers in order, each hop reading the value
  and forwarding it (ring attention's KV blocks; WeiPipe's ring is systolic,
  every rank stepping its slot at once: ``lower_weights`` has it).
* ``staged_broadcast``: owner -> staging rank of a group by one hop, then a
  broadcast from the staging rank inside the group (TawPipe's weights).
* ``reduce_to_owner``: a reduce inside a group to its root, then one hop to
  the owner when the owner is elsewhere (TawPipe's weight gradients).
* ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``: one
  collective step of a group (FSDP's shards, the replica all-reduce, TASP's
  exchange of KV pieces).

``ROUTES`` names them for programs that choose a policy.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence, Union


class Hop(NamedTuple):
    """A point-to-point leg: the value travels from ``src`` to ``dst`` (one SEND, one RECV)."""

    src: int
    dst: int


class GroupStep(NamedTuple):
    """A collective leg: every rank of ``ranks`` takes part; ``root`` is -1 for rootless collectives."""

    op: str
    ranks: tuple[int, ...]
    root: int = -1


Leg = Union[Hop, GroupStep]

# Collective step names, as the runtime calls them in torch.distributed.
BROADCAST, REDUCE = "broadcast", "reduce"
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"


def direct(producer: int, consumers: Sequence[int]) -> tuple[Leg, ...]:
    """One hop from ``producer`` to each other rank among ``consumers`` (once each, in order).

    Args:
        producer: the rank that makes the value.
        consumers: the ranks that read it, in the order they read it.
    Returns:
        the hops; none for consumers on the producer's rank.
    """
    seen = {producer}
    legs = []
    for rank in consumers:
        if rank not in seen:
            seen.add(rank)
            legs.append(Hop(producer, rank))
    return tuple(legs)


def ring(producer: int, consumers: Sequence[int]) -> tuple[Leg, ...]:
    """A chain producer -> c1 -> c2 -> ...: each consumer reads the value and forwards it.

    Consecutive consumers on one rank need no hop; a rank is visited in the
    order given (a ring schedule lists each rank once per round).
    """
    legs = []
    at = producer
    for rank in consumers:
        if rank != at:
            legs.append(Hop(at, rank))
            at = rank
    return tuple(legs)


def staged_broadcast(owner: int, group: Sequence[int], staging: int) -> tuple[Leg, ...]:
    """The owner's value to every rank of ``group``: a hop to ``staging`` (unless the owner is in the
    group, which then broadcasts from the owner), then a broadcast inside the group."""
    ranks = tuple(sorted(group))
    if owner in ranks:
        return (GroupStep(BROADCAST, ranks, owner),)
    if staging not in ranks:
        raise ValueError(f"staging rank {staging} is not in the group {list(ranks)}")
    return (Hop(owner, staging), GroupStep(BROADCAST, ranks, staging))


def reduce_to_owner(group: Sequence[int], owner: int, root: int) -> tuple[Leg, ...]:
    """Partials held by ``group`` summed at ``root`` (the owner when it is a member), then sent to the owner."""
    ranks = tuple(sorted(group))
    root = owner if owner in ranks else root
    if root not in ranks:
        raise ValueError(f"root rank {root} is not in the group {list(ranks)}")
    legs: tuple[Leg, ...] = (GroupStep(REDUCE, ranks, root),)
    return legs if root == owner else legs + (Hop(root, owner),)


def _group_step(op: str) -> Callable[[Sequence[int]], tuple[Leg, ...]]:
    def step(group: Sequence[int]) -> tuple[Leg, ...]:
        return (GroupStep(op, tuple(sorted(group))),)
    step.__name__ = op
    step.__doc__ = f"One {op.replace('_', '-')} of the group."
    return step


all_gather = _group_step(ALL_GATHER)
reduce_scatter = _group_step(REDUCE_SCATTER)
all_reduce = _group_step(ALL_REDUCE)
all_to_all = _group_step(ALL_TO_ALL)

# Policies a program may name, by name.
ROUTES: dict[str, Callable[..., tuple[Leg, ...]]] = {
    "direct": direct,
    "ring": ring,
    "staged_broadcast": staged_broadcast,
    "reduce_to_owner": reduce_to_owner,
    ALL_GATHER: all_gather,
    REDUCE_SCATTER: reduce_scatter,
    ALL_REDUCE: all_reduce,
    ALL_TO_ALL: all_to_all,
}
