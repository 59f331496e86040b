"""Checkpoints and resume: K steps, then K more from the checkpoint, end where 2K steps end.

``--save F`` writes the whole model's state_dict F and the training state
F.resume; ``--save-every K`` checkpoints along the way (``{step}`` in F keeps
each); ``--resume F`` restores parameters, optimizer state (SGD's momentum:
without it the resumed run would differ at once), the step count and the data
position, under the same schedule or another one, of another family or rank
count: a checkpoint is the whole model's state, keyed by parameter name.
Every resumed run is held to the uninterrupted one-process run within 1e-6.
What cannot be resumed is refused before any worker starts, with one line.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy
import pytest
import torch

from pipec.cli import main
from pipec.errors import UsageError
from pipec.examples.token_file import SPEC as TOKEN_SPEC, TokenConfig
from pipec.runtime import checkpoint
from pipec.runtime.model import LLAMA, ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_batch

HALF, FULL, N, SEED = 3, 6, 4, 4
RESUME_TOLERANCE = 1e-6
README = Path(__file__).resolve().parents[1] / "README.md"
TOKEN_MODEL = "pipec.examples.token_file:SPEC"


def _job(name: str, *options: str) -> list[str]:
    n = [] if name.endswith("ring") or name == "ring_attention" else ["-D", f"N={N}"]
    return [name, "-D", "P=2", *n, *options]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoints written and resumed in one set of 2 gloo processes, one job after the other."""
    folder = tmp_path_factory.mktemp("checkpoints")

    def at(name: str) -> str:
        return str(folder / name)

    # a real token file (README.md's bytes) read through a Dataset: its data position is a row count
    numpy.frombuffer(README.read_bytes(), dtype=numpy.uint8).astype("<u2").tofile(at("tokens.bin"))
    tokens = ["--model", TOKEN_MODEL, "--config", f"token_file={at('tokens.bin')}"]

    jobs = [
        _job("1f1b", "--steps", str(HALF), "--seed", str(SEED), "--save", at("1f1b-{step}.pt"), "--save-every", "1"),
        _job("1f1b", "--steps", str(FULL), "--resume", at(f"1f1b-{HALF}.pt"), "--save", at("1f1b-1f1b.pt")),
        _job("interleaved_1f1b", "--steps", str(FULL), "--resume", at(f"1f1b-{HALF}.pt"),
             "--save", at("1f1b-interleaved.pt")),
        _job("fsdp", "--steps", str(FULL), "--resume", at(f"1f1b-{HALF}.pt"), "--save", at("1f1b-fsdp.pt")),
        _job("fsdp", "--steps", str(HALF), "--seed", str(SEED), "--save", at("fsdp.pt")),
        _job("bitpipe", "--steps", str(FULL), "--resume", at("fsdp.pt"), "--save", at("fsdp-bitpipe.pt")),
        _job("weipipe", "--steps", str(FULL), "--resume", at("fsdp.pt"), "--save", at("fsdp-weipipe.pt")),
        _job("zigzag_ring", "--steps", str(HALF), "--seed", str(SEED), "--save", at("zigzag.pt")),
        _job("ring_attention", "--steps", str(FULL), "--resume", at("zigzag.pt"), "--save", at("zigzag-ring.pt")),
        _job("1f1b", "--steps", str(HALF), "--seed", str(SEED), "--save", at("tokens.pt"), *tokens),
        _job("interleaved_1f1b", "--steps", str(FULL), "--resume", at("tokens.pt"), "--save", at("tokens-6.pt"),
             *tokens),
    ]
    run = launch_batch(jobs, 2, 300.0)
    assert run.ok, run.describe()
    return folder, run


def _saved(folder, name: str) -> dict:
    return torch.load(folder / name, weights_only=True)


def test_every_checkpoint_of_save_every_is_the_run_after_that_step(runs):
    folder, _ = runs
    for step in range(1, HALF + 1):
        want = reference_run(ModelConfig(), step, N, SEED).state_dict
        assert_same_parameters(_saved(folder, f"1f1b-{step}.pt"), want, f"the checkpoint after step {step}")
        assert (folder / f"1f1b-{step}.pt.resume").is_file()


@pytest.mark.parametrize("saved, n", [
    ("1f1b-1f1b.pt", N), ("1f1b-interleaved.pt", N), ("1f1b-fsdp.pt", N),
    ("fsdp-bitpipe.pt", N), ("fsdp-weipipe.pt", N), ("zigzag-ring.pt", 1),
])
def test_a_resumed_run_ends_where_the_uninterrupted_run_ends(runs, saved, n):
    folder, _ = runs
    want = reference_run(ModelConfig(), FULL, n, SEED).state_dict
    assert_same_parameters(_saved(folder, saved), want, f"{saved}: {HALF} steps, then resumed to {FULL}",
                           RESUME_TOLERANCE)


