"""Tensor parallelism trains exactly: ``megatron_mlp`` on 2 and 4 gloo ranks ends with the one-process parameters.

Each rank holds slices of every layer and trains them through the family's
runtime (``runtime/tensor_parallel.py``: the one interpreter loop, the
all-reduces posted and waited through the shared exchange); ``--save``
gathers the slices into the whole model, which must equal the same training
in one process (``reference_parameters``), and so must the printed losses.
Options the runtime does not take yet, and a user's model, are refused by
name before any worker starts.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pipec.cli import main
from pipec.runtime.tensor_parallel import reference_parameters
from runtime_util import assert_same_parameters, launch_batch

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


@pytest.mark.parametrize("option, named", [
    (["--trace", "t.json"], "--trace"),
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
