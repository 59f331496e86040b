"""The simulator, the traffic count and the drawings of composed programs (a pipeline on a pp x dp mesh).

Programs are built with ``mesh_placement.place_on_mesh`` from a compiled pipeline. Member i of a stage's group
of k runs every task on 1/k of the microbatch's rows, so it takes 1/k of the task's time and sends 1/k
of each activation; its group meets in the stage's GATHER (an all-gather of the weights, a sub-step that
blocks before the compute's body), SYNC_GRAD (an all-reduce of the weight gradient) and REDUCE_GRAD (a
reduce-scatter), each run as a ring over the group (``network.ring_hops``). The hand counts below are
worked out in the comments from those rules and docs/costs.md, "Composed programs".
"""
from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction

import pytest

from pipec.compiler import ops
from pipec.compiler.mesh_placement import DataParallel, place_on_mesh
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.emit import format_timeline
from pipec.compiler.emit.text_grid import format_text_grid, rank_labels
from pipec.compiler.ir import Action, Mesh
from pipec.compiler.render import make_drawing, write_timeline
from pipec.compiler.render import style
from pipec.compiler.simulate import simulate
from pipec.compiler.traffic import node_map, traffic
from pipec.errors import DeadlockError, WellFormedError

DP = DataParallel("dp")
ZERO2 = DataParallel("dp", sharded=True)
ZERO3 = DataParallel("dp", sharded=True, reshard_after_forward=True)
POLICIES = {"dp": DP, "zero2": ZERO2, "zero3": ZERO3}
ACT, WEIGHT, BANDWIDTH = 40, 100, 10  # bytes of an activation, of a stage's weights; bytes per time unit


def pipeline(name: str = "1f1b", P: int = 2, N: int = 4):
    return compile_target(name, {"P": P, "N": N}).program


def composed(policy: DataParallel, dp: int = 2, name: str = "1f1b", P: int = 2, N: int = 4, dp_outer: bool = False):
    axes = (("dp", dp), ("pp", P)) if dp_outer else (("pp", P), ("dp", dp))
    return place_on_mesh(pipeline(name, P, N), Mesh(axes), "pp", policy)


def priced(node_size: int):
    """A cost file: activations and gradients of ACT bytes, stage weights of WEIGHT bytes, one link of
    BANDWIDTH without latency, ``node_size`` ranks per node (0: one node)."""
    links = {"bandwidth": BANDWIDTH, "bytes": {"act": ACT, "grad": ACT}}
    if node_size:
        links["node_size"] = node_size
    return costs_from_json({"links": links, "sizes": {"activation": ACT, "weight": WEIGHT}})


def comm_slots(result, rank: int, op: str) -> list:
    return [slot for slot in result.timeline[rank] if slot.is_comm and slot.action.op == op]


def gathers_on(program, rank: int) -> int:
    return sum(1 for action in program.ranks[rank] for part in action.parts if part.op == ops.GATHER)


# ------------------------------------------------------------ unit costs


