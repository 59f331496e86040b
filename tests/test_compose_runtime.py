"""Exactness of the runtime on composed programs: pipeline stages on data-parallel and fully sharded groups.

A pipeline program of 2 ranks placed on a mesh pp = 2 x dp = 2 (``mesh_placement.place_on_mesh``) runs on 4
gloo worker processes for three steps; member i of each stage's group runs every microbatch on share
i of its rows and weighs its loss by 1/2, replicated stages all-reduce their gradients (SYNC_GRAD),
sharded ones keep a shard, gather it before a compute (GATHER), drop the whole weights (RESHARD) and
reduce-scatter their gradients (REDUCE_GRAD). The saved model must be within 1e-5 of one process
trained with the same N (``reference_run``): PP2 x DP2 under 1f1b and zbv, PP2 x FSDP2 under 1f1b with
and without reshard after forward, with the built-in model and a user's model spec (a hidden state
and a mask, ``tests/payload_model.py``), clipped, and resumed from a checkpoint of step 2.

The programs are written to program files and read with ``--program`` (the ``.pipe`` compositions
come with the language); every run shares one set of 4 processes (``launch_batch``), which calls the
worker's ``make_plan`` and ``train`` as ``pipec run``'s workers do, but without rank 0's ``check_all``
of the file.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import payload_model
from pipec.compiler import ops
from pipec.compiler.mesh_placement import DataParallel, place_on_mesh
from pipec.compiler.driver import compile_target
from pipec.compiler.emit.json_program import write_program_json
from pipec.compiler.ir import Action, Mesh
from pipec.compiler.checks import check_all
from pipec.errors import ProgramError, UsageError
from pipec.runtime import worker
from pipec.runtime.interpreter import make_context
from pipec.runtime.model import ModelConfig, loss_fn, make_optimizer
from pipec.runtime.reference import reference_run
from runtime_util import TESTS, assert_same_parameters, launch_batch, launch_workers, save_path, train_saved_batch

STEPS = 3
SEED = 7
N = 4
WORLD = 4
# Hard limit of the batch of runs (nine trainings on a loaded 2-core machine); a hang fails instead.
BATCH_DEADLINE_S = 420.0
MESH = Mesh((("pp", 2), ("dp", 2)))
USER_CONFIG = ["--config", "rows=4"]  # 4 rows per microbatch: two shares of 2

# name -> (schedule, sharded, reshard_after_forward, model, extra worker arguments)
CASES = {
    "1f1b-dp": ("1f1b", False, False, None, []),
    "zbv-dp": ("zbv", False, False, None, []),
    "1f1b-fsdp": ("1f1b", True, True, None, ["--trace", "{folder}/1f1b-fsdp.trace.json"]),
    "1f1b-fsdp-keep": ("1f1b", True, False, None, []),
    "1f1b-fsdp-user": ("1f1b", True, True, "payload_model:PROBED", [*USER_CONFIG, "--config", "form=dict"]),
    "zbv-dp-user": ("zbv", False, False, "payload_model:SPEC", USER_CONFIG),
    "1f1b-fsdp-clip": ("1f1b", True, True, None, ["--clip-grad-norm", "0.5"]),
    "1f1b-dp-user": ("1f1b", False, False, "payload_model:SPEC", USER_CONFIG),
    "1f1b-zero2-user": ("1f1b", True, False, "payload_model:SPEC", USER_CONFIG),
    # an order per rank: the dp 0 replica runs 1F1B, the dp 1 replica GPipe (``composed``)
    "1f1b+gpipe-dp": ("1f1b+gpipe", False, False, None, []),
}
# Resumed runs: name -> the case whose step-2 checkpoint they go on from (those cases save every 2 steps).
RESUMED = {"1f1b-fsdp-resumed": "1f1b-fsdp", "1f1b-dp-resumed": "1f1b-dp"}


def composed(schedule: str, sharded: bool, reshard_after_forward: bool):
    """``schedule`` at P = 2, N = 4 on the 2 x 2 mesh, its stages replicated or sharded over dp; ``A+B``: the
    members at dp 0 run A's lists and those at dp 1 B's (an order per rank, as a program file may hold)."""
    placed = [place_on_mesh(compile_target(name, {"P": "2", "N": str(N)}).program, MESH, "pp",
                            DataParallel("dp", sharded, reshard_after_forward)) for name in schedule.split("+")]
    rows = [placed[min(MESH.coords(rank)["dp"], len(placed) - 1)].ranks[rank] for rank in range(WORLD)]
    return replace(placed[0], ranks=rows)


def _save(folder, name: str) -> str:
    return str(save_path(folder, name, RESUMED, STEPS, pattern=True))


def _job(folder, name: str, case) -> list[str]:
    schedule, sharded, after, model, extra = case
    program_file = folder / f"{name}.json"
    if not program_file.exists():
        with open(program_file, "w") as out:
            write_program_json(composed(schedule, sharded, after), out)
    model_args = ["--model", model] if model else []
    every = ["--save-every", "2"] if name in RESUMED.values() else []
    return [schedule.split("+")[0], "--program", str(program_file), "--steps", str(STEPS), "--seed", str(SEED), "--timeout", "90",
            "--save", _save(folder, name), *every, *model_args, *[a.format(folder=folder) for a in extra]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every case and resumed run in one set of 4 processes; (folder, the WorkerRun)."""
    folder = tmp_path_factory.mktemp("compose_runtime")
    run = train_saved_batch(folder, [_job(folder, name, case) for name, case in CASES.items()], RESUMED,
                            {name: case[0] for name, case in CASES.items()},
                            STEPS, WORLD, BATCH_DEADLINE_S)
    return folder, run


