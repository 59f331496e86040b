"""A user's own loop with torch.distributed.pipelining stages and a pipec schedule trains like one process.

Four gloo processes each run ``torch_path_worker.py``: compile with ``pipec.compile``, build this rank's
``PipelineStage`` objects, get the schedule from ``pipec.torch.schedule_for`` and train three SGD steps with
``schedule.step``, three ways: torch loaded with pipec's messages (``comms=True``), placing its own
(``comms=False``), and as torchtitan loads a CSV (compute only, ``scale_grads=False``, a loss divided by the
microbatch count). For 1F1B, interleaved 1F1B (v=2), ZB-V and a schedule whose eight stages are placed by
hand (neither torch's loop nor its V), every final parameter must match the same training in one process
within ``runtime_util.TOLERANCE``. Also: the stages a rank is given are checked against the program before
torch sees them (a wrong set is a ``UsageError``, not a hang).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import pipec
import torch_path_worker as worker
from runtime_util import TOLERANCE, _launch, assert_same_parameters

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torch_path_worker.py")
HAND_PLACED = os.path.join(HERE, "hand_placed.pipe")
# Four processes importing torch and training four schedules of a tiny model: seconds on a quiet machine;
# generous, as the machine running the tests may be loaded. A hang is killed at this deadline.
DEADLINE_S = 240.0
CASES = {
    "1f1b": ("1f1b", {"P": 4, "N": 8}),
    "interleaved_1f1b": ("interleaved_1f1b", {"P": 4, "N": 8, "v": 2}),
    "zbv": ("zbv", {"P": 4, "N": 8}),
    "hand_placed": (HAND_PLACED, {"P": 4, "N": 8}),
}
# The CSV form torch's runtime is loaded with: pipec's own messages, or torch's (comms=False); and torchtitan's
# way with the compute-only form: scale_grads=False, a loss that divides by the microbatch count itself.
FORMS = ("comms", "compute", "titan")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every case trained by one set of 4 gloo processes: case -> the whole model's parameters, from every rank."""
    out = tmp_path_factory.mktemp("torch_path")
    cases = [f"{name}-{form}:{form}:{target}:{json.dumps(params)}" for name, (target, params) in CASES.items()
             for form in FORMS]
    run = _launch([sys.executable, WORKER, str(out), *cases], 4, DEADLINE_S, None)
    assert run.ok, run.describe()
    results = {}
    for name in CASES:
        for form in FORMS:
            merged: dict[str, torch.Tensor] = {}
            for rank in range(4):
                merged.update(torch.load(out / f"{name}-{form}.rank{rank}.pt"))
            results[name, form] = merged
    return results


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_users_loop_trains_like_one_process(name, form, trained):
    assert_same_parameters(trained[name, form], worker.reference(), f"{name} ({form})", TOLERANCE)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_parameters_moved(name, trained):
    """Three steps changed the weights, so matching the reference is not matching the initial model."""
    initial = {key: value.detach() for key, value in worker.tiny_model().named_parameters()}
    moved = max((trained[name, "comms"][key] - initial[key]).abs().max().item() for key in initial)
    assert moved > 100 * TOLERANCE, f"{name}: the parameters barely moved ({moved:.3g})"


def test_the_hand_placed_schedule_is_neither_loop_nor_v():
    program = pipec.compile(HAND_PLACED, {"P": 4, "N": 8})
    homes = [next(r for r in range(4) if s in program.stages_on(r)) for s in range(program.num_stages)]
    assert homes != [s % 4 for s in range(8)]
    assert homes != [s if s < 4 else 7 - s for s in range(8)]


class _Stage:
    """What ``schedule_for`` reads of a ``PipelineStage`` before torch sees it."""

    def __init__(self, index: int, rank: int, num_stages: int = 4, group_size: int = 4):
        self.stage_index, self.group_rank, self.num_stages, self.group_size = index, rank, num_stages, group_size


@pytest.mark.parametrize("stages, message", [
    ([_Stage(0, 1)], "rank 1: 1f1b places stages [1] here; the stages given are [0]"),
    ([_Stage(1, 1, group_size=2)], "1f1b runs on 4 ranks; the stages' process group has 2"),
    ([_Stage(1, 1, num_stages=8)], "1f1b has 4 stages; the stages given say [8] in all"),
    ([], "schedule_for needs this rank's stages"),
])
def test_stages_that_are_not_the_programs_are_refused(stages, message):
    import pipec.torch

    program = pipec.compile("1f1b", {"P": 4, "N": 8})
    with pytest.raises(pipec.PipecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        pipec.torch.schedule_for(program, stages)


def test_another_microbatch_count_is_refused():
    import pipec.torch

    program = pipec.compile("1f1b", {"P": 4, "N": 8})
    with pytest.raises(pipec.PipecError, match="orders 8 microbatches a step; n_microbatches is 4"):
        pipec.torch.schedule_for(program, [_Stage(0, 0)], 4)


def test_a_program_torch_cannot_run_is_refused():
    import pipec.torch

    program = pipec.compile("weipipe", {"P": 4, "N": 8})
    with pytest.raises(pipec.PipecError):
        pipec.torch.schedule_for(program, [_Stage(0, 0)])


@pytest.mark.parametrize("arguments, options, message", [
    ("none", {}, "program: expected a pipec.Program (pipec.compile or pipec.load), got NoneType"),
    ("one stage", {}, "stages: expected a list of this rank's PipelineStage objects, got _Stage"),
    ("text", {}, "stages: expected a list of this rank's PipelineStage objects, got str"),
    ("object", {}, "stages[0]: expected a torch.distributed.pipelining PipelineStage, got object (it has no "
                   "stage_index)"),
    ("stages", {"n_microbatches": "8"}, "n_microbatches: expected an int >= 1 (or None: the program's own count), "
                                        "got '8'"),
    ("stages", {"n_microbatches": True}, "n_microbatches: expected an int >= 1"),
    ("stages", {"comms": "yes"}, "comms: expected True or False, got str"),
    ("stages", {"scale_grads": 1}, "scale_grads: expected True or False, got int"),
    ("stages", {"loss_fn": 3}, "loss_fn: expected a function (output, target) -> loss, got int"),
])
def test_arguments_of_the_wrong_type_are_pipecs_errors_naming_them(arguments, options, message):
    """Never a TypeError or AttributeError from inside, nor "yes" taken for True (was: both)."""
    import pipec.torch

    program = pipec.compile("1f1b", {"P": 4, "N": 8})
    given = {"none": (None, [_Stage(0, 0)]), "one stage": (program, _Stage(0, 0)), "text": (program, "stages"),
             "object": (program, [object()]), "stages": (program, [_Stage(0, 0)])}[arguments]
    with pytest.raises(pipec.PipecError) as caught:
        pipec.torch.schedule_for(*given, **options)
    assert str(caught.value) == message or str(caught.value).startswith(message), caught.value
