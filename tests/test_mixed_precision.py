"""``--dtype bf16``: autocast compute, fp32 masters and reductions, bf16 on the wire.

A bf16 run cannot equal an fp32 one, and its rounding depends on where the
pipeline cuts the model, so it is held to the one-process bf16 run
(``reference_run(..., precision=BF16)``: autocast around forward and loss) to
bf16's tolerance; that it really computed in bf16 shows in its first loss,
which differs from fp32's (before any update both runs see the same
parameters and data). Its saved parameters stay fp32, and the loss falls.
"""
from __future__ import annotations

import re

import pytest
import torch

from pipec.runtime.model import ModelConfig
from pipec.runtime.precision import BF16, FP32, precision
from pipec.errors import UsageError
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_batch

STEPS, N, SEED = 5, 4, 1
# bf16 keeps 8 bits of mantissa: after 5 steps the parameters of two bf16 runs
# that round at different places differ by a few 1e-4 (measured: 2.6e-4 under
# 1f1b, 4.6e-4 under zbv), against updates of up to 0.16.
BF16_TOLERANCE = 2e-3
LOSS_LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)
# 1f1b-remat: every stage recomputed, R under the same autocast as its FC
SCHEDULES = ("1f1b", "zbv", "weipipe", "zigzag_ring", "1f1b-remat")


def _n(name: str) -> int:
    return 1 if name.endswith("ring") else N


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    jobs = []
    for name in SCHEDULES:
        n = [] if _n(name) == 1 else ["-D", f"N={N}"]
        remat = ["-D", "remat=true"] if name.endswith("-remat") else []
        jobs.append([name.split("-")[0], "-D", "P=2", *n, *remat, "--steps", str(STEPS), "--seed", str(SEED), "--dtype", "bf16",
                     "--save", str(folder / f"{name}.pt")])
    run = launch_batch(jobs, 2, 240.0)
    assert run.ok, run.describe()
    losses = [float(x) for _, x in LOSS_LINE.findall(run.stdout[0])]
    assert len(losses) == STEPS * len(SCHEDULES), run.stdout[0]
    return folder, {name: losses[i * STEPS:(i + 1) * STEPS] for i, name in enumerate(SCHEDULES)}


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_bf16_run_agrees_with_one_bf16_process_and_its_loss_falls(runs, name):
    folder, losses = runs
    bf16 = reference_run(ModelConfig(), STEPS, _n(name), SEED, precision=BF16)
    fp32 = reference_run(ModelConfig(), STEPS, _n(name), SEED)
    saved = torch.load(folder / f"{name}.pt", weights_only=True)
    assert all(tensor.dtype == torch.float32 for tensor in saved.values())  # the masters stay fp32
    assert_same_parameters(saved, bf16.state_dict, f"{name} --dtype bf16", BF16_TOLERANCE)
    first = losses[name][0]
    assert abs(first - bf16.losses[0]) < 1e-3, (first, bf16.losses[0])
    assert abs(first - fp32.losses[0]) > 1e-6, "the first loss is fp32's: nothing ran in bf16"
    assert losses[name][-1] < losses[name][0] - 0.1, losses[name]


def test_precision_names():
    assert precision(None) is FP32 and precision("bf16") is BF16
    assert BF16.wire_dtype == torch.bfloat16 and FP32.wire_dtype is None
    with pytest.raises(UsageError, match="expected one of fp32, bf16"):
        precision("fp16")
