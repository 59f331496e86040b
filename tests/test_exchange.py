"""The shared exchange mechanism (``runtime/exchange.py``) without a process group.

Parts that post no point-to-point operation and no work (local fills) run
through ``post_exchange`` and ``wait_exchange`` alone: the handlers run in
part order, the arrivals run at the wait in part order, and the faults carry
the messages both families' runtimes raise.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pipec.compiler.ir import Action  # noqa: E402
from pipec.errors import RuntimeFault  # noqa: E402
from pipec.runtime.exchange import (DEFAULT_GROUP, Exchange, check_all_waited, post_exchange,  # noqa: E402
                                    wait_exchange)


def _fault(index: int, message: str) -> RuntimeFault:
    return RuntimeFault(message, 0, index, f"instruction {index}")


def _handler(log: list):
    def handle(state, part: Action, ex: Exchange) -> None:
        log.append(("post", part.mb))
        ex.arrivals.append(lambda: log.append(("arrive", part.mb)))
    return handle


def _wait_never(ex, site):
    raise AssertionError("an exchange without works waits for nothing")


def test_parts_post_in_order_and_arrive_in_order_at_the_wait():
    log: list = []
    row = [Action(-1, "EXCHANGE", 7, parts=(Action(0, "FILL", 1), Action(0, "FILL", 2))), Action(-1, "EXCHANGE_WAIT", 7)]
    open_: dict = {}
    ex = post_exchange(None, row[0], 0, open_, {"FILL": _handler(log)}, fault=_fault, refusal="cannot hold")
    assert (ex.number, ex.index, open_) == (7, 0, {7: ex}) and log == [("post", 1), ("post", 2)]
    wait_exchange(row[1], 1, open_, row, fault=_fault, site=None, wait=_wait_never)
    assert open_ == {} and log[2:] == [("arrive", 1), ("arrive", 2)]


def test_the_faults_name_the_exchange():
    row = [Action(-1, "EXCHANGE", 3, parts=(Action(0, "FILL", 1),)), Action(-1, "EXCHANGE_WAIT", 3)]
    open_: dict = {}
    with pytest.raises(RuntimeFault, match=r"an exchange cannot hold 0FILL1"):
        post_exchange(None, row[0], 0, open_, {}, fault=_fault, refusal="an exchange cannot hold")
    post_exchange(None, row[0], 0, open_, {"FILL": _handler([])}, fault=_fault, refusal="")
    with pytest.raises(RuntimeFault, match="exchange 3 is posted again before it was waited"):
        post_exchange(None, row[0], 0, open_, {"FILL": _handler([])}, fault=_fault, refusal="")
    with pytest.raises(RuntimeFault, match="exchange 3 is never waited"):
        check_all_waited(open_, _fault)
    wait_exchange(row[1], 1, open_, row, fault=_fault, site=None, wait=_wait_never)
    check_all_waited(open_, _fault)
    with pytest.raises(RuntimeFault, match=r"waits for exchange 3, which this rank has not posted \(or already waited\)"):
        wait_exchange(row[1], 1, open_, row, fault=_fault, site=None, wait=_wait_never)


def test_point_to_point_operations_are_grouped_in_the_order_their_groups_are_met():
    ex = Exchange(0, 0)
    ex.send("a", 1, 1, group=5)
    ex.receive("b", 2, 1)
    ex.send("c", 3, 2, group=5)
    assert list(ex.p2p) == [5, DEFAULT_GROUP] and ex.peers == {1, 2, 3}
    assert ex.p2p[5] == [(True, "a", 1, 1), (True, "c", 3, 2)] and ex.p2p[DEFAULT_GROUP] == [(False, "b", 2, 1)]
