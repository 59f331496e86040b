"""The two-level network the simulator prices transfers on: shared links, shared NICs, rings."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from pipec.compiler.costs import CostModel, Link, costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.network import ALL_GATHER, BROADCAST, REDUCE, Network, ring_hops
from pipec.compiler.simulate import simulate
from pipec.errors import CostFileError


def model(**links) -> CostModel:
    return costs_from_json({"links": links, "sizes": {"weight": 8}})


def test_without_sharing_a_transfer_takes_its_links_time_whatever_else_moves():
    network = Network(model(latency=1, bandwidth=4))
    assert [network.transfer(0, 1, 8, 0) for _ in range(3)] == [3, 3, 3]
    assert network.transfer(2, 2, 8, 5) == 5  # a device to itself: a local hand-off


def test_transfers_sharing_a_link_share_its_bandwidth():
    network = Network(model(latency=1, bandwidth=4, contention=True))
    assert network.transfer(0, 1, 8, 0) == 3       # 8 / 4 on the wire, then the latency
    assert network.transfer(0, 1, 8, 0) == 5       # queued behind the first: the link is busy until 2
    assert network.transfer(1, 0, 8, 0) == 3       # the other direction is another link
    assert network.transfer(0, 2, 8, 0) == 3       # and so is another pair


def test_a_transfer_ready_earlier_uses_a_free_window_left_before_a_later_one():
    network = Network(model(bandwidth=1, contention=True))
    assert network.transfer(0, 1, 2, 10) == 12     # asked first, ready at 10
    assert network.transfer(0, 1, 4, 0) == 4       # asked later but ready at 0: fits before 10
    assert network.transfer(0, 1, 8, 0) == 20      # does not fit in [4, 10): after 12


def test_a_nodes_transfers_to_other_nodes_share_its_nic():
    costs = model(node_size=2, bandwidth=100, inter_node={"bandwidth": 8}, nic={"bandwidth": 8})
    network = Network(costs)
    assert network.transfer(0, 2, 8, 0) == 1
    assert network.transfer(1, 3, 8, 0) == 2       # another pair, the same two NICs
    assert network.transfer(0, 1, 8, 0) == pytest.approx(0.08)  # inside the node: no NIC
    assert network.transfer(2, 0, 8, 0) == 1       # the other direction: the NICs' other halves


def test_a_nic_needs_nodes_and_contention_is_a_boolean():
    with pytest.raises(CostFileError, match="links.nic.*node_size"):
        costs_from_json({"links": {"nic": {"bandwidth": 1}}})
    with pytest.raises(CostFileError, match="links.contention: expected true or false"):
        costs_from_json({"links": {"contention": 1}})
    assert costs_from_json({"links": {"node_size": 4, "nic": {"bandwidth": 2}}}).nic == Link(0, 2)


def test_collectives_run_as_rings():
    hops, share, steps = ring_hops(BROADCAST, (0, 1, 2, 3), root=2)
    assert hops == [(2, 3), (3, 0), (0, 1)] and share == 1 and steps == 3
    hops, share, steps = ring_hops(REDUCE, (0, 1, 2, 3), root=2)
    assert hops == [(3, 2), (0, 3), (1, 0)]
    hops, share, steps = ring_hops(ALL_GATHER, (0, 1, 2))
    assert hops == [(0, 1), (1, 2), (2, 0)] and share == Fraction(2, 3) and steps == 2
    # times: a broadcast of 8 bytes over 4 ranks, latency 1, bandwidth 4: 3 latencies and 8 / 4
    assert Network(model(latency=1, bandwidth=4)).collective(BROADCAST, (0, 1, 2, 3), 8, 0, 0) == 5
    # an all-gather: 3 steps of 2 bytes each: 3 latencies and 6 / 4
    assert Network(model(latency=1, bandwidth=4)).collective(ALL_GATHER, (0, 1, 2, 3), 8, 0) == Fraction(9, 2)


def test_shared_links_slow_a_simulated_pipeline_down_and_never_speed_it_up():
    program = compile_target("1f1b", {"P": 4, "N": 8}).program
    plain = {"links": {"bandwidth": 1, "bytes": {"act": 2, "grad": 2}}}
    shared = {"links": {"bandwidth": 1, "bytes": {"act": 2, "grad": 2}, "contention": True}}
    alone, together = simulate(program, costs_from_json(plain)), simulate(program, costs_from_json(shared))
    assert together.makespan >= alone.makespan


@pytest.mark.parametrize("nic", [4, 2, 1])
def test_a_slow_shared_nic_costs_weipipe_more_than_tawpipe(nic):
    """Four nodes of two ranks joined by a slow NIC: TawPipe keeps most of its traffic in the node."""
    costs = costs_from_json({"links": {"node_size": 2, "bandwidth": 100, "inter_node": {"bandwidth": 100},
                                       "nic": {"bandwidth": nic}}, "sizes": {"weight": 4}})
    programs = {"weipipe": compile_target("weipipe", {"P": 8, "N": 8}).program,
                "tawpipe": compile_target("tawpipe", {"P": 8, "N": 8, "G": 4}).program}
    slowdown = {name: simulate(p, costs).makespan - simulate(p).makespan for name, p in programs.items()}
    assert slowdown["weipipe"] > slowdown["tawpipe"] > 0


def test_simulate_json_traffic_uses_the_cost_files_nodes(tmp_path):
    program = compile_target("weipipe", {"P": 4, "N": 4}).program
    one_node = simulate(program, costs_from_json({"sizes": {"weight": 1}})).traffic
    two_nodes = simulate(program, costs_from_json({"sizes": {"weight": 1}, "links": {"node_size": 2}})).traffic
    assert one_node["weight"]["inter"] == 0
    assert two_nodes["weight"]["inter"] > 0
    assert sum(one_node["weight"].values()) == sum(two_nodes["weight"].values())
    json.dumps(two_nodes)


_EVERYONE_AT_ONCE = """
schedule everyone_at_once(P: ranks = 8, N: microbatches = P) {
  stages P
  home microbatch m on rank m
  own layer l on rank l
  weights direct
  order rank r {
    at step 0 { for l in 0 .. P { F(l, r) } }
    at step 1 { for l in 0 .. P { B(P - 1 - l, r) } }
  }
}
"""


def _links(program, **links):
    return simulate(program, costs_from_json({"links": {"bandwidth": 1, **links}, "sizes": {"weight": 4}})).links


def test_link_utilisation_is_every_link_for_an_exchange_of_all_with_all_and_one_in_n_minus_1_for_a_ring(tmp_path):
    path = tmp_path / "all.pipe"
    path.write_text(_EVERYONE_AT_ONCE)
    everyone = compile_target(str(path)).program  # every rank fetches the 7 layers it does not own at once
    full_mesh = _links(everyone)
    assert full_mesh == {"communication": 8, "utilisation": 1.0}  # weights in (4), gradients out (4)
    ring = _links(compile_target("fsdp", {"P": 8, "N": 8}).program)  # ring all-gathers and reduce-scatters
    assert ring["utilisation"] == pytest.approx(1 / 7)


def test_a_switch_port_per_rank_takes_the_all_to_all_advantage_away(tmp_path):
    path = tmp_path / "all.pipe"
    path.write_text(_EVERYONE_AT_ONCE)
    everyone = compile_target(str(path)).program
    behind_ports = _links(everyone, port={"bandwidth": 1})
    assert behind_ports["communication"] == 7 * 8  # each port carries its 7 transfers one after another
    assert behind_ports["utilisation"] == pytest.approx(1 / 7)
    assert costs_from_json({"links": {"port": {"bandwidth": 3}}}).port == Link(0, 3)


def test_nothing_moving_reports_no_link_use():
    assert simulate(compile_target("weipipe", {"P": 4, "N": 8}).program).links is None
