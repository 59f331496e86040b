"""The wait-for engine: ranks walking their lists, some steps waiting on other ranks.

Lowering (to choose a communication placement that cannot deadlock) and the
deadlock check (to prove one) both run programs on this engine, so it lives
apart from both.

A program runs on a ``WaitGraph``: per rank, the sorted list of its waits,
each one int ``step * stride + other_step * R + other_rank`` ("at ``step`` this
rank needs ``other_rank`` to have reached ``other_step``"). It is a worklist
over ranks: a rank runs until a wait is unmet, parks on the one position it
waits for, and is woken when that rank gets there, so each wait is examined
O(1) times. ``blocked_ranks`` returns the ranks left parked and what each
waits for; the deadlock check turns them into a named cycle.

Every kind of meeting is a wait here: a rendezvous message (``add_meetings``),
a batch (its parts' waits at one step), a collective (``add_collectives``:
each member waits for every other to arrive).
"""
from __future__ import annotations

from itertools import repeat
from typing import Iterable, NamedTuple, Sequence


class WaitGraph(NamedTuple):
    """Every wait of a program, encoded as ints (module docstring).

    Attributes:
        num_ranks: R.
        done: the step value of a rank that finished (beyond every list).
        never: a step no rank ever reaches (waits for something that does not exist).
        stride: ``(never + 1) * R``; a wait is ``step * stride + other_step * R + other_rank``.
        waits: per rank, its waits sorted by step. A step that others wait for
            but that waits for nothing itself carries a wait that is always met.
    """

    num_ranks: int
    done: int
    never: int
    stride: int
    waits: list[list[int]]


def empty_graph(num_ranks: int, longest: int) -> WaitGraph:
    """A ``WaitGraph`` with no waits yet, for ranks whose lists have at most ``longest`` steps.

    Fill it with ``add_waits``, ``add_meetings`` and ``add_collectives``.
    """
    return WaitGraph(num_ranks, longest + 1, longest + 2, (longest + 3) * num_ranks, [[] for _ in range(num_ranks)])


def add_waits(graph: WaitGraph, rank: int, steps: Iterable[int], others: Iterable[int],
              other_steps: Iterable[int]) -> None:
    """At ``steps[i]``, ``rank`` waits until rank ``others[i]`` has reached ``other_steps[i]``."""
    stride, num_ranks = graph.stride, graph.num_ranks
    graph.waits[rank].extend([step * stride + at * num_ranks + other
                              for step, other, at in zip(steps, others, other_steps)])


def add_meetings(graph: WaitGraph, src: int, dst: int, send_steps: Sequence[int], recv_steps: Sequence[int]) -> None:
    """Rendezvous messages src -> dst: the i-th send and the i-th receive wait for each other.

    When one side has more operations, its extra ones wait for a step that never comes.
    """
    never = graph.never
    sends = list(send_steps) + [never] * (len(recv_steps) - len(send_steps))
    recvs = list(recv_steps) + [never] * (len(send_steps) - len(recv_steps))
    add_waits(graph, src, send_steps, repeat(dst), recvs)
    add_waits(graph, dst, recv_steps, repeat(src), sends)


def add_collectives(graph: WaitGraph, groups: Iterable[Sequence[tuple[int, int]]]) -> None:
    """Each group's (rank, step) members wait for every other member to arrive (``never``: a member that does not)."""
    for group in groups:
        for rank, step in group:
            if step != graph.never:
                others = [(other, at) for other, at in group if other != rank]
                add_waits(graph, rank, repeat(step, len(others)), (o for o, _ in others), (a for _, a in others))


def blocked_ranks(graph: WaitGraph) -> dict[int, tuple[int, int, int]]:
    """Advance every rank as far as it can go.

    Returns:
        rank -> (step it is stuck at, rank it waits for, step it waits for),
        for the ranks that never finish; empty when the program runs to the end.
    """
    num_ranks, stride, done = graph.num_ranks, graph.stride, graph.done
    waits = graph.waits
    for row in waits:
        row.sort()
    cursor = [0] * num_ranks
    reached = [row[0] // stride if row else done for row in waits]
    parked: dict[int, list[int]] = {}  # a position other_step * R + other_rank -> ranks waiting for it
    ready = list(range(num_ranks))
    while ready:
        rank = ready.pop()
        row = waits[rank]
        index, count = cursor[rank], len(row)
        while index < count:
            need = row[index] % stride
            if reached[need % num_ranks] < need // num_ranks:
                parked.setdefault(need, []).append(rank)
                break
            index += 1
            step = row[index] // stride if index < count else done
            if step != reached[rank]:  # moved on to a new instruction: it is posted now
                reached[rank] = step
                woken = parked.pop(step * num_ranks + rank, None)
                if woken:
                    ready.extend(woken)
        cursor[rank] = index
    stuck = {}
    for rank, row in enumerate(waits):
        if cursor[rank] < len(row):
            step, need = divmod(row[cursor[rank]], stride)
            other_step, other = divmod(need, num_ranks)
            stuck[rank] = (step, other, other_step)
    return stuck


__all__ = ["WaitGraph", "add_collectives", "add_meetings", "add_waits", "blocked_ranks", "empty_graph"]
