"""Route policies (compiler/routes.py): the legs each one derives, and lowering's use of them."""
from __future__ import annotations

import pytest

from pipec.compiler import ops, routes
from pipec.compiler.driver import compile_target
from pipec.compiler.ir import tensor_of
from pipec.compiler.routes import GroupStep, Hop


def test_direct_sends_once_to_each_other_rank_in_order():
    assert routes.direct(2, [2, 5, 1, 5, 3]) == (Hop(2, 5), Hop(2, 1), Hop(2, 3))
    assert routes.direct(0, [0]) == ()  # a local hand-off is no message


def test_ring_chains_through_the_consumers_each_forwarding():
    assert routes.ring(0, [1, 2, 3]) == (Hop(0, 1), Hop(1, 2), Hop(2, 3))
    assert routes.ring(3, [0, 1, 2]) == (Hop(3, 0), Hop(0, 1), Hop(1, 2))
    assert routes.ring(1, [1, 1, 2, 2, 0]) == (Hop(1, 2), Hop(2, 0))  # same rank twice: no hop


def test_staged_broadcast_hops_to_the_staging_rank_then_broadcasts_in_the_group():
    # TawPipe: the owner on node 0 sends to the rail-aligned staging rank of node 1
    assert routes.staged_broadcast(1, [4, 5, 6, 7], 5) == (Hop(1, 5), GroupStep(routes.BROADCAST, (4, 5, 6, 7), 5))
    # the owner in the group broadcasts itself
    assert routes.staged_broadcast(6, [7, 6, 5, 4], 5) == (GroupStep(routes.BROADCAST, (4, 5, 6, 7), 6),)
    with pytest.raises(ValueError, match="staging rank 9 is not in the group"):
        routes.staged_broadcast(1, [4, 5], 9)


def test_reduce_to_owner_reduces_in_the_group_then_hops_home():
    assert routes.reduce_to_owner([4, 5, 6, 7], 1, 4) == (GroupStep(routes.REDUCE, (4, 5, 6, 7), 4), Hop(4, 1))
    assert routes.reduce_to_owner([0, 1, 2, 3], 2, 0) == (GroupStep(routes.REDUCE, (0, 1, 2, 3), 2),)
    with pytest.raises(ValueError, match="root rank 8 is not in the group"):
        routes.reduce_to_owner([4, 5], 1, 8)


def test_group_steps_name_their_collective_and_sorted_members():
    for name in (routes.ALL_GATHER, routes.REDUCE_SCATTER, routes.ALL_REDUCE, routes.ALL_TO_ALL):
        assert routes.ROUTES[name]([3, 1, 2]) == (GroupStep(name, (1, 2, 3)),)


def test_every_value_kind_names_a_route_policy():
    assert all(kind.route in routes.ROUTES for kind in ops.VALUE_KINDS.values())


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "bitpipe", "zbv"])
def test_lowering_sends_each_message_along_its_kinds_route(name):
    program = compile_target(name, {"P": 4, "N": 8}).program
    home = [stage.rank for stage in program.stages]
    for rank, row in enumerate(program.ranks):
        for action in row:
            for part in action.comms():
                rule = ops.PART_RULES[part.op]
                if not rule.is_send:
                    continue
                kind, producer, _ = tensor_of(part, program)
                reader_stage = (program.next_stage if ops.READER_OF[kind] == ops.NEXT else program.prev_stage)(producer)
                legs = routes.ROUTES[ops.VALUE_KINDS[kind].route](home[producer], (home[reader_stage],))
                assert legs == (Hop(rank, part.peer),), f"{name}: {part.text()} on rank {rank}"
