"""The simulator and the cost model against the facts of DESIGN.md section 8.

Unit costs (F = 1, B = 2, I = W = 1, communication free) unless a test says
otherwise; expected makespans of the small cases are worked out by hand in
the comments.
"""
from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipec.compiler.costs import CostModel, Link, costs_from_json, load_costs
from pipec.compiler.ir import (
    ALLREDUCE_GRAD,
    ALLREDUCE_WAIT,
    FREE_F,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Program,
    StageInfo,
    batch,
)
from pipec.compiler.simulate import simulate
from pipec.errors import CostFileError, DeadlockError, MatchError, WellFormedError
from reference_orders import compute_program, gpipe, interleaved_1f1b, one_f_one_b

SHAPES = [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (5, 7), (8, 16), (8, 32)]


# ----------------------------------------------------------------- helpers


def with_comms(program: Program, batched: bool = False) -> Program:
    """Test-local communication inserter: RECV right before the consumer, SEND right after the producer.

    With ``batched``, a SEND directly followed by a RECV becomes one BATCH.
    """
    receives = {"F": (RECV_F, program.prev_stage), "B": (RECV_B, program.next_stage), "I": (RECV_B, program.next_stage)}
    sends = {"F": (SEND_F, program.next_stage), "B": (SEND_B, program.prev_stage), "I": (SEND_B, program.prev_stage)}

    def messages(table: dict, action: Action, rank: int) -> list[Action]:
        if action.op not in table:
            return []
        op, neighbour = table[action.op]
        other = neighbour(action.stage)
        if other < 0 or program.rank_of(other) == rank:
            return []
        return [Action(action.stage, op, action.mb, program.rank_of(other))]

    rows = []
    for rank, row in enumerate(program.ranks):
        out: list[Action] = []
        for action in row:
            out += messages(receives, action, rank) + [action] + messages(sends, action, rank)
        rows.append(_merge_send_recv(out) if batched else out)
    return dataclasses.replace(program, ranks=rows)


def _merge_send_recv(row: list[Action]) -> list[Action]:
    merged: list[Action] = []
    for action in row:
        if action.op in (RECV_F, RECV_B) and merged and merged[-1].op in (SEND_F, SEND_B):
            merged[-1] = batch([merged[-1], action])
        else:
            merged.append(action)
    return merged


def two_rank_program(orders: list[list[Action]], num_microbatches: int) -> Program:
    stages = [StageInfo(0, 0, 0, 0), StageInfo(1, 1, 0, 1)]
    return Program("hand", 2, num_microbatches, stages, [[0, 1]], [0] * num_microbatches, orders)


def cost_file(tmp_path, content) -> str:
    path = tmp_path / "costs.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def zb_h1(P: int, N: int) -> Program:
    """ZB-H1: 1F1B with B split into I and W; rank r defers each W by r steps (fills the cool-down bubble)."""
    orders = []
    for r in range(P):
        warm = min(P - 1 - r, N)
        row = [("F", r, m) for m in range(warm)]
        deferred: list[int] = []

        def backward(m: int) -> None:
            row.append(("I", r, m))
            deferred.append(m)
            if len(deferred) > r:
                row.append(("W", r, deferred.pop(0)))

        for i in range(N - warm):
            row.append(("F", r, warm + i))
            backward(i)
        for m in range(N - warm, N):
            backward(m)
        row += [("W", r, m) for m in deferred]
        orders.append(row)
    return compute_program("zb_h1", list(range(P)), N, orders)


# ----------------------------------------------------------------- facts of section 8


@pytest.mark.parametrize("P,N", SHAPES)
def test_1f1b_bubble_is_p_minus_1_over_n_plus_p_minus_1(P, N):
    result = simulate(one_f_one_b(P, N))
    assert result.bubble_fraction() == Fraction(P - 1, N + P - 1)
    assert result.makespan == 3 * (N + P - 1)
    assert result.bubble_ratio == pytest.approx((P - 1) / (N + P - 1))


def test_1f1b_4_ranks_8_microbatches_is_3_over_11():
    assert simulate(one_f_one_b(4, 8)).bubble_fraction() == Fraction(3, 11)


