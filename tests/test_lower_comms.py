"""insert_communication and insert_frees: placement, batching, all-reduces, and safety.

Every lowered program here is run through ``check_all`` under rendezvous
semantics: the verifier after every lowering.
"""
from __future__ import annotations

import copy
import random
from fractions import Fraction

import pytest

from pipec.compiler import lower_comms
from pipec.compiler.checks import check_all, check_conflict, check_deadlock, peak_activations
from pipec.compiler.costs import CostModel, Link
from pipec.compiler.ir import (
    ALLREDUCE_GRAD,
    ALLREDUCE_WAIT,
    BATCH,
    COMM_OPS,
    FREE_F,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Program,
    StageInfo,
    tensor_of,
)
from pipec.compiler.liveness import insert_frees
from pipec.compiler.lower_comms import insert_communication
from pipec.compiler.simulate import simulate
from pipec.errors import ConflictError, WellFormedError
from reference_orders import compute_program, gpipe, interleaved_1f1b, one_f_one_b


# --------------------------------------------------------------------- builders


def split_backward(P: int, N: int) -> Program:
    """1F1B with every B split into I followed by W (the ZB-H1 shape, simplified)."""
    base = one_f_one_b(P, N)
    orders = []
    for row in base.ranks:
        out = []
        for a in row:
            out += [("I", a.stage, a.mb), ("W", a.stage, a.mb)] if a.op == "B" else [(a.op, a.stage, a.mb)]
        orders.append(out)
    return compute_program("split", list(range(P)), N, orders)


def v_shape(P: int, N: int) -> Program:
    """One pipeline of 2P stages folded into a V: stage s on rank s, then back down (GPipe order)."""
    stage_ranks = [s if s < P else 2 * P - 1 - s for s in range(2 * P)]
    orders = [[] for _ in range(P)]
    for s in range(2 * P):
        orders[stage_ranks[s]] += [("F", s, m) for m in range(N)]
    for s in reversed(range(2 * P)):
        orders[stage_ranks[s]] += [("B", s, m) for m in range(N)]
    return compute_program("v", stage_ranks, N, orders)


def two_pipelines(P: int, orders: list[list[tuple[str, int, int]]], mb_pipeline: list[int]) -> Program:
    """Two mirrored pipelines (down: position i on rank i; up: on rank P-1-i); replicas share a position."""
    stages = [StageInfo(i, i, 0, i) for i in range(P)] + [StageInfo(P + i, P - 1 - i, 1, i) for i in range(P)]
    pipelines = [list(range(P)), list(range(P, 2 * P))]
    ranks = [[Action(s, op, m) for op, s, m in row] for row in orders]
    return Program("bidirectional", P, len(mb_pipeline), stages, pipelines, mb_pipeline, ranks)


def bidirectional(consistent: bool = True) -> Program:
    """P = 2: mbs 0, 1 ride down (stage 0 on rank 0, 1 on rank 1), mbs 2, 3 ride up (stage 2 on rank 1, 3 on rank 0).

    Chunk 0 = stages 0 and 2, chunk 1 = stages 1 and 3. With ``consistent``
    both ranks finish chunk 1 first; otherwise rank 1 finishes chunk 0 first,
    so the two ranks reach their all-reduces in opposite orders.
    """
    rank0 = [("F", 0, 0), ("F", 0, 1), ("F", 3, 2), ("B", 3, 2), ("F", 3, 3), ("B", 3, 3), ("B", 0, 0), ("B", 0, 1)]
    if consistent:
        rank1 = [("F", 2, 2), ("F", 2, 3), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 2, 2), ("B", 2, 3)]
    else:
        rank1 = [("F", 2, 2), ("F", 2, 3), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 2, 2), ("B", 2, 3), ("B", 1, 1)]
    return two_pipelines(2, [rank0, rank1], [0, 0, 1, 1])


