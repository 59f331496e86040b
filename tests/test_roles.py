"""What runs is what is proven: every member's roles written in the program, proven, and read by the runtime.

A stage placed on a group states each member's share of the microbatches, its shard of the weights and the
member that saves the stage (``ir.Placement``); the prover proves them (``checks/placement.py``), orders every
operation of a communicator, a context-parallel stage's ring included (``checks/symbolic.py``), and proves the
mesh against the placements (``checks/mesh.py``). Each class of hazard a user can write into a program file is
refused with the communicator or stage, the rank, the instruction and the reason; and a program whose roles are
not the plain ones (a stage whose members take their shares the other way round, with the hand-offs following)
is proved and trains to the parameters of a plain one-process torch loop, so the runtime reads the roles it
was given instead of deriving them.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import payload_model
from pipec.cli import main
from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.driver import compile_target
from pipec.compiler.emit.json_program import program_from_json, program_to_json, write_program_json
from pipec.compiler.ir import Action
from pipec.compiler.simulate import simulate
from pipec.errors import MatchError, WellFormedError
from pipec.runtime.model import LLAMA, ModelConfig
from runtime_util import assert_same_parameters, launch_batch


def compiled(name: str, **params):
    return compile_target(name, {key: str(value) for key, value in params.items()}).program


def through_file(program, change):
    """``program`` written as its JSON file, edited by ``change`` (as a user edits one), and read back."""
    data = json.loads(json.dumps(program_to_json(program)))
    change(data)
    return program_from_json(data)


def refused(program, cls):
    with pytest.raises(cls) as caught:
        check_all(program)
    return caught.value


# ------------------------------------------------------------------ the hazards, one of each class


def test_a_replica_group_joining_holders_of_different_shards_is_refused_naming_its_communicator():
    program = compiled("1f1b_hsdp", P=1)  # 4 ranks: shard groups (0, 1), (2, 3); replica groups (0, 2), (1, 3)

    def cross(data):  # replica groups that still cross every shard group once, but join shard 0 with shard 1
        for entry in data["stages"]:
            entry["placement"].pop("shards")  # a file written before roles: the plain shards are read
        data["communicators"][2]["ranks"], data["communicators"][3]["ranks"] = [0, 3], [1, 2]

    error = refused(through_file(program, cross), WellFormedError)
    assert error.rank == 3
    assert error.message == (f"communicator 2 ({ops.SHARD_REPLICAS} 0: ranks 0, 3) all-reduces the shard of the weights "
                             "of stage 0 (on ranks 0, 1, 2, 3) that its members hold (SYNC_SHARD), but rank 0 holds "
                             "shard 0 and rank 3 shard 1: a replica group joins holders of the same shard (it would sum "
                             "different pieces of the weights)")


def test_a_rank_that_takes_different_shares_in_two_stages_is_refused():
    program = compiled("zbv_dp")  # rank 0 is in stage 0 and stage 3, both on ranks 0, 1

    def other_way(data):
        data["stages"][3]["placement"]["shares"] = [1, 0]
        data.pop("mesh")  # without a mesh, so that the mesh's own check does not name it first

    error = refused(through_file(program, other_way), WellFormedError)
    assert error.rank == 0
    assert error.message == ("rank 0 takes share 1 of 2 of every microbatch in stage 3 (on ranks 0, 1), but share 0 "
                             "of 2 in stage 0: a rank takes one share in all its stages (it reads its rows, or "
                             "tokens, and its loss's targets once), so its roles must agree")


def reduction_moved(program, rank: int):
    """``program`` with ``rank`` posting stage 2's gradient all-reduce (SYNC_GRAD) right after 0B2 (its other
    members post it after 2B3, before 0B2); and the step of 0B2 on ``rank``."""
    row = list(program.ranks[rank])
    reduction = next(a for a in row if a.op == ops.EXCHANGE and a.parts[0].op == ops.SYNC_GRAD
                     and a.parts[0].stage == 2)
    row.remove(reduction)
    step = [a.text() for a in row].index("0B2")
    row.insert(step + 1, reduction)
    return replace(program, ranks=[*program.ranks[:rank], row, *program.ranks[rank + 1:]]), step


def test_a_gradient_reduction_moved_across_a_ring_on_one_member_of_a_context_parallel_stage_is_refused():
    # interleaved 1F1B x CP: stages 0 and 2 share the group (0, 1) and its communicator, where the rings of
    # their computes run beside their gradients' all-reduces; rank 1 posts stage 2's all-reduce after 0B2
    program, step = reduction_moved(compiled("interleaved_1f1b_cp"), 1)
    error = refused(program, MatchError)
    assert (error.rank, error.step) == (1, step)
    assert error.message.startswith(f"the 15th collective on communicator 0 ({ops.STAGE_GROUP} 0: ranks 0, 1) is 0B2 "
                                    "(the stage ring of 0B2 over its group (ranks 0, 1)) here but 2SYNC_GRAD on rank 0 "
                                    "(step 40): every member must meet its collectives in the same order")


TASP_CP = """\
schedule interleaved_tasp(P: int = 2, C: int = 3, N: microbatches = 4, v: chunks = 2) {
  mesh pp = P, cp = C
  pipeline interleaved_1f1b(P = P, N = N, v = v) from "interleaved_1f1b"
  context over cp ring "tasp"
}
"""


def test_under_tasp_a_reduction_crossing_a_rings_all_to_all_is_refused(tmp_path):
    # TASP's ring is an all_to_all on the group's communicator (gloo and NCCL match it with the all-reduce)
    path = tmp_path / "interleaved_tasp.pipe"
    path.write_text(TASP_CP)
    program = compile_target(str(path)).program
    check_all(program)
    error = refused(reduction_moved(program, 2)[0], MatchError)
    assert error.rank == 2 and "0B2 (the stage ring of 0B2 over its group (ranks 0, 1, 2))" in error.message
    assert "communicator 0" in error.message and "2SYNC_GRAD on rank" in error.message


def test_a_mesh_that_contradicts_the_placements_is_refused_naming_the_first_rank():
    program = compiled("1f1b_cp")

    def permute(data):
        data["mesh"] = data["mesh"][::-1]  # cp outermost: ranks 0, 1 would be pp 0 and pp 1

    error = refused(through_file(program, permute), WellFormedError)
    assert error.rank == 1
    assert error.message == ("the mesh (cp 2 x pp 2) contradicts the placements: rank 1 is at cp 0, pp 1 and is one "
                             "of the ranks stage 0 is placed on (0, 1), but a stage's group is every rank at one pp "
                             "coordinate, and the ranks at pp 0 are 0, 2")


def test_a_mesh_whose_coordinates_do_not_say_a_members_share_is_refused():
    program = compiled("1f1b_dp")
    stage = program.stages[1]
    swapped = replace(stage, placement=replace(stage.placement, shares=(1, 0)))
    error = refused(replace(program, stages=[program.stages[0], swapped]), WellFormedError)
    assert error.rank == 2
    assert error.message.startswith("the mesh (pp 2 x dp 2) contradicts the roles: rank 2 is at pp 1, dp 0, place 0 "
                                    "of stage 1's group along dp, but takes share 1 of its values")


def test_a_parameter_that_no_rank_saves_is_refused():
    program = compiled("1f1b_dp")

    def nobody(data):
        data["stages"][1]["placement"]["saver"] = 0  # rank 0 holds stage 0 only

    error = refused(through_file(program, nobody), WellFormedError)
    assert error.rank == 2
    assert error.message == ("stage 1 (on ranks 2, 3) is saved by rank 0, which is not one of its members: no rank "
                             "saves its parameters (a checkpoint would lack chunk 1)")


@pytest.mark.parametrize("shares,words", [((0, 0), "gives its members the shares [0, 0]"),
                                          ((0, 2), "gives its members the shares [0, 2]")])
def test_shares_that_do_not_cut_every_microbatch_once_are_refused(shares, words):
    program = compiled("1f1b_dp")
    stage = program.stages[0]
    program = replace(program, mesh=None,
                      stages=[replace(stage, placement=replace(stage.placement, shares=shares)), program.stages[1]])
    assert words in refused(program, WellFormedError).message


def test_a_shard_that_is_not_the_members_place_in_its_gather_is_refused():
    program = compiled("1f1b_fsdp")
    stage = program.stages[0]
    program = replace(program, stages=[replace(stage, placement=replace(stage.placement, shards=(1, 0))),
                                       program.stages[1]])
    error = refused(program, WellFormedError)
    assert error.rank == 0 and error.message.startswith(
        f"rank 0 holds shard 1 of the weights of stage 0 (on ranks 0, 1), but is member 0 of communicator 0 "
        f"({ops.STAGE_GROUP} 0: ranks 0, 1), where they are gathered")


def test_the_cli_names_a_hazard_in_a_program_file(tmp_path, capsys):
    path = tmp_path / "crossed.json"
    program = through_file(compiled("1f1b_hsdp", P=1), lambda data: data["communicators"][2].update(ranks=[0, 3])
                           or data["communicators"][3].update(ranks=[1, 2]))
    with open(path, "w") as out:
        write_program_json(program, out)
    assert main(["check", str(path)]) == 1
    assert "a replica group joins holders of the same shard" in capsys.readouterr().err


def test_the_roles_are_in_the_program_file_and_read_back():
    for name in ("1f1b_dp", "1f1b_fsdp", "1f1b_cp"):
        program = compiled(name)
        data = program_to_json(program)
        assert all({"shares", "saver"} <= set(entry["placement"]) for entry in data["stages"])
        assert program_from_json(json.loads(json.dumps(data))) == program
    hsdp = program_to_json(compiled("1f1b_hsdp", P=1))["stages"][0]["placement"]
    assert (hsdp["shares"], hsdp["shards"], hsdp["saver"]) == ([0, 1, 2, 3], [0, 1, 0, 1], 0)


# ------------------------------------------------------------------ stated roles, trained

STEPS, SEED, N, ROWS = 3, 7, 4, 4
PEERS = {0: {2: 3, 3: 2}, 1: {2: 3, 3: 2}, 2: {0: 1}, 3: {1: 0}}  # rank -> its hand-offs' new peers


def turned(saver: int) -> object:
    """1f1b_dp (P = 2, D = 2) without its mesh, stage 1's members taking their shares the other way round
    (rank 2 share 1, rank 3 share 0) and every hand-off going to the holder of the same share; stage 0
    saved by ``saver``."""
    program = compiled("1f1b_dp", N=N)
    first, second = program.stages

    def moved(action: Action, rank: int) -> Action:
        parts = tuple(moved(part, rank) for part in action.parts)
        return action._replace(peer=PEERS[rank].get(action.peer, action.peer), parts=parts)

    return replace(program, mesh=None,
                   stages=[replace(first, placement=replace(first.placement, saver=saver)),
                           replace(second, placement=replace(second.placement, shares=(1, 0)))],
                   ranks=[[moved(a, rank) for a in row] for rank, row in enumerate(program.ranks)])


def test_hand_offs_that_do_not_follow_the_stated_shares_are_refused():
    program = turned(saver=0)
    check_all(program)
    plain = compiled("1f1b_dp", N=N)
    error = refused(replace(program, ranks=plain.ranks), MatchError)
    assert (error.rank, error.step) == (0, 1)
    assert error.message == ("0SEND_F0 sends rank 0's share of the activation of 0F0 to rank 2, but stage 1 (on ranks "
                             "2, 3) takes that share on rank 3")


def test_the_simulator_hands_each_share_to_its_stated_holder():
    # the hand-offs follow the shares, so the turned program's timeline is the plain one's, rank by rank
    turned_run, plain_run = simulate(turned(saver=0)), simulate(compiled("1f1b_dp", N=N))
    assert turned_run.makespan == plain_run.makespan == 7.5  # PP2 x DP2 1F1B, N = 4: half of the 15 of P = 2
    assert [r.busy for r in turned_run.ranks] == [r.busy for r in plain_run.ranks]


def own_communicators():
    """interleaved_1f1b_cp (P = C = 2) with stages 2 and 3 meeting on communicators of their own (the same ranks
    as stages 0 and 1), and rank 1 posting stage 2's gradient all-reduce after 0B2, across stage 0's ring: on
    another communicator than that ring's, so the prover accepts it. The prover counts each stage's ring on the
    stage's own communicator, and the runtime runs it there (``placed.StageRing.contexts``)."""
    program = compiled("interleaved_1f1b_cp", N=N)
    groups = [*program.communicators, *(replace(c, id=len(program.communicators) + i, key=c.key + 2)
                                        for i, c in enumerate(program.communicators))]
    stages = [info if info.id < 2 else replace(info, placement=replace(info.placement,
                                                                       communicator=info.placement.communicator + 2))
              for info in program.stages]
    return reduction_moved(replace(program, communicators=groups, stages=stages), 1)[0]