@pytest.mark.parametrize("P,N", SHAPES)
def test_gpipe_makespan_equals_1f1b(P, N):
    gpipe_result, one_f_one_b_result = simulate(gpipe(P, N)), simulate(one_f_one_b(P, N))
    assert gpipe_result.makespan == one_f_one_b_result.makespan
    # same time, but GPipe holds every microbatch's activations at once
    assert [r.peak_activations for r in gpipe_result.ranks] == [N] * P


@pytest.mark.parametrize("P,N", SHAPES)
def test_1f1b_rank_r_peaks_at_p_minus_r_activations(P, N):
    result = simulate(one_f_one_b(P, N))
    assert [r.peak_activations for r in result.ranks] == [min(P - r, N) for r in range(P)]


@pytest.mark.parametrize("P,N,v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2), (4, 16, 4)])
def test_interleaved_bubble_is_p_minus_1_over_vn_plus_p_minus_1(P, N, v):
    result = simulate(interleaved_1f1b(P, N, v))
    assert result.bubble_fraction() == Fraction(P - 1, v * N + P - 1)


def test_interleaved_4_ranks_8_microbatches_2_chunks_is_3_over_19():
    assert simulate(interleaved_1f1b(4, 8, 2)).bubble_fraction() == Fraction(3, 19)


@pytest.mark.parametrize("P,N", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_bubble_and_memory(P, N):
    result = simulate(zb_h1(P, N))
    assert result.bubble_fraction() == Fraction(P - 1, 3 * N + P - 1)
    assert [r.peak_activations for r in result.ranks] == [r.peak_activations for r in simulate(one_f_one_b(P, N)).ranks]


# ----------------------------------------------------------------- programs with communication


def test_hand_written_two_rank_program_with_comms_matches_compute_only():
    # 1F1B, P = 2, N = 2. Rank 0: F0 F1 B0 B1; rank 1: F0 B0 F1 B1.
    compute_only = one_f_one_b(2, 2)
    f, b = "F", "B"
    rank0 = [
        Action(0, f, 0), Action(0, SEND_F, 0, 1),
        Action(0, f, 1), Action(0, SEND_F, 1, 1),
        Action(0, RECV_B, 0, 1), Action(0, b, 0), Action(0, FREE_F, 0),
        Action(0, RECV_B, 1, 1), Action(0, b, 1), Action(0, FREE_F, 1),
    ]
    rank1 = [
        Action(1, RECV_F, 0, 0), Action(1, f, 0), Action(1, b, 0), Action(1, SEND_B, 0, 0),
        Action(1, RECV_F, 1, 0), Action(1, f, 1), Action(1, b, 1), Action(1, SEND_B, 1, 0),
    ]
    with_messages = two_rank_program([rank0, rank1], 2)
    assert simulate(with_messages).makespan == simulate(compute_only).makespan == 9
    # link latency 1 on both hops of the critical path's tail (hand-worked below): 9 -> 11
    slow = CostModel(link=Link(latency=1))
    assert simulate(with_messages, slow).makespan == simulate(compute_only, slow).makespan == 11


@pytest.mark.parametrize("make", [lambda: one_f_one_b(4, 8), lambda: gpipe(3, 5), lambda: interleaved_1f1b(4, 8, 2), lambda: zb_h1(4, 8)])
@pytest.mark.parametrize("batched", [False, True])
def test_inserting_comms_keeps_the_makespan(make, batched):
    program = make()
    messages = with_comms(program, batched)
    assert messages.instruction_count() > program.instruction_count()
    for costs in (CostModel.unit(), CostModel(link=Link(latency=1), message_bytes=(("act", 3), ("grad", 5)))):
        assert simulate(messages, costs).makespan == simulate(program, costs).makespan
    assert [r.peak_activations for r in simulate(messages).ranks] == [r.peak_activations for r in simulate(program).ranks]


@settings(max_examples=25, deadline=None)
@given(
    P=st.integers(2, 5), extra=st.integers(0, 5), F=st.integers(1, 4), B=st.integers(1, 6),
    latency=st.integers(0, 3), batched=st.booleans(),
)
def test_comms_and_compute_only_agree_under_any_integer_costs(P, extra, F, B, latency, batched):
    program = one_f_one_b(P, P + extra)
    costs = CostModel(ops=(("B", B), ("F", F), ("I", 1), ("W", 1)), link=Link(latency=latency))
    assert simulate(with_comms(program, batched), costs).makespan == simulate(program, costs).makespan


def test_swapped_send_order_is_a_match_error():
    rank0 = [Action(0, "F", 0), Action(0, "F", 1), Action(0, SEND_F, 1, 1), Action(0, SEND_F, 0, 1)]
    rank1 = [Action(1, RECV_F, 0, 0), Action(1, "F", 0), Action(1, RECV_F, 1, 0), Action(1, "F", 1)]
    with pytest.raises(MatchError) as caught:
        simulate(two_rank_program([rank0, rank1], 2))
    assert caught.value.rank == 1 and caught.value.step == 0
    assert "expects the activation of 0F0" in caught.value.message and "carries the activation of 0F1" in caught.value.message


# ----------------------------------------------------------------- costs change the timeline by the expected amount


def test_link_latency_from_a_cost_file_two_ranks_one_microbatch(tmp_path):
    # F0 [0,1] -> +0.5 -> F1 [1.5,2.5], B1 [2.5,4.5] -> +1.5 -> B0 [6,8]: 6 + 0.5 + 1.5
    path = cost_file(tmp_path, {"links": {"bandwidth": 4, "bytes": {"act": 2, "grad": 6}}})
    program = one_f_one_b(2, 1)
    assert simulate(program).makespan == 6
    result = simulate(program, load_costs(path))
    assert result.makespan == 8
    assert [(s.start, s.end, s.action.text()) for s in result.timeline[1] if not s.is_comm] == [(1.5, 2.5, "1F0"), (2.5, 4.5, "1B0")]


def test_integer_latency_keeps_exact_fractions(tmp_path):
    # 1F1B P=2 N=2, latency 1. Rank 0: F0 [0,1] F1 [1,2]; rank 1: F0 [2,3] B0 [3,5] F1 [5,6] B1 [6,8];
    # rank 0: B0 [6,8], B1 needs rank 1's B1 (8) + 1: [9,11]. Makespan 11, each rank busy 6.
    result = simulate(one_f_one_b(2, 2), load_costs(cost_file(tmp_path, {"links": {"latency": 1}})))
    assert result.makespan == 11 and isinstance(result.makespan, int)
    assert result.bubble_fraction() == Fraction(5, 11)
    assert [(r.busy, r.idle) for r in result.ranks] == [(6, 5), (6, 5)]


def test_posting_a_message_holds_the_rank_and_the_send_leaves_when_posted():
    # 1F1B P=2 N=2 with its messages, post = 1 per message (a BATCH posts 2):
    #   rank 0 | 0F0 0SEND_F0 0F1 (0SEND_F1;0RECV_B0)BATCH 0B0 0FREE_F0 0RECV_B1 0B1 0FREE_F1
    #   rank 1 | 1RECV_F0 1F0 1B0 1FREE_F0 (1SEND_B0;1RECV_F1)BATCH 1F1 1B1 1FREE_F1 1SEND_B1
    # rank 0: F0 [0,1], post [1,2] (act 0 leaves at 2), F1 [2,3], batch [3,5] (act 1 leaves at 5);
    # rank 1: post [0,1], F0 [2,3], B0 [3,5], batch [5,7] (grad 0 leaves at 7), F1 [7,8], B1 [8,10],
    #         post [10,11] (grad 1 leaves at 11); rank 0: B0 [7,9], post [9,10], B1 [11,13].
    from pipec.compiler.driver import compile_target

    program = compile_target("1f1b", {"P": "2", "N": "2"}).program
    result = simulate(program, costs_from_json({"links": {"post": 1}}))
    assert result.makespan == 13
    assert [rank.busy for rank in result.ranks] == [6, 6]  # posting is not compute
    assert [(s.start, s.end) for s in result.timeline[0] if not s.is_comm] == [(0, 1), (2, 3), (7, 9), (11, 13)]
    assert simulate(program).makespan == 9  # free posting, the unit model: (N + P - 1) * 3


def test_comm_slots_mark_messages_that_take_time():
    program = with_comms(one_f_one_b(2, 1))
    result = simulate(program, CostModel(link=Link(latency=2)))
    comm = [(s.start, s.end, s.action.text()) for rank in result.timeline for s in rank if s.is_comm]
    # activation sent at 1 arrives at 3 on rank 1; gradient sent at 6 arrives at 8 on rank 0
    assert sorted(comm) == [(1, 3, "1RECV_F0"), (6, 8, "0RECV_B0")]
    # free messages take no time: no communication slots
    assert not any(s.is_comm for rank in simulate(program).timeline for s in rank)


def test_pair_links_apply_to_devices_not_program_ranks():
    costs = CostModel(pairs=((1, 2, Link(latency=5)),))
    program = one_f_one_b(2, 1)
    assert simulate(program, costs).makespan == 6
    # ranks 0 and 1 placed on devices 1 and 2: both messages pay 5
    assert simulate(dataclasses.replace(program, devices=[1, 2]), costs).makespan == 16
    assert simulate(dataclasses.replace(program, devices=[0, 2]), costs).makespan == 6


def test_per_chunk_compute_costs():
    # GPipe P=2 N=1 with chunk 1's forward at 3: F0 [0,1], F1 [1,4], B1 [4,6], B0 [6,8]
    costs = costs_from_json({"compute": {"per_chunk": {"1": {"F": 3}}}})
    assert simulate(gpipe(2, 1), costs).makespan == 8


def test_allreduce_joins_replicas_and_waits():
    # Two pipelines of one stage each, replicas of chunk 0 on ranks 0 and 1. Rank 0 joins at 3,
    # rank 1 at 6; a 2-member ring all-reduce with latency 1 takes 2 (n-1) = 2 and ends at 8.
    # Rank 0's F3 B3 after the wait stand in for the optimizer step: [8,9] [9,11].
    stages = [StageInfo(0, 0, 0, 0), StageInfo(1, 1, 1, 0)]
    rank0 = [Action(0, "F", 0), Action(0, "B", 0), Action(0, ALLREDUCE_GRAD), Action(0, ALLREDUCE_WAIT), Action(0, "F", 3), Action(0, "B", 3)]
    rank1 = [Action(1, "F", 1), Action(1, "B", 1), Action(1, "F", 2), Action(1, "B", 2), Action(1, ALLREDUCE_GRAD), Action(1, ALLREDUCE_WAIT)]
    program = Program("replicas", 2, 4, stages, [[0], [1]], [0, 1, 1, 0], [rank0, rank1])
    free = simulate(program)
    assert free.makespan == 9 and free.bubble_fraction() == Fraction(1, 3)
    result = simulate(program, costs_from_json({"allreduce": {"latency": 1}}))
    assert result.makespan == 11 and result.bubble_fraction() == Fraction(5, 11)
    assert [(s.start, s.end, s.is_comm) for s in result.timeline[0]][2:] == [(6, 8, True), (8, 9, False), (9, 11, False)]
    assert [(s.start, s.end) for s in result.timeline[1] if s.is_comm] == [(6, 8)]


def test_allreduce_missing_a_replica_is_reported_stuck():
    stages = [StageInfo(0, 0, 0, 0), StageInfo(1, 1, 1, 0)]
    rank0 = [Action(0, "F", 0), Action(0, "B", 0), Action(0, ALLREDUCE_GRAD), Action(0, ALLREDUCE_WAIT)]
    rank1 = [Action(1, "F", 1), Action(1, "B", 1)]
    with pytest.raises(DeadlockError, match="all-reduce of chunk 0") as caught:
        simulate(Program("replicas", 2, 2, stages, [[0], [1]], [0, 1], [rank0, rank1]))
    assert (caught.value.rank, caught.value.step) == (0, 3)


# ----------------------------------------------------------------- result shape


def test_timeline_holds_every_compute_action_once_in_order_without_overlap():
    program, costs = interleaved_1f1b(4, 8, 2), CostModel.unit()
    result = simulate(program, costs)
    for row, slots in zip(program.ranks, result.timeline):
        assert [s.action for s in slots] == row
        for slot in slots:
            assert slot.end - slot.start == costs.compute(slot.action.op, program.stages[slot.action.stage].chunk)
        assert all(a.end <= b.start for a, b in zip(slots, slots[1:]))
    assert max(s.end for slots in result.timeline for s in slots) == result.makespan
    assert [r.busy + r.idle for r in result.ranks] == [result.makespan] * 4


def test_to_json_is_plain_numbers():
    data = simulate(one_f_one_b(4, 8)).to_json()
    assert data == json.loads(json.dumps(data))
    assert data["makespan"] == 33 and data["bubble_ratio"] == pytest.approx(3 / 11)
    assert data["ranks"][0] == {"busy": 24, "idle": 9, "peak_activations": 4, "peak_waiting_w": 0}
    assert all(type(v) in (int, float) for rank in data["ranks"] for v in rank.values())


def test_empty_program():
    program = Program("empty", 2, 0, [StageInfo(0, 0, 0, 0)], [[0]], [], [[], []])
    result = simulate(program)
    assert (result.makespan, result.bubble_fraction(), result.bubble_ratio) == (0, 0, 0.0)


# ----------------------------------------------------------------- stuck and malformed programs


def test_backward_before_its_forward_is_reported_stuck():
    program = one_f_one_b(2, 1)
    program.ranks[1] = [Action(1, "B", 0), Action(1, "F", 0)]
    with pytest.raises(DeadlockError) as caught:
        simulate(program)
    # rank 1 waits for its own later F; rank 0's B waits for rank 1's B
    stuck = {(r, s): waits for r, s, waits in caught.value.cycle}
    assert set(stuck) == {(0, 1), (1, 0)}
    assert "1F0" in stuck[(1, 0)] and "1B0" in stuck[(0, 1)]
    assert caught.value.render().startswith("rank 0, step 1:")


def test_receive_without_send_is_reported_stuck():
    rank0 = [Action(0, "F", 0), Action(0, RECV_B, 0, 1), Action(0, "B", 0)]
    rank1 = [Action(1, RECV_F, 0, 0), Action(1, "F", 0), Action(1, "B", 0), Action(1, SEND_B, 0, 0)]
    with pytest.raises(DeadlockError) as caught:
        simulate(two_rank_program([rank0, rank1], 1))
    # rank 0 never sends the activation: rank 1 stalls at its F, and rank 0 at its B
    assert {(r, s) for r, s, _ in caught.value.cycle} == {(0, 2), (1, 1)}
    assert caught.value.rank == 0 and "rank 0, step 2" in caught.value.render()


@pytest.mark.parametrize("bad", [Action(0, "X", 0), Action(0, "F", 5), Action(7, "F", 0), Action(0, SEND_F, 0, 0), Action(0, RECV_F, 0, 1)])
def test_malformed_instructions_are_well_formed_errors(bad):
    program = one_f_one_b(2, 1)
    program.ranks[0] = [Action(0, "F", 0), bad] + program.ranks[0][1:]
    with pytest.raises(WellFormedError) as caught:
        simulate(program)
    assert (caught.value.rank, caught.value.step) == (0, 1)


# ----------------------------------------------------------------- the cost model and its file


def test_unit_costs_are_integers():
    unit = CostModel.unit()
    assert [unit.compute(op, 0) for op in "FBIW"] == [1, 2, 1, 1]
    assert all(type(unit.compute(op, 3)) is int for op in "FBIW")
    assert unit.transfer(0, 1, "act") == 0 == unit.transfer(1, 0, "grad") and type(unit.transfer(0, 1, "act")) is int
    assert unit.allreduce(2, 0) == 0


def test_cost_file_completion_rules(tmp_path):
    costs = load_costs(cost_file(tmp_path, {"compute": {"F": 2, "B": 4, "per_chunk": {"1": {"B": 6}, "2": {"F": 2.5}}}}))
    assert [costs.compute(op, 0) for op in "FBIW"] == [2, 4, 2, 2]  # I and W default to B / 2
    assert [costs.compute(op, 1) for op in "FBIW"] == [2, 6, 3, 3]
    assert [costs.compute(op, 2) for op in "FBIW"] == [2.5, 4, 2, 2]
    assert load_costs(cost_file(tmp_path, "{}")) == CostModel.unit()


def test_cost_file_links(tmp_path):
    path = cost_file(tmp_path, {
        "links": {
            "latency": 1, "bandwidth": 10, "bytes": {"act": 20, "grad": 5},
            "node_size": 2, "inter_node": {"latency": 3},
            "pairs": {"3-0": {"bandwidth": 5}},
        },
        "allreduce": {"latency": 1, "bandwidth": 2, "bytes": 8},
    })
    costs = load_costs(path)
    assert costs.transfer(0, 1, "act") == 1 + 2 and type(costs.transfer(0, 1, "act")) is int
    assert costs.transfer(0, 1, "grad") == 1.5
    assert costs.transfer(1, 2, "act") == 3 + 2  # across nodes
    assert costs.transfer(0, 3, "act") == costs.transfer(3, 0, "act") == 3 + 4  # pair keeps the inter-node latency
    assert costs.transfer(2, 2, "act") == 0
    # ring of 4: 2 * 3 steps of latency 1, plus 2 * 3/4 * 8 bytes / 2
    assert costs.allreduce(4, 0) == 6 + 6
    assert costs.allreduce(1, 0) == 0
    # a frozen, hashable value: loading the same file twice gives equal models
    assert costs == load_costs(path) and hash(costs) == hash(load_costs(path))
    assert costs != CostModel.unit()


BAD_FILES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "top level"),
    ('{"computes": {}}', "computes"),
    ('{"compute": {"X": 1}}', "compute.X"),
    ('{"compute": {"F": -1}}', "compute.F"),
    ('{"compute": {"B": "2"}}', "compute.B"),
    ('{"compute": {"W": true}}', "compute.W"),
    ('{"compute": {"F": NaN}}', "compute.F"),
    ('{"compute": {"per_chunk": {"one": {"F": 1}}}}', "compute.per_chunk.one"),
    ('{"compute": {"per_chunk": {"1": {"Q": 1}}}}', "compute.per_chunk.1.Q"),
    ('{"compute": {"per_chunk": [1]}}', "compute.per_chunk"),
    ('{"links": {"bandwidth": 0}}', "links.bandwidth"),
    ('{"links": {"latency": null}}', "links.latency"),
    ('{"links": {"bytes": {"weights": 1}}}', "links.bytes.weights"),
    ('{"links": {"node_size": 2.5}}', "links.node_size"),
    ('{"links": {"post": -1}}', "links.post"),
    ('{"links": {"pairs": {"0_1": {}}}}', "links.pairs.0_1"),
    ('{"links": {"pairs": {"1-1": {}}}}', "links.pairs.1-1"),
    ('{"links": {"pairs": {"0-1": {"latency": -2}}}}', "links.pairs.0-1.latency"),
    ('{"links": {"pairs": {"0-1": {}, "1-0": {}}}}', "links.pairs"),
    ('{"allreduce": {"bytes": [8]}}', "allreduce.bytes"),
    ('{"allreduce": 3}', "allreduce"),
]


