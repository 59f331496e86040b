"""Exactness of the runtime on context-parallel compositions: a sequence ring inside every pipeline stage (PP x CP).

A pipeline program of 2 ranks placed on a mesh pp = 2 x cp = 2 (``place_on_mesh(..., ContextParallel("cp",
ring))``) runs on 4 gloo worker processes for three steps: member i of each stage's group runs every
microbatch on ring rank i's chunks of every sequence, each attention of a stage's forward runs the ring's
forward half over the group and its backward half in the stage's B, the hand-off goes from cp rank c to cp
rank c, each member's loss weighs 1/2 and the stages all-reduce their gradients over the group
(SYNC_GRAD). The saved model must be within 1e-5 of one process trained with the same N
(``reference_run``): 1f1b and interleaved 1F1B with zigzag inside, with the built-in model and a user's
chunked, ring-ready spec (``tests/cp_model_spec.py``); ring_attention (causal, unbalanced) and TASP
(all_to_all over the group) inside 1f1b; 1f1b with every stage recomputed (FC, R run the ring forward
again); clipped; resumed from a checkpoint of step 2.

The programs are written to program files and read with ``--program``; every run shares one set of 4
processes (``launch_batch``).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

import cp_model_spec
from pipec.compiler.driver import compile_target
from pipec.compiler.emit.json_program import write_program_json
from pipec.compiler.ir import SEQUENCE_SHARE, Mesh
from pipec.compiler.mesh_placement import ContextParallel, DataParallel, place_on_mesh
from pipec.errors import UsageError
from pipec.runtime import worker
from pipec.runtime.family import placed_refusal
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import TESTS, assert_same_parameters, launch_batch, save_path, train_saved_batch

STEPS = 3
SEED = 7
N = 4
WORLD = 4
# Hard limit of the batch of runs (nine short trainings on a loaded 2-core machine); a hang fails instead.
BATCH_DEADLINE_S = 420.0
MESH = Mesh((("pp", 2), ("cp", 2)))
USER = "cp_model_spec:SPEC"

# name -> (pipeline schedule, its extra defines, the ring inside its stages, model, extra worker arguments)
CASES = {
    "1f1b-zigzag": ("1f1b", {}, "zigzag_ring", None, ["--trace", "{folder}/1f1b-zigzag.trace.json"]),
    "interleaved-zigzag": ("interleaved_1f1b", {}, "zigzag_ring", None, []),
    "1f1b-zigzag-user": ("1f1b", {}, "zigzag_ring", USER, []),
    "interleaved-zigzag-user": ("interleaved_1f1b", {}, "zigzag_ring", USER, []),
    "1f1b-ring": ("1f1b", {}, "ring_attention", None, []),
    "1f1b-tasp": ("1f1b", {}, "tasp", None, []),
    "1f1b-zigzag-remat": ("1f1b", {"remat": True}, "zigzag_ring", None, []),
    "1f1b-zigzag-clip": ("1f1b", {}, "zigzag_ring", None, ["--clip-grad-norm", "0.5"]),
}
# Resumed runs: name -> the case whose step-2 checkpoint they go on from (that case saves every 2 steps).
RESUMED = {"1f1b-zigzag-resumed": "1f1b-zigzag"}


def composed(schedule: str, defines: dict, ring: str):
    """``schedule`` at P = 2, N = 4 on the 2 x 2 mesh, ``ring`` (P = 2) inside every stage."""
    program = compile_target(schedule, {"P": 2, "N": N, **defines}).program
    return place_on_mesh(program, MESH, "pp", ContextParallel("cp", compile_target(ring, {"P": 2}).program))


def _program_file(folder, name: str):
    path = folder / f"{name}.json"
    if not path.exists():
        schedule, defines, ring, _, _ = CASES[name]
        with open(path, "w") as out:
            write_program_json(composed(schedule, defines, ring), out)
    return path


def _save(folder, name: str) -> str:
    return str(save_path(folder, name, RESUMED, STEPS, pattern=True))


def _job(folder, name: str) -> list[str]:
    schedule, _, _, model, extra = CASES[name]
    every = ["--save-every", "2"] if name in RESUMED.values() else []
    return [schedule, "--program", str(_program_file(folder, name)), "--steps", str(STEPS), "--seed", str(SEED),
            "--timeout", "90", "--save", _save(folder, name), *every, *(["--model", model] if model else []),
            *[a.format(folder=folder) for a in extra]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every case and resumed run in one set of 4 processes; (folder, the WorkerRun)."""
    folder = tmp_path_factory.mktemp("compose_cp_runtime")
    run = train_saved_batch(folder, [_job(folder, name) for name in CASES], RESUMED,
                            {name: case[0] for name, case in CASES.items()}, STEPS, WORLD, BATCH_DEADLINE_S)
    return folder, run


def _saved(folder, name: str) -> dict:
    return torch.load(save_path(folder, name, RESUMED, STEPS), weights_only=True)


def _reference(name: str) -> dict:
    _, _, _, model, extra = CASES[RESUMED.get(name, name)]
    clip = float(extra[1]) if "--clip-grad-norm" in extra else None
    if model is None:
        return reference_run(ModelConfig(), STEPS, N, SEED, clip_grad_norm=clip).state_dict
    return reference_run(cp_model_spec.Config(), STEPS, N, SEED, cp_model_spec.SPEC, clip_grad_norm=clip).state_dict


@pytest.mark.parametrize("name", [*CASES, *RESUMED])
def test_a_context_parallel_composition_trains_like_one_process(trained, name):
    folder, _ = trained
    assert_same_parameters(_saved(folder, name), _reference(name), name)


