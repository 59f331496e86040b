"""Messages, batches and replica all-reduces for the interpreter, each with a deadline.

The interpreter posts every communication at its instruction and waits for it
later (a receive at the first compute that reads it, a send at the end of the
step, an all-reduce at its ALLREDUCE_WAIT). This module owns the two things
that differ between backends and the one thing that must never differ:

* How a wait meets its deadline. gloo's ``Work.wait(timeout)`` blocks the CPU
  until the operation is done or the deadline passes, which is what a CPU run
  wants. NCCL's ``Work.wait()`` only makes the compute stream wait, so the CPU
  can run ahead and queue kernels; blocking it at every wait would serialise
  CPU and GPU. There the deadline is checked when the step settles (``settle``),
  by polling ``is_completed`` of everything still outstanding.
* How a failed wait is reported: ``RuntimeFault`` naming the rank, the
  instruction index and text, how long it waited and for which rank(s).
* The communicators: ``replica_groups`` (activation passing) and
  ``communicator_groups`` (weight passing) call ``dist.new_group`` for every
  communicator of the program (``Program.communicators``) in list order, on
  every rank, members or not, as torch.distributed requires.

The exchanges of weight passing and sequence rings (``runtime/exchange.py``)
post point-to-point parts with ``post_p2p`` (a group and a tag per kind, so
that each kind keeps its own FIFO channel); weight passing's collectives use
``start_broadcast``, ``start_reduce``, ``start_all_gather`` and
``start_reduce_scatter``, all asynchronous.
"""
from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from pipec.compiler.ir import Program
from pipec.errors import RuntimeFault

# How often a deadline poll looks at an unfinished NCCL operation, in seconds.
_POLL_S = 0.0005
# Words in a backend's error that mean "the deadline passed" rather than "the peer failed".
_TIMEOUT_WORDS = ("timed out", "timeout")


class Site(NamedTuple):
    """Where a wait happens, for its fault message.

    Attributes:
        rank: the waiting rank.
        step: the index of the instruction that waits.
        instruction: that instruction's text (and, when it waits for an
            operation another instruction posted, which one).
        peers: the rank(s) the operation involves.
        iteration: the training step, counted from 1.
    """

    rank: int
    step: int
    instruction: str
    peers: tuple[int, ...]
    iteration: int


def _peers_text(peers: Sequence[int]) -> str:
    if len(peers) == 1:
        return f"rank {peers[0]}"
    return "ranks " + ", ".join(map(str, peers))


def wait_fault(site: Site, waited: float, error: BaseException | None) -> RuntimeFault:
    """The fault for a wait at ``site`` that ended after ``waited`` seconds.

    Args:
        site: where the wait happened.
        waited: seconds waited.
        error: the backend's exception, or None when the deadline passed without one.
    Returns:
        a ``RuntimeFault`` whose message starts ``waited T s for rank Q``.
    """
    head = f"waited {waited:.1f} s for {_peers_text(site.peers)}"
    text = _backend_words(error)
    if error is None or any(word in text.lower() for word in _TIMEOUT_WORDS):
        why = "no answer within the timeout (a hung or slower peer; raise --timeout if it is only slow)"
    else:
        why = f"the peer failed or closed the connection ({text})"
    message = f"{head}: {why}; training step {site.iteration}"
    return RuntimeFault(message, site.rank, site.step, site.instruction, site.peers[0] if site.peers else None)


def _backend_words(error: BaseException | None) -> str:
    """The gist of a backend's error: its first sentence, without gloo's source location."""
    if error is None:
        return ""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # "[.../pair.cc:553] "
    return text.split(". ")[0].rstrip(".")


def await_blocking(works: Sequence[dist.Work], timeout: float, site: Site) -> None:
    """Wait for every work on the CPU, all within ``timeout`` seconds (gloo).

    Raises:
        RuntimeFault: the deadline passed or the backend reported an error.
    """
    start = time.monotonic()
    for work in works:
        remaining = timeout - (time.monotonic() - start)
        try:
            if remaining <= 0 or not work.wait(timeout=timedelta(seconds=remaining)):
                raise wait_fault(site, time.monotonic() - start, None)
        except RuntimeError as error:  # gloo reports a timeout and a dead peer as RuntimeError
            raise wait_fault(site, time.monotonic() - start, error) from None