def random_program(seed: int) -> Program:
    """A random feasible compute order: a random topological order of the tasks, split by rank.

    Layouts: straight, interleaved (v = 2), V-shaped, or two mirrored pipelines
    with replicated chunks; backward either B or I + W per (stage, mb).
    """
    rng = random.Random(seed)
    P, N = rng.randint(2, 4), rng.randint(1, 6)
    layout = rng.choice(["straight", "interleaved", "v", "bidirectional"])
    if layout == "bidirectional":
        mb_pipeline = [m % 2 for m in range(N)]
        stages = [StageInfo(i, i, 0, i) for i in range(P)] + [StageInfo(P + i, P - 1 - i, 1, i) for i in range(P)]
        pipelines = [list(range(P)), list(range(P, 2 * P))]
    else:
        homes = {"straight": list(range(P)), "interleaved": [s % P for s in range(2 * P)],
                 "v": [s if s < P else 2 * P - 1 - s for s in range(2 * P)]}[layout]
        stages = [StageInfo(s, r, 0, s) for s, r in enumerate(homes)]
        pipelines, mb_pipeline = [list(range(len(homes)))], [0] * N
    split = rng.random() < 0.4
    needs: dict[tuple, list[tuple]] = {}  # task (op, stage, mb) -> the tasks it reads
    for m in range(N):
        line = pipelines[mb_pipeline[m]]
        backward_of_next = None
        for i, s in enumerate(line):
            needs[("F", s, m)] = [("F", line[i - 1], m)] if i else []
        for s in reversed(line):
            backward = "I" if split and rng.random() < 0.7 else "B"
            needs[(backward, s, m)] = [("F", s, m)] + ([backward_of_next] if backward_of_next else [])
            if backward == "I":
                needs[("W", s, m)] = [("I", s, m)]
            backward_of_next = (backward, s, m)
    orders = [[] for _ in range(P)]
    done: set = set()
    pending = set(needs)
    while pending:
        ready = sorted(task for task in pending if all(n in done for n in needs[task]))
        task = rng.choice(ready)
        pending.remove(task)
        done.add(task)
        orders[stages[task[1]].rank].append(Action(task[1], task[0], task[2]))
    return Program(f"random{seed}", P, N, stages, pipelines, mb_pipeline, orders)


REFERENCE = [
    *(one_f_one_b(P, N) for P, N in [(2, 2), (2, 5), (4, 4), (4, 8), (4, 13), (8, 8), (8, 24)]),
    *(gpipe(P, N) for P, N in [(2, 3), (4, 8)]),
    *(interleaved_1f1b(P, N, v) for P, N, v in [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 16, 3), (8, 16, 2)]),
    split_backward(4, 8),
    v_shape(3, 4),
]


def _ids(program: Program) -> str:
    return f"{program.name}-P{program.num_ranks}-N{program.num_microbatches}-S{len(program.stages)}"


def _comms(program: Program):
    """(rank, step, part) for every point-to-point part."""
    for rank, row in enumerate(program.ranks):
        for step, action in enumerate(row):
            for part in action.comms():
                yield rank, step, part


# ------------------------------------------------------------------ properties


@pytest.mark.parametrize("program", REFERENCE, ids=_ids)
def test_lowered_reference_orders_pass_every_check(program):
    lowered = insert_communication(program)
    check_all(lowered, semantics="rendezvous")
    check_all(lowered, semantics="async")  # rendezvous-safe implies async-safe
    check_all(insert_frees(lowered), semantics="rendezvous")


@pytest.mark.parametrize("program", REFERENCE, ids=_ids)
def test_lowering_keeps_compute_order_and_leaves_input_untouched(program):
    before = copy.deepcopy(program.ranks)
    lowered = insert_communication(program)
    assert program.ranks == before
    assert lowered.ranks is not program.ranks
    assert [[a for a in row if a.is_compute] for row in lowered.ranks] == program.ranks
    assert (lowered.stages, lowered.pipelines, lowered.mb_pipeline) == (program.stages, program.pipelines,
                                                                          program.mb_pipeline)


@pytest.mark.parametrize("program", REFERENCE, ids=_ids)
def test_every_remote_handoff_is_one_message_and_local_ones_none(program):
    lowered = insert_communication(program)
    home = [s.rank for s in program.stages]
    sent = {}
    for rank, step, part in _comms(lowered):
        if part.op in (SEND_F, SEND_B):
            tensor = tensor_of(part, lowered)
            assert tensor not in sent
            sent[tensor] = (rank, part.peer)
    expected = {}
    for s in range(len(program.stages)):
        for m in program.microbatches_of(s):
            nxt, prv = program.next_stage(s), program.prev_stage(s)
            if nxt >= 0 and home[nxt] != home[s]:
                expected[("act", s, m)] = (home[s], home[nxt])
            if prv >= 0 and home[prv] != home[s]:
                expected[("grad", s, m)] = (home[s], home[prv])
    assert sent == expected