@pytest.mark.parametrize("content,key", BAD_FILES)
def test_bad_cost_files_name_the_file_and_the_key(tmp_path, content, key):
    path = cost_file(tmp_path, content)
    with pytest.raises(CostFileError) as caught:
        load_costs(path)
    message = str(caught.value)
    assert message.startswith(path) and key in message


def test_missing_cost_file(tmp_path):
    path = str(tmp_path / "absent.json")
    with pytest.raises(CostFileError, match="absent.json"):
        load_costs(path)


# ----------------------------------------------------------------- messages: batches, checks and their order


def test_batched_messages_that_take_time_give_the_same_comm_slots_as_single_ones():
    program = one_f_one_b(3, 4)
    costs = CostModel(link=Link(latency=2))
    single, batched = simulate(with_comms(program), costs), simulate(with_comms(program, batched=True), costs)
    assert any(row != unbatched for row, unbatched in zip(with_comms(program, True).ranks, with_comms(program).ranks))

    def comm_slots(result):
        return sorted((r, s.start, s.end, s.action.text()) for r, row in enumerate(result.timeline) for s in row if s.is_comm)

    assert comm_slots(batched) == comm_slots(single) and len(comm_slots(single)) == 2 * 2 * 4
    assert batched.makespan == single.makespan == simulate(program, costs).makespan