def await_stream(works: Sequence[dist.Work], timeout: float, site: Site) -> None:
    """Make the current stream wait for every work (NCCL); the CPU goes on.

    The deadline is checked later, by ``settle``.
    """
    for work in works:
        work.wait()


def settle(works: Sequence[dist.Work], timeout: float, site: Site) -> None:
    """Poll until every work has completed, within ``timeout`` seconds; the CPU-side check for NCCL.

    Raises:
        RuntimeFault: the deadline passed, or a work reports an exception.
    """
    start = time.monotonic()
    for work in works:
        while not work.is_completed():
            waited = time.monotonic() - start
            if waited > timeout:
                raise wait_fault(site, waited, None)
            time.sleep(_POLL_S)
        try:
            work.wait()  # completed: returns at once, or raises the operation's error
        except RuntimeError as error:
            raise wait_fault(site, time.monotonic() - start, error) from None


# Per backend: (wait at use, whether the CPU blocks there). A backend not listed
# is treated as gloo: blocking waits are correct everywhere, only slower on GPU.
WAIT_RULES = {
    "gloo": (await_blocking, True),
    "nccl": (await_stream, False),
}


def wait_rule(backend: str):
    """The (wait function, blocks the CPU) pair for ``backend``."""
    return WAIT_RULES.get(backend, WAIT_RULES["gloo"])


# ------------------------------------------------------------------ posting


def post_send(tensor: torch.Tensor, peer: int) -> list[dist.Work]:
    return [dist.isend(tensor, peer)]


def post_recv(buffer: torch.Tensor, peer: int) -> list[dist.Work]:
    return [dist.irecv(buffer, peer)]


def post_batch(ops: Sequence[tuple[bool, torch.Tensor, int]]) -> list[list[dist.Work]]:
    """Post a batch through ``batch_isend_irecv``; per op, the works to wait for it.

    Args:
        ops: (is_send, tensor, peer) in the batch's order.
    Returns:
        one list of works per op: its own work when the backend returns one per
        op (gloo), else every work of the batch (NCCL coalesces a batch).
    """
    p2p = [dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer) for is_send, tensor, peer in ops]
    works = dist.batch_isend_irecv(p2p)
    if len(works) == len(ops):
        return [[work] for work in works]
    return [works] * len(ops)


class ReplicaGroup(NamedTuple):
    """The subgroup that all-reduces one replicated chunk's weight gradients.

    Attributes:
        group: the process group (this rank is a member).
        peers: the other member ranks, for fault messages.
    """

    group: object
    peers: tuple[int, ...]


def replica_groups(program: Program, rank: int) -> dict[int, ReplicaGroup]:
    """Create the program's communicators once; collective: every rank calls it, in the same state.

    Args:
        program: the compiled program (the same on every rank).
        rank: this rank.
    Returns:
        communicator key (for the replica all-reduce: the chunk) -> its
        ``ReplicaGroup``, for the communicators this rank is in that span two
        or more ranks. Replicas on a single rank share one module and need no
        all-reduce.
    """
    groups = _new_groups(program, rank)
    return {program.communicators[communicator_id].key: group for communicator_id, group in groups.items()}


def _new_groups(program: Program, rank: int) -> dict[int, ReplicaGroup]:
    """Every communicator of two or more ranks made a process group, on every rank in the program's
    order (``new_group`` is collective); communicator id -> group, for those this rank is in."""
    mine: dict[int, ReplicaGroup] = {}
    for communicator in program.communicators:
        ranks = list(communicator.ranks)
        if len(ranks) < 2:
            continue
        group = dist.new_group(ranks)
        if rank in ranks:
            mine[communicator.id] = ReplicaGroup(group, tuple(r for r in ranks if r != rank))
    return mine


def start_allreduce(flat: torch.Tensor, replicas: ReplicaGroup) -> list[dist.Work]:
    """Start the sum all-reduce of a chunk's flat gradient buffer in its replica group."""
    return [dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=replicas.group, async_op=True)]


# ------------------------------------------------------------ weight passing


