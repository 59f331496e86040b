"""One worker of a pipelined training run: ``python -m pipec.runtime TARGET ...``.

Started by torchrun (or ``pipec run``) once per rank, it reads RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE from the environment (without them it runs
alone as rank 0 of 1), gets the program: from ``--program FILE``, the JSON
``pipec run`` compiled once for all workers, or else by compiling the target
itself (compilation is deterministic, so every rank gets the same program;
a file is proved by rank 0's check, ``program_refusal``, before any step),
joins the process group on its device (on GPU the one the program's device map
gives it), builds only its own chunks (under weight passing, where every rank
runs every layer, that is every chunk), and runs K training steps through the
interpreter. Rank 0 prints
``step k loss X`` per step (k from 1; the loss of the whole batch, the mean of
its microbatch losses). ``--save`` gathers the chunks' parameters to rank 0
(one copy of replicated chunks; under weight passing each layer from its
owner) and writes the whole model's state_dict;
``--trace`` gathers every instruction's timing to rank 0 as one Chrome trace.
Every family trains through this one loop (``train``); what differs is the
family's ``Trainer`` (``runtime/family.py``): what a rank builds and what one
step runs (a sequence ring, ``runtime/sequence.py``: every rank runs the whole
model on its chunks of the sequence).

A fault (a wait past ``--timeout``, a peer that died) prints
``rank R, step S (INSTR): waited T s for rank Q ...`` to stderr and ends the
process at once with status 1: ``os._exit``, because tearing down a process
group whose peer is gone can itself hang. A run that succeeds also ends with
``os._exit`` (``end_process``), once the group is left and the output flushed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Iterator, NamedTuple, Sequence

from pipec.compiler.guarded_read import count_arg, positive_count_arg, positive_decimal_arg, seconds_arg
from pipec.errors import PipecError, RuntimeFault, UsageError, printable
from pipec.runtime import phases, report
from pipec.runtime.family import placed_refusal
from pipec.runtime.config import (DEFAULT_BACKEND, DEFAULT_DTYPE, DEFAULT_JOIN_TIMEOUT_S, DEFAULT_MODEL, DEFAULT_SEED,
                                  DEFAULT_STEPS, DEFAULT_TIMEOUT_S, RunConfig, output_clash)

# How long joining the group may take. Workers start at different moments
# (importing torch, compiling the schedule, on other nodes), which has nothing
# to do with --timeout, the deadline of a training step's waits: the group's own
# timeout is --join-timeout (this by default), or --timeout when that is longer.
JOIN_ALLOWANCE_S = DEFAULT_JOIN_TIMEOUT_S
# Test-only faults planted with --inject KIND:RANK:INDEX: hang, stop (SIGSTOP), kill or exit at
# instruction INDEX of RANK, or start RANK late by INDEX seconds.
_INJECT_OPS = {"hang": "INJECT_HANG", "stop": "INJECT_STOP", "kill": "INJECT_KILL", "exit": "INJECT_EXIT"}
_LATE = "late"
# The first line every rank prints when rank 0's check rejects the --program file (``program_refusal``);
# the check's own message follows it.
PROGRAM_REFUSED = ("{file}: refused before the first step: the program fails pipec's checks "
                   "(run on rank 0, as `pipec check` runs them):")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipec.runtime",
        description="One worker of a pipelined run; start it with torchrun --nproc-per-node P (or use `pipec run`).",
    )
    add_training_arguments(parser, defaults=True)
    parser.add_argument("--program", metavar="FILE",
                        help="run this compiled program (JSON, as `pipec compile --format json` writes it) instead of "
                             "compiling TARGET; TARGET, -D and --costs then only name, in the trace, what it was compiled from")
    parser.add_argument("--join-timeout", dest="join_timeout", type=seconds_arg, default=DEFAULT_JOIN_TIMEOUT_S,
                        metavar="SECONDS",
                        help=f"deadline of getting ready: start-up, loading a checkpoint, building the model, joining "
                             f"the group and waiting for every rank's build; ranks start at different moments, on "
                             f"other machines, with models of any size (default {DEFAULT_JOIN_TIMEOUT_S:g})")
    return parser


def add_training_arguments(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The options of a training run, which a worker and ``pipec run`` share.

    Args:
        parser: the parser to add them to.
        defaults: True for the worker (the one place the defaults are set);
            False for ``pipec run``, which passes on only what it was given, so
            that a worker's default applies to everything else.
    """
    def default(value):
        return value if defaults else None

    parser.add_argument("target", metavar="TARGET", help="a .pipe file, or a shipped schedule's name (see `pipec list`)")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                        help="set a schedule parameter (repeatable)")
    parser.add_argument("--steps", type=count_arg, default=default(DEFAULT_STEPS), metavar="K",
                        help=f"training steps, those before a --resume's checkpoint included (default {DEFAULT_STEPS})")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=default(DEFAULT_BACKEND),
                        help="gloo (CPU, default) or nccl (one GPU per rank)")
    parser.add_argument("--trace", metavar="FILE", help="write every instruction's start and end as Chrome/Perfetto JSON")
    parser.add_argument("--save", metavar="FILE",
                        help="torch.save the whole model's state_dict after the last step as FILE, and the training "
                             "state (model, optimizer, step, data position) as FILE.resume; a {step} in FILE is "
                             "replaced by the step")
    parser.add_argument("--save-every", dest="save_every", type=positive_count_arg, metavar="K",
                        help="also save after every K-th step (needs --save)")
    parser.add_argument("--resume", metavar="FILE",
                        help="go on from the checkpoint --save FILE wrote (FILE.resume): parameters, optimizer "
                             "state, step count and data position")
    parser.add_argument("--seed", type=count_arg, metavar="S",
                        help=f"seed of the parameters and the data (default {DEFAULT_SEED}, or the checkpoint's "
                             "with --resume)")
    parser.add_argument("--timeout", type=seconds_arg, default=default(DEFAULT_TIMEOUT_S), metavar="SECONDS",
                        help=f"longest wait of one instruction; past it the run stops with a fault message "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    add_model_arguments(parser, defaults=defaults)
    parser.add_argument("--partition", metavar="FILE",
                        help="cut a model given by its layers (a spec with layers(config, seed)) into the program's "
                             "chunks as this partition file says (`pipec partition -o` writes one; default: "
                             "an even cut)")
    parser.add_argument("--costs", metavar="FILE", help="a JSON cost file, for schedules whose order depends on costs")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=default(DEFAULT_DTYPE),
                        help="compute precision: bf16 runs the forwards under autocast, keeps fp32 master weights, "
                             "optimizer state and gradient reductions, and sends bf16 activations (default fp32)")
    parser.add_argument("--clip-grad-norm", dest="clip_grad_norm", type=positive_decimal_arg, metavar="X",
                        help="before each optimizer step, scale the gradients so that their global norm over every "
                             "rank (replicas counted once) is at most X, as torch.nn.utils.clip_grad_norm_ does")
    # test-only: plant a fault in a worker (--inject KIND:RANK:INDEX)
    parser.add_argument("--inject", metavar="KIND:RANK:INDEX", help=argparse.SUPPRESS)