@pytest.mark.parametrize("parts, problem", [
    ((), "posts nothing"),
    ((Action(0, "F", 1),), "cannot be part of a batch"),
    ((Action(0, SEND_F, 0, 1), Action(0, RECV_B, 0, 0)), "out of range"),
    ((Action(0, SEND_F, 0, 1), Action(0, RECV_F, 0, 1)), "no neighbour"),
])
def test_malformed_batches_are_well_formed_errors_at_the_batch(parts, problem):
    rank0 = [Action(0, "F", 0), Action(-1, "BATCH", -1, -1, parts), Action(0, RECV_B, 0, 1), Action(0, "B", 0)]
    rank1 = [Action(1, RECV_F, 0, 0), Action(1, "F", 0), Action(1, "B", 0), Action(1, SEND_B, 0, 0)]
    with pytest.raises(WellFormedError, match=problem) as caught:
        simulate(two_rank_program([rank0, rank1], 1))
    assert (caught.value.rank, caught.value.step) == (0, 1)


def test_a_send_before_its_tensor_parks_the_rank_and_posts_nothing_of_its_batch():
    # rank 0 sends 0F0 before computing it: it stalls at the batch, so the
    # batch's receive is not posted either and rank 1's SEND_B stays unmatched
    rank0 = [Action(-1, "BATCH", -1, -1, (Action(0, RECV_B, 0, 1), Action(0, SEND_F, 0, 1))), Action(0, "F", 0), Action(0, "B", 0)]
    rank1 = [Action(1, RECV_F, 0, 0), Action(1, "F", 0), Action(1, "B", 0), Action(1, SEND_B, 0, 0)]
    with pytest.raises(DeadlockError) as caught:
        simulate(two_rank_program([rank0, rank1], 1))
    stuck = {(r, s): waits for r, s, waits in caught.value.cycle}
    assert set(stuck) == {(0, 0), (1, 1)}
    assert "0F0" in stuck[(0, 0)] and "activation for 1F0" in stuck[(1, 1)]