def test_sends_follow_their_producer_and_runs_are_batched_sends_first(monkeypatch):
    no_global_order(monkeypatch)
    lowered = insert_communication(one_f_one_b(4, 8))  # near-use placement
    for row in lowered.ranks:
        for step, action in enumerate(row):
            if step and action.is_comm:
                assert not row[step - 1].is_comm, "two communications in a row must be one batch"
            if action.op == BATCH:
                kinds = [part.op in (SEND_F, SEND_B) for part in action.parts]
                assert len(kinds) >= 2 and kinds == sorted(kinds, reverse=True)
            for part in action.comms():
                if part.op in (SEND_F, SEND_B):
                    producer = row[step - 1]
                    assert producer.is_compute and (producer.stage, producer.mb) == (part.stage, part.mb)
    # Megatron's steady state: send_forward_recv_backward and send_backward_recv_forward
    rank1 = [a.text() for a in lowered.ranks[1]]
    assert "(1SEND_F2;1RECV_B0)BATCH" in rank1 and "(1SEND_B0;1RECV_F3)BATCH" in rank1


def test_receives_come_just_before_their_reader_in_fifo_order():
    lowered = insert_communication(gpipe(3, 4))
    for rank, row in enumerate(lowered.ranks):
        for step, action in enumerate(row):
            for part in action.comms():
                if part.op in (RECV_F, RECV_B):
                    reader = row[step + 1]
                    assert reader.is_compute and (reader.stage, reader.mb) == (part.stage, part.mb)
    assert [a.text() for a in lowered.ranks[2]][:4] == ["2RECV_F0", "2F0", "2RECV_F1", "2F1"]


def no_global_order(monkeypatch):
    """Make the global-order placement fail loudly: the test expects near use or paired to do."""
    def refuse(program, plan):
        raise AssertionError(f"{program.name} needed the global-order placement")
    monkeypatch.setattr(lower_comms, "_place_in_global_order", refuse)


