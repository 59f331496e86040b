"""Hostile cases on the runtime side (issue 24): each ends with a named pipec error, exit 1, no traceback,
no hang and nothing lost.

The models are ``tests/hostile_specs.py``'s (the built-in decoder with one function made wrong). A
fault inside the run (a forward or backward raising on rank 1) is run for real through ``pipec run`` on
2 gloo ranks under a hard deadline; what is refused before any worker starts is run in-process with
the launcher replaced by a failure (``no_launch``).
"""
from __future__ import annotations

import errno
import os
import re

import pytest
import torch

from pipec.cli import main
from pipec.errors import UsageError
from pipec.runtime import checkpoint as checkpoints
from pipec.runtime.model import ModelConfig, build_model
from test_run_cli import run_pipec

TESTS = os.path.dirname(os.path.abspath(__file__))
GPIPE_2 = ["gpipe", "-D", "P=2", "-D", "N=2"]
# A whole faulty run: three Pythons importing torch on a loaded machine; the faults end it in seconds.
DEADLINE_S = 150


@pytest.fixture
def tests_on_path(monkeypatch):
    """Workers (and this process) import ``hostile_specs`` from tests/."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))


def assert_named_failure(done, pattern: str) -> None:
    assert done.status == 1, done.describe()
    assert re.search(pattern, done.stderr, re.M), done.describe()
    assert "Traceback" not in done.stderr + done.stdout, done.describe()
    assert not done.survivors, f"processes left behind: {done.survivors}\n{done.describe()}"


# ------------------------------------------------------------ a model failing inside the run


@pytest.mark.parametrize("spec, where, words", [
    ("FORWARD_RAISES", r"rank 1, step 1 \(1F0\)", r"ValueError: forward exploded on purpose"),
    ("BACKWARD_RAISES", r"rank 1, step 4 \(1B0\)", r"ArithmeticError: backward exploded on purpose"),
    ("RAISES_BASE_EXCEPTION", r"rank 1, step 1 \(1F0\)", r"Refusal: not an Exception"),
    ("RAISES_INTERRUPT_SUBCLASS", r"rank 1, step 1 \(1F0\)", r"InterruptLike: raised by the model"),
    ("EXITS_IN_FORWARD", r"rank 1, step 1 \(1F0\)", r"it called sys\.exit\(0\), which does not end a run as a success"),
])
def test_a_model_failing_on_one_rank_ends_the_run_naming_rank_instruction_and_line(spec, where, words,
                                                                                    tests_on_path):
    done = run_pipec("run", *GPIPE_2, "--steps", "2", "--timeout", "60", "--model", f"hostile_specs:{spec}",
                     deadline_s=DEADLINE_S)
    assert_named_failure(done, rf"^{where}: the instruction failed: {words}.*\(raised at hostile_specs\.py:\d+")
    assert "step 1 loss" not in done.stdout, done.describe()  # it failed in step 1: no step was reported done


@pytest.mark.parametrize("spec, words", [
    ("LOSS_RAISES", r"rank 1, step \d+ \(1F\d\): the instruction failed: RuntimeError: loss exploded"),
    ("LOSS_NOT_A_TENSOR", r"rank 1, step \d+ \(1F\d\): the instruction failed: TypeError"),
])
def test_a_wrong_loss_function_ends_the_run_naming_the_last_stage(spec, words, tests_on_path):
    done = run_pipec("run", *GPIPE_2, "--steps", "1", "--timeout", "60", "--model", f"hostile_specs:{spec}",
                     deadline_s=DEADLINE_S)
    assert_named_failure(done, words)


# ------------------------------------------------------------ refused before any worker starts


@pytest.mark.parametrize("spec, words", [
    ("OPTIMIZER_RAISES", "make_optimizer(parameters) failed: TypeError: optimizer factory exploded"),
    ("OPTIMIZER_NONE", "make_optimizer(parameters) returned NoneType, not a torch.optim.Optimizer"),
    ("OPTIMIZER_NOT_ONE", "make_optimizer(parameters) returned list, not a torch.optim.Optimizer"),
    ("EXITS_IN_OPTIMIZER", "make_optimizer(parameters) failed: it called sys.exit(0)"),
    ("EXITS_IN_BUILD", "build_chunk(config, 0, 2, seed) failed: it called sys.exit(0)"),
])
def test_a_wrong_spec_function_is_refused_before_launch_and_exit_0_is_no_success(spec, words, tests_on_path,
                                                                                capsys, no_launch):
    status = main(["run", *GPIPE_2, "--model", f"hostile_specs:{spec}"])
    err = capsys.readouterr().err
    assert status == 1, err
    assert f"model spec hostile_specs:{spec}: {words}" in err, err
    assert "Traceback" not in err


def test_a_spec_module_that_exits_0_on_import_is_refused(tmp_path, monkeypatch, capsys, no_launch):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status = main(["run", *GPIPE_2, "--model", "exits_on_import:SPEC"])
    err = capsys.readouterr().err
    assert status == 1, err
    assert "cannot import module 'exits_on_import': it called sys.exit(0)" in err, err


# ------------------------------------------------------------ checkpoints for --resume


def _checkpoint(path, *, step=1, optimizer=None, data=None, model=None) -> str:
    """A checkpoint of the built-in model as ``pipec run --save`` writes it, with parts replaced."""
    whole = build_model(ModelConfig(), 0).state_dict() if model is None else model
    checkpoints.write_checkpoint(str(path), whole, {} if optimizer is None else optimizer, step=step, seed=0,
                                 data={"source": "synthetic_batch", "steps": step} if data is None else data,
                                 meta={})
    return str(path)


def test_a_checkpoint_missing_a_key_or_of_another_shape_is_refused_naming_the_key(tmp_path):
    whole = build_model(ModelConfig(), 0).state_dict()
    missing = dict(whole)
    del missing["layers.3.mlp.w2.weight"]
    read = checkpoints.read_checkpoint(_checkpoint(tmp_path / "missing.pt", model=missing))
    with pytest.raises(UsageError, match=r"has no 'layers\.3\.mlp\.w2\.weight'"):
        checkpoints.load_modules([build_model(ModelConfig(), 0)], read.model, "missing.pt")
    reshaped = dict(whole, **{"head.weight": torch.zeros(3, 3)})
    read = checkpoints.read_checkpoint(_checkpoint(tmp_path / "shape.pt", model=reshaped))
    with pytest.raises(UsageError, match=r"'head\.weight' is \(3, 3\) in the checkpoint"):
        checkpoints.load_modules([build_model(ModelConfig(), 0)], read.model, "shape.pt")


@pytest.mark.parametrize("optimizer, words", [
    ({"head.weight": {"momentum_buffer": "not a tensor"}}, "'momentum_buffer' of 'head.weight' is a str"),
    ({"head.weight": {"momentum_buffer": [1.0, 2.0]}}, "'momentum_buffer' of 'head.weight' is a list"),
    ({"no.such.weight": {"momentum_buffer": torch.zeros(1)}}, "names 'no.such.weight'"),
    ({"norm.weight": {"momentum_buffer": torch.zeros(10_000)}}, "has 10000 values, the tensor 32"),
])
def test_a_checkpoint_with_an_unusable_optimizer_state_is_refused_when_read(tmp_path, optimizer, words):
    path = _checkpoint(tmp_path / "ckpt.pt", optimizer=optimizer)
    with pytest.raises(UsageError, match="not a usable pipec checkpoint") as caught:
        checkpoints.read_checkpoint(path)
    assert words in str(caught.value)


def test_a_skewed_data_position_is_refused_before_launch(tmp_path, capsys, no_launch):
    path = _checkpoint(tmp_path / "skewed.pt", step=1, data={"source": "synthetic_batch", "steps": 7})
    status = main(["run", *GPIPE_2, "--steps", "3", "--resume", path])
    err = capsys.readouterr().err
    assert status == 1, err
    assert "its data position is at step 7 and its model after step 1" in err, err
    assert "Traceback" not in err


def test_an_optimizer_state_of_pathological_size_is_refused_unread(tmp_path, monkeypatch):
    # many entries, as a hostile file holds millions: past the structure limit, nothing is unpickled
    many = {f"layers.{i}.x": {"step": float(i)} for i in range(2000)}
    path = _checkpoint(tmp_path / "huge.pt", optimizer=many)
    monkeypatch.setattr(checkpoints, "STRUCTURE_LIMIT", 20_000)

    def no_load(*args, **kwargs):
        raise AssertionError("the checkpoint was unpickled")

    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(UsageError, match=r"its structure .* past the limit of 20000 bytes; refused unread"):
        checkpoints.read_checkpoint(path)


def test_checkpoints_are_read_without_arbitrary_pickles(tmp_path):
    # a pickle that would run code when loaded: weights_only refuses it, as a named error
    class Planted:
        def __reduce__(self):
            return (os.system, ("echo planted > " + str(tmp_path / "ran"),))

    path = tmp_path / "planted.pt.resume"
    torch.save({"format": checkpoints.FORMAT, "planted": Planted()}, str(path))
    with pytest.raises(UsageError, match="is not a pipec checkpoint"):
        checkpoints.read_checkpoint(str(path))
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------ a full disk under --save and --trace


class _FullDisk:
    """A file that takes ``room`` bytes and then fails as a full disk does (ENOSPC)."""

    def __init__(self, stream, room: int):
        self.stream, self.room = stream, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.close()


@pytest.fixture
def full_disk(monkeypatch):
    """Every file the atomic writer opens fills up after 100 bytes (its temporary file, beside the target)."""
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *args, **kwargs: _FullDisk(real(*args, **kwargs), 100))


def test_a_full_disk_under_save_is_named_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path / "model.pt", step=1)
    before = {name: (tmp_path / name).read_bytes() for name in ("model.pt", "model.pt.resume")}
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *args, **kwargs: _FullDisk(real(*args, **kwargs), 100))
    with pytest.raises(UsageError, match=r"cannot write the checkpoint '.*model\.pt\.resume': No space left"):
        _checkpoint(path, step=2)
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt.resume"]  # no temporary file left
    assert checkpoints.read_checkpoint(path).step == 1


def test_a_full_disk_under_trace_is_named_and_the_previous_trace_stays(tmp_path, full_disk):
    from pipec.runtime.trace import write_chrome_trace

    path = tmp_path / "run.json"
    path.write_text('{"old": true}')
    with pytest.raises(UsageError, match=r"cannot write .*run\.json': No space left"):
        write_chrome_trace(str(path), [[{"name": "x" * 500, "ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0}]])
    assert path.read_text() == '{"old": true}'
    assert os.listdir(tmp_path) == ["run.json"]


# ------------------------------------------------------------ outputs that would overwrite each other


@pytest.mark.parametrize("options, words", [
    (["--save", "{d}/a.pt", "--trace", "{d}/a.pt"], "--save {d}/a.pt is also --trace's file"),
    (["--save", "{d}/a.pt", "--trace", "{d}/./a.pt.resume"], "--trace {d}/./a.pt.resume is also --save's training state's file"),
    (["--trace", "{d}/old.pt", "--resume", "{d}/old.pt", "--steps", "3"], "--trace {d}/old.pt is also --resume's file"),
    (["--save", "{d}/old.pt.resume", "--resume", "{d}/old.pt", "--steps", "3"], "is also --resume's training state"),
])
def test_outputs_naming_each_other_or_an_input_are_refused_up_front(options, words, tmp_path, capsys, no_launch):
    _checkpoint(tmp_path / "old.pt", step=1)
    before = (tmp_path / "old.pt.resume").read_bytes()
    status = main(["run", *GPIPE_2, *[option.format(d=tmp_path) for option in options]])
    err = capsys.readouterr().err
    assert status == 1, err
    assert words.format(d=tmp_path) in err, err
    assert (tmp_path / "old.pt.resume").read_bytes() == before


def test_a_checkpoint_saved_in_place_of_the_one_resumed_is_still_allowed(tmp_path, capsys, monkeypatch):
    from pipec.commands import run as run_command

    launched = []
    monkeypatch.setattr(run_command, "launch", lambda *args, **kwargs: launched.append(args) or
                        run_command.LaunchResult(ok=True))
    path = _checkpoint(tmp_path / "ckpt.pt", step=1)
    assert main(["run", *GPIPE_2, "--steps", "3", "--resume", path, "--save", path]) == 0, capsys.readouterr().err
    assert launched


def test_a_worker_under_torchrun_refuses_the_same_clash():
    from pipec.runtime.worker import make_plan, parse_run_config

    with pytest.raises(UsageError, match="is also --trace's file"):
        make_plan(parse_run_config([*GPIPE_2, "--save", "x.pt", "--trace", "x.pt"]), 2)


# ------------------------------------------------------------ pipec profile on a layer that hangs


def test_profile_of_a_hanging_layer_ends_at_its_timeout_naming_the_layer(tmp_path, tests_on_path):
    out = tmp_path / "layers.json"
    done = run_pipec("profile", "--model", "hostile_specs:HANGING_LAYER", "--repeats", "1", "--timeout", "2",
                     "-o", str(out), deadline_s=DEADLINE_S)
    assert_named_failure(done, r"^model spec hostile_specs:HANGING_LAYER: layer 1 \(1\)'s forward did not "
                               r"return within 2 s \(pipec profile --timeout\)")
    assert not out.exists()