def test_a_reduction_on_another_communicator_may_cross_a_ring():
    check_all(own_communicators())
    error = refused(reduction_moved(compiled("interleaved_1f1b_cp", N=N), 1)[0], MatchError)  # one communicator
    assert "2SYNC_GRAD" in error.message


def one_process(spec, config, rows: int, clip: float | None = None) -> dict[str, torch.Tensor]:
    """The same training written as a plain torch loop: ``spec``'s whole model, N microbatches of ``rows`` rows of
    each step's batch, each microbatch's loss over N, the spec's optimizer, the gradients' norm clipped."""
    model = spec.build_model(config, SEED)
    optimizer = spec.make_optimizer(model.parameters())
    for step in range(STEPS):
        inputs, targets = spec.synthetic_batch(config, step, N, SEED)
        optimizer.zero_grad()
        for m in range(N):
            part = slice(m * rows, (m + 1) * rows)
            (spec.loss_fn(model(inputs[part]), targets[part]) / N).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {name: value.detach() for name, value in model.state_dict().items()}


def test_stated_roles_train_like_a_plain_torch_loop(tmp_path):
    config = replace(payload_model.Config(), rows=ROWS)
    cases = {"turned": (turned(0), ["--model", "payload_model:SPEC", "--config", f"rows={ROWS}"]),
             "turned-saved-by-1-clipped": (turned(1), ["--model", "payload_model:SPEC", "--config", f"rows={ROWS}",
                                                       "--clip-grad-norm", "0.5"]),
             "cp-own-communicators": (own_communicators(), [])}
    jobs = []
    for name, (program, extra) in cases.items():
        path = tmp_path / f"{name}.json"
        with open(path, "w") as out:
            write_program_json(program, out)
        jobs.append(["1f1b", "--program", str(path), "--steps", str(STEPS), "--seed", str(SEED), "--timeout", "90",
                     "--save", str(tmp_path / f"{name}.pt"), *extra])
    run = launch_batch(jobs, 4, 300.0)
    assert run.ok, run.describe()
    llama = ModelConfig()
    wanted = {"turned": one_process(payload_model.SPEC, config, ROWS),
              "turned-saved-by-1-clipped": one_process(payload_model.SPEC, config, ROWS, clip=0.5),
              "cp-own-communicators": one_process(LLAMA, llama, llama.microbatch_size)}
    for name, want in wanted.items():
        saved = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert_same_parameters(saved, want, name)
    initial = payload_model.build_model(config, SEED).state_dict()
    assert any((wanted["turned"][k] - initial[k]).abs().max() > 1e-3 for k in initial)
