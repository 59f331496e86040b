"""Exactness of the runtime: every shipped schedule trains like one process.

For every shipped schedule at P = 2 and P = 4 (a composition at P = 2 x D = 2), three training steps on P gloo
worker processes must leave every parameter within 1e-5 of ``train_reference``
(the same model, data and seed on one process). Sequence-ring schedules
(ring_attention, zigzag_ring, tasp) declare no N: they train one batch per
step, sequence-parallel, and are held to the reference with N = 1.
Asynchronous schedules (pipedream, pipedream_2bw: updates in the order) are
held to the one-process emulation of their staleness (``async_reference_run``).
The runs of one world size share one set of processes (``launch_batch``): the
imports cost more than the training. One more run goes through the real
``python -m pipec.runtime`` command line with ``--trace``.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from pipec.compiler.driver import compile_target, resolve_target, shipped_schedules
from pipec.runtime.model import ModelConfig
from pipec.compiler.versions import has_updates
from pipec.dsl.composition import ResolvedComposition
from pipec.runtime.reference import async_reference_run, reference_run
from runtime_util import assert_same_parameters, launch_batch, launch_workers

STEPS = 3
SEED = 7
# Hard limit of one world size's batch of runs; a hang fails instead of stalling.
BATCH_DEADLINE_S = 240.0
WORLD_SIZES = (2, 4)


def declares_n(name: str) -> bool:
    """Whether the schedule has a microbatch count N (sequence rings do not)."""
    return "N" in {param.name for param, _, _ in resolve_target(name).params}


def is_composed(name: str) -> bool:
    """Whether the schedule is a composition on a mesh (schedules/*_dp.pipe, ...): its pipeline runs on P ranks
    and each stage on a group of D = 2 (its default), so a world of 4 is P = 2."""
    return isinstance(resolve_target(name), ResolvedComposition)


def pipeline_ranks(name: str, ranks: int) -> int:
    """The P a schedule takes on ``ranks`` worker processes."""
    return ranks // 2 if is_composed(name) else ranks


def microbatches(name: str, ranks: int) -> int:
    """A valid N for every shipped schedule: 2P at P = 2 (past warm-up), P at P = 4 (fewest, fastest); 1 for
    a sequence ring (one batch per step: the reference it is held to)."""
    if not declares_n(name):
        return 1
    return 2 * ranks if ranks == 2 else ranks


def _case_id(name: str, ranks: int) -> str:
    return f"{name}-P{ranks}"


# A family that trains its own model (tensor parallelism's MLP stack) is held to its own one-process
# run (tests/test_tensor_parallel_run.py), not to the built-in model's.
OWN_MODEL = {"megatron_mlp"}
# HSDP's composition needs 8 ranks at P = 2 (pp x ddp x fsdp); tests/test_compose_hsdp.py runs it on 4 (P = 1).
OWN_RUN = {"1f1b_hsdp"}
# A composition runs on 4 ranks (P = 2 x D = 2) only.
CASES = [(name, ranks) for ranks in WORLD_SIZES for name in shipped_schedules()
         if name not in OWN_MODEL | OWN_RUN and (ranks == 4 or not is_composed(name))]


def _job(name: str, ranks: int, save: str) -> list[str]:
    n = ["-D", f"N={microbatches(name, ranks)}"] if declares_n(name) else []
    return [name, "-D", f"P={pipeline_ranks(name, ranks)}", *n, "--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60",
            "--save", save]


@pytest.fixture(scope="module")
def batch_runs(tmp_path_factory):
    """Per world size: (the WorkerRun, schedule name -> saved state_dict path)."""
    folder = tmp_path_factory.mktemp("runtime_exact")
    out = {}
    for ranks in WORLD_SIZES:
        names = [name for name, p in CASES if p == ranks]
        saves = {name: str(folder / f"{_case_id(name, ranks)}.pt") for name in names}
        run = launch_batch([_job(name, ranks, saves[name]) for name in names], ranks, BATCH_DEADLINE_S)
        out[ranks] = (run, saves)
    return out


_references: dict[tuple[int, int], object] = {}


def reference(num_microbatches: int):
    """The one-process run (cached per N: several schedules share it)."""
    key = (num_microbatches, SEED)
    if key not in _references:
        _references[key] = reference_run(ModelConfig(), STEPS, num_microbatches, SEED)
    return _references[key]


@pytest.mark.parametrize("name,ranks", CASES, ids=[_case_id(*case) for case in CASES])
def test_schedule_trains_like_one_process(batch_runs, name, ranks):
    run, saves = batch_runs[ranks]
    path = saves[name]
    assert os.path.exists(path), f"{name} at P={ranks} saved nothing:\n{run.describe()}"
    params = {"P": str(pipeline_ranks(name, ranks)), "N": str(microbatches(name, ranks))}
    program = compile_target(name, params).program if declares_n(name) else None
    if program is not None and has_updates(program):  # asynchronous: its oracle keeps the same staleness
        want = async_reference_run(program, ModelConfig(), STEPS, SEED)
    else:
        want = reference(microbatches(name, ranks))
    assert_same_parameters(torch.load(path), want.state_dict, f"{name} P={ranks}")
    # the parameters moved: a run that changed nothing would also "match" an untrained model
    initial = reference_run(ModelConfig(), 0, 1, SEED).state_dict
    assert any((want.state_dict[k] - initial[k]).abs().max() > 1e-3 for k in initial)


def test_batches_finished_cleanly(batch_runs):
    for ranks, (run, saves) in batch_runs.items():
        assert run.ok, run.describe()
        assert run.stdout[0].count(" done") == len(saves), run.describe()


def test_printed_losses_are_the_batch_losses(batch_runs):
    """Rank 0 prints the mean microbatch loss of each step: the one-process run's loss."""
    run, _ = batch_runs[4]
    name = "bitpipe"  # two pipelines and replicas: the loss gathers from several ranks
    names = [n for n, p in CASES if p == 4]
    lines = [line for line in run.stdout[0].splitlines() if line.startswith("step ")]
    start = names.index(name) * STEPS
    printed = [float(line.split()[-1]) for line in lines[start:start + STEPS]]
    want = reference(microbatches(name, 4)).losses
    assert printed == pytest.approx(want, abs=2e-6), (printed, want)
    assert printed[-1] < printed[0]


def test_command_line_worker_with_trace(tmp_path):
    """``python -m pipec.runtime`` under a torchrun-like environment: exact, and a Chrome trace of every instruction."""
    save, trace = tmp_path / "model.pt", tmp_path / "trace.json"
    ranks, n = 2, 2
    run = launch_workers(["chimera", "-D", f"P={ranks}", "-D", f"N={n}", "--steps", "2", "--seed", str(SEED),
                          "--save", str(save), "--trace", str(trace), "--timeout", "60"], ranks, 120.0)
    assert run.ok, run.describe()
    assert [line.split()[:2] for line in run.stdout[0].splitlines() if line.startswith("step")] == \
        [["step", "1"], ["step", "2"]]
    assert_same_parameters(torch.load(save), reference_run(ModelConfig(), 2, n, SEED).state_dict, "chimera P=2 CLI")
    events = json.loads(trace.read_text())["traceEvents"]
    program = compile_target("chimera", {"P": ranks, "N": n}).program
    for rank in range(ranks):
        mine = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] != "wait"]
        texts = [a.text() for a in program.ranks[rank]] + ["optimizer step"]
        assert [e["name"] for e in mine] == texts * 2, f"rank {rank}: every instruction once per step, in order"
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
        starts = [e["ts"] for e in mine]
        assert starts == sorted(starts)
        assert all(0 <= e["args"]["wait_us"] <= e["dur"] + 1e-3 for e in mine)
    # a compute that reads a received tensor waits for it first: a nested "wait" slice inside it
    waits = [e for e in events if e.get("cat") == "wait"]
    assert waits
    for wait in waits:
        action = program.ranks[wait["pid"]][wait["args"]["index"]]
        assert action.is_compute and action.op != "W", action.text()


def test_world_size_must_match_the_program(tmp_path):
    """A worker started with the wrong world size says so and exits 1 (before joining any group)."""
    run = launch_workers(["1f1b", "-D", "P=3"], 2, 60.0)
    assert run.returncodes == [1, 1], run.describe()
    assert "compiled for 3 ranks, but WORLD_SIZE is 2" in run.stderr[0]
