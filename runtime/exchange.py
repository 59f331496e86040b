"""Exchanges in the runtime: post a family's parts at EXCHANGE, wait for them at EXCHANGE_WAIT.

Weight passing (``runtime/weights.py``) and sequence rings (``runtime/rings.py``)
both run a rank's communication as numbered exchanges: ``EXCHANGE`` posts
every part of one instruction, the computes in between overlap with it, and
``EXCHANGE_WAIT`` of the same number waits for all of it and only then makes
what arrived usable. This module is that mechanism, once for every family:

* ``Exchange``: one posted exchange, its works, its point-to-point operations
  grouped by process group, what each part does on arrival, the peers it
  involves and the tensors the backend still reads or writes.
* ``post_exchange``: runs the family's handler of each part in part order
  (a collective part starts its work at once; a point-to-point part only adds
  its operation, ``Exchange.send`` / ``Exchange.receive``), then posts the
  point-to-point operations, one ``batch_isend_irecv`` per group in the order
  the groups were first met (``post_grouped``). Every rank posts its
  collectives in the same order because the handlers run in part order.
* ``wait_exchange``: waits for an exchange's works within the timeout, the
  family's way (``comm``'s rule for the backend), then runs its arrivals in
  part order.
* ``check_all_waited``: the end of a list leaves no exchange open.

A family keeps only what its parts mean: a table part op -> handler
``(state, part, exchange) -> None`` that says which tensor goes where and adds
operations and arrivals to the ``Exchange``. Faults are the family's
``RuntimeFault`` (its ``fault(index, message)``), with the messages below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import torch

from pipec.compiler.ir import Action
from pipec.errors import RuntimeFault
from pipec.runtime import comm

# The key of the default process group among an exchange's point-to-point groups.
DEFAULT_GROUP = -1

# (index of the instruction, message) -> the family's fault naming its rank and that instruction.
FaultMaker = Callable[[int, str], RuntimeFault]
# A family's meaning of one part: (the family's state, the part, the exchange it is posted in) -> None.
PartHandler = Callable[[Any, Action, "Exchange"], None]


@dataclass
class Exchange:
    """One posted exchange: where it was posted, its works, and what to do when it is waited.

    Attributes:
        number: its number (``Action.mb``).
        index: the index of its EXCHANGE in the rank's list.
        works: the backend's works of its parts.
        p2p: group key (communicator id, or ``DEFAULT_GROUP``) -> its point-to-point
            operations (is_send, tensor, peer's global rank, tag), posted together
            after every part was read.
        arrivals: what each part does on this rank once waited, in part order.
        peers: the other ranks its parts involve (for a fault's message).
        keep: tensors the backend reads or writes until the wait (and, on NCCL,
            until its deadline is checked); nothing else may need to hold them.
    """

    number: int
    index: int
    works: list = field(default_factory=list)
    p2p: dict = field(default_factory=dict)
    arrivals: list[Callable[[], None]] = field(default_factory=list)
    peers: set = field(default_factory=set)
    keep: list = field(default_factory=list)

    def send(self, tensor: torch.Tensor, peer: int, tag: int, group: int = DEFAULT_GROUP) -> None:
        """Add a send of ``tensor`` to global rank ``peer`` on ``group``'s batch (posted by ``post_grouped``)."""
        self._add(True, tensor, peer, tag, group)

    def receive(self, buffer: torch.Tensor, peer: int, tag: int, group: int = DEFAULT_GROUP) -> None:
        """Add a receive into ``buffer`` from global rank ``peer`` on ``group``'s batch; usable once waited."""
        self._add(False, buffer, peer, tag, group)

    def _add(self, is_send: bool, tensor: torch.Tensor, peer: int, tag: int, group: int) -> None:
        self.p2p.setdefault(group, []).append((is_send, tensor, peer, tag))
        self.peers.add(peer)


def post_grouped(ex: Exchange, groups: Mapping[int, comm.ReplicaGroup]) -> None:
    """Post the exchange's point-to-point operations, one batch per group, and keep their works.

    Args:
        ex: the exchange, every part already read.
        groups: communicator id -> this rank's group, for every key of ``ex.p2p``
            but ``DEFAULT_GROUP`` (the default process group).
    """
    # Groups go out in the order the parts first named them, which is the same
    # list order on every rank of a checked program.
    for key, operations in ex.p2p.items():
        group = None if key == DEFAULT_GROUP else groups[key].group
        ex.works += comm.post_p2p(operations, group)


def post_exchange(state, action: Action, index: int, open_: MutableMapping[int, Exchange],
                  handlers: Mapping[str, PartHandler], *, fault: FaultMaker, refusal: str,
                  groups: Mapping[int, comm.ReplicaGroup] | None = None) -> Exchange:
    """EXCHANGE: post every part of ``action`` in part order, then its point-to-point batches.

    Args:
        state: what the family's handlers take first (its rank's state).
        action: the EXCHANGE (``mb`` its number, ``parts`` its parts).
        index: its index in the rank's list.
        open_: exchange number -> posted and not waited; the new one is added.
        handlers: part op -> the family's handler of that part.
        fault: the family's fault maker.
        refusal: the words before a part's text when no handler has its op
            (``"an exchange cannot hold"``).
        groups: communicator id -> group, for the point-to-point groups (``post_grouped``).
    Returns:
        the posted ``Exchange``.
    Raises:
        RuntimeFault: the number is still open, a part the family does not
            have, or whatever a handler refuses.
    """
    number = action.mb
    if number in open_:
        raise fault(index, f"exchange {number} is posted again before it was waited")
    ex = Exchange(number, index)
    for part in action.parts:
        handler = handlers.get(part.op)
        if handler is None:
            raise fault(index, f"{refusal} {part.text()}")
        handler(state, part, ex)
    post_grouped(ex, groups or {})
    open_[number] = ex
    return ex


def wait_exchange(action: Action, index: int, open_: MutableMapping[int, Exchange], row: Sequence[Action], *,
                  fault: FaultMaker, site: Callable[[int, str, tuple[int, ...]], comm.Site],
                  wait: Callable[[Exchange, comm.Site], None]) -> Exchange:
    """EXCHANGE_WAIT: wait for every work of exchange ``action.mb``, then run its arrivals in part order.

    Args:
        action: the EXCHANGE_WAIT (``mb`` the exchange's number).
        index: its index in the rank's list.
        open_: exchange number -> posted and not waited; the waited one is removed.
        row: the rank's list (for the wait's text: this wait and the EXCHANGE it waits for).
        fault: the family's fault maker.
        site: (index, text, peers) -> the ``comm.Site`` of a wait.
        wait: waits for the exchange's works at a site within the family's timeout,
            the backend's way (``comm.wait_rule``); raises the ``RuntimeFault`` past it.
    Returns:
        the waited ``Exchange``.
    Raises:
        RuntimeFault: an exchange not posted (or already waited), or the wait's fault.
    """
    ex = open_.pop(action.mb, None)
    if ex is None:
        raise fault(index, f"it waits for exchange {action.mb}, which this rank has not posted (or already waited)")
    if ex.works:  # a local part (a fill, a collective of one) posts nothing to wait for
        text = f"{row[index].text()}, for {row[ex.index].text()} of step {ex.index}"
        wait(ex, site(index, text, tuple(sorted(ex.peers))))
    for arrive in ex.arrivals:
        arrive()
    return ex


def check_all_waited(open_: Mapping[int, Exchange], fault: FaultMaker) -> None:
    """Raise the fault of the first exchange still open (posted, never waited); nothing when none is."""
    if open_:
        number, ex = next(iter(open_.items()))
        raise fault(ex.index, f"exchange {number} is never waited")


__all__ = ["DEFAULT_GROUP", "Exchange", "FaultMaker", "PartHandler", "check_all_waited", "post_exchange",
           "post_grouped", "wait_exchange"]