def test_fifo_forces_an_early_receive(monkeypatch):
    # rank 1 reads mb 1 before mb 0, but rank 0 sends mb 0 first: both receives precede 1F1
    no_global_order(monkeypatch)
    program = compute_program("fifo", [0, 1], 2, [[("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
                                                  [("F", 1, 1), ("F", 1, 0), ("B", 1, 0), ("B", 1, 1)]])
    lowered = insert_communication(program)
    check_all(lowered)
    assert lowered.ranks[1][0].text() == "(1RECV_F0;1RECV_F1)BATCH"


def test_v_shape_bottom_is_a_local_handoff():
    lowered = insert_communication(v_shape(2, 2))
    check_all(lowered)
    texts = {part.text() for _, _, part in _comms(lowered)}
    assert not any(t.startswith(("1SEND_F", "2RECV_F", "2SEND_B", "1RECV_B")) for t in texts)
    assert "0SEND_F0" in texts and "3RECV_B0" not in texts and "3SEND_B0" in texts


def test_interleaved_gets_the_global_order_and_no_pairing(monkeypatch):
    # Near use deadlocks here; the global order takes over and posts each
    # forward's send right after it (Megatron's pairing held it until after
    # the next backward, exposing the link latency).
    calls = []
    original = lower_comms._place_in_global_order
    monkeypatch.setattr(lower_comms, "_place_in_global_order", lambda *args: calls.append(1) or original(*args))
    lowered = insert_communication(interleaved_1f1b(4, 8, 2))
    check_all(lowered)
    assert calls
    rank1 = [a.text() for a in lowered.ranks[1]]
    assert rank1[rank1.index("1F2") + 1].startswith(("1SEND_F2", "(1SEND_F2;"))


def _sends_after_producers(program: Program) -> None:
    """Every send of the lowered ``program`` is in the instruction right after the compute that makes its tensor."""
    for rank, row in enumerate(insert_communication(program).ranks):
        for step, action in enumerate(row):
            for part in action.comms():
                if part.op in (SEND_F, SEND_B):
                    producer = row[step - 1]
                    assert producer.is_compute and (producer.stage, producer.mb) == (part.stage, part.mb), \
                        f"{program.name}: rank {rank}, step {step}: {action.text()} after {producer.text()}"


@pytest.mark.parametrize("program", REFERENCE, ids=_ids)
def test_every_send_is_posted_right_after_its_producer(program):
    _sends_after_producers(program)


def test_every_send_of_random_orders_is_posted_right_after_its_producer():
    for seed in range(60):
        _sends_after_producers(random_program(seed))


_READS = {RECV_F: ("F",), RECV_B: ("B", "I")}


def test_a_batch_holds_no_receive_its_next_compute_can_do_without():
    """A runtime may wait for a batch as a whole (NCCL coalesces one): each receive a batch holds is read by
    the compute right after it, or comes before (FIFO) one from the same rank that is."""
    for program in REFERENCE + [random_program(seed) for seed in range(60)]:
        for rank, row in enumerate(insert_communication(program).ranks):
            for step, action in enumerate(row):
                if action.op != BATCH:
                    continue
                after = next((a for a in row[step + 1:] if a.is_compute), None)
                read = [after is not None and (p.stage, p.mb) == (after.stage, after.mb)
                        and after.op in _READS.get(p.op, ()) for p in action.parts]
                for i, part in enumerate(action.parts):
                    if part.op in _READS:
                        assert any(read[j] and action.parts[j].peer == part.peer for j in range(i, len(read))), \
                            f"{program.name}: rank {rank}, step {step}: {action.text()} before {after and after.text()}"


def test_the_placement_adds_no_wait_of_its_own():
    """Each message leaves when its data is made, so the lowered program takes exactly as long as the
    compute order (links not shared, posting free), whatever the links cost."""
    latency = CostModel(link=Link(1))
    bandwidth = CostModel(link=Link(Fraction(1, 4), 4), message_bytes=(("act", 8), ("grad", 2)))
    for program in REFERENCE + [random_program(seed) for seed in range(60)]:
        lowered = insert_communication(program)
        for costs in (latency, bandwidth):
            assert simulate(lowered, costs).makespan == simulate(program, costs).makespan, program.name


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("N", [1, 3, 8, 16])
def test_one_f_one_b_peak_activations(P, N):
    lowered = insert_frees(insert_communication(one_f_one_b(P, N)))
    check_all(lowered, memory_budget=min(P, N))
    assert peak_activations(lowered) == [min(P - r, N) for r in range(P)]


@pytest.mark.parametrize("seed", range(150))
def test_random_feasible_orders_lower_to_safe_programs(seed):
    program = random_program(seed)
    lowered = insert_communication(program)
    check_all(lowered, semantics="rendezvous")
    check_all(insert_frees(lowered), semantics="async")


def test_global_order_fallback_is_used_and_safe(monkeypatch):
    calls = []
    original = lower_comms._place_in_global_order

    def spy(program, plan):
        calls.append(program.name)
        return original(program, plan)

    monkeypatch.setattr(lower_comms, "_place_in_global_order", spy)
    used = []
    for seed in range(60):
        lowered = insert_communication(random_program(seed))
        if calls and calls[-1] == f"random{seed}":
            check_all(lowered)
            used.append(seed)
    assert used, "no random order needed the global-order placement"


# ----------------------------------------------------------------- all-reduces


def test_replicated_chunks_get_one_allreduce_per_rank_after_its_last_backward():
    # Both ranks start with a send to each other: near use and paired deadlock,
    # so this also exercises the global-order placement.
    lowered = insert_communication(bidirectional())
    check_all(lowered)
    for rank, row in enumerate(lowered.ranks):
        texts = [a.text() for a in row]
        grads = [i for i, a in enumerate(row) if a.op == ALLREDUCE_GRAD]
        assert len(grads) == 2  # chunk 0 and chunk 1
        for i in grads:
            chunk = lowered.stages[row[i].stage].position
            last = max(j for j, a in enumerate(row) if a.op in ("B", "W") and lowered.stages[a.stage].position == chunk)
            assert last < i, texts
        waits = [a for a in row if a.op == ALLREDUCE_WAIT]
        assert [a.stage for a in waits] == [row[i].stage for i in grads]
        assert all(a.op == ALLREDUCE_WAIT for a in row[-2:])
    assert not any(a.op == ALLREDUCE_GRAD for row in insert_communication(one_f_one_b(2, 2)).ranks for a in row)


def test_allreduces_meeting_in_opposite_orders_are_reordered_safely():
    # Rank 0 finishes chunk 1 first, rank 1 chunk 0: all-reduces right after the
    # last backward would cross; the global order defers them consistently.
    lowered = insert_communication(bidirectional(consistent=False))
    check_all(lowered)
    orders = [[lowered.stages[a.stage].position for a in row if a.op == ALLREDUCE_GRAD] for row in lowered.ranks]
    assert orders[0] == orders[1] and sorted(orders[0]) == [0, 1]


# ------------------------------------------------------------------- liveness


def test_frees_follow_the_last_use_and_are_idempotent():
    for program in (one_f_one_b(3, 5), split_backward(3, 4)):
        freed = insert_frees(insert_communication(program))
        check_conflict(freed)
        for row in freed.ranks:
            for step, action in enumerate(row):
                if action.op == FREE_F:
                    last = row[step - 1]
                    assert (last.stage, last.mb) == (action.stage, action.mb)
                    assert last.op == ("W" if program.name == "split" else "B")
        count = sum(a.op == FREE_F for row in freed.ranks for a in row)
        assert count == len(program.stages) * program.num_microbatches
        assert insert_frees(freed).ranks == freed.ranks


def test_a_free_before_the_backward_is_a_conflict():
    freed = insert_frees(insert_communication(one_f_one_b(2, 2)))
    row = freed.ranks[0]
    step = next(i for i, a in enumerate(row) if a.op == FREE_F)
    row.insert(step - 2, row.pop(step))  # the free now precedes its B
    with pytest.raises(ConflictError, match="before 0B0 uses it"):
        check_conflict(freed)


def test_cyclic_order_lowers_without_crashing_and_fails_the_checks():
    program = one_f_one_b(2, 2)
    program.ranks[1][0], program.ranks[1][1] = program.ranks[1][1], program.ranks[1][0]  # 1B0 before 1F0
    lowered = insert_communication(program)
    assert [[a for a in row if a.is_compute] for row in lowered.ranks] == program.ranks
    with pytest.raises(WellFormedError, match="1B0 needs 1F0, which comes later on this rank"):
        check_all(lowered)


def test_comm_ops_are_the_only_new_instructions():
    lowered = insert_communication(interleaved_1f1b(2, 4, 3))
    for row in lowered.ranks:
        for action in row:
            assert action.is_compute or action.op == BATCH or action.op in COMM_OPS
    check_deadlock(lowered)


def test_a_rank_without_stages_gets_an_empty_list():
    program = compute_program("idle", [0, 1], 2, [[("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
                                                  [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)], []])
    lowered = insert_frees(insert_communication(program))
    check_all(lowered)
    assert lowered.ranks[2] == [] and peak_activations(lowered) == [2, 1, 0]


@pytest.mark.parametrize("name, params", [
    ("interleaved_1f1b", {"P": 4, "N": 32, "v": 2}),
    ("interleaved_1f1b", {"P": 4, "N": 64, "v": 4}),
    ("1f1b", {"P": 4, "N": 32}),
    ("zb_h1", {"P": 4, "N": 32}),
])
def test_early_deadlock_probe_agrees_with_the_whole_simulation(name, params):
    """The prefix probe never claims a deadlock that the whole simulation does not find."""
    from pipec.compiler.build import compute_program
    from pipec.compiler.checks.deadlock import blocked_ranks
    from pipec.compiler.checks.wellformed import stage_tables
    from pipec.compiler.driver import resolve_target
    program = compute_program(resolve_target(name).evaluate(params))
    plan = lower_comms._plan(program, stage_tables(program))
    near_use = lower_comms._near_use(program, plan)
    early = lower_comms._deadlocks_early(program, plan, near_use)
    whole = bool(blocked_ranks(lower_comms._wait_graph(program, plan, lower_comms._layout(program, plan, near_use))))
    assert whole or not early
    if name == "interleaved_1f1b" and params["v"] == 2:  # near use deadlocks early here: the probe sees it
        assert lower_comms._deadlocks_early(program, plan, near_use)
