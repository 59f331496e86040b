"""Place a weight-passing rank's copy drops and gradient waits where no transfer is still using them.

With ``prefetch K`` an exchange posted at boundary b is waited at boundary
b + K, so for K >= 2 two things the lowering places by steps alone can race a
transfer still in flight:

* a delivered copy dropped (``FREE_W``) while a send or broadcast of it is in
  flight. A non-owner sends a layer from the oldest copy of it that it holds
  (``checks.weights`` and the runtime both take that one), so the staging
  rank's later broadcast may read the copy an earlier step left, which its
  step's ``FREE_W`` would drop under the send;
* a layer's gradient partial added to (a B or W computed, or a received
  partial added at its wait) or lent again while an earlier exchange still
  sends or reduces it, or still has a received partial of it to add.

Contract: ``separate_transfers(row, rank, layer_of, owners)`` returns the
rank's list with the same actions, each ``FREE_W`` moved after the wait of
every exchange that sends from its copy, and an ``EXCHANGE_WAIT`` moved
forward to just before the first action that would race its gradient part
(the later wait of it is then left out). Nothing is reordered otherwise, so
every rank posts its exchanges in the order it did; ``checks.weights`` proves
the result.
"""
from __future__ import annotations

from collections import defaultdict

from pipec.compiler.ir import Action
from pipec.compiler.ops import (
    BCAST_W,
    EXCHANGE,
    EXCHANGE_WAIT,
    FREE_W,
    GRADIENT_CONTRIBUTORS,
    RECV_G,
    RECV_W,
    REDUCE_G,
    REDUCESCATTER_G,
    SEND_G,
    SEND_W,
)

# Parts that lend a rank's gradient partial of a layer to a transfer until their exchange is waited.
_LENDS = (SEND_G, REDUCE_G, REDUCESCATTER_G)


class _Rank:
    """One rank's copies and open transfers while its list is rewritten."""

    def __init__(self, rank: int, layer_of, owners):
        self.rank, self.layer_of, self.owners = rank, layer_of, owners
        self.out: list[Action] = []
        self.copies: dict[tuple, None] = {}            # ("W", layer, step), oldest first
        self.arriving: dict[int, list[tuple]] = defaultdict(list)  # exchange -> copies it delivers
        self.sending: dict[tuple, set[int]] = defaultdict(set)     # copy -> exchanges sending from it
        self.gradients: dict[int, set[int]] = defaultdict(set)     # layer -> open exchanges with its partial
        self.lent: dict[int, set[int]] = defaultdict(set)          # layer -> open exchanges lending it
        self.open: set[int] = set()
        self.held_frees: list[Action] = []

    def free_key(self, action: Action) -> tuple:
        return ("W", self.layer_of(action), action.mb)

    def wait(self, number: int) -> None:
        if number not in self.open:
            return  # waited earlier, where a gradient part needed it
        self.open.discard(number)
        self.out.append(Action(-1, EXCHANGE_WAIT, number))
        for key in self.arriving.pop(number, ()):
            self.copies[key] = None
        for exchanges in (*self.sending.values(), *self.gradients.values(), *self.lent.values()):
            exchanges.discard(number)
        held, self.held_frees = self.held_frees, []
        for free in held:
            self.free(free)

    def wait_all(self, exchanges) -> None:
        for number in sorted(exchanges):
            self.wait(number)

    def free(self, action: Action) -> None:
        key = self.free_key(action)
        if self.sending[key]:
            self.held_frees.append(action)  # dropped once the last send of it is waited
            return
        self.copies.pop(key, None)
        self.out.append(action)

    def post(self, action: Action) -> None:
        number = action.mb
        for part in action.parts:  # a gradient part after every earlier transfer of its layer's partial
            if part.op in _LENDS or part.op == RECV_G:
                self.wait_all(self.gradients[self.layer_of(part)] - {number})
        self.out.append(action)
        self.open.add(number)
        for part in action.parts:
            layer = self.layer_of(part)
            if part.op in _LENDS or part.op == RECV_G:
                self.gradients[layer].add(number)
                if part.op in _LENDS:
                    self.lent[layer].add(number)
            elif part.op == SEND_W or (part.op == BCAST_W and part.peer == self.rank):
                self.send_weights(layer, number)
            elif part.op in (RECV_W, BCAST_W):
                self.arriving[number].append(("W", layer, part.mb))

    def send_weights(self, layer: int, number: int) -> None:
        if self.owners is None or self.owners[layer] == self.rank:
            return  # from the master (no owners: every rank sends from its shard)
        key = next((k for k in self.copies if k[1] == layer), None)
        if key is not None:
            self.sending[key].add(number)

    def step(self, action: Action) -> None:
        if action.op == EXCHANGE:
            self.post(action)
        elif action.op == EXCHANGE_WAIT:
            self.wait(action.mb)
        elif action.op == FREE_W:
            self.free(action)
        else:
            if action.op in GRADIENT_CONTRIBUTORS:
                self.wait_all(self.lent[self.layer_of(action)])
            self.out.append(action)


def separate_transfers(row: list[Action], rank: int, layer_of, owners) -> list[Action]:
    """The rank's list with its drops and gradient waits placed clear of transfers (module docstring).

    Args:
        row: the rank's assembled list (exchanges, waits, computes, drops).
        rank: its rank.
        layer_of: Action -> the layer its stage runs.
        owners: layer -> the rank that owns it (and sends it from its master); None under all_gather.
    Returns:
        the rewritten list.
    """
    state = _Rank(rank, layer_of, owners)
    for action in row:
        state.step(action)
    state.out.extend(state.held_frees)  # unreachable when every exchange is waited; kept so nothing is lost
    return state.out
