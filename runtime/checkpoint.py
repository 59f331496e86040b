"""Checkpoints: what ``--save F`` writes beside the model, and what ``--resume F`` restores.

``--save F`` keeps its meaning: F is one state_dict with the whole model's
keys (``build_model(config, seed).state_dict()``'s). Beside it, ``F.resume``
holds everything a run needs to go on as if it had never stopped:

* ``model``: the same whole-model state_dict;
* ``optimizer``: the optimizer's per-parameter state keyed by the
  parameter's name in the whole model (``layers.3.mlp.w2.weight`` ->
  ``{"momentum_buffer": tensor}``), not by a rank's parameter index, so a
  checkpoint written under one schedule and rank count resumes under
  another: each rank takes the entries of the parameters it steps;
* ``step``: the optimizer steps taken; ``seed``; ``data``: the data
  position (``runtime/data.py``'s ``state_after``);
* what wrote it (``schedule``, ``params``, ``ranks``, ``dtype``), for people.

The optimizer's hyperparameters (learning rate, momentum) are the model
spec's ``make_optimizer``'s on resume, not the checkpoint's: its state is
restored, its settings are the code's. Randomness drawn by the model itself
(dropout) is not part of a checkpoint.

``F.resume`` is written first, then F, each through the atomic writer: a kill
leaves each file whole, old or new, and ``--resume`` reads ``F.resume``
alone, which holds the model too. A ``{step}`` in F names every checkpoint's
own files (``ckpt-{step}.pt``); without it each checkpoint replaces the last.

The file is read with ``torch.load(weights_only=True)`` (no arbitrary pickle:
only tensors and plain containers), memory-mapped, after the guarded
reader's checks (a regular file, within ``CHECKPOINT``'s limit), and its
structure is checked before anything is taken from it.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, NamedTuple

import torch
from torch import nn

from pipec.errors import UsageError
from pipec.runtime.family import runtime_family

FORMAT = "pipec checkpoint"
VERSION = 1
SUFFIX = ".resume"
STEP_FIELD = "{step}"


class Checkpoint(NamedTuple):
    """A checkpoint read back (see the module docstring for the fields)."""

    step: int
    seed: int
    data: dict
    model: dict
    optimizer: dict
    meta: dict


def resume_file(path: str) -> str:
    """The training-state file of a checkpoint whose model file is ``path``."""
    return path + SUFFIX


def checkpoint_path(template: str, step: int) -> str:
    """The model file of the checkpoint after ``step``: ``template`` with ``{step}`` filled in."""
    return template.replace(STEP_FIELD, str(step))


# ------------------------------------------------------------------ writing


def write_checkpoint(path: str, model: dict, optimizer: dict, *, step: int, seed: int, data: dict,
                     meta: dict) -> None:
    """Write ``path.resume`` (everything) and then ``path`` (the model's state_dict), each atomically.

    Args:
        path: the model file (``--save``'s, ``{step}`` already filled in).
        model: the whole model's state_dict (CPU tensors).
        optimizer: parameter name -> its optimizer state (CPU tensors and numbers).
        step, seed, data, meta: see the module docstring.
    Raises:
        UsageError: a file cannot be written (the atomic writer's message).
    """
    record = {"format": FORMAT, "version": VERSION, "step": step, "seed": seed, "data": dict(data),
              "model": model, "optimizer": optimizer, "meta": dict(meta)}
    save_atomically(record, resume_file(path), "the checkpoint")
    save_atomically(model, path, "the saved model")  # the old file stays whole until then


def save_atomically(value: Any, path: str, what: str) -> None:
    """``torch.save(value)`` to ``path`` through the atomic writer.

    torch.save turns a failed write (a full disk) into a RuntimeError of its own that does not say why;
    the stream records the OSError underneath, which is raised instead, so that the atomic writer names
    the file and the reason and leaves the previous file whole.

    Raises:
        UsageError: ``cannot write WHAT 'PATH': REASON``.
    """
    from pipec.compiler.atomic_write import atomic_writer

    with atomic_writer(path, binary=True, what=what) as stream:
        out = _RecordingStream(stream)
        try:
            torch.save(value, out)
        except RuntimeError:
            if out.error is None:
                raise
            raise out.error from None


class _RecordingStream:
    """A binary stream that keeps the OSError its write raised (``save_atomically``)."""

    def __init__(self, stream):
        self.stream, self.error = stream, None

    def write(self, data) -> int:
        try:
            return self.stream.write(data)
        except OSError as error:
            self.error = error
            raise

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def named_optimizer_state(optimizer: torch.optim.Optimizer | None, names: dict[int, str]) -> dict:
    """The optimizer's per-parameter state keyed by parameter name (CPU copies).

    Args:
        optimizer: the rank's optimizer, or None (it steps nothing).
        names: ``id(parameter)`` -> the parameter's name in the whole model.
    """
    if optimizer is None:
        return {}
    out = {}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if state:
                out[names[id(parameter)]] = {key: _cpu(value) for key, value in state.items()}
    return out


def _cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


# ------------------------------------------------------------------ reading


def read_checkpoint(path: str) -> Checkpoint:
    """The checkpoint ``--resume PATH`` names: ``PATH.resume`` beside a model file, or the ``.resume`` file itself.

    Raises:
        UsageError: no checkpoint there (a model file without its ``.resume``
            says so), a file that is not a pipec checkpoint, or one whose
            structure is broken, each naming the file.
    """
    from pipec.compiler.guarded_read import CHECKPOINT, regular_file_size

    if not path.endswith(SUFFIX) and os.path.exists(path) and not os.path.exists(resume_file(path)):
        raise UsageError(f"--resume {path}: no checkpoint beside it ({resume_file(path)} does not exist): a model "
                         "file alone holds no optimizer state, step or data position (pipec run --save F writes "
                         "both F and F.resume)")
    source = path if path.endswith(SUFFIX) else resume_file(path)
    regular_file_size(source, CHECKPOINT)
    _check_record_size(source)
    try:
        record = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a broken or foreign file fails in torch's own ways
        raise UsageError(f"--resume: {source} is not a pipec checkpoint ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None
    return _checked(record, source)


# The most bytes of a checkpoint's pickled structure (names, numbers, containers: the tensors' data are
# kept apart in the file) and the most records (tensors' storages) it may hold. A real checkpoint's
# structure is some hundred bytes per tensor; one far past these (millions of optimizer entries, a huge
# list of numbers) would take minutes and gigabytes to unpickle, so it is refused before any of it is read.
STRUCTURE_LIMIT = 256 * 1024 * 1024
RECORD_LIMIT = 1_000_000


def _check_record_size(source: str) -> None:
    """Refuse, from the zip directory alone (nothing unpickled), a checkpoint whose structure is past
    ``STRUCTURE_LIMIT`` bytes or that holds more than ``RECORD_LIMIT`` records.

    Raises:
        UsageError: naming the file and the limit; a file that is no zip archive is left to ``torch.load``.
    """
    import zipfile

    try:
        with zipfile.ZipFile(source) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # torch.load says what it is not
    structure = sum(entry.file_size for entry in entries if entry.filename.endswith(".pkl"))
    if structure > STRUCTURE_LIMIT:
        raise UsageError(f"--resume: {source} is not a usable pipec checkpoint: its structure (optimizer state, "
                         f"names) is {structure} bytes, past the limit of {STRUCTURE_LIMIT} bytes; refused unread")
    if len(entries) > RECORD_LIMIT:
        raise UsageError(f"--resume: {source} is not a usable pipec checkpoint: it holds {len(entries)} records, "
                         f"past the limit of {RECORD_LIMIT}; refused unread")


def _checked(record: Any, source: str) -> Checkpoint:
    def fail(why: str) -> UsageError:
        return UsageError(f"--resume: {source} is not a usable pipec checkpoint: {why}")

    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise fail(f"no \"format\": \"{FORMAT}\" record")
    if record.get("version") != VERSION:
        raise fail(f"version {record.get('version')!r}, this pipec reads version {VERSION}")
    step, seed = record.get("step"), record.get("seed")
    for name, value in (("step", step), ("seed", seed)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
            raise fail(f"its {name} is {value!r}, not an integer in 0 .. 2^63 - 1")
    model, optimizer = record.get("model"), record.get("optimizer")
    if not isinstance(model, dict) or not model or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise fail("its model is not a state_dict of named tensors")
    if not isinstance(optimizer, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) and all(isinstance(key, str) for key in v)
            for k, v in optimizer.items()):
        raise fail("its optimizer state is not keyed by parameter names")
    problem = _optimizer_problem(optimizer, model)
    if problem is not None:
        raise fail(problem)
    data, meta = record.get("data"), record.get("meta", {})
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise fail("its data position is not a record")
    if data.get("steps") != step:  # state_after(step) is saved with the step: another count skews the data
        raise fail(f"its data position is at step {data.get('steps')!r} and its model after step {step}: "
                   "resuming would train on other batches than the run it continues")
    return Checkpoint(step, seed, data, model, optimizer, meta if isinstance(meta, dict) else {})


def _optimizer_problem(optimizer: dict, model: dict) -> str | None:
    """What is wrong with a checkpoint's named optimizer state, or None: every entry must name a tensor of
    the model and hold only tensors (no more values than that tensor) and plain numbers.
    """
    for name, entry in optimizer.items():
        if name not in model:
            return f"its optimizer state names '{name}', which is no tensor of its model"
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                if value.numel() > max(1, model[name].numel()):
                    return (f"its optimizer state '{key}' of '{name}' has {value.numel()} values, the tensor "
                            f"{model[name].numel()}")
            elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                return f"its optimizer state '{key}' of '{name}' is a {type(value).__name__}, not a tensor or number"
    return None


# ------------------------------------------------------------------ restoring


def load_modules(modules: Iterable[nn.Module], model: dict, source: str) -> None:
    """Copy the checkpoint's tensors into each module, key for key (a module's keys are the whole model's).

    Raises:
        UsageError: a module's key missing from the checkpoint, or a tensor of another shape: the
            checkpoint is of another model (or another config).
    """
    for module in {id(m): m for m in modules}.values():
        own = module.state_dict()
        missing = [name for name in own if name not in model]
        if missing:
            raise UsageError(f"--resume: the checkpoint has no '{missing[0]}' ({len(missing)} of this model's "
                             f"tensors are missing): it was saved from another model or config ({source})")
        for name, tensor in own.items():
            if tuple(model[name].shape) != tuple(tensor.shape):
                raise UsageError(f"--resume: '{name}' is {tuple(model[name].shape)} in the checkpoint and "
                                 f"{tuple(tensor.shape)} in this model: it was saved from another config ({source})")
        module.load_state_dict({name: model[name] for name in own}, strict=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer | None, names: dict[int, str], saved: dict) -> None:
    """Give each parameter the optimizer the state the checkpoint keeps under its name.

    A parameter with no entry starts without state (as before its first
    step); the optimizer's hyperparameters stay its own.

    Raises:
        UsageError: a state tensor whose shape does not fit its parameter.
    """
    if optimizer is None:
        return
    current = optimizer.state_dict()
    state = {}
    index = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            name = names[id(parameter)]
            entry = saved.get(name)
            if entry:
                for key, value in entry.items():
                    if (isinstance(value, torch.Tensor) and value.dim() > 0
                            and value.numel() != parameter.numel()):
                        raise UsageError(f"--resume: the optimizer state '{key}' of '{name}' has "
                                         f"{value.numel()} values, the parameter {parameter.numel()}")
                state[index] = {key: (value.reshape(parameter.shape) if isinstance(value, torch.Tensor)
                                      and value.dim() > 0 else value) for key, value in entry.items()}
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def parameter_names(modules: Iterable[nn.Module]) -> dict[int, str]:
    """``id(parameter)`` -> its name, over modules whose names are the whole model's."""
    return {id(p): name for module in modules for name, p in module.named_parameters()}


# ------------------------------------------------- one rank's part, gathered


def rank_part(context, stages: dict) -> dict:
    """What this rank contributes to a checkpoint of a run of interpreter steps (CPU copies).

    Returns:
        {"model": ..., "optimizer": ...}, as the program's family keeps them
        (``RuntimeFamily.checkpoint_part``): for activation passing the state_dicts
        of its chunks and the named state of its optimizer; under weight passing
        the owned layers' (or shards') state.
    """
    return runtime_family(context.program).checkpoint_part(context, stages)


def merged_parts(context, parts: list[dict]) -> tuple[dict, dict]:
    """The whole model's state_dict and the named optimizer state from every rank's ``rank_part`` (rank order).

    The family merges them (``RuntimeFamily.merged_parts``): a replicated chunk's
    copies are equal (their gradients were all-reduced), the first is kept; under
    weight passing each layer comes from its owner, or is joined from the shards.
    """
    return runtime_family(context.program).merged_parts(context, parts)


def restore_optimizer(context, stages: dict, saved: dict) -> None:
    """Give this rank's optimizer the checkpoint's state of the parameters (or shards) it steps."""
    runtime_family(context.program).restore_optimizer(context, stages, saved)


def check_resumable(checkpoint: Checkpoint, steps: int, seed: int | None, source: str) -> int:
    """Check that a run of ``steps`` total steps can go on from ``checkpoint``; returns the seed to use.

    Raises:
        UsageError: nothing left to train (``--steps`` counts every step, the
            checkpoint's included), or a ``--seed`` other than the checkpoint's.
    """
    if checkpoint.step >= steps:
        raise UsageError(f"--resume {source}: the checkpoint was taken after step {checkpoint.step}, and --steps "
                         f"{steps} counts every step of the run, those before it included: nothing is left to "
                         f"train (pass --steps {checkpoint.step + max(1, steps)} for {max(1, steps)} more)")
    if seed is not None and seed != checkpoint.seed:
        raise UsageError(f"--resume {source}: --seed {seed}, but the checkpoint was trained with seed "
                         f"{checkpoint.seed}; its data would not go on (leave --seed out, or pass --seed "
                         f"{checkpoint.seed})")
    return checkpoint.seed


__all__ = [
    "Checkpoint", "FORMAT", "SUFFIX", "VERSION", "check_resumable", "checkpoint_path", "load_modules",
    "load_optimizer_state", "merged_parts", "named_optimizer_state", "parameter_names", "rank_part",
    "read_checkpoint", "restore_optimizer", "resume_file", "save_atomically", "write_checkpoint",
]