def test_a_lone_send_is_checked_in_full_before_it_waits_for_its_tensor():
    rank0 = [Action(0, SEND_F, 0, 7), Action(0, "F", 0), Action(0, RECV_B, 0, 1), Action(0, "B", 0)]
    rank1 = [Action(1, RECV_F, 0, 0), Action(1, "F", 0), Action(1, "B", 0), Action(1, SEND_B, 0, 0)]
    with pytest.raises(WellFormedError, match="out of range") as caught:
        simulate(two_rank_program([rank0, rank1], 1))
    assert (caught.value.rank, caught.value.step) == (0, 0)


def test_a_swapped_batch_is_a_match_error_naming_both_ends():
    rank0 = [Action(0, "F", 0), Action(0, "F", 1), batch([Action(0, SEND_F, 1, 1), Action(0, SEND_F, 0, 1)])]
    rank1 = [batch([Action(1, RECV_F, 0, 0), Action(1, RECV_F, 1, 0)]), Action(1, "F", 0), Action(1, "F", 1)]
    with pytest.raises(MatchError, match="expects the activation of 0F0") as caught:
        simulate(two_rank_program([rank0, rank1], 2))
    assert (caught.value.rank, caught.value.step) == (1, 0)
    assert "(rank 0, step 2)" in caught.value.message
