"""HSDP as a composition: `shard over A` and `replicate over B` on a mesh pp x B x A (``schedules/1f1b_hsdp.pipe``).

Each stage spans the R * S ranks of its pp coordinate; its rows are shared over all of them (member i of the
group in ascending rank order), its weights sharded over the member's shard group (S ranks along A) and
replicated across the R shard groups. GATHER, RESHARD and REDUCE_GRAD meet on the shard group; once the
REDUCE_GRAD's exchange is waited, SYNC_SHARD all-reduces the member's shard of the gradient over its replica
group (R ranks along B). Held here: the language and its located errors, the placement (groups, shares,
lists), the prover's hazards at rank and instruction, bytes per member, traffic and prices on the cost
file's links, the JSON program, and exact runs on 4 gloo processes (P = 1, R = S = 2: every HSDP meeting,
the fewest processes; PP x HSDP with P = 2 needs 8, proved and priced here instead): pipec's runtime, and
torch's runtime on the torch CSV export over FSDP2's fully_shard on the 2-D (ddp, fsdp) mesh.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import pytest
import torch

from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target, lower_spec, resolve_target
from pipec.compiler.emit.torch_csv import installed_torch_runtime, write_torch_csv
from pipec.compiler.emit.json_program import program_from_json, program_to_json
from pipec.compiler.ir import Action, Mesh
from pipec.compiler.memory_counts import peak_bytes
from pipec.compiler.mesh_placement import DataParallel, place_on_mesh
from pipec.compiler.simulate import simulate
from pipec.errors import ConflictError, MatchError, ResolveError, SourceErrors, UsageError, WellFormedError
from pipec.runtime.family import share_of
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import _launch, assert_same_parameters, launch_batch
from source_util import messages
from test_compose_language import at, error_in

import torch_runtime_worker as reference_worker

HSDP = DataParallel("fsdp", sharded=True, reshard_after_forward=True, replicas="ddp")
SIZES = {"activation": 1000, "weight": 4000}


def shipped(**params):
    """``1f1b_hsdp`` lowered (unchecked) with ``params``."""
    return lower_spec(resolve_target("1f1b_hsdp").evaluate(params))[1]


def hsdp(name: str = "1f1b", P: int = 2, R: int = 2, S: int = 2, N: int = 4, axes=("pp", "ddp", "fsdp")):
    sizes = {"pp": P, "ddp": R, "fsdp": S}
    program = compile_target(name, {"P": P, "N": N}).program
    return place_on_mesh(program, Mesh(tuple((axis, sizes[axis]) for axis in axes)), "pp", HSDP)


def texts(program, rank: int) -> list[str]:
    return [action.text() for action in program.ranks[rank]]


def with_row(program, rank: int, change):
    ranks = [list(row) for row in program.ranks]
    ranks[rank] = change(ranks[rank])
    return replace(program, ranks=ranks)


def raised(program, cls):
    with pytest.raises(cls) as caught:
        check_all(program)
    return caught.value


# ------------------------------------------------------------------ the language


def test_the_shipped_file_is_1f1b_placed_with_hybrid_sharding_on_eight_ranks():
    program = shipped()
    params = {"P": 2, "R": 2, "S": 2, "N": 4}
    want = replace(hsdp(), name="1f1b_hsdp", params=params, source=program.source)
    assert program == want and program.num_ranks == 8
    assert program.mesh == Mesh((("pp", 2), ("ddp", 2), ("fsdp", 2)))
    with open(resolve_target("1f1b_hsdp").path) as handle:  # says what it composes, as every shipped one
        text = handle.read()
    assert text.startswith("# ") and "N microbatches" in text.replace("\n#", "") and "8 ranks" in text


def test_the_two_policy_lines_may_come_in_either_order(tmp_path):
    with open(resolve_target("1f1b_hsdp").path) as handle:
        text = handle.read()
    swapped = text.replace("  shard over fsdp reshard after forward\n  replicate over ddp\n",
                           "  replicate over ddp\n  shard over fsdp reshard after forward\n")
    assert swapped != text
    path = tmp_path / "swapped.pipe"
    path.write_text(swapped)
    program = lower_spec(resolve_target(str(path)).evaluate({}))[1]
    assert program.ranks == shipped().ranks and program.stages == shipped().stages


def test_an_axis_of_one_rank_leaves_fsdp_or_dp():
    fsdp = shipped(R=1)  # one shard group: FSDP over fsdp, no shard to all-reduce
    assert all(not info.placement.hybrid and info.placement.sharded for info in fsdp.stages)
    assert not any(ops.SYNC_SHARD in text for text in texts(fsdp, 0)) and "(0REDUCE_GRAD)EXCHANGE0" in texts(fsdp, 0)
    dp = shipped(S=1)  # shard groups of one rank hold whole weights: DP over ddp
    assert all(not info.placement.sharded for info in dp.stages)
    assert "(0SYNC_GRAD)EXCHANGE0" in texts(dp, 0) and not any("GATHER" in text for text in texts(dp, 0))
    for program in (fsdp, dp):
        check_all(program)


GOOD = """\
schedule h(P: int = 2, R: int = 2, S: int = 2, N: microbatches = 4) {
  mesh pp = P, ddp = R, fsdp = S
  pipeline one_f_one_b(P = P, N = N) from "1f1b"
  shard over fsdp
  replicate over ddp
}
"""


@pytest.mark.parametrize("old,new,line,col,message", [
    ("  replicate over ddp\n", "  replicate over ddp\n  shard over ddp\n", 6, 3,
     "a composition has one `shard over`; another is at line 4"),
    ("  replicate over ddp\n", "  replicate over ddp\n  replicate over fsdp\n", 6, 3,
     "a composition has one `replicate over`; another is at line 5"),
    ("replicate over ddp", "replicate over fsdp", 5, 18,
     "axis fsdp has a data policy already (line 4): a hybrid composition shards over one axis and replicates the "
     "shards over another"),
    ("replicate over ddp", "replicate over xp", 5, 18, "xp is not an axis of the mesh (line 2: pp, ddp, fsdp)"),
    ("replicate over ddp", "replicate over pp", 5, 18, "the data axis cannot be the pipeline's axis, pp"),
    ("mesh pp = P, ddp = R, fsdp = S", "mesh pp = P, ddp = R, fsdp = S, cp = 2", 2, 35,
     "axis cp is used by nothing: a hybrid composition runs the pipeline along pp, shards its stages' weights "
     "over fsdp and replicates the shards over ddp"),
    ("  replicate over ddp\n", "", 2, 16,  # a third data axis no policy covers
     "axis ddp is used by nothing: a composition runs the pipeline along pp and replicates, shards or splits the "
     "sequences of its stages over one other axis (fsdp)"),
    ("replicate over ddp", "replicate over ddp reshard after forward", 5, 3,
     "`reshard after forward` drops the weights a sharded stage gathered; a replicated stage keeps its whole "
     "weights (write `shard over ... reshard after forward`)"),
])
def test_a_mistake_in_a_hybrid_composition_is_named_where_it_is_written(tmp_path, old, new, line, col, message):
    assert old in GOOD
    error = error_in(tmp_path, GOOD.replace(old, new, 1), (SourceErrors, ResolveError))
    found = messages(error)
    assert found == [(line, col, message)], found
    for each in (error.errors if isinstance(error, SourceErrors) else [error]):
        at(each, "c.pipe", each.span.line, each.span.col)


# ------------------------------------------------------------------ placement


def test_shard_groups_sit_inside_a_node_and_replica_groups_across_with_fsdp_innermost():
    program = hsdp()
    ranks = lambda ids: [program.communicators[i].ranks for i in ids]  # noqa: E731
    first, second = (info.placement for info in program.stages)
    assert (first.ranks, ranks(first.shard_groups), ranks(first.replica_groups)) == (
        (0, 1, 2, 3), [(0, 1), (2, 3)], [(0, 2), (1, 3)])
    assert (second.ranks, ranks(second.shard_groups), ranks(second.replica_groups)) == (
        (4, 5, 6, 7), [(4, 5), (6, 7)], [(4, 6), (5, 7)])
    assert first.communicator == -1 and [c.purpose for c in program.communicators[:4]] == [
        ops.STAGE_GROUP, ops.STAGE_GROUP, ops.SHARD_REPLICAS, ops.SHARD_REPLICAS]
    # every rank resolves its own groups; rows are shared over the whole group in ascending rank order
    for rank in range(8):
        gather = program.communicator_on(Action(rank // 4, ops.GATHER), rank)
        sync = program.communicator_on(Action(rank // 4, ops.SYNC_SHARD), rank)
        assert rank in gather.ranks and rank in sync.ranks and len(set(gather.ranks) & set(sync.ranks)) == 1
        assert share_of(program, rank) == (rank % 4, 4)


def test_with_ddp_innermost_a_shard_group_is_strided():
    program = hsdp(axes=("pp", "fsdp", "ddp"))
    placement = program.stages[0].placement
    assert [program.communicators[i].ranks for i in placement.shard_groups] == [(0, 2), (1, 3)]
    assert [program.communicators[i].ranks for i in placement.replica_groups] == [(0, 1), (2, 3)]
    check_all(program)


def test_the_shards_all_reduce_follows_the_reduce_scatters_wait():
    row = texts(hsdp(), 4)
    assert row[-4:] == ["1SEND_B3", "EXCHANGE_WAIT0", "(1SYNC_SHARD)EXCHANGE1", "EXCHANGE_WAIT1"]
    assert row.index("(1REDUCE_GRAD)EXCHANGE0") == row.index("(1GATHER3)1B3") + 1
    assert texts(hsdp(), 4)[:4] == texts(hsdp(), 7)[:4] == ["1RECV_F0", "(1GATHER0)1F0", "1B0", "1FREE_F0"]
    assert hsdp().ranks[4][0].peer == 0 and hsdp().ranks[7][0].peer == 3  # the same (ddp, fsdp) coordinate


# ------------------------------------------------------------------ the prover


@pytest.mark.parametrize("name,P,R,S,N", [("1f1b", 2, 2, 2, 4), ("1f1b", 2, 3, 2, 4), ("1f1b", 1, 2, 4, 2),
                                          ("interleaved_1f1b", 2, 2, 2, 4), ("zbv", 2, 2, 2, 4)])
def test_hybrid_compositions_are_proved(name, P, R, S, N):
    check_all(hsdp(name, P, R, S, N))


def test_the_shards_all_reduce_before_the_reduce_scatters_wait_is_named():
    program = hsdp()
    wait = texts(program, 0).index("EXCHANGE_WAIT0")
    moved = with_row(program, 1, lambda row: row[:wait] + [row[wait + 1], row[wait]] + row[wait + 2:])
    error = raised(moved, ConflictError)
    exchange = texts(program, 1).index("(0REDUCE_GRAD)EXCHANGE0")
    assert (error.rank, error.step) == (1, wait)
    assert error.message == (f"(0SYNC_SHARD)EXCHANGE1 all-reduces stage 0's shard gradient before EXCHANGE_WAIT0 "
                             f"waited for (0REDUCE_GRAD)EXCHANGE0 (step {exchange}): it would sum a shard still "
                             "being reduce-scattered (wait for the reduce-scatter first)")


def test_a_shards_all_reduce_missing_unwaited_doubled_or_on_fsdp_is_named():
    program = hsdp()
    row = texts(program, 5)
    sync, wait0 = row.index("(1SYNC_SHARD)EXCHANGE1"), row.index("EXCHANGE_WAIT0")
    missing = raised(with_row(program, 5, lambda r: r[:sync] + r[sync + 2:]), WellFormedError)
    assert (missing.rank, missing.step) == (5, row.index("(1REDUCE_GRAD)EXCHANGE0"))
    assert missing.message.startswith("rank 5 never all-reduces its shard of the weight gradient of stage 1 "
                                      "(hybrid sharded on ranks 4, 5, 6, 7) over the members holding that shard")
    unwaited = raised(with_row(program, 5, lambda r: r[:-1]), MatchError)
    assert (unwaited.rank, unwaited.step) == (5, sync) and "never waits for it (EXCHANGE_WAIT1)" in unwaited.message
    twice = raised(with_row(program, 5, lambda r: r + [Action(-1, ops.EXCHANGE, 2, -1, (Action(1, ops.SYNC_SHARD),)),
                                                       Action(-1, ops.EXCHANGE_WAIT, 2)]), WellFormedError)
    assert (twice.rank, twice.step) == (5, len(row)) and "a second time on rank 5" in twice.message
    fsdp = place_on_mesh(compile_target("1f1b", {"P": 2, "N": 4}).program, Mesh((("pp", 2), ("dp", 2))), "pp",
                         DataParallel("dp", sharded=True))
    stray = raised(with_row(fsdp, 0, lambda r: r + [Action(-1, ops.EXCHANGE, 1, -1, (Action(0, ops.SYNC_SHARD),)),
                                                    Action(-1, ops.EXCHANGE_WAIT, 1)]), WellFormedError)
    assert stray.rank == 0 and "only a hybrid sharded stage (HSDP) replicates its shards" in stray.message
    assert wait0 < sync


def test_replica_groups_meeting_in_different_orders_are_named_at_the_meeting():
    # interleaved 1F1B: pp rank 1 holds stages 1 and 3; rank 6 all-reduces stage 3's shard before stage 1's,
    # rank 4 (its replica-group peer) after
    # (both reduce-scatters waited first, so that each all-reduce still follows its own reduce-scatter's wait)
    program = hsdp("interleaved_1f1b")
    row = texts(program, 6)
    assert row[-6:] == ["EXCHANGE_WAIT0", "(3SYNC_SHARD)EXCHANGE2", "EXCHANGE_WAIT1", "(1SYNC_SHARD)EXCHANGE3",
                        "EXCHANGE_WAIT2", "EXCHANGE_WAIT3"]
    end = len(row) - 6
    swapped = with_row(program, 6, lambda r: r[:end] + [r[end], r[end + 2], r[end + 3], r[end + 1]] + r[end + 4:])
    error = raised(swapped, MatchError)
    replicas = program.communicator_on(Action(1, ops.SYNC_SHARD), 6)
    assert (error.rank, error.step, error.marks) == (6, end + 2, [(4, end + 1)])
    assert error.message == (f"the 1st collective on communicator {replicas.id} ({ops.SHARD_REPLICAS} 1: ranks 4, "
                             f"6) is 1SYNC_SHARD here but 3SYNC_SHARD on rank 4 (step {end + 1}): every member must "
                             "meet its collectives in the same order")


def test_replica_groups_that_do_not_cross_the_shard_groups_are_named():
    program = hsdp()
    placement = program.stages[0].placement
    bad = replace(program.stages[0], placement=replace(placement, replica_groups=placement.shard_groups))
    error = raised(replace(program, stages=[bad, program.stages[1]]), WellFormedError)
    assert error.rank == 0 and "its replica groups [0, 1] are not communicators of purpose" in error.message


def test_the_program_file_keeps_the_groups():
    program = shipped()
    again = program_from_json(json.loads(json.dumps(program_to_json(program))))
    assert again.stages == program.stages and again.communicators == program.communicators
    assert again.ranks == program.ranks
    check_all(again)


# ------------------------------------------------------------------ memory, traffic, prices


def test_bytes_per_member_are_the_hand_count():
    # rank 0 (pp 0): two in-flight microbatches of which it holds a quarter (R * S = 4 share the rows),
    # one stage's whole weights while gathered, its shard of W / S = 4000 / 2 always; rank 4 one microbatch
    peaks = peak_bytes(shipped(), SIZES)
    assert peaks[0] == {"activation": 500, "weight": 4000, "shard": 2000}
    assert peaks[4] == {"activation": 250, "weight": 4000, "shard": 2000}


def test_traffic_per_link_class_is_the_hand_count():
    # P = R = S = 2, N = 4, nodes of 2 ranks: a shard group is a node, a replica group spans two, and the
    # pipeline crosses nodes. act, grad: 4 microbatches x 4 members x 1000 / 4 = 4000 each, inter. A ring of
    # 2 over a shard group: a GATHER moves (S - 1) W = 4000, twice per stage (reshard after forward), on each
    # of 2 shard groups of 2 stages: 32000; REDUCE_GRAD (S - 1) W = 4000 once: 16000, intra. SYNC_SHARD
    # all-reduces a shard of W / S = 2000 over 2 ranks: 2 (R - 1) x 2000 = 4000 per replica group, 4 groups,
    # 16000, inter.
    costs = costs_from_json({"sizes": SIZES, "links": {"node_size": 2}})
    assert simulate(shipped(), costs).traffic == {
        "act": {"intra": 0, "inter": 4000}, "grad": {"intra": 0, "inter": 4000},
        "wgrad": {"intra": 16000, "inter": 0}, "weight": {"intra": 32000, "inter": 0},
        "shard": {"intra": 0, "inter": 16000}}


@pytest.mark.parametrize("inter,took", [(None, 5), (5, 10)])
def test_the_shards_all_reduce_is_a_ring_over_the_replica_group_on_its_links(inter, took):
    # shard = 100 / 2 = 50 bytes; an all-reduce of 2 ranks moves 2 (n - 1) / n = 1 shard over each link:
    # 50 / 10 = 5 on a link of bandwidth 10; across nodes of bandwidth 5, 10
    links = {"bandwidth": 10, "node_size": 2}
    if inter:
        links["inter_node"] = {"bandwidth": inter}
    result = simulate(shipped(), costs_from_json({"links": links, "sizes": {"activation": 40, "weight": 100}}))
    for rank in range(8):
        (slot,) = [s for s in result.timeline[rank] if s.is_comm and s.action.op == ops.SYNC_SHARD]
        assert slot.end - slot.start == took


# ------------------------------------------------------------------ torch's runtime over FSDP2's HSDP

TORCH_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_hsdp_worker.py")


def test_torchs_csv_is_fsdps_with_the_shards_all_reduce_inside_reduce_grad():
    # FSDP2's fully_shard on the (ddp, fsdp) sub-mesh reduce-scatters and then all-reduces in its REDUCE_GRAD:
    # the row is PP x FSDP's (the SYNC_SHARD exchange writes nothing)
    fsdp = place_on_mesh(compile_target("1f1b", {"P": 2, "N": 4}).program, Mesh((("pp", 2), ("dp", 2))), "pp",
                         DataParallel("dp", sharded=True, reshard_after_forward=True))
    for comms in (True, False):
        assert write_torch_csv(shipped(), with_comms=comms) == write_torch_csv(fsdp, with_comms=comms)
    crossing = with_row(shipped(), 4, lambda r: [a._replace(peer=2) if a.op == ops.RECV_F else a for a in r])
    with pytest.raises(UsageError, match=r"rank 4, step 0: 1RECV_F0 goes to rank 2 at ddp 1, fsdp 0, but rank 4 is "
                                         r"at ddp 0, fsdp 0; .* pp group of one ddp x fsdp coordinate"):
        write_torch_csv(crossing, with_comms=True)


@pytest.mark.skipif(not getattr(installed_torch_runtime(), "reduce_grad", False),
                    reason="the installed torch's runtime has no REDUCE_GRAD/UNSHARD (torch < 2.10)")
def test_torchs_runtime_trains_the_hsdp_export_like_one_process(tmp_path):
    # P = 1, R = S = 2 on 4 gloo processes; torch_runtime_worker's batch of 8 rows in N = 2 microbatches:
    # a row for each of the 4 members. FSDP2 gathers at each UNSHARD and reduces once per step.
    program = shipped(P=1, N=2)
    path = tmp_path / "hsdp.csv"
    path.write_text(write_torch_csv(program, with_comms=True, for_torch=installed_torch_runtime()))
    done = _launch([sys.executable, TORCH_WORKER, str(path), "1", "2", "2", "2"], 4, 240.0, None)
    assert done.ok, done.describe()
    grads, params = reference_worker.reference(1)
    for rank in range(4):
        result = torch.load(f"{path}.rank{rank}.pt")
        assert set(result["params"]) == set(params)
        for key, value in result["params"].items():
            torch.testing.assert_close(value, params[key], atol=1e-5, rtol=0, msg=f"rank {rank}: {key}")
            for step, step_grads in enumerate(result["grads"]):
                torch.testing.assert_close(step_grads[key], grads[step][key], atol=1e-5, rtol=0,
                                           msg=f"rank {rank}: step {step} gradient of {key}")
        assert result["collectives"] == {"gather": 2, "reduce": 1}


# ------------------------------------------------------------------ exact runs, one set of 4 processes

STEPS, SEED, N = 3, 7, 4
CONFIG = ["--config", "microbatch_size=4"]  # 4 rows per microbatch: a row for each of the 4 members
STRIDED = """\
# HSDP with the replica axis innermost: each shard group is strided (ranks 0, 2 and 1, 3).
schedule strided(P: int = 1, R: int = 2, S: int = 2, N: microbatches = 4) {
  mesh pp = P, fsdp = S, ddp = R
  pipeline one_f_one_b(P = P, N = N) from "1f1b"
  shard over fsdp
  replicate over ddp
}
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hsdp_runtime")
    (folder / "strided.pipe").write_text(STRIDED)
    common = ["-D", "P=1", "-D", f"N={N}", "--steps", str(STEPS), "--seed", str(SEED), "--timeout", "90", *CONFIG]
    jobs = [["1f1b_hsdp", *common, "--save", str(folder / "hsdp-{step}.pt"), "--save-every", "2"],
            ["1f1b_hsdp", *common, "--save", str(folder / "clip.pt"), "--clip-grad-norm", "0.5"],
            [str(folder / "strided.pipe"), *common, "--save", str(folder / "strided.pt")],
            ["1f1b_hsdp", *common, "--save", str(folder / "resumed.pt"), "--resume", str(folder / "hsdp-2.pt")]]
    run = launch_batch(jobs, 4, 300.0)
    assert run.ok, run.describe()
    return folder


@pytest.mark.parametrize("name,clip", [("hsdp-3", None), ("clip", 0.5), ("strided", None), ("resumed", None)])
def test_hsdp_trains_like_one_process(trained, name, clip):
    want = reference_run(ModelConfig(microbatch_size=4), STEPS, N, SEED, clip_grad_norm=clip).state_dict
    saved = torch.load(trained / f"{name}.pt", weights_only=True)
    assert_same_parameters(saved, want, name)
    initial = reference_run(ModelConfig(microbatch_size=4), 0, 1, SEED).state_dict
    assert any((want[k] - initial[k]).abs().max() > 1e-3 for k in initial)
    assert os.path.exists(trained / "hsdp-2.pt")