def test_a_resumed_run_goes_on_reading_a_dataset_where_it_stopped(runs):
    folder, _ = runs
    state = checkpoint.read_checkpoint(str(folder / "tokens.pt"))
    rows = HALF * N * TokenConfig().microbatch_size
    assert state.data == {"source": "dataset", "steps": HALF, "rows": rows}
    config = TokenConfig(token_file=str(folder / "tokens.bin"))
    want = reference_run(config, FULL, N, SEED, TOKEN_SPEC).state_dict
    assert_same_parameters(_saved(folder, "tokens-6.pt"), want, "a token file's run resumed under interleaved_1f1b",
                           RESUME_TOLERANCE)


def test_a_resumed_run_goes_on_counting_its_steps(runs):
    _, run = runs
    out = run.stdout[0]
    assert f"step {HALF + 1} loss" in out and f"step {FULL} loss" in out


def test_the_training_state_holds_the_optimizer_by_parameter_name(runs):
    folder, _ = runs
    state = checkpoint.read_checkpoint(str(folder / f"1f1b-{HALF}.pt"))
    assert state.step == HALF and state.seed == SEED and state.meta["schedule"] == "1f1b"
    names = sorted(LLAMA.build_model(ModelConfig(), 0).state_dict())
    assert sorted(state.model) == names and sorted(state.optimizer) == names
    assert all(set(entry) == {"momentum_buffer"} for entry in state.optimizer.values())


# ------------------------------------------------------------------ refused before launch


def _run(capsys, *argv: str) -> str:
    assert main(["run", "gpipe", "-D", "P=2", "-D", "N=2", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_what_cannot_be_resumed_is_refused_before_any_worker_starts(runs, tmp_path, capsys, no_launch):
    folder, _ = runs
    half = str(folder / f"1f1b-{HALF}.pt")
    lone = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(1)}, lone)
    assert "no checkpoint beside it" in _run(capsys, "--resume", str(lone), "--steps", "9")
    assert "no such file" in _run(capsys, "--resume", str(tmp_path / "missing.pt"))
    assert f"taken after step {HALF}" in _run(capsys, "--resume", half, "--steps", str(HALF))
    assert f"trained with seed {SEED}" in _run(capsys, "--resume", half, "--steps", "9", "--seed", "1")
    assert "--save-every K saves to the --save file" in _run(capsys, "--save-every", "2")
    garbage = tmp_path / "garbage.pt.resume"
    garbage.write_bytes(b"not a checkpoint at all")
    assert "is not a pipec checkpoint" in _run(capsys, "--resume", str(garbage))
    foreign = tmp_path / "foreign.pt.resume"
    torch.save({"format": "something else"}, foreign)
    assert "not a usable pipec checkpoint" in _run(capsys, "--resume", str(foreign))


class _Planted:
    """An object whose unpickling would run code: a checkpoint must never be loaded as a plain pickle."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/pipec-checkpoint-pwned",))


def test_a_checkpoint_is_never_unpickled(tmp_path):
    planted = tmp_path / "planted.pt.resume"
    torch.save({"format": checkpoint.FORMAT, "payload": _Planted()}, planted)
    if os.path.exists("/tmp/pipec-checkpoint-pwned"):
        os.unlink("/tmp/pipec-checkpoint-pwned")
    with pytest.raises(UsageError, match="is not a pipec checkpoint"):
        checkpoint.read_checkpoint(str(planted))
    assert not os.path.exists("/tmp/pipec-checkpoint-pwned")


def test_a_checkpoint_of_another_model_is_named(runs):
    folder, _ = runs
    state = checkpoint.read_checkpoint(str(folder / "fsdp.pt"))
    wider = LLAMA.build_chunk(ModelConfig(dim=64, hidden=128), 0, 2, 0)
    with pytest.raises(UsageError, match=r"'embed.weight' is \(64, 32\) in the checkpoint and \(64, 64\) in this model"):
        checkpoint.load_modules([wider], state.model, "fsdp.pt")
    deeper = LLAMA.build_chunk(ModelConfig(layers=16), 1, 2, 0)
    with pytest.raises(UsageError, match="the checkpoint has no 'layers.8"):
        checkpoint.load_modules([deeper], state.model, "fsdp.pt")