def test_the_runs_trained_and_printed_one_process_losses(trained):
    """The references moved away from the initial models (matching them is not matching an untrained one),
    and rank 0 printed one process's losses: every member's 1/2 of each microbatch's loss reached the reduce."""
    folder, run = trained
    for config, spec in ((ModelConfig(), None), (cp_model_spec.Config(), cp_model_spec.SPEC)):
        more = {} if spec is None else {"spec": spec}
        initial = reference_run(config, 0, 1, SEED, **more).state_dict
        want = reference_run(config, STEPS, N, SEED, **more).state_dict
        assert any((want[k] - initial[k]).abs().max() > 1e-3 for k in initial)
    losses = reference_run(ModelConfig(), STEPS, N, SEED).losses
    printed = [float(line.split()[-1]) for line in run.stdout[0].splitlines() if line.startswith("step ")][:STEPS]
    assert printed == pytest.approx(losses, abs=2e-6)


def test_the_trace_records_every_members_stage_computes_and_reductions(trained):
    folder, _ = trained
    with open(folder / "1f1b-zigzag.trace.json") as handle:
        events = json.load(handle)["traceEvents"]
    names = {(event["pid"], event["name"]) for event in events if event.get("ph") == "X"}
    for rank in range(WORLD):
        stage = rank // 2
        for text in (f"{stage}F0", f"{stage}B3", f"({stage}SYNC_GRAD)EXCHANGE0"):
            assert (rank, text) in names, (rank, text, sorted(n for p, n in names if p == rank)[:40])


def test_a_member_that_stops_before_its_backward_is_named_inside_the_ring(tmp_path):
    """Rank 3 (stage 1, member 1) exits before its first backward, ``1B0``: rank 2, its group's other member,
    ends inside 1B0's ring backward with a fault naming the ring instruction and the call (global ranks),
    and no rank hangs."""
    path = tmp_path / "program.json"
    with open(path, "w") as out:
        write_program_json(composed("1f1b", {}, "zigzag_ring"), out)
    run = launch_batch([["1f1b", "--program", str(path), "--steps", "1", "--timeout", "5", "--inject", "exit:3:2"]],
                       WORLD, 180.0)
    assert not run.timed_out and all(code != 0 for code in run.returncodes), run.describe()
    named = re.search(r"rank 2, step \d+ \(.*EXCHANGE.*, in stage 1, microbatch 0, attention \d+'s backward\): "
                      r"(waited [\d.]+ s for rank (\d+)|the instruction failed)", run.stderr[2])
    assert named, run.describe()
    assert named.group(2) in (None, "3"), run.describe()  # a wait names the peer's global rank, not its ring rank 1


# ------------------------------------------------------------------ before any worker starts, in one process


def _plan(tmp_path, program, *args):
    path = tmp_path / "program.json"
    with open(path, "w") as out:
        write_program_json(program, out)
    return worker.make_plan(worker.parse_run_config(["1f1b", "--program", str(path), *args]), WORLD)


def test_a_member_hands_on_its_tokens_of_each_sequence(tmp_path, monkeypatch):
    """The wire between the stages carries a member's half of each sequence, every row: (rows, seq / 2, ...)."""
    monkeypatch.syspath_prepend(TESTS)
    builtin = _plan(tmp_path, composed("1f1b", {}, "zigzag_ring"))
    assert [leaf.shape for leaf in builtin.layouts[0].leaves] == [(4, 8, 32)]
    user = _plan(tmp_path, composed("1f1b", {}, "zigzag_ring"), "--model", USER)
    assert [leaf.shape for leaf in user.layouts[0].leaves] == [(2, 4, 6)]


def test_a_spec_without_ring_model_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TESTS)
    with pytest.raises(UsageError, match=r"runs every stage's attention through the ring zigzag_ring over the "
                                         r"stage's group \(PP x CP\), and model spec cp_model_spec:UNDECLARED does "
                                         r"not declare ring_model\(config\)"):
        _plan(tmp_path, composed("1f1b", {}, "zigzag_ring"), "--model", "cp_model_spec:UNDECLARED")


def test_a_stage_ring_of_another_mask_is_refused(tmp_path):
    full = compile_target("zigzag_ring", {"P": 2, "causal": False}).program
    program = place_on_mesh(compile_target("1f1b", {"P": 2, "N": N}).program, MESH, "pp", ContextParallel("cp", full))
    with pytest.raises(UsageError, match="full attention mask, but the built-in model's attention is causal.*"
                                         r"context over cp ring zigzag_ring\(causal = true\)"):
        _plan(tmp_path, program)


def test_a_sequence_that_the_stage_ring_does_not_cut_is_refused(tmp_path):
    with pytest.raises(UsageError, match="seq_len 6 cannot be cut into zigzag_ring's 4 chunks"):
        _plan(tmp_path, composed("1f1b", {}, "zigzag_ring"), "--config", "seq_len=6")


def test_a_context_parallel_program_that_splits_its_backward_is_refused_by_name():
    """What ``place_on_mesh`` refuses, in a hand-made program file: a stage ring inside zbv's I and W."""
    program = place_on_mesh(compile_target("zbv", {"P": 2, "N": N}).program, MESH, "pp", DataParallel("cp"))
    ring = compile_target("zigzag_ring", {"P": 2}).program
    stages = [replace(info, placement=replace(info.placement, split=SEQUENCE_SHARE)) for info in program.stages]
    refusal = placed_refusal(replace(program, stages=stages, stage_ring=ring))
    assert refusal is not None and "splits its backward" in refusal and "inside a whole backward B" in refusal
    assert "no stage ring" in placed_refusal(replace(program, stages=stages))