def _saved(folder, name: str) -> dict:
    return torch.load(save_path(folder, name, RESUMED, STEPS), weights_only=True)


def _reference(name: str) -> dict:
    _, _, _, model, extra = CASES[RESUMED.get(name, name)]
    clip = 0.5 if name.endswith("-clip") else None
    if model is None:
        return reference_run(ModelConfig(), STEPS, N, SEED, clip_grad_norm=clip).state_dict
    form = "dict" if "form=dict" in extra else "tuple"
    spec = getattr(payload_model, model.split(":")[1])
    return reference_run(payload_model.Config(rows=4, form=form), STEPS, N, SEED, spec).state_dict


@pytest.mark.parametrize("name", [*CASES, *RESUMED])
def test_a_composed_program_trains_like_one_process(trained, name):
    folder, _ = trained
    want = _reference(name)
    assert_same_parameters(_saved(folder, name), want, name)


def test_the_runs_trained(trained):
    """The reference moved away from the initial model (so matching it is not matching an untrained one),
    and rank 0 printed one process's losses: every member's share of the loss reached the reduce."""
    folder, run = trained
    initial = reference_run(ModelConfig(), 0, 1, SEED).state_dict
    want = reference_run(ModelConfig(), STEPS, N, SEED)
    assert any((want.state_dict[k] - initial[k]).abs().max() > 1e-3 for k in initial)
    printed = [float(line.split()[-1]) for line in run.stdout[0].splitlines() if line.startswith("step ")][:STEPS]
    assert printed == pytest.approx(want.losses, abs=2e-6)


def test_an_order_per_rank_is_a_program_file_that_pipec_run_checks_and_launches(tmp_path):
    """Members of one group may run different orders (here 1F1B on the dp 0 replica, GPipe on dp 1: each meets
    its group only in its stage's all-reduce): the prover accepts the lists, the batch above trains them to one
    process's parameters, and ``pipec run FILE.json`` reads the file, checks it and starts its 4 workers."""
    from pipec.cli import build_parser
    from pipec.commands.run import check_before_launch

    program = composed("1f1b+gpipe", False, False)
    assert program.ranks[0] != program.ranks[1]  # not one order for the group
    path = tmp_path / "mixed.json"
    with open(path, "w") as out:
        write_program_json(program, out)
    checked, nproc = check_before_launch(build_parser().parse_args(["run", str(path), "--steps", "1"]))
    assert (checked.ranks, nproc) == (program.ranks, WORLD)
    with pytest.raises(UsageError, match="-D sets parameters of a .pipe schedule"):
        check_before_launch(build_parser().parse_args(["run", str(path), "-D", "N=8"]))
    broken = replace(program, ranks=[program.ranks[0][1:], *program.ranks[1:]])
    with open(path, "w") as out:
        write_program_json(broken, out)
    with pytest.raises(ProgramError):  # proved before any worker starts, as a compiled target is
        check_before_launch(build_parser().parse_args(["run", str(path)]))


def test_the_trace_records_the_group_steps(trained):
    folder, _ = trained
    with open(folder / "1f1b-fsdp.trace.json") as handle:
        events = json.load(handle)["traceEvents"]
    names = {(event["pid"], event["name"]) for event in events if event.get("ph") == "X"}
    for rank in range(WORLD):
        stage = rank // 2
        for text in (f"({stage}GATHER0){stage}F0", f"{stage}RESHARD", f"({stage}REDUCE_GRAD)EXCHANGE0",
                     "EXCHANGE_WAIT0"):
            assert (rank, text) in names, (rank, text, sorted(n for p, n in names if p == rank)[:40])


