"""Tensor parallelism trains exactly: ``megatron_mlp`` on 2 and 4 gloo ranks ends with the one-process parameters.

Each rank holds slices of every layer and trains them through the family's
runtime (``runtime/tensor_parallel.py``: the one interpreter loop, the
all-reduces posted and waited through the shared exchange); ``--save``
gathers the slices into the whole model, which must equal the same training
in one process (``reference_parameters``), and so must the printed losses.
The family trains through the one training loop (``worker.train``), so it
takes what every family takes: a run resumed from a ``--save-every``
checkpoint ends with the uninterrupted run's parameters, ``--trace`` holds
every rank's instructions per step and the optimizer step, and ``--inject``
plants a fault whose peer names it. Options the runtime does not take yet,
and a user's model, are refused by name before any worker starts.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pipec.cli import main
from pipec.compiler.driver import compile_target
from pipec.runtime.tensor_parallel import reference_parameters
from runtime_util import assert_same_parameters, launch_batch
from test_run_cli import run_pipec

STEPS, SEED, LAYERS, MICROBATCHES = 3, 5, 3, 2
DEADLINE_S = 150.0


def _whole(layers: list[dict]) -> dict:
    return {f"layers.{i}.{name}": tensor for i, layer in enumerate(layers) for name, tensor in layer.items()}


@pytest.mark.parametrize("ranks", [2, 4])
def test_megatron_mlp_trains_to_the_one_process_parameters(tmp_path, ranks):
    saved = tmp_path / "tp.pt"
    job = ["megatron_mlp", "-D", f"P={ranks}", "-D", f"L={LAYERS}", "-D", f"N={MICROBATCHES}", "--steps", str(STEPS),
           "--seed", str(SEED), "--timeout", "60", "--save", str(saved)]
    run = launch_batch([job], ranks, DEADLINE_S)
    assert run.ok and saved.exists(), run.describe()
    want, losses = reference_parameters(LAYERS, MICROBATCHES, STEPS, SEED)
    initial, _ = reference_parameters(LAYERS, MICROBATCHES, 0, SEED)
    assert_same_parameters(torch.load(saved), _whole(want), f"megatron_mlp on {ranks} ranks")
    # the training moved every parameter, so equality is not that of two untouched models
    assert all((w[name] - i[name]).abs().max() > 1e-4 for w, i in zip(want, initial) for name in w)
    printed = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", run.stdout[0], re.M)]
    assert printed == pytest.approx(losses, abs=2e-6), run.describe()


def test_a_resumed_run_and_a_traced_one_train_as_the_uninterrupted_run(tmp_path):
    """One set of 2 processes: 3 steps saving after steps 2 and 3; 3 steps resumed after step 2; 2 traced steps."""
    common = ["megatron_mlp", "-D", "P=2", "-D", f"L={LAYERS}", "-D", f"N={MICROBATCHES}", "--seed", str(SEED),
              "--timeout", "60"]
    every, resumed, trace = tmp_path / "tp-{step}.pt", tmp_path / "resumed.pt", tmp_path / "trace.json"
    jobs = [[*common, "--steps", "3", "--save", str(every), "--save-every", "2"],
            [*common, "--steps", "3", "--resume", str(tmp_path / "tp-2.pt"), "--save", str(resumed)],
            [*common, "--steps", "2", "--trace", str(trace)]]
    run = launch_batch(jobs, 2, DEADLINE_S)
    assert run.ok, run.describe()
    want, losses = reference_parameters(LAYERS, MICROBATCHES, 3, SEED)
    after_two, _ = reference_parameters(LAYERS, MICROBATCHES, 2, SEED)
    assert_same_parameters(torch.load(tmp_path / "tp-2.pt"), _whole(after_two), "megatron_mlp after step 2")
    assert_same_parameters(torch.load(resumed), _whole(want), "megatron_mlp resumed after step 2")
    printed = re.findall(r"^step (\d+) loss (\S+)$", run.stdout[0], re.M)  # 1, 2, 3; then the resumed run's 3
    assert printed[3][0] == "3" and float(printed[3][1]) == pytest.approx(losses[2], abs=2e-6), run.describe()
    with open(trace, encoding="utf-8") as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "wait"]
    program = compile_target("megatron_mlp", {"P": 2, "L": LAYERS, "N": MICROBATCHES}).program
    for rank, row in enumerate(program.ranks):
        for step in (1, 2):
            mine = [e for e in events if e["pid"] == rank and e["args"]["step"] == step]
            assert [e["args"]["index"] for e in mine] == list(range(len(row) + 1)), (rank, step)
            assert [e["name"] for e in mine] == [a.text() for a in row] + ["optimizer step"], (rank, step)


def test_an_injected_hang_is_named_by_its_peer_at_the_timeout():
    timeout = 3.0  # the phases before the fault (the model build) have --timeout + 3 s on a loaded machine
    done = run_pipec("run", "megatron_mlp", "-D", "P=2", "--steps", "2", "--timeout", str(timeout),
                     "--inject", "hang:1:0", deadline_s=90)
    assert done.status == 1, done.describe()
    assert re.search(r"^rank 0, step \d+ \(EXCHANGE_WAIT\d*.*\): waited (\d+(?:\.\d+)?) s for rank 1: no answer "
                     r"within the timeout.*training step 1$", done.stderr, re.M), done.describe()
    assert "Traceback" not in done.stderr and not done.survivors, done.describe()


@pytest.mark.parametrize("option, named", [
    (["--config", "rows=8"], "--config"),
    (["--clip-grad-norm", "1.0"], "--clip-grad-norm"),
    (["--dtype", "bf16"], "--dtype bf16"),
    (["--model", "ring_model_spec:SPEC"], "--model is not taken yet"),
])
def test_what_the_runtime_does_not_take_yet_is_refused_before_any_worker_starts(capsys, no_launch, tmp_path,
                                                                                monkeypatch, option, named):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    assert main(["run", "megatron_mlp", "-D", "P=2", *option]) == 1
    err = capsys.readouterr().err
    assert named in err and "tensor-parallel" in err and "Traceback" not in err, err


def test_ranks_that_do_not_divide_the_models_width_are_refused_before_any_worker_starts(capsys, no_launch):
    assert main(["run", "megatron_mlp", "-D", "P=3"]) == 1
    err = capsys.readouterr().err
    assert "inner width, 64, across 3 ranks: it must divide by them" in err and "Traceback" not in err, err
