"""The prover on composed programs: pipelines on a pp x dp mesh, data parallel and fully sharded (docs/ir.md).

``mesh_placement.place_on_mesh`` turns a compiled pipeline into the composed program
(every stage on its dp group, a GATHER sub-step where a sharded stage's weights
must be made whole, RESHARD after, each stage's gradient all-reduced or
reduce-scattered in an EXCHANGE after its last contribution). ``check_all``
proves every shipped pipeline schedule so composed, and names each planted
cross-axis hazard at its rank and instruction; memory is counted in bytes per
member (shards, whole weights, shares of activations) against a budget.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.mesh_placement import DataParallel, place_on_mesh
from pipec.compiler.driver import compile_target
from pipec.compiler.ir import Action, Mesh, Program
from pipec.compiler.memory_counts import peak_bytes
from pipec.errors import BudgetError, ConflictError, DeadlockError, MatchError, RouteError, WellFormedError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
MODES = {"dp": DataParallel("dp"), "fsdp": DataParallel("dp", sharded=True),
         "zero3": DataParallel("dp", sharded=True, reshard_after_forward=True)}


@lru_cache(maxsize=None)
def _pipeline(schedule: str, stages: int) -> Program:
    return compile_target(schedule, {"P": stages, "N": 2 * stages}).program


def composed(schedule: str, stages: int, mode: str, microbatches: int | None = None) -> Program:
    base = (_pipeline(schedule, stages) if microbatches is None
            else compile_target(schedule, {"P": stages, "N": microbatches}).program)
    return place_on_mesh(base, Mesh((("pp", stages), ("dp", 2))), "pp", MODES[mode])


def with_row(program: Program, rank: int, change) -> Program:
    ranks = [list(row) for row in program.ranks]
    ranks[rank] = change(ranks[rank])
    return replace(program, ranks=ranks)


def index_of(program: Program, rank: int, text: str) -> int:
    return [a.text() for a in program.ranks[rank]].index(text)


def _raised(program: Program, cls):
    with pytest.raises(cls) as caught:
        check_all(program)
    return caught.value


# ------------------------------------------------------------------ proved


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_pipeline_schedule_composed_on_a_data_axis_is_proved(schedule, stages, mode):
    program = composed(schedule, stages, mode)
    check_all(program)
    used = {a.op for row in program.ranks for a in row} | {p.op for row in program.ranks for a in row for p in a.parts}
    sharded = mode != "dp"
    assert (ops.GATHER in used, ops.RESHARD in used) == (sharded, sharded)
    assert (ops.REDUCE_GRAD in used, ops.SYNC_GRAD in used) == (sharded, not sharded)


def test_sub_steps_and_gradient_reductions_are_told_apart_by_the_rule_table():
    assert ops.SUBSTEP_OPS == (ops.GATHER,)
    assert set(ops.STAGE_EXCHANGE_OPS) == {ops.SYNC_GRAD, ops.REDUCE_GRAD}
    assert ops.SHARDED_REDUCTION_OPS == (ops.REDUCE_GRAD,) and ops.REPLICATED_REDUCTION_OPS == (ops.SYNC_GRAD,)
    assert ops.RESHARD_OPS == (ops.RESHARD,)


# ----------------------------------------------------------------- hazards


def test_a_reshard_before_the_backward_that_needs_the_whole_weights_is_named():
    program = composed("1f1b", 2, "fsdp", 4)
    at = index_of(program, 0, "0B2")
    error = _raised(with_row(program, 0, lambda row: row[:at] + [Action(0, ops.RESHARD)] + row[at:]), RouteError)
    assert error.message == ("0B2 runs stage 0 on its shard alone: its whole weights were dropped by 0RESHARD "
                             "(step 12) and not gathered since (a GATHER in this compute or an earlier one of the "
                             "stage makes them whole)")
    assert (error.rank, error.step, error.marks) == (0, 13, [(0, 12)])


def test_a_reshard_after_forward_moved_before_the_last_forward_is_named():
    program = composed("1f1b", 2, "zero3", 4)
    at = index_of(program, 2, "1F3")
    error = _raised(with_row(program, 2, lambda row: row[:at] + [row[at + 1], row[at]] + row[at + 2:]), RouteError)
    assert error.message.startswith("1F3 runs stage 1 on its shard alone: its whole weights were dropped by 1RESHARD")
    assert (error.rank, error.step) == (2, at + 1)


def test_an_all_gather_before_a_pipeline_receive_on_one_dp_rank_and_after_it_on_its_peer_is_a_named_cycle():
    # GPipe, ZeRO-3: rank 0 gathers stage 0's weights for 0B0 before the batch that receives its gradient;
    # rank 1, its dp peer, after. Under rendezvous rank 0 waits in the gather for rank 1, rank 1 for the
    # gradient from rank 3, rank 3 in stage 1's gather for rank 2, and rank 2 for 0F3's activation from rank 0.
    program = composed("gpipe", 2, "zero3", 4)
    at = index_of(program, 0, "(0GATHER0)0B0")
    error = _raised(with_row(program, 0, lambda row: row[:at - 1] + [row[at], row[at - 1]] + row[at + 1:]),
                    DeadlockError)
    assert error.message == (
        "deadlock: rank 0 (step 8) waits in (0GATHER0)0B0 for rank 1 to join 0GATHER0; rank 1 (step 8) waits in "
        "(0SEND_F3;0RECV_B0)BATCH for 0RECV_B0 to meet rank 3; rank 3 (step 9) waits in (1GATHER0)1B0 for rank 2 "
        "to join 1GATHER0; rank 2 (step 6) waits in 1RECV_F3 for 1RECV_F3 to meet rank 0")
    assert (error.rank, error.step, error.marks) == (0, 8, [(1, 8), (3, 9), (2, 6)])


def test_a_microbatch_handed_to_the_wrong_dp_rank_of_the_next_stage_is_named():
    program = composed("1f1b", 2, "dp", 4)
    at = index_of(program, 0, "0SEND_F0")
    error = _raised(with_row(program, 0, lambda row: row[:at] + [row[at]._replace(peer=3)] + row[at + 1:]),
                    MatchError)
    assert error.message == ("0SEND_F0 sends rank 0's share of the activation of 0F0 to rank 3, but stage 1 (on "
                             "ranks 2, 3) takes that share on rank 2 (rank 3 is at dp 1; the share is at dp 0)")
    assert (error.rank, error.step) == (0, at)


def test_a_members_free_before_its_backward_twice_or_of_what_it_never_made_is_named():
    # Found by the mutants of tests/mutants.py: a placed program's frees were proved by nothing, and the
    # runtime faults in the backward after a free of its saved activation.
    program = composed("1f1b", 2, "dp", 2)
    at = index_of(program, 3, "1FREE_F0")
    early = with_row(program, 3, lambda row: row[:at - 1] + [row[at], row[at - 1]] + row[at + 1:])
    error = _raised(early, ConflictError)
    assert error.message == "1FREE_F0 frees the activation before 1B0 uses it (step 3)"
    assert (error.rank, error.step, error.marks) == (3, 2, [(3, 3)])
    error = _raised(with_row(program, 3, lambda row: row[:at + 1] + [row[at]] + row[at + 1:]), ConflictError)
    assert error.message == f"1FREE_F0 frees the activation twice (first at step {at})"
    assert (error.rank, error.step) == (3, at + 1)
    error = _raised(with_row(program, 0, lambda row: row + [Action(1, ops.FREE_F, 0)]), ConflictError)
    assert error.message == "1FREE_F0 frees an activation that is never made on rank 0"
    ships = index_of(program, 0, "0SEND_F0")
    error = _raised(with_row(program, 0, lambda row: row[:ships] + [Action(0, ops.FREE_F, 0)] + row[ships:]),
                    ConflictError)
    assert error.message == f"0FREE_F0 frees the activation before 0SEND_F0 uses it (step {ships + 1})"


def test_a_gradient_contribution_after_its_reduction_is_named():
    program = composed("1f1b", 2, "fsdp", 4)
    at = index_of(program, 0, "(0REDUCE_GRAD)EXCHANGE0")
    error = _raised(with_row(program, 0, lambda row: row[:at - 1] + [row[at], row[at - 1]] + row[at + 1:]),
                    ConflictError)
    assert error.message == ("0B3 adds to stage 0's weight gradient after (0REDUCE_GRAD)EXCHANGE0 (step 15) reduced "
                             "it over the group: this contribution misses the sum (a reduction comes after the "
                             "stage's last backward)")
    assert (error.rank, error.step, error.marks) == (0, 16, [(0, 15)])


def test_a_split_backwards_last_weight_gradient_after_the_reduction_is_named():
    program = composed("zb_h1", 2, "dp", 4)
    at = index_of(program, 2, "1W3")
    error = _raised(with_row(program, 2, lambda row: row[:at] + [row[at + 1], row[at]] + row[at + 2:]),
                    ConflictError)
    assert error.message.startswith("1W3 adds to stage 1's weight gradient after (1SYNC_GRAD)EXCHANGE0")
    assert (error.rank, error.step) == (2, at + 1)


def test_a_reduction_missing_twice_unwaited_or_of_the_wrong_kind_is_named():
    sharded, replicated = composed("1f1b", 2, "fsdp", 4), composed("1f1b", 2, "dp", 4)
    exchange = index_of(sharded, 0, "(0REDUCE_GRAD)EXCHANGE0")
    cases = (
        (sharded, lambda row: [a for a in row if a.op != ops.EXCHANGE and a.op != ops.EXCHANGE_WAIT], WellFormedError,
         "rank 0 never reduces the weight gradient of stage 0 (sharded on ranks 0, 1): its members would step on "
         "different gradients (a (0REDUCE_GRAD)EXCHANGE belongs after its last gradient contribution here, 0B3 "
         "(step 15))", 15),
        (sharded, lambda row: [a for a in row if a.op != ops.EXCHANGE_WAIT], MatchError,
         "(0REDUCE_GRAD)EXCHANGE0 reduces stage 0's weight gradient, but rank 0 never waits for it (EXCHANGE_WAIT0) "
         "before its list ends: the optimizer would step on a gradient still being reduced", exchange),
        (sharded, lambda row: row[:exchange + 1] + [Action(-1, ops.EXCHANGE, 1, -1, (Action(0, ops.REDUCE_GRAD),))]
         + row[exchange + 1:] + [Action(-1, ops.EXCHANGE_WAIT, 1)], WellFormedError,
         "(0REDUCE_GRAD)EXCHANGE1 reduces stage 0's weight gradient a second time on rank 0 (first at step 16): "
         "each member reduces it once", exchange + 1),
        (replicated, lambda row: [a._replace(parts=(Action(0, ops.REDUCE_GRAD),)) if a.op == ops.EXCHANGE else a
                                  for a in row], WellFormedError,
         "(0REDUCE_GRAD)EXCHANGE0 reduces the weight gradient of stage 0 (replicated on ranks 0, 1) with "
         "REDUCE_GRAD: a replicated stage's is reduced by SYNC_GRAD", 16),
        (sharded, lambda row: [a._replace(parts=(Action(0, ops.SYNC_GRAD),)) if a.op == ops.EXCHANGE else a
                               for a in row], WellFormedError,
         "(0SYNC_GRAD)EXCHANGE0 reduces the weight gradient of stage 0 (sharded on ranks 0, 1) with SYNC_GRAD: a "
         "sharded stage's is reduced by REDUCE_GRAD", exchange),
    )
    for program, change, cls, message, step in cases:
        error = _raised(with_row(program, 0, change), cls)
        assert (error.message, error.rank, error.step) == (message, 0, step)


def test_gathers_and_reshards_out_of_place_are_named():
    sharded, replicated = composed("1f1b", 2, "fsdp", 4), composed("1f1b", 2, "dp", 4)
    gathered = (Action(0, ops.GATHER, 0),)
    both = replace(replicated, ranks=[[row[0]._replace(parts=gathered)] + row[1:] if rank < 2 else row
                                      for rank, row in enumerate(replicated.ranks)])
    error = _raised(both, WellFormedError)
    assert error.message == ("(0GATHER0)0F0 gathers the weights of stage 0 (replicated on ranks 0, 1): a replicated "
                             "stage holds them whole on every member, only a sharded one gathers")
    again = replace(sharded, ranks=[[row[0], row[1], row[2]._replace(parts=(Action(0, ops.GATHER, 1),))] + row[3:]
                                    if rank < 2 else row for rank, row in enumerate(sharded.ranks)])
    error = _raised(again, WellFormedError)
    assert error.message == ("(0GATHER1)0F1 gathers stage 0's weights, which are whole here since step 0: a second "
                             "copy would be gathered for nothing (a RESHARD drops the first)")
    assert (error.rank, error.step, error.marks) == (0, 2, [(0, 0)])
    last = index_of(sharded, 0, "0RESHARD")
    error = _raised(with_row(sharded, 0, lambda row: row[:last] + [row[last]] + row[last:]), RouteError)
    assert error.message == ("0RESHARD drops stage 0's whole weights, which are not whole here: 0RESHARD (step "
                             f"{last}) dropped them already")
    error = _raised(with_row(sharded, 0, lambda row: [a for a in row if a.op != ops.RESHARD]), WellFormedError)
    assert error.message == ("stage 0's whole weights, gathered at step 0, are still held when rank 0's list ends: "
                             "the optimizer steps on the shards, so the whole copy would be stale (a RESHARD after "
                             "the stage's last compute drops it)")
    error = _raised(with_row(replicated, 0, lambda row: row + [Action(0, ops.RESHARD)]), WellFormedError)
    assert error.message == ("0RESHARD drops the whole weights of stage 0 (replicated on ranks 0, 1): a replicated "
                             "stage keeps them")


@pytest.mark.parametrize("mode,reduction,k,step,theirs", [
    ("dp", ops.SYNC_GRAD, "1st", 46, 39),
    ("fsdp", ops.REDUCE_GRAD, "3rd", 47, 39),   # after the two gathers of stages 1 and 3: counted together
    ("zero3", ops.REDUCE_GRAD, "5th", 49, 41),  # after the four gathers (again for the backwards)
])
def test_members_posting_their_stages_reductions_in_different_orders_are_named_at_the_meeting(
        mode, reduction, k, step, theirs):
    # interleaved 1F1B: pp rank 1 holds stages 1 and 3, whose gathers and reductions meet on one communicator;
    # rank 3 posts stage 3's reduction after stage 1's, rank 2 (its dp peer) before
    program = composed("interleaved_1f1b", 2, mode, 4)
    first = index_of(program, 3, f"(3{reduction})EXCHANGE0")
    second = index_of(program, 3, f"(1{reduction})EXCHANGE1")
    moved = with_row(program, 3, lambda row: row[:first] + row[first + 1:second + 1] + [row[first]] + row[second + 1:])
    error = _raised(moved, MatchError)
    assert error.message == (f"the {k} collective on communicator 1 ({ops.STAGE_GROUP} 1: ranks 2, 3) is "
                             f"1{reduction} here but 3{reduction} on rank 2 (step {theirs}): every member must meet "
                             "its collectives in the same order")
    assert (error.rank, error.step, error.marks) == (3, step, [(2, theirs)])


# ------------------------------------------------------------------ memory

ACTIVATION, WEIGHT = 1000, 4001  # an odd weight: each of 2 shards is padded to 2001 bytes


@pytest.mark.parametrize("mode", ["fsdp", "zero3"])
def test_pp2_x_fsdp2_peak_bytes_per_rank_are_the_hand_count(mode):
    program = composed("1f1b", 2, mode, 4)
    sizes = {ops.SIZE_ACTIVATION: ACTIVATION, ops.SIZE_WEIGHT: WEIGHT}
    shard = (WEIGHT + 1) // 2
    # 1F1B with P = 2: stage 0 holds 2 microbatches' saved activations at once, stage 1 one; each member its
    # half of the rows. Each member holds its shard always, and the stage's whole weights while gathered.
    live = {0: 2, 1: 2, 2: 1, 3: 1}
    expected = [{ops.SIZE_ACTIVATION: live[rank] * ACTIVATION // 2, ops.SIZE_WEIGHT: WEIGHT, ops.SIZE_SHARD: shard}
                for rank in range(4)]
    assert peak_bytes(program, sizes) == expected
    check_all(program, byte_budget={c: expected[0][c] for c in expected[0]}, sizes=sizes)
    cases = {ops.SIZE_ACTIVATION: (2, "this member's shares of the values"),  # the second forward's share
             ops.SIZE_WEIGHT: (0, "the whole weights of the stages this member holds now"),  # (0GATHER0)0F0
             ops.SIZE_SHARD: (0, "this member's shards")}
    for size_class, (step, held) in cases.items():
        with pytest.raises(BudgetError) as caught:
            check_all(program, byte_budget={size_class: expected[0][size_class] - 1}, sizes=sizes)
        peak = expected[0][size_class]
        assert caught.value.message == (f"{peak} bytes of {size_class}-sized values alive here ({held}), over the "
                                         f"{size_class} budget of {peak - 1} bytes; this rank's peak is {peak} bytes")
        assert (caught.value.rank, caught.value.step) == (0, step)


def test_a_shard_budget_is_priced_by_the_weight_size_where_a_stage_is_sharded(capsys, tmp_path):
    """The shard is derived from the weight bytes (``placed_memory``), so ``--budget-bytes shard=`` needs no
    ``shard`` size of its own: held at the peak, refused one byte below at the first GATHER; on a program that
    shards nothing (or without a weight size) it is refused as unsized, never a traceback."""
    import json

    import pipec.api
    from pipec.cli import main
    from pipec.errors import UsageError

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"sizes": {ops.SIZE_ACTIVATION: ACTIVATION, ops.SIZE_WEIGHT: WEIGHT}}))
    shard = (WEIGHT + 1) // 2

    def check(*args: str) -> tuple[int, str, str]:
        status = main(["check", *args, "--costs", str(costs)])
        return (status, *capsys.readouterr())

    status, out, _ = check("1f1b_fsdp", "--budget-bytes", f"shard={shard}")
    assert status == 0 and f"shard [{', '.join(['1.954 KiB'] * 4)}]" in out
    status, out, err = check("1f1b_fsdp", "--budget-bytes", f"shard={shard - 1}")
    assert (status, out) == (1, "") and err.startswith(
        f"rank 0, step 0: {shard} bytes of shard-sized values alive here (this member's shards), over the shard "
        f"budget of {shard - 1} bytes")
    status, _, err = check("1f1b_dp", "--budget-bytes", f"shard={shard}")
    assert (status, err) == (1, "a byte budget for 'shard' needs its size: 1f1b_dp shards no stage's weights, so "
                                "the weight size gives none (sizes)\n")
    saved = tmp_path / "fsdp.json"
    assert main(["compile", "1f1b_fsdp", "-o", str(saved)]) == 0
    status, _, err = check(str(saved), "--budget-bytes", f"shard={shard - 1}")
    assert status == 1 and err.startswith("rank 0, step 0: ")
    replicated = pipec.api.compile("1f1b_dp", costs=str(costs))
    with pytest.raises(UsageError, match="this program shards no stage's weights"):
        replicated.check(byte_budget={ops.SIZE_SHARD: shard})
    costs.write_text(json.dumps({"sizes": {ops.SIZE_ACTIVATION: ACTIVATION}}))
    status, _, err = check("1f1b_fsdp", "--budget-bytes", f"shard={shard}")
    assert status == 1 and err.startswith("a byte budget for 'shard' needs its size: add")


def test_whole_weights_rise_at_the_gather_and_fall_at_the_reshard():
    from pipec.compiler.placed_memory import placed_bytes

    program = composed("1f1b", 2, "zero3", 4)
    sizes = {ops.SIZE_WEIGHT: WEIGHT}
    weights = [live[ops.SIZE_WEIGHT] for live in placed_bytes(program, 0, sizes)][1:]  # after each instruction
    row = program.grid()[0]
    for step, text in enumerate(row):
        whole = weights[step] == WEIGHT
        assert whole == (weights[step] != 0)
        if "GATHER" in text:
            assert whole
        if text.endswith(ops.RESHARD):
            assert weights[step] == 0
    regather = index_of(program, 0, "(0GATHER2)0B2")  # after the last forward's reshard, for the backwards
    assert weights[regather - 1] == 0 < weights[regather]


def test_a_replicated_stage_holds_its_whole_weights_and_no_shard():
    program = composed("1f1b", 2, "dp", 4)
    sizes = {ops.SIZE_ACTIVATION: ACTIVATION, ops.SIZE_WEIGHT: WEIGHT}
    assert peak_bytes(program, sizes)[0] == {ops.SIZE_ACTIVATION: ACTIVATION, ops.SIZE_WEIGHT: WEIGHT}
    with pytest.raises(BudgetError) as caught:
        check_all(program, byte_budget={ops.SIZE_WEIGHT: WEIGHT - 1}, sizes=sizes)
    assert (caught.value.rank, caught.value.step) == (0, 0)


def test_plain_programs_count_as_before():
    program = compile_target("1f1b", {"P": 2, "N": 4}).program
    assert peak_bytes(program, {ops.SIZE_ACTIVATION: ACTIVATION, ops.SIZE_WEIGHT: WEIGHT}) == [
        {ops.SIZE_ACTIVATION: 2 * ACTIVATION, ops.SIZE_WEIGHT: 0},
        {ops.SIZE_ACTIVATION: ACTIVATION, ops.SIZE_WEIGHT: 0}]  # a plain stage's weights are not counted


def test_a_groups_ops_on_a_stage_on_one_rank_or_in_a_program_without_groups_are_named():
    from test_placement import placed

    program = placed()  # stage 1 lives on rank 2 alone
    error = _raised(with_row(program, 2, lambda row: row + [Action(1, ops.RESHARD)]), WellFormedError)
    assert error.message == "1RESHARD drops whole weights, but stage 1 lives on rank 2 alone, not on a group of ranks"
    reduce = [Action(-1, ops.EXCHANGE, 0, -1, (Action(1, ops.SYNC_GRAD),)), Action(-1, ops.EXCHANGE_WAIT, 0)]
    error = _raised(with_row(program, 2, lambda row: row + reduce), WellFormedError)
    assert error.message == ("1SYNC_GRAD reduces a weight gradient over its stage's group, but stage 1 lives on rank "
                             "2 alone, not on a group of ranks")
    plain = compile_target("1f1b", {"P": 2, "N": 4}).program
    for extra, op in (([Action(0, ops.RESHARD)], ops.RESHARD), (reduce, ops.SYNC_GRAD)):
        error = _raised(with_row(plain, 0, lambda row: row + extra), WellFormedError)
        assert error.message.endswith(f": {op} belongs to a stage placed on a group of ranks, and this program "
                                      "places none")
        assert (error.rank, error.step) == (0, len(plain.ranks[0]))