def test_the_worker_command_line_checks_and_trains_a_composed_program(tmp_path):
    """``python -m pipec.runtime --program FILE``, as ``pipec run``'s workers: rank 0 proves the file first."""
    program = composed("1f1b", True, False)
    check_all(program, semantics="rendezvous")  # what rank 0 proves before any worker trains
    path, save = tmp_path / "program.json", tmp_path / "model.pt"
    with open(path, "w") as out:
        write_program_json(program, out)
    run = launch_workers(["1f1b", "--program", str(path), "--steps", str(STEPS), "--seed", str(SEED),
                          "--timeout", "90", "--save", str(save)], WORLD, 240.0)
    assert run.ok, run.describe()
    assert_same_parameters(torch.load(save, weights_only=True), _reference("1f1b-fsdp-keep"), "1f1b FSDP via the CLI")


def test_a_member_that_stops_inside_a_gather_is_named_not_waited_for(tmp_path):
    """Rank 1 exits before its first instruction, ``(0GATHER0)0F0``: rank 0, its group's other member, ends at
    that sub-step's all-gather with a fault naming the sub-step and rank 1, and no rank hangs."""
    path = tmp_path / "program.json"
    with open(path, "w") as out:
        write_program_json(composed("1f1b", True, True), out)
    run = launch_batch([["1f1b", "--program", str(path), "--steps", "1", "--timeout", "5", "--inject", "exit:1:0"]],
                       WORLD, 180.0)
    assert not run.timed_out and all(code != 0 for code in run.returncodes), run.describe()
    assert "rank 0, step 0 (0GATHER0, a sub-step of (0GATHER0)0F0): waited" in run.stderr[0], run.describe()
    assert "for rank 1" in run.stderr[0], run.describe()


# ------------------------------------------------------------------ refusals, in one process


def _plan(tmp_path, program, *args):
    path = tmp_path / "program.json"
    with open(path, "w") as out:
        write_program_json(program, out)
    config = worker.parse_run_config(["1f1b", "--program", str(path), *args])
    return worker.make_plan(config, WORLD)


@pytest.mark.parametrize("model", ["payload_model:SPEC", "payload_model:PROBED"])
def test_rows_that_do_not_split_into_the_shares_are_refused_before_the_start(tmp_path, monkeypatch, model):
    monkeypatch.syspath_prepend(TESTS)
    with pytest.raises(UsageError, match=r"split.* into the 2 .*shares"):
        _plan(tmp_path, composed("1f1b", True, True), "--model", model, "--config", "rows=3")


def test_a_placed_program_of_unequal_groups_is_refused_by_name(tmp_path):
    program = composed("1f1b", False, False)
    lone = replace(program.stages[1], rank=2, placement=None)
    program = replace(program, stages=[program.stages[0], lone])
    with pytest.raises(UsageError, match="groups of different sizes"):
        _plan(tmp_path, program)


def test_a_group_op_in_a_plain_program_is_refused_before_the_start():
    program = compile_target("1f1b", {"P": "2", "N": "2"}).program
    row = list(program.ranks[0])
    row.insert(3, Action(0, ops.RESHARD))
    program = replace(program, ranks=[row, program.ranks[1]])
    config = ModelConfig(layers=2)
    from pipec.runtime.model import build_chunk

    with pytest.raises(ProgramError, match="RESHARD' belongs to stages placed on rank groups"):
        make_context(program, 0, {0: build_chunk(config, 0, 2, SEED)}, loss_fn=loss_fn,
                     make_optimizer=make_optimizer, activation_shape=(2, 16, 32))


# ------------------------------------------------------------------ a sharded stage's storage, in one process


def test_a_reshard_frees_the_whole_weights_and_a_gather_brings_them_back_for_the_backward():
    """What RESHARD and GATHER do to one member's module (a group of one, the gather played by a copy): the
    storage of the whole weights, the parameters' and what the forward saved for its backward alike, is
    freed; filled again, the backward gives one process's gradients."""
    from pipec.runtime.model import build_chunk
    from pipec.runtime.placed import shard_stage

    config = ModelConfig(layers=2)
    reference = build_chunk(config, 0, 2, SEED)
    module = build_chunk(config, 0, 2, SEED)
    params = [p for p in module.parameters() if p.requires_grad]
    sharded, grads = shard_stage(0, module, params, (0, 1), group=None)
    assert sharded.whole.untyped_storage().nbytes() == 0  # built resharded: only the shard is kept
    tokens = torch.randint(0, config.vocab, (2, config.seq_len), generator=torch.Generator().manual_seed(SEED))

    def gather():  # what GATHER's all-gather leaves in the whole vector on a group of one: the shard
        sharded.make_room().copy_(sharded.shard.detach())

    gather()
    out = module(tokens)
    sharded.drop_whole()
    assert sharded.whole.untyped_storage().nbytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # the same storage: nothing whole is left
    gather()
    out.square().mean().backward()
    reference(tokens).square().mean().backward()
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters() if p.requires_grad])
    assert torch.equal(grads[:sharded.size], want)
    assert torch.equal(sharded.whole[:sharded.size], torch.cat([p.detach().reshape(-1) for p in reference.parameters()
                                                                if p.requires_grad]))