@pytest.mark.parametrize("policy", POLICIES, ids=list(POLICIES))
@pytest.mark.parametrize("name", ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1"])
def test_free_communication_halves_the_makespan_and_keeps_the_bubble(name, policy):
    # Each member runs every task on half the rows: every compute takes half its time, and with free
    # communication (unit costs) the gathers and gradient reductions take none, so the whole schedule
    # is the plain one at half speed. PP2 x DP2 1f1b (P=2, N=4): makespan 15 -> 7.5, bubble 1/5.
    plain = simulate(pipeline(name))
    result = simulate(composed(POLICIES[policy], name=name))
    assert result.makespan == Fraction(plain.makespan, 2)
    assert result.bubble_fraction() == plain.bubble_fraction()
    for rank, stats in enumerate(result.ranks):
        assert stats.busy == Fraction(plain.ranks[rank // 2].busy, 2)
    if name == "1f1b":
        assert (plain.makespan, result.makespan, str(result.bubble_fraction())) == (15, 7.5, "1/5")


def test_four_members_take_a_quarter_each():
    plain = simulate(pipeline(P=4, N=8))
    result = simulate(composed(ZERO3, dp=4, P=4, N=8))
    assert plain.makespan == 33 and result.makespan == Fraction(33, 4)
    assert result.bubble_fraction() == plain.bubble_fraction() == Fraction(3, 11)


def test_a_data_axis_of_one_is_the_plain_pipeline():
    program = place_on_mesh(pipeline(), Mesh((("pp", 2), ("dp", 1))), "pp", ZERO3)
    assert simulate(program).makespan == simulate(pipeline()).makespan == 15


# ------------------------------------------------------------ traffic by hand


@pytest.mark.parametrize("policy,expected", [
    # PP2 x DP2, 1f1b, N=4, node_size 2: each stage's group (ranks 0, 1 and 2, 3) is one node, so the
    # pipeline's messages cross nodes. Activations: 4 microbatches x 2 members x ACT/2 = 160, and as many
    # gradients. A group of 2 runs a ring of 2 hops: SYNC_GRAD (an all-reduce) moves 2(n-1)/n = 1 of the
    # gradient per hop, 2 x 100 = 200 per group, 400 for both; REDUCE_GRAD (a reduce-scatter) (n-1)/n = 1/2,
    # 100 per group, 200; a GATHER 1/2 of the weights per hop, 100 per group: ZeRO-2 gathers once per stage
    # (200), ZeRO-3 again before the first backward after its last forward (400).
    ("dp", {"act": {"intra": 0, "inter": 160}, "grad": {"intra": 0, "inter": 160},
            "wgrad": {"intra": 400, "inter": 0}}),
    ("zero2", {"act": {"intra": 0, "inter": 160}, "grad": {"intra": 0, "inter": 160},
               "wgrad": {"intra": 200, "inter": 0}, "weight": {"intra": 200, "inter": 0}}),
    ("zero3", {"act": {"intra": 0, "inter": 160}, "grad": {"intra": 0, "inter": 160},
               "wgrad": {"intra": 200, "inter": 0}, "weight": {"intra": 400, "inter": 0}}),
])
def test_traffic_per_link_class_is_the_hand_count(policy, expected):
    result = simulate(composed(POLICIES[policy]), priced(node_size=2))
    assert result.traffic == expected


def test_with_the_data_axis_outermost_the_groups_cross_nodes_and_the_pipeline_does_not():
    # mesh dp = 2, pp = 2: ranks 0, 1 are dp 0 (pp 0, 1), so a stage's group is ranks 0, 2 (or 1, 3):
    # on two nodes of 2. The same bytes as above, on the other link class.
    result = simulate(composed(DP, dp_outer=True), priced(node_size=2))
    assert result.traffic == {"act": {"intra": 160, "inter": 0}, "grad": {"intra": 160, "inter": 0},
                              "wgrad": {"intra": 0, "inter": 400}}
    # and the all-reduce runs on the slower link between nodes: 100 bytes per hop at 5 per unit, 20
    slow = costs_from_json({"links": {"bandwidth": BANDWIDTH, "bytes": {"act": ACT, "grad": ACT}, "node_size": 2,
                                      "inter_node": {"bandwidth": BANDWIDTH // 2}},
                            "sizes": {"activation": ACT, "weight": WEIGHT}})
    timed = simulate(composed(DP, dp_outer=True), slow)
    assert {slot.end - slot.start for rank in range(4) for slot in comm_slots(timed, rank, ops.SYNC_GRAD)} == {20}
    assert {slot.end - slot.start for rank in range(4) for slot in comm_slots(timed, rank, ops.RECV_F)} == {2}


def test_a_group_of_four_moves_the_ring_volumes():
    # PP2 x DP4, 1f1b, N=4, node_size 4 (one node per stage). A ring of n = 4 hops: SYNC_GRAD moves
    # 2(n-1)/n W per hop, 2 (n-1) W = 600 per group, 1200; REDUCE_GRAD (n-1) W = 300 per group, 600; a GATHER
    # 300 per group. The pipeline's messages: 4 members x ACT/4 per microbatch, the plain program's 160.
    by_policy = {name: simulate(composed(policy, dp=4), priced(node_size=4)).traffic
                 for name, policy in POLICIES.items()}
    assert by_policy["dp"]["wgrad"] == {"intra": 1200, "inter": 0}
    assert by_policy["zero2"]["wgrad"] == {"intra": 600, "inter": 0}
    assert by_policy["zero2"]["weight"] == {"intra": 600, "inter": 0}
    for moved in by_policy.values():
        assert moved["act"] == moved["grad"] == {"intra": 0, "inter": 160}
    plain = traffic(pipeline(), {"activation": ACT}, lambda rank: rank)
    assert plain["act"]["inter"] == plain["grad"]["inter"] == 160


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_zero3_gathers_more_than_zero2_by_its_re_gathers(name, dp):
    # Every gather of a stage's group moves (n-1)/n of its weights over each of its n hops: (n-1) W. ZeRO-3
    # gathers again after each reshard after a forward; the difference is those re-gathers, counted on
    # the first member of each group (every member lists them).
    zero2, zero3 = composed(ZERO2, dp=dp, name=name), composed(ZERO3, dp=dp, name=name)
    firsts = [info.ranks[0] for info in zero2.stages]
    regathers = sum(gathers_on(zero3, rank) - gathers_on(zero2, rank) for rank in sorted(set(firsts)))
    assert regathers > 0
    sizes = {"weight": WEIGHT}
    moved2 = traffic(zero2, sizes, node_map(zero2))["weight"]["intra"]
    moved3 = traffic(zero3, sizes, node_map(zero3))["weight"]["intra"]
    assert moved3 - moved2 == regathers * (dp - 1) * WEIGHT


# ------------------------------------------------------------ timing of the collectives


def test_a_gather_blocks_before_its_compute_and_the_reductions_take_their_ring_times():
    # node_size 0: one link everywhere, bandwidth 10, no latency. A GATHER of a group of 2 moves 50 bytes
    # on each hop at once: 5; REDUCE_GRAD the same; SYNC_GRAD 100 bytes: 10. A member's activation
    # message carries ACT / 2 = 20 bytes: 2.
    zero3 = simulate(composed(ZERO3), priced(node_size=0))
    first_gather = comm_slots(zero3, 0, ops.GATHER)[0]
    assert (first_gather.start, first_gather.end) == (0, 5)
    first_compute = next(slot for slot in zero3.timeline[0] if not slot.is_comm)
    assert first_compute.action.text() == "(0GATHER0)0F0" and first_compute.start == 5
    assert [slot.end - slot.start for slot in comm_slots(zero3, 0, ops.REDUCE_GRAD)] == [5]
    assert {slot.end - slot.start for slot in comm_slots(zero3, 2, ops.RECV_F)} == {2}
    sync = simulate(composed(DP), priced(node_size=0))
    for group in ((0, 1), (2, 3)):
        slots = [comm_slots(sync, rank, ops.SYNC_GRAD)[0] for rank in group]
        last_backward = max(slot.end for rank in group for slot in sync.timeline[rank]
                            if not slot.is_comm and slot.action.op == ops.B)
        # posted right after each member's last backward: it starts when the later member posts it
        assert {(slot.start, slot.end) for slot in slots} == {(last_backward, last_backward + 10)}
    assert sync.makespan == max(comm_slots(sync, rank, ops.SYNC_GRAD)[0].end for rank in range(4))


def test_shared_links_price_a_members_share_of_each_message():
    # With contention the network reserves each transfer's bytes on its link: a member's message holds it
    # for ACT / 2 / BANDWIDTH = 2, so the first arrives 2 after it is sent and the second, sent 0.5 later
    # on the same link, waits for it: 4 after the first was sent.
    costs = costs_from_json({"links": {"bandwidth": BANDWIDTH, "bytes": {"act": ACT, "grad": ACT}, "contention": True},
                             "sizes": {"activation": ACT, "weight": WEIGHT}})
    result = simulate(composed(DP), costs)
    for rank in (2, 3):
        first, second = comm_slots(result, rank, ops.RECV_F)[:2]
        assert (first.start, first.end, second.start, second.end) == (0.5, 2.5, 1, 4.5)


def test_a_member_that_never_joins_its_groups_gather_is_a_named_deadlock():
    program = composed(ZERO2)
    ranks = [list(row) for row in program.ranks]
    ranks[1] = []
    with pytest.raises(DeadlockError, match="a collective that not every member of its communicator joins") as caught:
        simulate(replace(program, ranks=ranks))
    assert caught.value.rank == 0


def test_a_task_on_a_rank_outside_its_stages_group_is_refused_at_its_step():
    program = composed(DP)
    ranks = [list(row) for row in program.ranks]
    ranks[1][0] = Action(1, ops.F, 0)
    with pytest.raises(WellFormedError) as caught:
        simulate(replace(program, ranks=ranks))
    assert caught.value.message == "1F0: rank 1 runs a task or a message of stage 1, which is placed on the ranks 2, 3"
    assert (caught.value.rank, caught.value.step) == (1, 0)


# ------------------------------------------------------------ reports


def test_the_json_report_holds_plain_numbers_traffic_and_whatever_memory_counts_gives():
    from pipec.api import Program

    costs = priced(node_size=2)
    report = Program(composed(ZERO3), costs).simulate().to_json()
    text = json.dumps(report)  # no Fraction left
    assert report["makespan"] == simulate(composed(ZERO3), costs).makespan
    assert report["traffic"]["weight"] == {"intra": 400, "inter": 0}
    assert len(report["ranks"]) == 4 and all("peak_bytes" in rank for rank in report["ranks"])
    assert "Fraction" not in text


def test_lanes_are_labelled_by_mesh_coordinate(tmp_path):
    program = composed(ZERO3)
    result = simulate(program)
    labels = ["rank 0: pp 0, dp 0", "rank 1: pp 0, dp 1", "rank 2: pp 1, dp 0", "rank 3: pp 1, dp 1"]
    assert rank_labels(program) == labels
    text = format_timeline(result, labels=rank_labels(program)).splitlines()
    assert [line.split(" | ")[0] for line in text[:4]] == labels
    assert [line.split(" | ")[0].rstrip() for line in format_text_grid(program).splitlines()[1:]] == labels
    drawing = make_drawing(result, program)
    assert drawing.layout["left"] > style.LAYOUT["left"]  # the longer labels get a wider margin
    for suffix in ("svg", "html", "json"):
        path = tmp_path / f"t.{suffix}"
        write_timeline(result, program, str(path))
        written = path.read_text()
        assert all(label in written for label in labels), suffix
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {event["pid"]: event["args"]["name"] for event in trace["traceEvents"] if event["name"] == "process_name"}
    assert names == dict(enumerate(labels))


def test_a_plain_programs_lanes_are_as_they_were():
    program = pipeline()
    result = simulate(program)
    assert rank_labels(program) == ["rank 0", "rank 1"]
    assert make_drawing(result, program).layout is style.LAYOUT
    assert format_timeline(result).startswith("rank 0 | 0F0")


def test_pipec_simulate_reports_a_composed_program(capsys, monkeypatch, tmp_path):
    # Until the language names a composition and the prover takes one, the command is handed the program
    # (its own ``_program`` replaced): what it prints for a composed program, in text and in JSON.
    from cli_util import cli

    from pipec.api import Program
    from pipec.commands import simulate as command

    costs_path = tmp_path / "costs.json"
    costs_path.write_text(json.dumps({"links": {"bandwidth": BANDWIDTH, "bytes": {"act": ACT, "grad": ACT},
                                                "node_size": 2}, "sizes": {"activation": ACT, "weight": WEIGHT}}))
    monkeypatch.setattr(command, "_program", lambda args, costs: Program(composed(ZERO3), costs))
    status, out, _ = cli(capsys, "simulate", "1f1b", "--costs", str(costs_path))
    assert status == 0
    expected = simulate(composed(ZERO3), priced(node_size=2))
    assert f"makespan {expected.makespan}" in out and "rank 3: busy" in out
    status, out, _ = cli(capsys, "simulate", "1f1b", "--costs", str(costs_path), "--json")
    assert status == 0
    assert json.loads(out)["traffic"] == expected.traffic


def test_the_task_graph_joins_each_member_to_the_member_with_its_share():
    import re

    from pipec.compiler.render import task_graph_dot

    program = composed(ZERO3)
    dot = task_graph_dot(program)
    assert re.findall(r'label="(rank \d: pp \d, dp \d)"', dot) == rank_labels(program)
    assert 'label="(0GATHER0)0F0"' in dot  # a compute with a sub-step is drawn as itself
    data = re.findall(r"r(\d)_\d+ -> r(\d)_\d+ \[color=\"#333333\"", dot)
    assert data and all(program.mesh.coords(int(a))["dp"] == program.mesh.coords(int(b))["dp"] for a, b in data)
    # every cross-rank input of every member: 4 microbatches x (activation + gradient) x 2 members
    assert len(data) == 16
