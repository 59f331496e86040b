"""pipec's ``torch-csv-comms`` export, run by torch's own runtime, trains exactly like one process.

torch's ``_PipelineScheduleRuntime`` (2.10 and later) divides a stage's
gradients by N only at that stage's ``REDUCE_GRAD``; an export without it
trains with gradients N times too large. Two gloo processes run pipec's
interleaved 1F1B (P=2, v=2) and ZBV (P=2) exports, N=4, on a tiny model split
into four stages, two SGD steps, and every gradient and final parameter must
match the same training in one process to 1e-5. The export is also read back
by pipec's own importer, checked and simulated.
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from pipec.compiler.driver import compile_target
from pipec.compiler.emit.torch_csv import (
    NEWEST_TORCH,
    TorchRuntime,
    installed_torch_runtime,
    runtime_caveats,
    write_torch_csv,
)
from pipec.compiler.import_torch import prepare_imported, read_torch_csv
from pipec.compiler.simulate import simulate
from runtime_util import _launch

import torch_runtime_worker as worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_runtime_worker.py")
# Two processes importing torch and running two steps of a tiny model: seconds; a hang is killed here.
DEADLINE_S = 45.0
NUM_MICROBATCHES = 4
CASES = {
    "interleaved_1f1b": {"P": 2, "N": NUM_MICROBATCHES, "v": 2},
    "zbv": {"P": 2, "N": NUM_MICROBATCHES},
}

runtime = installed_torch_runtime()
needs_reduce_grad = pytest.mark.skipif(
    runtime is None or not runtime.reduce_grad,
    reason="the installed torch's runtime has no REDUCE_GRAD (torch < 2.10); the export is exact from 2.10 on",
)


def _export(name: str) -> str:
    program = compile_target(name, dict(CASES[name])).program
    return write_torch_csv(program, with_comms=True, for_torch=installed_torch_runtime())


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """Every case's export run by torch's runtime in one set of 2 gloo processes: case -> per-rank results."""
    folder = tmp_path_factory.mktemp("torch_runtime")
    paths = {}
    for name in CASES:
        paths[name] = folder / f"{name}.csv"
        paths[name].write_text(_export(name))
    run = _launch([sys.executable, WORKER, str(NUM_MICROBATCHES), *map(str, paths.values())], 2, DEADLINE_S, None)
    assert run.ok, run.describe()
    return {name: [torch.load(f"{path}.rank{rank}.pt") for rank in range(2)] for name, path in paths.items()}


@needs_reduce_grad
@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_runtime_trains_like_one_process(name, torch_runs):
    grads, params = worker.reference()
    seen = set()
    for result in torch_runs[name]:
        for key, value in result["params"].items():
            seen.add(key)
            torch.testing.assert_close(value, params[key], atol=1e-5, rtol=0, msg=f"{name}: parameter {key}")
            for step, step_grads in enumerate(result["grads"]):
                torch.testing.assert_close(step_grads[key], grads[step][key], atol=1e-5, rtol=0,
                                           msg=f"{name}: step {step} gradient of {key}")
    assert seen == set(params), f"{name}: the ranks' stages miss {sorted(set(params) - seen)}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_carries_one_reduce_grad_per_stage_after_its_last_backward(name):
    program = compile_target(name, dict(CASES[name])).program
    rows = [line.split(",") for line in write_torch_csv(program, with_comms=True, for_torch=NEWEST_TORCH).splitlines()]
    for stage in range(4):
        row = next(r for r in rows if f"{stage}F0" in r)
        assert row.count(f"{stage}REDUCE_GRAD") == 1
        backwards = [i for i, cell in enumerate(row) if re.fullmatch(rf"{stage}[BW]\d+", cell)]
        assert len(backwards) == NUM_MICROBATCHES and max(backwards) < row.index(f"{stage}REDUCE_GRAD")
        # torch's runtime asserts an FSDP stage is unsharded whenever it computes
        unsharded = False
        for cell in row:
            if cell in (f"{stage}UNSHARD", f"{stage}RESHARD"):
                assert unsharded == (cell == f"{stage}RESHARD"), (stage, cell)
                unsharded = cell == f"{stage}UNSHARD"
            elif re.fullmatch(rf"{stage}[FBIW]\d+", cell):
                assert unsharded, (stage, cell)
        assert not unsharded, f"stage {stage} is left unsharded"


@pytest.mark.parametrize("name", sorted(CASES))
def test_reimported_export_checks_and_simulates(name):
    program, had_comms = read_torch_csv(_export(name), source=f"<{name}>")
    assert had_comms
    original = compile_target(name, dict(CASES[name])).program
    checked = prepare_imported(program, had_comms)
    assert [[a.text() for a in row] for row in checked.ranks] == \
        [[p.text() for a in row for p in (a.parts or (a,)) if p.op not in ("FREE_F",)] for row in original.ranks]
    assert simulate(checked).makespan == simulate(original).makespan


def test_older_runtimes_get_the_form_they_read_and_a_warning():
    program = compile_target("zbv", dict(CASES["zbv"])).program
    old = TorchRuntime("2.8.0", reduce_grad=False)
    text = write_torch_csv(program, with_comms=True, for_torch=old)
    assert "REDUCE_GRAD" not in text and "UNSHARD" in text
    assert any("weight backward (W)" in note for note in runtime_caveats(program, old))
    unscaled = TorchRuntime("2.5.1", reduce_grad=False, scales_full_backward=False, local_handoff=False)
    notes = runtime_caveats(program, unscaled)
    assert any("never divides" in note for note in notes) and any("adjacent stages" in note for note in notes)
    assert "SHARD" not in write_torch_csv(program, with_comms=True) and "REDUCE_GRAD" not in write_torch_csv(program, True)
    assert runtime_caveats(program, NEWEST_TORCH) == []
    assert runtime_caveats(program, None) and "not installed" in runtime_caveats(program, None)[0]
    interleaved = compile_target("interleaved_1f1b", dict(CASES["interleaved_1f1b"])).program
    assert runtime_caveats(interleaved, old) == []  # full backwards only: 2.7-2.9 scale it themselves


def test_compile_command_writes_the_installed_torchs_form(tmp_path, capsys, monkeypatch):
    from pipec.cli import main
    from pipec.compiler.emit import torch_csv

    path = tmp_path / "zbv.csv"
    assert main(["compile", "zbv", "-D", "P=2", "-D", "N=4", "--format", "torch-csv-comms", "-o", str(path)]) == 0
    err = capsys.readouterr().err
    if runtime is not None and runtime.reduce_grad:
        assert err == "" and path.read_text().count("REDUCE_GRAD") == 4
    # without torch: the newest accepted torch's form, and a warning that says so
    monkeypatch.setattr(torch_csv, "installed_torch_runtime", lambda: None)
    assert main(["compile", "zbv", "-D", "P=2", "-D", "N=4", "--format", "torch-csv-comms", "-o", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: torch is not installed") and path.read_text().count("REDUCE_GRAD") == 4
    # a torch whose runtime scales only after full backwards: its form, and which stages it leaves unscaled
    monkeypatch.setattr(torch_csv, "installed_torch_runtime", lambda: TorchRuntime("2.8.0", reduce_grad=False))
    assert main(["compile", "zbv", "-D", "P=2", "-D", "N=4", "--format", "torch-csv-comms", "-o", str(path)]) == 0
    err = capsys.readouterr().err
    assert "torch 2.8.0" in err and "stage(s) 0, 1, 2, 3" in err and "REDUCE_GRAD" not in path.read_text()
