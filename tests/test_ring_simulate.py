"""Sequence rings in the simulator: attention blocks priced by area, KV moving over the topology.

Facts (issue "Sequence rings"): under area costs (a whole block 1, a diagonal
one 1/2) the zigzag placement gives every rank the same busy time for causal
attention and a contiguous ring gives rank r a busy time proportional to
2r + 1; on a full mesh of n = 8 ranks with equal per-link bandwidth TASP keeps
every directed link busy while KV moves (utilisation 1) where a ring keeps
1/7 of them, and moves a step's KV 7 times faster; behind a per-rank switch
port the advantage disappears.
"""
from __future__ import annotations

from fractions import Fraction

import pytest

from pipec.compiler.costs import CostModel, Link
from pipec.compiler.ir import RingPlan
from pipec.compiler.lower_rings import lower_plan
from pipec.compiler.rings import hamiltonian_rings
from pipec.compiler.simulate import simulate


def zigzag(P: int) -> tuple[int, ...]:
    return tuple(c if c < P else 2 * P - 1 - c for c in range(2 * P))


def programs(P: int, causal: bool = True):
    rings = hamiltonian_rings(P).cycles
    return {
        "ring": lower_plan(RingPlan(P, tuple(range(P)), 1, (tuple(range(P)),), causal), "ring"),
        "zigzag": lower_plan(RingPlan(2 * P, zigzag(P), 1, (tuple(range(P)),), causal), "zigzag"),
        "tasp": lower_plan(RingPlan(2 * P, zigzag(P), len(rings), rings, causal, transfer="all_to_all"), "tasp"),
    }


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_area_costs_balance_zigzag_and_grow_2r_plus_1_on_a_contiguous_ring(P):
    shapes = programs(P)
    ring = simulate(shapes["ring"])  # unit costs: AF 1, AB 2 per whole block
    assert [r.busy for r in ring.ranks] == [Fraction(3 * (2 * r + 1), 2) for r in range(P)]
    assert ring.makespan == Fraction(3 * (2 * P - 1), 2)  # the last rank's work: nothing waits on the ring
    for name in ("zigzag", "tasp"):
        result = simulate(shapes[name])
        assert [r.busy for r in result.ranks] == [3 * 2 * P] * P, name  # 2P whole blocks each way, AB twice AF
        assert result.bubble_fraction() == 0


def test_full_attention_costs_every_rank_the_same_on_any_placement():
    for name, program in programs(4, causal=False).items():
        busy = {r.busy for r in simulate(program).ranks}
        assert len(busy) == 1, name


def _links(port: Link | None = None, contention: bool = True) -> CostModel:
    # communication only: blocks cost nothing; one chunk's K and V is 7 bytes, a link moves 1 a unit
    return CostModel(ops=(("AB", 0), ("AF", 0), ("B", 2), ("F", 1), ("I", 1), ("W", 1)), link=Link(0, 1),
                     contention=contention, port=port, value_bytes=(("kv", 7),))


def test_on_a_full_mesh_tasp_uses_every_link_and_moves_kv_seven_times_faster_than_a_ring():
    shapes = programs(8)
    for contention in (False, True):
        ring, tasp = simulate(shapes["zigzag"], _links(contention=contention)), \
            simulate(shapes["tasp"], _links(contention=contention))
        assert ring.links["utilisation"] == pytest.approx(1 / 7)
        assert tasp.links["utilisation"] == pytest.approx(1.0)
        assert ring.links["communication"] / tasp.links["communication"] == pytest.approx(7, rel=0.05)


def test_behind_a_switch_port_per_rank_the_advantage_disappears():
    shapes = programs(8)
    port = Link(0, 7)  # a rank's port moves as much as all its 7 links of the mesh together
    ring, tasp = simulate(shapes["zigzag"], _links(port)), simulate(shapes["tasp"], _links(port))
    assert ring.links["communication"] == pytest.approx(tasp.links["communication"])