def add_model_arguments(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """``--model`` and ``--config``: the model spec and its config overrides (``load_model_spec``,
    ``override_config``), which training and ``pipec profile`` share.

    Args:
        parser: the parser to add them to.
        defaults: whether ``--model`` defaults to the built-in model here (see ``add_training_arguments``).
    """
    parser.add_argument("--model", default=DEFAULT_MODEL if defaults else None, metavar="MODULE:ATTR",
                        help="a model spec (default: the built-in LLaMA-style decoder)")
    parser.add_argument("--config", dest="config", action="append", default=[], metavar="NAME=VALUE",
                        help="override a field of the model's config, e.g. --config layers=16 (repeatable)")


def parse_run_config(argv: list[str] | None = None) -> RunConfig:
    """A worker's command line (``build_parser``; None: ``sys.argv``) as the run's configuration."""
    return RunConfig.from_args(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Run the worker; returns its exit status (a fault ends the process itself)."""
    config = parse_run_config(argv)
    die_with_launcher()
    # every phase from here on is under a deadline; `pipec run` reads the phase file, if it asked for one
    phases.start_watch(_announced_rank(), config.timeout, config.join_timeout, os.environ.get(phases.PHASE_DIR_ENV))
    try:
        rank, world, local_rank = launch_environment()
        report.start(rank)
        plan = make_plan(config, world)
        report.emit("load", program=plan.program.name)
        # before joining: a map this node cannot honour is every rank's mistake, not a fault
        index = device_index(plan.program.devices, rank, local_rank, _node_size(world)) if config.backend == "nccl" else None
        refusal = program_refusal(config, plan.program, rank)
    except PipecError as error:
        sys.stderr.write(error.render() + "\n")
        return 1
    signal.signal(signal.SIGTERM, lambda *_: die(f"rank {rank}: stopped by the launcher (another worker failed)"))
    phases.announce(phases.GROUP_FORMATION)
    if plan.inject and plan.inject.kind == _LATE and plan.inject.rank == rank:
        time.sleep(plan.inject.index)
    with fatal_errors(rank):
        device = join_group(config.backend, rank, world, local_rank, config.timeout, gpu=index,
                            join_timeout=config.join_timeout)
        report.emit("join", device=str(device))
        from pipec.runtime.agreement import check_same_training  # every node must train the same thing

        phases.announce(phases.FIRST_EXCHANGE)
        check_same_training(plan, world, refusal)  # the same program on every rank, and rank 0 proved it
        train(plan, rank, world, device)
        # The run's cyclic garbage (autograd graphs, communication works that
        # hold the group) is freed now, while the group and the interpreter are
        # alive, not by whatever collection happens to come later.
        gc.collect()
        phases.announce(phases.GROUP_EXIT)
        leave_group()
    return 0


def _announced_rank() -> int:
    """The rank the phase watch names before ``launch_environment`` has checked it (0 alone or unreadable)."""
    text = os.environ.get("RANK", "0")
    return int(text) if text.isascii() and text.isdigit() else 0


@contextlib.contextmanager
def fatal_errors(rank: int) -> Iterator[None]:
    """Turn any failure inside into a message on stderr and an immediate exit (``os._exit``)."""
    try:
        yield
    except RuntimeFault as fault:
        die(fault.render())
    except PipecError as error:
        die(f"rank {rank}: {error.render()}")
    except KeyboardInterrupt:
        die(f"rank {rank}: interrupted", status=130)
    except BaseException:  # a bug: show it, and do not hang in the process group's teardown
        die(f"rank {rank}: internal error\n{traceback.format_exc()}")


def die_with_launcher() -> None:
    """On Linux, ask the kernel to SIGKILL this worker when its launcher dies, so
    that a killed ``pipec run`` or torchrun leaves no worker behind."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own shutdown still stops the workers


def end_process(status: int) -> None:
    """Flush the output and end the process now, skipping the interpreter's teardown.

    A worker has left its group and written its files by then; what Python's
    finalization would still destroy (tensors, gloo's works and threads) it
    destroys in no set order with the interpreter half torn down, which now and
    then aborts a run that succeeded (``terminate called without an active
    exception``, status -6).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def die(message: str, status: int = 1) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
    finally:
        os._exit(status)


def launch_environment() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; alone when it is not set."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise UsageError("RANK and WORLD_SIZE must both be set to integers (start the workers with torchrun)") from None
    return rank, world, local_rank


def _node_size(world: int) -> int:
    """Ranks per node: torchrun's LOCAL_WORLD_SIZE; without it, one node holds the whole world."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise UsageError("LOCAL_WORLD_SIZE must be an integer (start the workers with torchrun)") from None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Plan:
    """What every rank derives from the arguments alone, before joining the group.

    Attributes:
        run: the run's configuration, its seed settled (``resolve_checkpoint``):
            what every step below reads of the command line.
        layouts: chunk position c -> what chunk c hands chunk c + 1
            (``payload.Layout``); None when no activation leaves its rank
            (weight passing) or the program is a sequence ring.
        precision: the run's compute precision (``--dtype``).
        checkpoint: with ``--resume``, the checkpoint the run goes on from
            (``runtime/checkpoint.py``); ``run.seed`` is then its seed.
    """

    run: RunConfig
    program: object
    spec: object
    config: object
    layouts: list | None
    precision: object
    inject: Injection | None = None
    checkpoint: object = None


def make_plan(config: RunConfig, world: int) -> Plan:
    """Get the program (``--program``'s file, or compile the target), load the model, check the arguments against the world size."""
    if config.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {config.steps}")
    if not config.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {config.timeout}")
    # importing torch and compiling take what they take on a loaded machine: part of joining, not --timeout's
    phases.announce(phases.START_UP)
    import torch  # noqa: F401

    program = load_program(config.program) if config.program else compile_program(config)
    if config.resume:
        phases.announce(phases.CHECKPOINT_LOAD)
    config, checkpoint = resolve_checkpoint(config)
    refusal = placed_refusal(program)
    if refusal is not None:
        raise UsageError(f"{config.target}: {refusal}")
    if world != program.num_ranks:
        from pipec.compiler.ir import resize_hint

        raise UsageError(
            f"{config.target} was compiled for {program.num_ranks} ranks, but WORLD_SIZE is {world}: "
            f"start {program.num_ranks} workers (torchrun --nproc-per-node {program.num_ranks}), or change "
            f"{resize_hint(program)}"
        )
    phases.announce(phases.MODEL_BUILD)  # importing the user's module, and under torchrun trying chunk 0
    spec = run_model_spec(config.model, config.partition, program)
    model_config = override_config(spec.config, config.config_overrides)
    precision = run_precision(config)
    # `pipec run` checked the model before starting the workers (check_plan_model): only what a worker
    # needs is redone then; under torchrun nothing was checked: say what is wrong before joining the group
    layouts = model_layouts(spec, model_config, program, config.seed, config.model, precision,
                            checked=bool(config.program))
    from pipec.runtime.stash import check_update_options

    check_update_options(config, program)
    inject = parse_injection(config.inject) if config.inject else None
    return Plan(config, program, spec, model_config, layouts, precision, inject, checkpoint)


def run_model_spec(name: str, partition: str | None, program):
    """The model spec ``--model NAME`` names, its chunks cut as the ``--partition`` file says when one is given.

    Args:
        name: ``--model``'s text.
        partition: ``--partition``'s file, or None.
        program: the compiled program the run trains with.
    Returns:
        the ``ModelSpec``; with a partition, one whose ``build_chunk`` cuts
        its layers as the file says (``layered.cut_by_partition``).
    Raises:
        UsageError: ``load_model_spec``'s, ``load_partition``'s (the file
            unreadable or malformed), ``cut_by_partition``'s (a spec that
            builds its own chunks, a stage count or placement other than the program's).
    """
    from pipec.runtime.model import load_model_spec

    spec = load_model_spec(name)
    if not partition:
        return spec
    from pipec.compiler.partition import load_partition
    from pipec.runtime.layered import cut_by_partition

    return cut_by_partition(spec, load_partition(partition), partition, program, name)


def resolve_checkpoint(config: RunConfig) -> tuple[RunConfig, object]:
    """Check ``--save-every`` and ``--resume``, read the checkpoint and settle the seed (the
    checkpoint's under ``--resume``, else ``--seed`` or the default).

    Returns:
        (``config`` with its seed settled, an int; the ``checkpoint.Checkpoint`` to go on from, or None).
    Raises:
        UsageError: ``--save-every`` without ``--save``; outputs that overwrite each other or an input
            (``config.output_clash``); ``check_resumable``'s and ``read_checkpoint``'s.
    """
    if config.save_every and not config.save:
        raise UsageError("--save-every K saves to the --save file: pass --save FILE too")
    clash = output_clash(config)
    if clash is not None:
        raise UsageError(clash)
    if not config.resume:
        return dataclasses.replace(config, seed=DEFAULT_SEED if config.seed is None else config.seed), None
    from pipec.runtime.checkpoint import check_resumable, read_checkpoint

    checkpoint = read_checkpoint(config.resume)
    seed = check_resumable(checkpoint, config.steps, config.seed, config.resume)
    return dataclasses.replace(config, seed=seed), checkpoint


def run_precision(config: RunConfig):
    """The run's compute precision (``--dtype``)."""
    from pipec.runtime.precision import precision

    return precision(config.dtype)


def model_layouts(spec, config, program, seed: int, name: str, precision=None, *, checked: bool = False):
    """Check that the model fits the program, and what each chunk hands the next.

    The program's family checks the model first (``RuntimeFamily.check_model``:
    a sequence ring, ``sequence.check_ring_model``, needs a spec that declares
    ``ring_model``, the model's mask, a ``seq_len`` its chunks and pieces cut).
    In a family that runs the model cut into chunks, the built-in model's
    layers must split into the program's chunks. Then ``runtime.model.check_model_cut``
    builds chunk 0 and runs it on one microbatch (and, when the spec declares
    no ``activation_shape``, runs that microbatch on through the chunks to
    find each boundary's layout).

    Args:
        checked: the model was checked before the workers started (``pipec
            run``): a declared layout is taken as it is, without running chunk 0 again.
    Returns:
        chunk position c -> the ``payload.Layout`` of chunk c's output; None
        in a family whose activations never leave their rank (weight passing)
        or that runs no chunks (a sequence ring). When the stages sit on groups of
        k ranks, what one member hands on: its share of the rows (``payload.share_layout``), or
        under context parallelism its tokens of each sequence (``payload.token_layout``).
    Raises:
        UsageError: ``model spec NAME: ...``, naming the function at fault, or the cut; rows that do not
            cut into the groups' shares.
    """
    from pipec.runtime.data import batch_microbatches
    from pipec.runtime.family import row_shares, runtime_family
    from pipec.runtime.model import ModelConfig, check_model_cut, chunk_layers, spec_label
    from pipec.runtime.payload import share_layout, token_layout

    family = runtime_family(program)
    family.check_model(spec, config, program, name)
    if not family.runs_chunks:
        return None
    if isinstance(config, ModelConfig):
        try:  # the cut must be even: say so before joining the group
            chunk_layers(config, 0, program.num_chunks)
        except UsageError as error:
            raise UsageError(f"{error} (--config layers=N sets the model's layer count)") from None
    passes = family.passes_activations
    declared = _declared_layout(spec, config) if passes else None
    if checked and (declared is not None or not passes):
        layouts = [declared] * (program.num_chunks - 1) if passes else None
    else:
        layouts = check_model_cut(spec, config, program.num_chunks, batch_microbatches(program), seed, declared,
                                  name, precision, passes, row_shares(program))
    if layouts and row_shares(program) > 1:
        layouts = [share_layout(layout, row_shares(program), f"{spec_label(name)}: chunk {c}'s output")
                   for c, layout in enumerate(layouts)]
    if layouts and program.stage_ring is not None:
        from pipec.runtime.placed import stage_ring_model, token_share

        seq_len = stage_ring_model(spec, config, program, name).seq_len
        tokens = len(token_share(program, program.stages[0].ranks[0], seq_len).positions)
        layouts = [token_layout(layout, tokens, seq_len, f"{spec_label(name)}: chunk {c}'s output")
                   for c, layout in enumerate(layouts)]
    return layouts


def check_plan_model(spec, config, program, seed: int, name: str, precision=None):
    """Check, before any worker starts, that the model spec fits ``program`` (``model_layouts``: chunk 0
    built and run on microbatch 0 of step 0, drawn as training draws it); returns the layouts (None under
    weight passing and for a sequence ring)."""
    return model_layouts(spec, config, program, seed, name, precision)


def compile_program(config: RunConfig):
    """Compile ``config.target`` with its ``-D`` values and ``--costs``: what a worker started without ``--program`` runs.

    Returns:
        the checked program, the same on every rank (compilation is deterministic).
    Raises:
        PipecError: the compiler's error.
    """
    from pipec.compiler.defines import parse_defines
    from pipec.compiler.driver import compile_target

    costs = None
    if config.costs:
        from pipec.compiler.costs import load_costs

        costs = load_costs(config.costs)
    return compile_target(config.target, parse_defines(list(config.defines)), costs=costs).program


def load_program(path: str):
    """The program in a JSON file (``program_to_json``'s format), read without compiling anything.

    ``pipec run`` compiles and checks once, writes the program to its run
    folder and passes it here, so that P workers do not compile P times.

    Args:
        path: the file.
    Returns:
        the ``Program`` it holds.
    Raises:
        UsageError: the file cannot be read, is not JSON or not a pipec
            program (the one guarded reader, ``guarded_read.read_program``:
            a regular file, at most ``PROGRAM``'s limit, bounded JSON).
        ImportError_: it is a pipec program whose content is invalid.
    """
    from pipec.compiler.guarded_read import read_program

    return read_program(path)


def program_refusal(config: RunConfig, program, rank: int) -> str | None:
    """Rank 0's proof of a ``--program`` file: the line that refuses it, or None.

    A program read from a file may be one the checks reject (hand-edited, or
    written by something else); the runtime cannot tell two equal-sized
    tensors apart, so a swapped receive would train silently wrong. Rank 0
    runs the full check (``check_all``, as ``pipec check FILE`` does) before
    joining the group, and the ranks share its verdict in their first
    collective (``agreement.check_same_training``, which also proves that
    every rank holds the same program): every rank then stops with this
    text, before any step. A compiled TARGET was proved by ``compile_target``
    on every rank already. Checking costs milliseconds (0.5 ms for 1f1b at
    its default size, 20 ms for tasp's 2,256 instructions), so ``pipec run``,
    which checked the program before writing it, simply pays it once more.

    Args:
        config: the run's configuration (``config.program``: the file, or None).
        program: the program the worker loaded.
        rank: this worker's rank; only rank 0 checks.
    Returns:
        on rank 0, for a program the checks reject: ``PROGRAM_REFUSED``
        with the file's name, then the check's own message (``rank R, step
        S: ...`` and the grid window); otherwise None.
    """
    if not config.program or rank != 0:
        return None
    from pipec.compiler.checks import check_all

    try:
        check_all(program, semantics="rendezvous")
    except PipecError as error:
        return PROGRAM_REFUSED.format(file=printable(config.program)) + "\n" + error.render()
    return None


def override_config(config, items: Sequence[str]):
    """The model config with ``--config NAME=VALUE`` overrides (a dataclass config, values typed like its fields)."""
    if not items:
        return config
    if not dataclasses.is_dataclass(config):
        raise UsageError("--config needs a model whose config is a dataclass")
    fields = {f.name: f for f in dataclasses.fields(config)}
    changes = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            known = ", ".join(fields)
            raise UsageError(f"--config expects NAME=VALUE with NAME one of {known}; got {item!r}")
        changes[name] = _config_value(text, getattr(config, name), f"--config {name}")
    return dataclasses.replace(config, **changes)


# What a bool field of a model config accepts from --config, and what it means.
_CONFIG_BOOLS = {"true": True, "false": False, "1": True, "0": False}


def _config_value(text: str, current, what: str):
    """``text`` as a value of the type of ``current``, read as every number pipec reads (``guarded_read``):
    an int in plain ASCII digits within pipec's range, a float as a plain finite decimal, a bool as
    true/false (``bool("false")`` would be True); another type from its constructor.

    Raises:
        UsageError: naming ``what`` and quoting ``text``.
    """
    from pipec.compiler.guarded_read import plain_float, plain_int, quote

    if isinstance(current, bool):
        value = _CONFIG_BOOLS.get(text.strip().lower())
        if value is None:
            raise UsageError(f"{what}: expected true or false, got {quote(text, 40)}")
        return value
    if isinstance(current, int):
        return plain_int(text, what)
    if isinstance(current, float):
        return plain_float(text, what)
    kind = type(current)
    try:
        return kind(text.strip())
    except (ValueError, TypeError):
        raise UsageError(f"{what}: {quote(text, 40)} is not a valid {kind.__name__}") from None


def _declared_layout(spec, config):
    """What the spec says one chunk hands the next (``activation_shape(config)`` as a ``payload.Layout``),
    or None when it does not say (the runtime then finds it: ``check_model_cut``)."""
    from pipec.runtime.payload import declared_layout

    shape_of = getattr(spec, "activation_shape", None)
    if not callable(shape_of):
        return None
    try:
        declared = shape_of(config)
    except Exception as error:  # a user's function may fail in any way
        raise UsageError(f"the model spec's activation_shape(config) failed: {type(error).__name__}: {error}") from None
    return declared_layout(declared, "the model spec's activation_shape(config)")


def device_index(devices: list[int] | None, rank: int, local_rank: int, node_size: int) -> int:
    """The GPU of its node that ``rank`` runs on, honouring the program's device map.

    The map (``map rank r to device EXPR``, ``Program.devices``) numbers
    devices as torchrun numbers ranks: node by node, ``node_size`` on each, one
    GPU per rank. So rank r's node holds ranks and devices ``r - local_rank``
    .. ``r - local_rank + node_size - 1``, and device d is GPU ``d mod
    node_size`` of the node ``d // node_size``. A rank may move to another GPU
    of its node, never to another node: its process runs where torchrun
    started it.

    Args:
        devices: rank -> device, a permutation of the ranks; None: the identity.
        rank: the global rank (RANK).
        local_rank: its index on its node (LOCAL_RANK).
        node_size: ranks per node (LOCAL_WORLD_SIZE).
    Returns:
        the CUDA device index on this node: ``local_rank`` without a map, else
        ``devices[rank] mod node_size``.
    Raises:
        UsageError: the map puts ``rank`` on a device of another node.
    """
    if devices is None:
        return local_rank
    device = devices[rank]
    first = rank - local_rank  # the node's first rank, and its first device
    if not first <= device < first + node_size:
        raise UsageError(
            f"the schedule's device map puts rank {rank} on device {device}, which is on another node: with "
            f"{node_size} ranks per node, rank {rank} runs on the node of ranks and devices {first}..{first + node_size - 1}, "
            f"and a rank can only move to a GPU of its own node (change the `map rank r to device` line, or the ranks per node)"
        )
    return device - first


def check_device_map(devices: list[int] | None, world: int, node_size: int) -> None:
    """Check that every rank of a launch can run on the device the map gives it (``device_index``).

    Args:
        devices: the program's rank -> device map, or None.
        world: the number of ranks.
        node_size: ranks per node; torchrun numbers the ranks of a node consecutively.
    Raises:
        UsageError: the first rank the map would move to another node.
    """
    for rank in range(world):
        device_index(devices, rank, rank % node_size, node_size)


def _device(backend: str, index: int):
    """The device of a worker: ``cuda:index`` for nccl (made current), the CPU for gloo (which ignores ``index``)."""
    import torch

    if backend == "nccl":
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise UsageError(f"--backend nccl needs GPU {index} on this node, and {torch.cuda.device_count()} are visible")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def join_group(backend: str, rank: int, world: int, local_rank: int, timeout: float, *, gpu: int | None = None,
               join_timeout: float = JOIN_ALLOWANCE_S):
    """Pick this rank's device and join the default process group; returns the device.

    Args:
        gpu: the GPU of this node to run on (``device_index()`` of the
            program's map); None: ``local_rank``. Ignored by gloo: on the CPU
            the device map changes nothing.
        join_timeout: ``--join-timeout``: how long group formation may wait for the other ranks.
    """
    import torch.distributed as dist

    device = _device(backend, local_rank if gpu is None else gpu)
    # The group's own timeout bounds joining and the collectives that have no
    # deadline of their own (the barriers, the closing gathers); the waits of a
    # step, the loss reduce included, have --timeout. NCCL's watchdog gets a
    # margin so that those deadlines speak first.
    group_timeout = timedelta(seconds=max(timeout, join_timeout) + (30 if backend == "nccl" else 0))
    extra = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=group_timeout, **extra)
    return device


def leave_group() -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def train(plan: Plan, rank: int, world: int, device) -> list[float]:
    """Run ``plan.run.steps`` training steps of ``plan`` on this rank; the group is joined. The one loop of
    every family and composition: the family builds what the rank trains (``RuntimeFamily.trainer``) and
    runs each step; the loop owns the steps' phases, the loss, the reports, checkpoints, resume and the trace.

    Collective: every rank calls it with the same arguments. Rank 0 prints the
    loss per step, and writes the trace and the saved model when asked.

    Returns:
        on rank 0 the loss of each step; elsewhere an empty list.
    """
    import torch.distributed as dist

    from pipec.runtime.family import runtime_family
    from pipec.runtime.list_trainer import ListTrainer

    program, run = plan.program, plan.run
    trainer = (runtime_family(program).trainer or ListTrainer)(plan, rank, world, device)
    if plan.inject:
        plant_injection(trainer.context, plan.inject)
    first = 1
    if plan.checkpoint is not None:  # the model and optimizer took theirs in the trainer; the data go on here
        trainer.data.restore(plan.checkpoint.data)
        first, plan.checkpoint = plan.checkpoint.step + 1, None
    if rank == 0:
        _print_staleness_note(program)
    report.built(trainer.modules)
    # the barrier waits for every rank to have built its model: getting ready, with --join-timeout
    phases.announce(phases.step_phase(first), deadline=phases.JOIN_DEADLINE)
    dist.barrier()
    t0 = time.perf_counter()
    clock = report.StepClock(rank, run.steps, device, *trainer.batch_size)
    recorded = []
    losses = []
    for iteration in range(first, run.steps + 1):
        phases.announce(phases.step_phase(iteration), deadline=None)  # each wait of a step has --timeout
        outcome = trainer.step(trainer.data.batch(iteration - 1), iteration)
        if run.trace:
            recorded.append(outcome.events)
        total = _reduced_loss(outcome.loss, rank, world, trainer.context, iteration, device)
        if rank == 0:
            losses.append(total)
        clock.done(iteration, total, outcome.grad_norm)
        if saves_after(run, iteration):
            _save_checkpoint(plan, trainer, trainer.data.state_after(iteration), rank, world, iteration)
    if run.trace:
        phases.announce(phases.TRACE)
        write_trace(run, trainer.context, recorded, t0, world)
    return losses


def _reduced_loss(loss, rank: int, world: int, context, iteration: int, device) -> float | None:
    """The step's loss summed over the ranks onto rank 0 (there its value, elsewhere None), waited like an
    instruction: a peer that hangs after its last one ends the run at --timeout."""
    import torch
    import torch.distributed as dist

    from pipec.runtime import comm

    total = loss.detach().reshape(1).float() if loss is not None else torch.zeros(1, device=device)
    reduced = dist.reduce(total, dst=0, op=dist.ReduceOp.SUM, async_op=True)
    others = tuple(r for r in range(world) if r != rank) if rank == 0 else (0,)
    site = comm.Site(rank, len(context.row), "the step's loss reduce", others, iteration)
    comm.settle([reduced], context.timeout, site)
    return total.item() if rank == 0 else None


def saves_after(config: RunConfig, iteration: int) -> bool:
    """Whether a checkpoint is written after step ``iteration``: the last, and every ``--save-every``-th."""
    every = config.save_every
    return bool(config.save) and (iteration == config.steps or bool(every and iteration % every == 0))


def checkpoint_meta(program, world: int, precision) -> dict:
    """What a checkpoint records of the run that wrote it (for people; nothing is checked against it)."""
    return {"schedule": program.name, "params": dict(program.params), "ranks": world, "dtype": precision.name}


def _save_checkpoint(plan: Plan, trainer, data_state: dict, rank: int, world: int, iteration: int) -> None:
    """Gather every rank's part of the checkpoint after step ``iteration`` on rank 0, which writes it
    (``checkpoint.write_checkpoint``: ``F.resume``, then F, the whole model's state_dict), with the data
    position ``data_state`` (``BatchSource.state_after``)."""
    from pipec.runtime import checkpoint

    phases.announce(phases.CHECKPOINT_SAVE)
    gathered = _gather(trainer.checkpoint_part(), rank, world)
    if rank == 0:
        model, optimizer = trainer.merged_parts(gathered)
        path = checkpoint.checkpoint_path(plan.run.save, iteration)
        checkpoint.write_checkpoint(path, model, optimizer, step=iteration, seed=plan.run.seed,
                                    data=data_state, meta=checkpoint_meta(plan.program, world, plan.precision))
        print(f"saved: {path}", flush=True)


def _print_staleness_note(program) -> None:
    """Before the first step of an asynchronous program: what its learning rate needs (one line)."""
    from pipec.compiler.versions import staleness_note

    note = staleness_note(program)
    if note is not None:
        print(f"note: {note}", flush=True)


def step_line(iteration: int, loss: float, grad_norm: float | None) -> str:
    """Rank 0's line per step: ``step k loss X``, and ``grad norm Y`` (before clipping) under clipping."""
    norm = "" if grad_norm is None else f" grad norm {grad_norm:.6f}"
    return f"step {iteration} loss {loss:.6f}{norm}"


def _gather(obj, rank: int, world: int):
    """Every rank's ``obj`` on rank 0 (a list in rank order), None elsewhere."""
    import torch.distributed as dist

    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def write_trace(config: RunConfig, context, recorded, t0: float, world: int) -> None:
    """Gather every rank's events to rank 0 and write them, with what ran: the
    target and cost file (so that ``pipec render --trace`` compiles the same
    program again), the schedule's name and parameters.

    Args:
        context: the rank's context (``rank``, ``row``, ``program``): an interpreter's or a ring's.
        recorded: per step, its events (``runtime/trace.chrome_events``).
    """
    from pipec.compiler.driver import lasting_target
    from pipec.runtime.trace import chrome_events, write_chrome_trace

    events = chrome_events(context.rank, context.row, recorded, t0)
    gathered = _gather(events, context.rank, world)
    if context.rank == 0:
        program = context.program
        metadata = {"schedule": program.name, "params": dict(program.params), "target": lasting_target(config.target)}
        if config.costs:
            metadata["costs"] = os.path.abspath(config.costs)
        write_chrome_trace(config.trace, gathered, metadata)
        print(f"trace: {config.trace}", flush=True)


class Injection(NamedTuple):
    """A test-only fault (``--inject KIND:RANK:INDEX``)."""

    kind: str
    rank: int
    index: int


def parse_injection(text: str) -> Injection:
    kinds = (*_INJECT_OPS, _LATE)
    try:
        kind, rank_text, index_text = text.split(":")
        injection = Injection(kind, int(rank_text), int(index_text))
    except ValueError:
        injection = None
    if injection is None or injection.kind not in kinds:
        raise UsageError(f"--inject expects KIND:RANK:INDEX with KIND one of {', '.join(kinds)}; got {text!r}")
    return injection


def plant_injection(context, injection: Injection) -> None:
    """Plant ``hang``, ``stop``, ``kill`` (SIGKILL itself) or ``exit`` at instruction INDEX of RANK's list.

    Args:
        context: the rank's context, any family's: its ``row`` (a copy of the list) gets the
            fault's instruction, its ``handlers`` table the fault's handler.
        injection: the fault; ``late`` (a late start, done before joining) plants nothing.
    """
    from pipec.compiler.ir import Action

    if injection.kind == _LATE or injection.rank != context.rank:
        return
    op = _INJECT_OPS[injection.kind]
    context.row.insert(min(injection.index, len(context.row)), Action(-1, op))
    context.handlers[op] = _INJECTED[op]


def _hang(step, action, index) -> None:
    """Hang in Python, as a worker stuck in a loop would: it still answers SIGTERM at once.

    Short sleeps, not one long one: a signal the kernel hands to another thread
    (gloo's, torch's) only sets Python's flag, and the main thread runs the
    handler when it next wakes; asleep for an hour it would not, and the
    launcher would have to SIGKILL it.
    """
    while True:
        time.sleep(_HANG_TICK_S)


_HANG_TICK_S = 0.05


def _stop(step, action, index) -> None:
    """Stop this process (SIGSTOP), as a debugger or a stuck machine would: it no longer acts on SIGTERM."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSTOP)
    _hang(step, action, index)


def _kill(step, action, index) -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _exit(step, action, index) -> None:
    die(f"rank {step.rank}: injected exit before instruction {index}", status=3)


_INJECTED = {"INJECT_HANG": _hang, "INJECT_STOP": _stop, "INJECT_KILL": _kill, "INJECT_EXIT": _exit}


__all__ = [
    "RuntimeFault", "build_parser", "check_device_map", "compile_program", "device_index", "die",
    "die_with_launcher", "fatal_errors", "join_group", "launch_environment", "leave_group", "load_program", "main",
    "make_plan", "parse_run_config", "plant_injection", "program_refusal", "PROGRAM_REFUSED",
    "train", "write_trace",
]
