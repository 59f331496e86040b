"""Sequence rings in the simulator: attention blocks priced by area, KV moving over the topology.

Facts (issue "Sequence rings"): under area costs (a whole block 1, a diagonal
one 1/2) the zigzag placement gives every rank the same busy time for causal
attention and a contiguous ring gives rank r a busy time proportional to
2r + 1; on a full mesh of n = 8 ranks with equal per-link bandwidth TASP keeps
every directed link busy while KV moves (utilisation 1) where a ring keeps
1/7 of them, and moves a step's KV 7 times faster; behind a per-rank switch
port the advantage disappears; on nodes joined by rails the rail rings of
``tasp_rails`` cross between nodes on every rail at once.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
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


def _simulate_cli(tmp_path, target: list[str], links: dict) -> dict:
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"compute": {"AF": 0, "AB": 0}, "links": links, "sizes": {"kv": 8}}))
    done = subprocess.run([sys.executable, "-m", "pipec", "simulate", *target, "--costs", str(costs), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_on_rail_nodes_the_rail_rings_use_every_rail_where_one_ring_crosses_on_two(tmp_path):
    # 2 nodes of 4 ranks; links inside a node fast, each device's rail NIC slow: the inter-node hops decide
    links = {"latency": 0, "bandwidth": 100, "node_size": 4, "inter_node": {"latency": 0, "bandwidth": 100},
             "rails": {"bandwidth": 1}, "contention": True}
    ring = _simulate_cli(tmp_path, ["zigzag_ring", "-D", "P=8"], links)
    rails = _simulate_cli(tmp_path, ["tasp:tasp_rails", "-D", "M=2", "-D", "K=4"], links)
    mesh = _simulate_cli(tmp_path, ["tasp", "-D", "P=8"], links)
    # one ring crosses between the nodes on 2 of its 8 hops, each carrying a whole bundle through one rail;
    # the 4 rail rings cross on every rail at once with a quarter of it each
    assert ring["links"]["communication"] == pytest.approx(4 * rails["links"]["communication"])
    # Hamiltonian rings of all 8 ranks cross between nodes on many arcs that share the rails
    assert mesh["links"]["communication"] > rails["links"]["communication"]


def test_rails_need_nodes(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"links": {"rails": {"bandwidth": 1}}}))
    done = subprocess.run([sys.executable, "-m", "pipec", "simulate", "zigzag_ring", "--costs", str(costs)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "links.rails" in done.stderr and "node_size" in done.stderr


@pytest.mark.parametrize("P", [2, 3, 5])
def test_traffic_counts_each_bundle_by_its_chunks_and_pieces(P):
    from pipec.compiler.traffic import traffic

    sizes = {"kv": 8}
    for name, program in programs(P).items():
        chunks = program.rings.chunks // P  # per rank
        moved = traffic(program, sizes, lambda rank: 0)
        # KV goes round twice (forward, again in backward): n - 1 hops of every rank's chunks, each time;
        # dK, dV partials n hops; pieces only cut the same bytes into more messages
        assert moved["kv"]["intra"] == 2 * (P - 1) * P * chunks * 8, name
        assert moved["dkv"]["intra"] == P * P * chunks * 8, name


@pytest.mark.parametrize("P", [2, 3, 5])
def test_peak_kv_bytes_are_three_shares_under_kv_again_and_every_share_under_kv_kept(P):
    # a rank's own chunks, plus per piece the bundle it reads and the one arriving (kv again), or every
    # other rank's bundle (kv kept); "kv" is one chunk's keys and values
    for name, program in programs(P).items():
        own = program.rings.chunks // P * 8
        assert [r.peak_bytes["kv"] for r in simulate(program, sizes={"kv": 8}).ranks] == [3 * own] * P, name
        kept = lower_plan(replace(program.rings, kv="kept"))
        assert [r.peak_bytes["kv"] for r in simulate(kept, sizes={"kv": 8}).ranks] == [P * own] * P, name
