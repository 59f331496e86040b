"""The network a simulation prices transfers on: two levels, shared links.

Contract: a ``Network`` built from a ``CostModel`` answers when a transfer
between two devices has arrived (``transfer``), when a collective has ended
(``collective``, as the ring of transfers ``ring_hops`` makes of it: a ring
step of its members at once, a broadcast or reduce pipelined along a ring, an
all-gather or reduce-scatter as n - 1 ring steps of 1/n of the value), and how
busy the directed links were while anything moved (``usage``);
``compiler/traffic.py`` counts bytes on the same hops.

Ranks sit on nodes (``CostModel.node_size`` consecutive devices per node). A
transfer uses the link between its two devices (``CostModel.link_between``:
the default link inside a node, ``inter_node`` between nodes, a ``pairs``
entry where one is given). Without ``links.contention`` and without a NIC,
port or rail a transfer takes ``latency + bytes / bandwidth`` whatever else is
moving (pipec's classic model, and the default). With them, transfers that
share a resource share its bandwidth: each resource keeps a calendar of
reservations, and a transfer takes the earliest window in which all of its
resources are free (``Network`` says which resources and how). The cost-file
keys are described in docs/costs.md, ``links``.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from fractions import Fraction
from typing import Sequence

from pipec.compiler.costs import CostModel, Link, Number, exact_ratio

# The collectives of ``ring_hops``.
BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER = "broadcast", "reduce", "all_gather", "reduce_scatter"
ALL_REDUCE = "all_reduce"


class Network:
    """The resources of one simulation and their calendars.

    The resources of a transfer: its directed link (with ``contention``);
    between nodes the sending and the receiving node's NIC (with ``nic``,
    always shared: that is what a NIC is) and the two devices' rail NICs (with
    ``rails``); the sender's and the receiver's switch port (with ``port``).
    A transfer moves at the rate of its slowest resource (cut-through) and
    holds every resource it uses for ``bytes / that rate``, then arrives
    ``latency`` later. Each resource keeps a calendar of the intervals it is
    busy; a transfer ready at t takes the earliest window at or after t that
    is free on all its resources. Two transfers of b bytes posted at once on
    one link of bandwidth w arrive at b / w and 2 b / w, as two flows sharing
    it fairly would finish in total. A window left free between reservations
    is used by a later one that fits: the simulator asks in the order it runs
    ranks, not strictly in time order, and gap-filling keeps a transfer asked
    later but ready earlier from waiting behind one that is ready later.
    """

    def __init__(self, costs: CostModel):
        self.costs = costs
        self.shared = costs.contention or any(link is not None for link in (costs.nic, costs.port, costs.rails))
        self.busy: dict[tuple, list[tuple[Number, Number]]] = {}
        # every transfer that took time, as (src, dst, start, arrival): the links' use, for ``usage``
        self.moved: list[tuple[int, int, Number, Number]] = []

    def transfer(self, src: int, dst: int, nbytes: Number, ready: Number) -> Number:
        """When ``nbytes`` from device ``src`` to device ``dst``, ready at ``ready``, have arrived.

        Args:
            src, dst: devices (a program's ranks mapped through its devices).
            nbytes: the bytes moved.
            ready: when the transfer may start (both sides posted, the data made).
        Returns:
            the arrival time; ``ready`` for a device to itself.
        """
        if src == dst:
            return ready
        link = self.costs.link_between(src, dst)
        resources, rate = self._resources(src, dst, link)
        if not self.shared or not nbytes or rate is None:
            start, arrival = ready, ready + link.time(nbytes)
        else:
            hold = exact_ratio(nbytes, rate)
            start = self._window(resources, ready, hold)
            for resource in resources:
                insort(self.busy.setdefault(resource, []), (start, start + hold))
            arrival = start + hold + link.latency + self._nic_latency(src, dst)
        self.record(src, dst, start, arrival)
        return arrival

    def record(self, src: int, dst: int, start: Number, arrival: Number) -> None:
        """Note that a transfer used the link ``src`` -> ``dst`` from ``start`` to ``arrival``."""
        if arrival > start:
            self.moved.append((src, dst, start, arrival))

    def usage(self, devices: int) -> dict[str, Number] | None:
        """How busy the links were while anything moved, or None when nothing took time.

        Returns:
            ``communication``: the time during which at least one transfer was
            under way; ``utilisation``: the mean share of the ``devices * (devices - 1)``
            directed links busy during that time (a ring step of every device: 1 / (devices - 1);
            an all-to-all exchange: 1).
        """
        if not self.moved or devices < 2:
            return None
        spans = sorted((start, arrival) for _, _, start, arrival in self.moved)
        communication, (open_start, open_end) = 0, spans[0]
        for start, arrival in spans[1:]:
            if start > open_end:
                communication += open_end - open_start
                open_start, open_end = start, arrival
            else:
                open_end = max(open_end, arrival)
        communication += open_end - open_start
        links: dict[tuple[int, int], list[tuple[Number, Number]]] = {}
        for src, dst, start, arrival in self.moved:
            links.setdefault((src, dst), []).append((start, arrival))
        busy = sum(_covered(intervals) for intervals in links.values())
        utilisation = busy / (communication * devices * (devices - 1))
        return {"communication": _number(communication), "utilisation": float(utilisation)}

    def hops(self, hops: Sequence[tuple[int, int]], nbytes: Number, start: Number, steps: int = 1) -> Number:
        """When transfers of ``nbytes`` over every (src, dst) of ``hops``, all ready at ``start``, are done,
        run as ``steps`` pipelined steps (each step after the first adds the slowest hop's latency).

        Returns:
            ``start`` when there is no hop.
        """
        if not hops:
            return start
        end = max(self.transfer(src, dst, nbytes, start) for src, dst in hops)
        slowest = max(self.costs.link_between(src, dst).latency for src, dst in hops)
        return end + (steps - 1) * slowest

    def collective(self, kind: str, members: Sequence[int], nbytes: Number, start: Number,
                   root: int | None = None) -> Number:
        """When a collective of ``members`` (devices, ascending) that starts at ``start`` has ended,
        as the rings of ``ring_hops``."""
        hops, share, steps = ring_hops(kind, members, root)
        return self.hops(hops, _plain(share * Fraction(nbytes)), start, steps)

    # -- internals ---------------------------------------------------------------

    def _resources(self, src: int, dst: int, link: Link) -> tuple[list[tuple], Number | None]:
        """The resources a transfer holds and the rate it moves at (None: infinite)."""
        costs = self.costs
        resources: list[tuple] = []
        rates = [link.bandwidth]
        if costs.contention:
            resources.append(("link", src, dst))
        if costs.nic is not None and costs.node_size and src // costs.node_size != dst // costs.node_size:
            resources += [("nic out", src // costs.node_size), ("nic in", dst // costs.node_size)]
            rates.append(costs.nic.bandwidth)
        if costs.port is not None:
            resources += [("port out", src), ("port in", dst)]
            rates.append(costs.port.bandwidth)
        if costs.rails is not None and src // costs.node_size != dst // costs.node_size:
            resources += [("rail out", src), ("rail in", dst)]
            rates.append(costs.rails.bandwidth)
        known = [rate for rate in rates if rate is not None]
        return resources, (min(known) if known else None)

    def _nic_latency(self, src: int, dst: int) -> Number:
        """The latency the node's NIC and the devices' rails add to a transfer between nodes."""
        costs = self.costs
        if not costs.node_size or src // costs.node_size == dst // costs.node_size:
            return 0
        return sum(link.latency for link in (costs.nic, costs.rails) if link is not None)

    def _window(self, resources: list[tuple], ready: Number, hold: Number) -> Number:
        """The earliest start at or after ``ready`` at which every resource is free for ``hold``."""
        start = ready
        while True:
            latest = start
            for resource in resources:
                latest = max(latest, _free_from(self.busy.get(resource, ()), start, hold))
            if latest == start:
                return start
            start = latest


def ring_hops(kind: str, members: Sequence[int], root: int | None = None
              ) -> tuple[list[tuple[int, int]], Fraction, int]:
    """How a collective of ``members`` runs as a ring over them in the given order: its hops
    (src, dst), the share of the value each hop carries, and its pipelined steps.

    A broadcast is a chain from ``root`` along the ring (n - 1 hops of the whole
    value), a reduce the same chain towards it; an all-gather or a
    reduce-scatter goes round the whole ring in n - 1 steps of 1/n of the
    value, (n - 1)/n on each of its n hops; an all-reduce is a reduce-scatter
    and then an all-gather, twice round. One member: no hop.
    """
    n = len(members)
    if n <= 1:
        return [], Fraction(1), 1
    order = list(members)
    if root is not None and root in order:  # the chain starts at the root
        at = order.index(root)
        order = order[at:] + order[:at]
    chain = list(zip(order, order[1:]))
    if kind == BROADCAST:
        return chain, Fraction(1), n - 1
    if kind == REDUCE:
        return [(dst, src) for src, dst in chain], Fraction(1), n - 1
    if kind in (ALL_GATHER, REDUCE_SCATTER):
        return chain + [(order[-1], order[0])], Fraction(n - 1, n), n - 1
    if kind == ALL_REDUCE:
        return chain + [(order[-1], order[0])], Fraction(2 * (n - 1), n), 2 * (n - 1)
    raise ValueError(f"unknown collective {kind!r}")


def _free_from(calendar: Sequence[tuple[Number, Number]], start: Number, hold: Number) -> Number:
    """The earliest time at or after ``start`` at which ``calendar`` (sorted, disjoint busy intervals)
    has ``hold`` free."""
    index = bisect_left(calendar, (start,))
    if index and calendar[index - 1][1] > start:  # the interval before it is still busy at start
        start = calendar[index - 1][1]
    for busy_start, busy_end in calendar[index:]:
        if busy_start >= start + hold:
            return start
        start = max(start, busy_end)
    return start


def _covered(intervals: list[tuple[Number, Number]]) -> Number:
    """The total length of the union of ``intervals``."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _number(value) -> Number:
    return value if isinstance(value, int) else float(value)


def _plain(value: Fraction) -> Number:
    return int(value) if value.denominator == 1 else float(value)
