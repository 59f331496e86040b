"""What a training run was asked to do: ``RunConfig``, the runtime's one view of the command line.

The command line is parsed where it is read (``runtime.worker.build_parser``
for a worker, ``pipec run``'s own parser for the launcher); right there
``RunConfig.from_args`` turns the parsed arguments into this frozen, typed
record, and the runtime reads nothing else: no module below the command line
takes an ``argparse.Namespace``. What a run settles later (the seed, once a
``--resume`` checkpoint is read) makes a new record (``dataclasses.replace``).

The constants below are the command line's defaults. They live here, in a
module that loads no torch, because ``pipec``'s parser is built for every
command: ``pipec check`` must not pay for importing torch.
"""
from __future__ import annotations

import dataclasses
import os

DEFAULT_STEPS = 5
DEFAULT_SEED = 0
DEFAULT_TIMEOUT_S = 60.0
# How long start-up and group formation may take (``--join-timeout``): workers start at different moments.
DEFAULT_JOIN_TIMEOUT_S = 300.0
DEFAULT_BACKEND = "gloo"
DEFAULT_DTYPE = "fp32"
# The built-in LLaMA-style decoder (``runtime.model.LLAMA``).
DEFAULT_MODEL = "pipec.runtime.model:LLAMA"
# ``pipec profile``'s measured passes per layer when not told (``runtime.profile``).
DEFAULT_REPEATS = 20
# `pipec profile`: the longest one layer's forward or backward (or the whole model's pass) may take, seconds.
DEFAULT_PROFILE_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The options of one training run (``runtime.worker.add_training_arguments``), typed.

    Attributes:
        target: TARGET: a ``.pipe`` file or a shipped schedule's name.
        defines: ``-D NAME=VALUE`` schedule parameters, as given.
        steps: ``--steps``: training steps, those before a ``--resume``'s checkpoint included.
        backend: ``--backend``: ``gloo`` (CPU) or ``nccl`` (one GPU per rank).
        trace: ``--trace``: the Chrome trace file to write, or None.
        save: ``--save``: the model file to write (``{step}`` replaced by the step), or None.
        save_every: ``--save-every``: also save after every K-th step; None: after the last only.
        resume: ``--resume``: the ``--save`` file whose checkpoint the run goes on from, or None.
        seed: ``--seed``: the parameters' and the data's seed; None when not given. Settled by
            ``runtime.worker.resolve_checkpoint`` (the checkpoint's under ``--resume``, else
            ``DEFAULT_SEED``), so the config a ``Plan`` holds has an int.
        timeout: ``--timeout``: the longest wait of one instruction, seconds.
        model: ``--model``: the model spec, ``MODULE:ATTR``.
        config_overrides: ``--config NAME=VALUE`` overrides of the model's config, as given.
        partition: ``--partition``: the partition file that cuts the model's layers, or None.
        costs: ``--costs``: the cost file the target is compiled with, or None.
        dtype: ``--dtype``: the compute precision's name (``runtime.precision.PRECISIONS``).
        clip_grad_norm: ``--clip-grad-norm``: the gradients' largest global norm, or None.
        inject: ``--inject KIND:RANK:INDEX``: a test-only fault, unparsed, or None.
        join_timeout: ``--join-timeout``: the deadline of getting ready (``phases.GETTING_READY``), seconds.
        program: ``--program``: the compiled program's JSON file to run instead of compiling
            TARGET, or None (always None for ``pipec run``, which writes that file itself).
    """

    target: str
    defines: tuple[str, ...] = ()
    steps: int = DEFAULT_STEPS
    backend: str = DEFAULT_BACKEND
    trace: str | None = None
    save: str | None = None
    save_every: int | None = None
    resume: str | None = None
    seed: int | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    model: str = DEFAULT_MODEL
    config_overrides: tuple[str, ...] = ()
    partition: str | None = None
    costs: str | None = None
    dtype: str = DEFAULT_DTYPE
    clip_grad_norm: float | None = None
    inject: str | None = None
    program: str | None = None
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S

    @classmethod
    def from_args(cls, args) -> RunConfig:
        """The run configuration of parsed training arguments.

        Args:
            args: an ``argparse.Namespace`` with ``add_training_arguments``'s
                options: a worker's (its parser sets the defaults) or ``pipec
                run``'s (it keeps only what was given: an option it leaves None,
                or lacks, takes the worker's default, the constants above).
        Returns:
            the frozen ``RunConfig``; the seed stays None when not given.
        """
        def given(name: str, default=None):
            value = getattr(args, name, None)
            return default if value is None else value

        return cls(
            target=args.target,
            defines=tuple(given("defines", ())),
            steps=given("steps", DEFAULT_STEPS),
            backend=given("backend", DEFAULT_BACKEND),
            trace=given("trace"),
            save=given("save"),
            save_every=given("save_every"),
            resume=given("resume"),
            seed=given("seed"),
            timeout=given("timeout", DEFAULT_TIMEOUT_S),
            model=given("model", DEFAULT_MODEL),
            config_overrides=tuple(given("config", ())),
            partition=given("partition"),
            costs=given("costs"),
            dtype=given("dtype", DEFAULT_DTYPE),
            clip_grad_norm=given("clip_grad_norm"),
            inject=given("inject"),
            program=given("program"),
            join_timeout=given("join_timeout", DEFAULT_JOIN_TIMEOUT_S),
        )


# A checkpoint saved over the one resumed from (`--resume F --save F`, docs/runtime.md) is allowed: the
# checkpoint is read whole (memory-mapped) before the run, and each file is replaced by a rename, which
# leaves the mapped old file intact until the new one is complete.
_IN_PLACE = {("--save", "--resume"), ("--save's training state", "--resume's training state"),
             ("--save's training state", "--resume")}


def output_clash(config: RunConfig) -> str | None:
    """Why the run's outputs cannot be written as given, or None: ``--save`` and ``--trace`` naming the same
    file (the trace would replace the saved model), or either naming one of the run's inputs (the
    program, the checkpoint resumed from, the cost or partition file, the target): a run must not
    destroy what it reads; only a checkpoint saved in place of the one resumed from (``_IN_PLACE``) is
    allowed. Paths are compared as the files they name (links and ``..`` resolved).
    """
    def real(path: str) -> str:
        return os.path.realpath(path)

    outputs = [(f"--{option}", path) for option, path in (("save", config.save), ("trace", config.trace)) if path]
    if config.save:
        outputs.append(("--save's training state", config.save + ".resume"))
    inputs = [(f"--{option}", path) for option, path in (("program", config.program), ("costs", config.costs),
                                                          ("partition", config.partition), ("resume", config.resume))
              if path]
    if config.resume:
        inputs.append(("--resume's training state", config.resume + ".resume"))
    if os.path.isfile(config.target):
        inputs.append(("the target", config.target))
    for index, (option, path) in enumerate(outputs):
        for other, other_path in outputs[index + 1:] + inputs:
            if real(path) == real(other_path) and (option, other) not in _IN_PLACE:
                return (f"{option} {path} is also {other}'s file: the run would overwrite it; give "
                        f"{option} a file of its own")
    return None


__all__ = ["DEFAULT_BACKEND", "DEFAULT_DTYPE", "DEFAULT_JOIN_TIMEOUT_S", "DEFAULT_MODEL", "DEFAULT_PROFILE_TIMEOUT_S",
           "DEFAULT_SEED", "DEFAULT_STEPS", "DEFAULT_TIMEOUT_S", "RunConfig", "output_clash"]