def communicator_groups(program: Program, rank: int) -> dict[int, ReplicaGroup]:
    """Create the program's communicators once, keyed by their id (weight passing); collective.

    Weight passing's communicators have keys that repeat across purposes (the
    ring, group 0 and the world all have key 0), so they are named by id.
    Each group this rank is in is then used once (a barrier, members only, in
    list order): NCCL wants every member in a group's first operation, and a
    batch of point-to-point operations may otherwise be a group's first.

    Args:
        program: the compiled program (the same on every rank).
        rank: this rank.
    Returns:
        communicator id -> its ``ReplicaGroup``, for the communicators this
        rank is in that span two or more ranks (a collective of one member
        moves nothing).
    """
    mine = _new_groups(program, rank)
    for communicator_id in sorted(mine):  # one global order: no two ranks wait on each other's group
        dist.barrier(group=mine[communicator_id].group)
    return mine


def post_p2p(ops: Sequence[tuple[bool, torch.Tensor, int, int]], group=None) -> list[dist.Work]:
    """Post point-to-point operations of one group together (``batch_isend_irecv``); their works.

    Args:
        ops: (is_send, tensor, peer's global rank, tag), in posting order. gloo
            matches messages FIFO per (pair, tag); NCCL ignores tags and
            matches per pair in posting order, which the program's order gives.
        group: the process group (None: the default one).
    """
    p2p = [dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer, group, tag)
           for is_send, tensor, peer, tag in ops]
    return list(dist.batch_isend_irecv(p2p)) if p2p else []


def start_broadcast(tensor: torch.Tensor, root: int, group: ReplicaGroup) -> list[dist.Work]:
    """Start broadcasting ``tensor`` from global rank ``root`` to the group (in place on the others)."""
    return [dist.broadcast(tensor, src=root, group=group.group, async_op=True)]


def start_reduce(tensor: torch.Tensor, root: int, group: ReplicaGroup) -> list[dist.Work]:
    """Start the sum reduce of every member's ``tensor`` into the root's (the others' may be overwritten)."""
    return [dist.reduce(tensor, dst=root, op=dist.ReduceOp.SUM, group=group.group, async_op=True)]


# torch >= 2.13 names the single-tensor collectives *_single; earlier ones *_into_tensor / *_tensor.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Set when the backend turned the single-tensor form down (an older gloo): the list or all-reduce form then.
_FALLBACK: set[str] = set()


def start_all_gather(output: torch.Tensor, shard: torch.Tensor, group: ReplicaGroup) -> list[dist.Work]:
    """Start gathering every member's ``shard`` into ``output`` (members in rank order, one shard each)."""
    if "all_gather" not in _FALLBACK:
        try:
            return [_ALL_GATHER_SINGLE(output, shard, group=group.group, async_op=True)]
        except (RuntimeError, NotImplementedError):  # refused at the call, the same way on every rank
            _FALLBACK.add("all_gather")
    pieces = list(output.chunk(output.numel() // shard.numel()))
    return [dist.all_gather(pieces, shard, group=group.group, async_op=True)]


def start_reduce_scatter(flat: torch.Tensor, index: int, group: ReplicaGroup) -> tuple[list[dist.Work], torch.Tensor]:
    """Start the sum reduce-scatter of every member's ``flat``; this member keeps piece ``index``.

    Args:
        flat: this member's tensor, ``members`` equal pieces long; may be overwritten.
        index: this member's place in the group (its piece).
        group: the group.
    Returns:
        (works, the tensor that holds this member's piece of the sum once they are done).
    """
    members = len(group.peers) + 1
    piece = flat.numel() // members
    if "reduce_scatter" not in _FALLBACK:
        output = torch.empty(piece, dtype=flat.dtype, device=flat.device)
        try:
            return [_REDUCE_SCATTER_SINGLE(output, flat, group=group.group, async_op=True)], output
        except (RuntimeError, NotImplementedError):  # refused at the call, the same way on every rank
            _FALLBACK.add("reduce_scatter")
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group.group, async_op=True)
    return [work], flat[index * piece:(index + 1) * piece]


__all__ = [
    "ReplicaGroup",
    "Site",
    "communicator_groups",
    "post_p2p",
    "start_all_gather",
    "start_broadcast",
    "start_reduce",
    "start_reduce_scatter",
    "WAIT_RULES",
    "await_blocking",
    "await_stream",
    "post_batch",
    "post_recv",
    "post_send",
    "replica_groups",
    "settle",
    "start_allreduce",
    "wait_fault",
    "wait_rule",
]
