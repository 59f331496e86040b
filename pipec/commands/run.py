"""``pipec run``: train a model with a compiled schedule on P worker processes.

The parent compiles and checks the target first, so a bad schedule fails at
once with the compiler's error; it writes the program (JSON) into the run's
own folder, the one that also keeps the workers' logs, and starts P workers
through torch's elastic launcher (the launcher ``torchrun`` runs), each one
``python -m pipec.runtime TARGET ... --program FILE``: the workers load that
program instead of compiling it P times again. Starting the workers here
rather than through ``torchrun`` changes nothing else for them: they see the
same environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). Over several machines
(``--nnodes M --node-rank I --rdzv-endpoint HOST:PORT``) each machine's
``pipec run`` compiles, checks and starts its own workers, ranks I*P ..
I*P+P-1, and the launchers meet in torchrun's static rendezvous, whose store
node 0 keeps (``Nodes``, ``_meeting``).

What the user sees:

* each phase as it ends and every step with its loss, speed and memory
  (``run_report``, which the workers feed with events on their stdout);
* every worker's stdout and stderr, live: rank 0's stdout lines as they are,
  others behind ``[rank R] `` (R its global rank); ``--log-format json``: all
  of it as JSON objects, one a line;
* on a failure, the workers' fault messages (``rank R, step S (INSTR): waited
  T s for rank Q ...``), each distinct one once, and how each failed worker
  ended; never the launcher's own traceback. Exit status 1.

Every worker ends with the run: the launcher sends the whole worker group
SIGTERM as soon as one worker fails (and SIGKILL after ``SHUTDOWN_TIMEOUT_S``),
each worker runs in its own process group, and ``launch`` returns only after
the agent has reaped them.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

from pipec.commands import run_report
from pipec.commands._deadline import StopWatch
from pipec.compiler.defines import parse_defines
from pipec.compiler.guarded_read import count_arg, positive_count_arg, seconds_arg
from pipec.errors import UsageError, printable, printable_name
from pipec.runtime.agreement import MISMATCH_PREFIX
from pipec.runtime.config import DEFAULT_JOIN_TIMEOUT_S, DEFAULT_MODEL, DEFAULT_SEED, DEFAULT_TIMEOUT_S, RunConfig
from pipec.runtime.phases import PHASE_DIR_ENV

# How often the launcher's agent looks at its workers, in seconds: the delay
# between a worker's exit and the others being stopped (and the run's end).
# Not shorter: when a worker dies, the peer waiting on it sees the broken
# connection at once, but needs a moment (more on a loaded machine) to print
# its fault message (rank, instruction, peer) before the launcher stops it.
MONITOR_INTERVAL_S = 0.5
# A worker that ignores SIGTERM for this long is killed.
SHUTDOWN_TIMEOUT_S = 5
# How often a closing launcher wakes stopped workers (SIGCONT) so that they act on its SIGTERM.
_CONTINUE_EVERY_S = 0.1
# How often the output follower polls the workers' stdout files.
FOLLOW_INTERVAL_S = 0.05
# A worker's fault message: "rank R, step S (INSTR): ..." (runtime.worker's RuntimeFault), or the line
# every worker prints when the ranks were not started for the same training (runtime.agreement.check_same_training).
# Or a phase overrun: "rank R (host H), phase X: waited T s (...)" (runtime.phases.phase_line).
FAULT_LINE = re.compile(rf"rank \d+, step \d+ \(.+\): .*|rank \d+ \(host .*\), phase .+: waited .*|"
                        rf"{re.escape(MISMATCH_PREFIX)}.*")
# Stderr lines shown for a failed worker that printed no fault message.
TAIL_LINES = 20
# The compiled program's file in the run folder, passed to the workers as --program.
PROGRAM_FILE = "program.json"

# The worker program: ``python -m pipec.runtime``.
WORKER_MODULE = "pipec.runtime"
# Worker options passed through as they are: (option, argparse dest).
_PASS_THROUGH = (
    ("--steps", "steps"),
    ("--backend", "backend"),
    ("--seed", "seed"),
    ("--timeout", "timeout"),
    ("--model", "model"),
    ("--dtype", "dtype"),
    ("--clip-grad-norm", "clip_grad_norm"),
    ("--save-every", "save_every"),
    ("--inject", "inject"),
    ("--join-timeout", "join_timeout"),
)
# Repeatable worker options: (option, dest holding a list).
_REPEATED = (("-D", "defines"), ("--config", "config"))
# Worker options that name files: passed as absolute paths so that they do not
# depend on the directory a worker resolves them in.
_PATHS = (("--trace", "trace"), ("--save", "save"), ("--costs", "costs"), ("--resume", "resume"),
          ("--partition", "partition"))


def register(sub) -> None:
    parser = sub.add_parser(
        "run",
        help="train with a schedule on P worker processes (torch.distributed, launched like torchrun)",
        description="Compile and check TARGET (or read and check a compiled program .json, as `pipec compile "
                    "--format json` writes), then train the model with it on --nproc worker processes.",
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--nproc", type=positive_count_arg, metavar="P",
        help="worker processes on this machine; all nodes together must start the program's ranks "
             "(default: its ranks, divided among --nnodes)",
    )
    nodes = parser.add_argument_group(
        "several machines",
        "start `pipec run` with the same arguments on every machine, each with its own --node-rank; node 0 "
        "hosts the rendezvous at --rdzv-endpoint (torchrun's static rendezvous) and writes --save and --trace")
    nodes.add_argument("--nnodes", type=positive_count_arg, default=1, metavar="M",
                       help="machines in the run (default 1)")
    nodes.add_argument("--node-rank", dest="node_rank", type=count_arg, default=None, metavar="I",
                       help="this machine's index, 0 .. M-1; its workers are ranks I*P .. I*P+P-1")
    nodes.add_argument("--rdzv-endpoint", dest="rdzv_endpoint", metavar="HOST:PORT",
                       help="node 0's address and a free port there: node 0 listens, the others join")
    nodes.add_argument("--join-timeout", dest="join_timeout", type=seconds_arg, default=None, metavar="SECONDS",
                       help=f"how long getting ready may take: the nodes waiting for each other, each worker "
                            f"importing, loading a checkpoint and building its model, and the ranks waiting for "
                            f"each other's build (default {DEFAULT_JOIN_TIMEOUT_S:g}); on one machine too")
    run_report.add_arguments(parser)
    parser.set_defaults(func=run)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``pipec run`` shares with ``python -m pipec.runtime`` (the worker's defaults apply when omitted)."""
    from pipec.runtime.worker import add_training_arguments

    add_training_arguments(parser, defaults=False)


def run(args) -> int:
    nodes = nodes_of(args)
    report = run_report.RunReport.from_args(args, nodes)
    program, nproc = check_before_launch(args, report)
    result = launch_program(program, worker_arguments(args), nproc, nodes=nodes, reporter=report,
                            timeout=args.timeout)
    if result.ok:
        return 0
    sys.stderr.write(result.report)
    return 1


def check_before_launch(args, report: run_report.RunReport | None = None) -> tuple[object, int]:
    """Compile and check the target, and validate the launch, before any worker starts.

    Args:
        args: the parsed ``pipec run`` arguments.
        report: where the phases are reported as they end (compile, check); None: nowhere.
    Returns:
        (the checked program, the number of workers to start: see ``check_launch``).
    Raises:
        PipecError: the compiler's error, or ``check_launch``'s.
    """
    start = time.monotonic()
    program = _checked_target(args)
    if report is not None:
        report.compiled(program, time.monotonic() - start)
        start = time.monotonic()
    nproc = check_launch(args, program)
    if report is not None:
        report.checked(args.model or DEFAULT_MODEL, time.monotonic() - start)
    return program, nproc


def _checked_target(args):
    """The target compiled and checked, or a compiled program file (``pipec compile --format json``: a
    composition's lists edited per rank, say) read and checked as the compiler checks what it emits."""
    from pipec.commands._common import load_costs
    from pipec.compiler.driver import compile_target
    from pipec.compiler.guarded_read import looks_like_program

    if not looks_like_program(args.target):
        return compile_target(args.target, parse_defines(args.defines), costs=load_costs(args)).program
    from pipec.api import load_file

    if args.defines:
        raise UsageError(f"-D sets parameters of a .pipe schedule; the compiled program '{args.target}' has its own")
    return load_file(args.target, costs=load_costs(args)).ir


def check_launch(args, program) -> int:
    """Check that the workers can run ``program`` with these arguments, so that a mistake shows once, here.

    Args:
        args: the parsed ``pipec run`` arguments.
        program: the compiled target.
    Returns:
        the number of workers to start on this machine: ``--nproc``, or the
        program's ranks divided among the ``--nnodes`` machines.
    Raises:
        UsageError: a worker count other than the program's ranks (all nodes
            together), a bad step count or timeout, too few GPUs for nccl, or a
            model that cannot be loaded or cut into the program's chunks (or
            by its ``--partition`` file); over
            several machines a bad ``--node-rank`` or ``--rdzv-endpoint``
            (``nodes_of``, ``_check_endpoint``); a program of several families (proved by
            ``check_all``, but not yet run: the composition issue), or stages on rank groups the runtime
            does not train (``runtime.family.placed_refusal``: only activation passing's PP x DP and PP x FSDP).
    """
    from pipec.compiler.family import families_of
    from pipec.compiler.ir import resize_hint
    from pipec.runtime.family import placed_refusal

    refusal = placed_refusal(program)
    if refusal is not None:
        raise UsageError(f"{args.target}: {refusal}")
    families = [family.name for family in families_of(program)]
    if len(families) > 1:
        raise UsageError(f"{args.target}: the program holds ops of {' and '.join(families)}; pipec proves such a "
                         "program but its runtime trains one family at a time")
    nodes = nodes_of(args)
    config = RunConfig.from_args(args)  # the runtime's checks read this, as the workers' do theirs
    nproc = _workers_per_node(args.nproc, program.num_ranks, nodes.count if nodes else 1, args.target,
                              resize_hint(program))
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if getattr(args, "backend", None) == "nccl":
        _check_gpus(nproc)
        _check_device_map(program, nproc)
    if nodes is None or nodes.rank == 0:  # only rank 0, on node 0, writes --trace and --save
        _check_outputs(args)
    if nodes is not None:
        _check_endpoint(nodes)
    _checks_under_deadline(config, program)
    return nproc


def _checks_under_deadline(config: RunConfig, program) -> None:
    """The checks that run a user's code or read a checkpoint (which may hang), each phase within its deadline
    (``runtime.phases.announce``), so that a module whose import hangs is named, not waited for."""
    import torch  # noqa: F401 - loading torch is start-up on a loaded machine, not the model's build

    from pipec.runtime import phases

    with phases.launcher_checks(config.timeout, config.join_timeout):
        phases.announce(phases.CHECKPOINT_LOAD)
        _check_resume(config)
        phases.announce(phases.MODEL_BUILD)
        _check_model_fits(config, program)


def _check_model_fits(config: RunConfig, program) -> None:
    """The update options, the family's refusals and the model spec against ``program``."""
    from pipec.runtime.stash import check_update_options

    check_update_options(config, program)
    from pipec.runtime.family import runtime_family

    refusal = runtime_family(program).refuse_run(config)
    if refusal is not None:
        raise UsageError(f"{config.target}: {refusal}")
    _check_model(config, program)


def _workers_per_node(nproc: int | None, ranks: int, count: int, target: str, resize: str = "-D P=...") -> int:
    """The workers this machine starts: ``--nproc``, or the program's ranks divided among the machines.

    Args:
        nproc: ``--nproc``, or None.
        ranks: the program's ranks; one worker runs one rank.
        count: the machines (``--nnodes``), each starting the same number of workers.
        target: the target, for the message.
        resize: how the user changes the program's ranks (``ir.resize_hint``), for the message.
    Raises:
        UsageError: the machines' workers together are not the program's ranks.
    """
    if nproc is None and ranks % count == 0:
        return ranks // count
    if nproc is None:
        raise UsageError(f"{target} was compiled for {ranks} ranks, which do not divide among --nnodes {count} "
                         f"machines (each starts the same number of workers): change --nnodes, or {resize}")
    if nproc * count != ranks:
        on = f" on each of {count} machines starts {nproc * count} workers" if count > 1 else ""
        fits = f"pass --nproc {ranks // count}" if ranks % count == 0 else "change --nnodes"
        raise UsageError(f"--nproc {nproc}{on}, but {target} was compiled for {ranks} ranks: "
                         f"one worker runs one rank ({fits}, or change {resize})")
    return nproc


@dataclass(frozen=True)
class Nodes:
    """A run over several machines: this launcher starts node ``rank`` of ``count``.

    Every node's launcher meets at ``host:port``, where node 0's launcher
    keeps the rendezvous store (torchrun's static rendezvous): the node ranks
    are the ones given, so node i's workers are ranks ``i * nproc`` ..
    ``i * nproc + nproc - 1`` (as torchrun numbers them), and the workers'
    group meets in the same store.

    Attributes:
        count: the machines in the run (``--nnodes``).
        rank: this machine's index (``--node-rank``).
        host, port: the rendezvous (``--rdzv-endpoint``).
        join_timeout: seconds the launchers wait for each other (``--join-timeout``).
    """

    count: int
    rank: int
    host: str
    port: int
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


# The run's name in the rendezvous store. One store serves one run (its port
# names the run), so every node can use the same name; a name derived from
# the endpoint would split the run when two nodes spell the address differently.
MULTINODE_RUN_ID = "pipec-run"
# How often a node other than node 0 tries to reach node 0 while it waits for it, seconds.
_REACH_EVERY_S = 0.2


def nodes_of(args) -> Nodes | None:
    """The parsed ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint`` and ``--join-timeout``; None for one machine
    (where ``--join-timeout`` is only the workers' deadline of getting ready).

    Args:
        args: the parsed ``pipec run`` arguments (another command's have none of them: one machine).
    Returns:
        this launcher's ``Nodes``, or None for a run on one machine.
    Raises:
        UsageError: a node rank outside 0 .. M-1, a missing node rank or endpoint
            when M > 1 (or either given when M is 1), an endpoint that is not HOST:PORT.
    """
    count = getattr(args, "nnodes", 1) or 1
    rank, endpoint = getattr(args, "node_rank", None), getattr(args, "rdzv_endpoint", None)
    join_timeout = getattr(args, "join_timeout", None)
    if count == 1:  # --join-timeout still bounds getting ready (the workers take it as it is)
        if rank not in (None, 0) or endpoint is not None:
            raise UsageError("--node-rank and --rdzv-endpoint are for a run over several machines: pass --nnodes M "
                             "too")
        return None
    if rank is None or endpoint is None:
        raise UsageError(f"--nnodes {count}: every machine needs its --node-rank (0 .. {count - 1}) and the same "
                         "--rdzv-endpoint HOST:PORT (node 0's address and a free port)")
    if not 0 <= rank < count:
        raise UsageError(f"--node-rank {rank}: the nodes of --nnodes {count} are numbered 0 .. {count - 1}")
    host, _, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:29500
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint {printable(endpoint)!r}: expected HOST:PORT, e.g. 10.0.0.1:29500 "
                         "(a port 1 .. 65535)")
    return Nodes(count, rank, host, int(port), DEFAULT_JOIN_TIMEOUT_S if join_timeout is None else join_timeout)


def _check_endpoint(nodes: Nodes) -> None:
    """Check the rendezvous address before launching: its host must resolve, and on node 0, which
    listens on it, the port must be free.

    The port is checked on every interface, as the store binds it; another
    program may still take it before the store does, and the launch then
    reports the store's own error (``_rendezvous_failure``).

    Raises:
        UsageError: a host that does not resolve, or a port in use on node 0.
    """
    try:
        family = socket.getaddrinfo(nodes.host, nodes.port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as error:
        raise UsageError(f"--rdzv-endpoint {nodes.endpoint}: cannot resolve {nodes.host!r} "
                         f"({getattr(error, 'strerror', None) or error})") from None
    if nodes.rank != 0:
        return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: a closed run's port is free
        try:
            probe.bind(("", nodes.port))
        except OSError as error:
            raise UsageError(f"--rdzv-endpoint {nodes.endpoint}: node 0 listens on port {nodes.port}, which is in "
                             f"use on this machine ({error.strerror or error}): pick a free port and give it "
                             "to every node") from None


def _check_outputs(args) -> None:
    """Check that ``--trace`` and ``--save`` can be written, so that a typo in a folder does not cost the run.

    Raises:
        UsageError: ``cannot write the trace 'PATH': ...`` (a missing or read-only folder, a folder given as file).
    """
    from pipec.compiler.atomic_write import check_writable

    for option, what in (("trace", "the trace"), ("save", "the saved model")):
        path = getattr(args, option, None)
        if path is not None:
            check_writable(path, f"{what} (--{option})")


def _check_resume(config: RunConfig) -> None:
    """Check ``--save-every`` and ``--resume`` as the workers will (``runtime.worker.resolve_checkpoint``):
    a checkpoint that is missing, broken, finished or of another seed stops the run here."""
    from pipec.runtime.worker import resolve_checkpoint

    resolve_checkpoint(config)


def _check_gpus(nproc: int) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < nproc:
        raise UsageError(f"--backend nccl needs one GPU per rank: {nproc} ranks, {count} GPUs visible")


def _check_device_map(program, nproc: int) -> None:
    """Check that every worker can run on the GPU the program's device map gives it.

    Every node runs ``nproc`` workers (torchrun's LOCAL_WORLD_SIZE), so the
    map's devices are numbered node by node, ``nproc`` GPUs on each; one
    machine is the case where ``nproc`` is the program's ranks. On gloo the
    map changes nothing and is not checked.

    Raises:
        UsageError: the map puts a rank on another node's device (``runtime.worker.device_index``).
    """
    from pipec.runtime.worker import check_device_map

    check_device_map(program.devices, program.num_ranks, node_size=nproc)


def _check_model(config: RunConfig, program) -> None:
    """Load the model spec and its config as the workers will (cut by ``--partition`` when given), and check
    that it cuts into the program's chunks (``runtime.worker.check_plan_model``): an error shows here, once,
    not P times after start-up.
    """
    from pipec.runtime.worker import check_plan_model, override_config, run_model_spec, run_precision

    name = config.model or DEFAULT_MODEL
    spec = run_model_spec(name, config.partition, program)
    model_config = override_config(spec.config, config.config_overrides)
    seed = DEFAULT_SEED if config.seed is None else config.seed
    check_plan_model(spec, model_config, program, seed, name, run_precision(config))


def worker_arguments(args) -> list[str]:
    """The command-line arguments of ``python -m pipec.runtime`` for the parsed ``pipec run`` arguments.

    Only the options the user gave are passed, so the worker's defaults stay the
    one source of defaults.
    """
    out = [args.target]
    for option, dest in _REPEATED:
        for value in getattr(args, dest, None) or ():
            out += [option, value]
    for option, dest in _PASS_THROUGH:
        value = getattr(args, dest, None)
        if value is not None:
            out += [option, str(value)]
    for option, dest in _PATHS:
        value = getattr(args, dest, None)
        if value is not None:
            out += [option, os.path.abspath(value)]
    return out


# ------------------------------------------------------------------ launching


@dataclass
class LaunchResult:
    """How a launch ended.

    Attributes:
        ok: every worker exited 0.
        report: on failure, the text to show the user (fault messages first); "" on success.
        exits: for each failed rank the launcher saw, its exit code (negative: killed by that signal).
        faults: the distinct fault messages the workers printed, in rank order.
    """

    ok: bool
    report: str = ""
    exits: dict[int, int] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)


def launch_program(program, arguments: list[str], nproc: int, **options) -> LaunchResult:
    """Launch ``nproc`` workers that run ``program`` as it is, without compiling it again.

    Makes the run's folder, writes the program there (``write_program``) and
    launches ``python -m pipec.runtime ARGUMENTS --program FILE``. The folder
    also keeps the workers' logs: it is removed after a successful run, kept
    after a failed one (the report names it).

    Args:
        program: the compiled, checked program.
        arguments: the worker's other arguments (``worker_arguments``): TARGET,
            -D and --costs name what the program came from, in the trace.
        nproc: the number of workers (on this node).
        options: passed on to ``launch`` (``on_line``, ``echo``, ``env``, ``nodes``, ``reporter``, whose
            ``--log-dir`` also picks the folder).
    Returns:
        ``launch``'s result.
    """
    reporter = options.get("reporter")
    run_dir = run_report.run_folder(reporter.log_dir if reporter is not None else None)
    try:
        path = write_program(program, run_dir)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return launch(["-m", WORKER_MODULE, *arguments, "--program", path], nproc, run_dir=run_dir, **options)


def write_program(program, folder: str, name: str = PROGRAM_FILE) -> str:
    """Write ``program`` as JSON (``write_program_json``, as ``pipec compile --format json`` does)
    to ``folder/NAME`` (``program.json``), atomically.

    The file appears whole or not at all (a temporary file in the same folder,
    then ``os.replace``), so a worker never reads half a program.

    Args:
        program: the program to write.
        folder: an existing folder.
        name: the file's name in it (``pipec attention`` writes one per program).
    Returns:
        the file's absolute path.
    Raises:
        UsageError: the file cannot be written.
    """
    from pipec.compiler.atomic_write import atomic_writer
    from pipec.compiler.emit.json_program import write_program_json

    path = os.path.abspath(os.path.join(folder, name))
    with atomic_writer(path, what="the compiled program") as out:
        write_program_json(program, out)
    return path


def launch(
    python_args: list[str],
    nproc: int,
    *,
    on_line: Callable[[int, str], None] | None = None,
    echo: bool = True,
    env: dict[str, str] | None = None,
    run_dir: str | None = None,
    command: str = "pipec run",
    nodes: Nodes | None = None,
    reporter: run_report.RunReport | None = None,
    timeout: float | None = None,
) -> LaunchResult:
    """Run ``python PYTHON_ARGS`` on ``nproc`` local workers through torch's elastic launcher.

    Args:
        python_args: the arguments of each worker's Python, e.g.
            ``["-m", "pipec.runtime", *worker_arguments(args)]``.
        nproc: the number of workers (the program's ranks).
        on_line: called with (rank, line without newline) for each stdout line of a worker.
        echo: also write the workers' stdout to ours (rank 0 as is, the others behind ``[rank R] ``).
        env: extra environment for the workers. OMP_NUM_THREADS defaults to 1
            (ranks share the machine's cores) and PYTHONUNBUFFERED to 1 (lines arrive as printed).
        run_dir: the run's folder, for the workers' logs (with whatever the
            caller put there, e.g. the program); None: a new temporary folder.
            Removed after a successful run.
        command: how the report and the messages name the command (``pipec attention`` launches too).
        nodes: this launcher's node of a run over several machines; None: one machine.
            Output lines and the report name the workers by their global rank.
        reporter: shows phases, steps, stdout and stderr live (``run_report``; ``on_line``, ``echo`` unused).
        timeout: ``--timeout`` (None: its default): a worker stopped that long ends the run (``_deadline``).
    Returns:
        a ``LaunchResult``; every worker has exited when it returns.
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    log_dir = run_dir or tempfile.mkdtemp(prefix="pipec-run-")
    first = nodes.rank * nproc if nodes else 0
    if reporter is not None:
        reporter.launching(nproc, first, nodes.endpoint if nodes else None)
        env = {**(env or {}), **reporter.worker_environment()}
    followers = _followers(log_dir, nproc, first, on_line, echo, reporter)
    stop_watch = StopWatch(log_dir, nproc, first, DEFAULT_TIMEOUT_S if timeout is None else timeout).start()
    exits, launched = {}, False
    with _worker_environment({**(env or {}), PHASE_DIR_ENV: log_dir}), _quiet_launcher_logs(), _prompt_shutdown():
        for follower in followers:
            follower.start()
        try:
            if nodes is not None:
                _join_nodes(nodes, command)
            elastic_launch(_launch_config(log_dir, nproc, nodes), sys.executable)(*python_args)
            launched = True
        except ChildFailedError as failed:
            exits = {rank: failure.exitcode for rank, failure in failed.failures.items()}
        except (SignalException, KeyboardInterrupt) as stop:
            # we were told to stop; the agent has stopped the workers already
            sigval = getattr(stop, "sigval", signal.SIGINT)
            if sigval == signal.SIGINT:
                sys.stderr.write(f"{command}: interrupted\nworker logs: {printable_name(log_dir)}\n")
                raise KeyboardInterrupt from None
            report = f"{command}: stopped by {signal.Signals(sigval).name}\nworker logs: {printable_name(log_dir)}\n"
            return LaunchResult(ok=False, report=report)
        except (RendezvousError, DistError, _NodeZeroUnreachable) as error:
            # no worker ran: the store could not start, or the nodes never met
            shutil.rmtree(log_dir, ignore_errors=True)
            return LaunchResult(ok=False, report=_rendezvous_failure(error, nodes, command))
        finally:
            stopped = stop_watch.stop()
            for follower in followers:
                follower.stop()
            if reporter is not None:
                reporter.finished(launched, log_dir)
    if not exits:
        _after_success(log_dir, nproc, first, reporter)
        return LaunchResult(ok=True)
    return _failed(log_dir, nproc, exits, stopped, command, first, ended=stop_watch.ended)


def _failed(log_dir: str, nproc: int, exits: dict[int, int], stopped: list[str], command: str, first: int,
            ended: bool) -> LaunchResult:
    """The result of a launch whose workers failed: ``stopped``, the launcher's phase lines
    (``_deadline.StopWatch``), first, as they name the rank at fault; then the workers' own."""
    said = (line for local in range(nproc) for line in _fault_lines(_read_stderr(log_dir, local)))
    faults = _distinct([*stopped, *said])
    report = _failure_report(log_dir, nproc, exits, faults, command, first, ended=ended)
    return LaunchResult(ok=False, report=report, exits=exits, faults=faults)


def _launch_config(log_dir: str, nproc: int, nodes: Nodes | None):
    """The elastic launcher's ``LaunchConfig``: ``nproc`` workers, no restarts, their output in ``log_dir``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(**_meeting(nodes), nproc_per_node=nproc, max_restarts=0, monitor_interval=MONITOR_INTERVAL_S,
                        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL))


def _followers(log_dir: str, nproc: int, first: int, on_line, echo: bool,
               reporter: run_report.RunReport | None) -> list[_OutputFollower]:
    """What follows the workers' files: their stdout (to ``on_line`` and ours); with a reporter, both
    stdout and stderr, live, through it."""
    if reporter is None:
        return [_OutputFollower(log_dir, nproc, on_line, echo, first)]
    return [_OutputFollower(log_dir, nproc, reporter.on_stdout, False, first),
            _OutputFollower(log_dir, nproc, reporter.on_stderr, False, first, name="stderr.log")]


def _after_success(log_dir: str, nproc: int, first: int, reporter: run_report.RunReport | None) -> None:
    """Show the workers' stderr (unless a reporter showed it live), and remove the run's folder
    unless ``--log-dir`` keeps it."""
    if reporter is None:
        _echo_stderr(log_dir, nproc, first)
    if reporter is None or not reporter.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)


def _join_nodes(nodes: Nodes, command: str) -> None:
    """Say, on this node, that it waits for the others and for how long (no worker starts before they
    meet); a node other than 0 then waits for node 0 to listen (``_reach_node_zero``)."""
    others = "node 0" if nodes.rank > 0 else f"the other {nodes.count - 1} node{'s' if nodes.count > 2 else ''}"
    sys.stderr.write(f"{command}: node {nodes.rank} of {nodes.count} waits for {others} at {nodes.endpoint}, "
                     f"at most {nodes.join_timeout:g} s (--join-timeout)\n")
    sys.stderr.flush()
    if nodes.rank > 0:
        _reach_node_zero(nodes)


def _meeting(nodes: Nodes | None) -> dict:
    """The rendezvous part of the launcher's ``LaunchConfig``.

    One machine: a c10d rendezvous on 127.0.0.1 port 0, where the agent's
    store takes a free port itself (no probe-then-bind race). Several: the
    static rendezvous torchrun runs for ``--rdzv-backend static``: node 0's
    agent keeps the store at the endpoint, every node's rank is the one given,
    and the store waits ``join_timeout`` for the nodes to meet (its timeout is
    whole seconds).
    """
    if nodes is None:
        return dict(min_nodes=1, max_nodes=1, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                    rdzv_endpoint="127.0.0.1:0")
    return dict(min_nodes=nodes.count, max_nodes=nodes.count, run_id=MULTINODE_RUN_ID, rdzv_backend="static",
                rdzv_endpoint=nodes.endpoint,
                rdzv_configs={"rank": nodes.rank, "timeout": max(1, math.ceil(nodes.join_timeout))})


class _NodeZeroUnreachable(Exception):
    """Nothing listened at the rendezvous within the join timeout (``_reach_node_zero``)."""


def _reach_node_zero(nodes: Nodes) -> None:
    """Wait until node 0's store listens at the endpoint, at most ``join_timeout`` seconds.

    A node started before node 0 would otherwise leave it to the agent's store
    client, which retries on its own but prints every failed try, with C++
    stack frames, to our stderr. A bare connection that closes at once does
    not count as a node joining the store.

    Raises:
        _NodeZeroUnreachable: the timeout passed first.
    """
    deadline = time.monotonic() + nodes.join_timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((nodes.host, nodes.port), timeout=max(min(left, 2.0), 0.01)):
                return
        except OSError:
            if left <= _REACH_EVERY_S:
                raise _NodeZeroUnreachable() from None
            time.sleep(_REACH_EVERY_S)


def _rendezvous_failure(error: Exception, nodes: Nodes | None, command: str) -> str:
    """The report of a launch whose workers never started: the launcher's store could not start, or
    (over several machines) the nodes did not meet within ``--join-timeout``, said from this node's side."""
    said = printable(str(error).strip().splitlines()[0]) if str(error).strip() else type(error).__name__
    if nodes is None:
        return f"{command}: the launcher could not start the workers: {said}\n"
    where, within = nodes.endpoint, f"within {nodes.join_timeout:g} s (--join-timeout)"
    if "address already in use" in said.lower():
        message = (f"node 0 cannot listen at {where}: port {nodes.port} is in use on this machine; pick a free "
                   "port and give it to every node")
    elif isinstance(error, _NodeZeroUnreachable):
        message = (f"node {nodes.rank} found nothing listening at {where} {within}: start node 0 "
                   f"(--node-rank 0) on the machine at {nodes.host}, and check that its port {nodes.port} is "
                   "open to this one")
    elif nodes.rank == 0:
        others = "--node-rank 1" if nodes.count == 2 else f"--node-rank 1 .. {nodes.count - 1}"
        message = (f"not all {nodes.count} nodes joined at {where} {within} ({said}): start `pipec run` with the "
                   f"same arguments and {others} on the other machines")
    else:
        message = f"node {nodes.rank} could not join the run at {where} {within}: {said}"
    return f"{command}: {message}\n"


def _failure_report(log_dir: str, nproc: int, exits: dict[int, int], faults: list[str],
                    command: str = "pipec run", first: int = 0, ended: bool = False) -> str:
    """The failure text: fault messages, then how each failed worker ended (``exits``: by global rank; this
    node's workers are ranks ``first`` ..), then where the logs are. ``ended``: the launcher killed them
    itself, a stopped worker past its deadline (``_deadline.StopWatch``)."""
    lines = [f"{command}: the run failed"] + [printable(fault) for fault in faults]
    for rank in sorted(exits):
        code = exits[rank]
        stderr = _read_stderr(log_dir, rank - first)
        if code < 0:
            ended_here = ended and code == -signal.SIGKILL
            lines.append(f"rank {rank}: stopped by the launcher, which ended the run at the deadline (SIGKILL)"
                         if ended_here else f"rank {rank}: {_signal_name(-code)}")
            continue
        lines.append(f"rank {rank}: exited with status {code}")
        if not _fault_lines(stderr):
            # no fault message: a startup error or a bug; its own words say more than ours
            tail = [line for line in stderr.splitlines() if line.strip()][-TAIL_LINES:]
            lines += [f"  {printable(line)}" for line in tail]
    lines.append(f"worker logs: {printable_name(log_dir)}")
    return "\n".join(lines) + "\n"


def _signal_name(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    # the launcher stops the survivors with SIGTERM once one worker failed
    why = " (stopped by the launcher after another worker failed)" if number == signal.SIGTERM else ""
    return f"killed by {name}{why}"


def _fault_lines(stderr: str) -> list[str]:
    return [match.group(0) for match in map(FAULT_LINE.search, stderr.splitlines()) if match]


def _distinct(lines) -> list[str]:
    return list(dict.fromkeys(lines))


def _worker_file(log_dir: str, local: int, name: str) -> str | None:
    """The path of this node's worker ``local``'s ``stdout.log`` / ``stderr.log`` once the launcher has made it."""
    # DefaultLogsSpecs' layout: <log_dir>/<run_id>_<random>/attempt_0/<local rank>/<name>
    found = glob.glob(os.path.join(glob.escape(log_dir), "*", "attempt_0", str(local), name))
    return found[0] if found else None


def _read_stderr(log_dir: str, local: int) -> str:
    path = _worker_file(log_dir, local, "stderr.log")
    if path is None:
        return ""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _echo_stderr(log_dir: str, nproc: int, first: int = 0) -> None:
    """After a successful run, show what workers wrote to stderr (warnings), behind their global rank."""
    for local in range(nproc):
        for line in _read_stderr(log_dir, local).splitlines():
            sys.stderr.write(f"[rank {first + local}] {printable(line)}\n")


@contextlib.contextmanager
def _worker_environment(extra: dict[str, str] | None) -> Iterator[None]:
    """os.environ as the workers should inherit it (the launcher copies it), restored afterwards."""
    wanted = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    changes = {name: value for name, value in wanted.items() if name not in os.environ}
    changes.update(extra or {})
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _prompt_shutdown() -> Iterator[None]:
    """Make the launcher stop the workers within ``SHUTDOWN_TIMEOUT_S`` of a failure, stopped (SIGSTOP) ones too.

    When one worker fails, the elastic launcher's process context closes the
    others with its own default grace, 30 s between SIGTERM and SIGKILL (its
    ``shutdown_timeout`` reaches only the agent's last shutdown, not this
    one). A worker that hangs in Python answers SIGTERM at once, but a stopped
    one cannot: the run would end half a minute after the fault was named.
    Here every close waits at most ``SHUTDOWN_TIMEOUT_S`` and, for as long as
    it waits, sends the still-running workers' process groups SIGCONT every
    ``_CONTINUE_EVERY_S``, so that a stopped worker acts on the SIGTERM (and
    says it was stopped by the launcher): once is not enough, since a worker
    may stop itself just after a SIGCONT and before the SIGTERM arrives.
    """
    try:
        from torch.distributed.elastic.multiprocessing.api import PContext
    except ImportError:  # pragma: no cover - every accepted torch has it
        yield
        return
    original = PContext.close

    def close(self, death_sig=None, timeout=SHUTDOWN_TIMEOUT_S):
        handlers = list((getattr(self, "subprocess_handlers", None) or {}).values())
        closed = threading.Event()

        def keep_continuing() -> None:
            while not closed.is_set():
                for handler in handlers:
                    if handler.proc.poll() is None:
                        with contextlib.suppress(OSError):  # each worker leads its own process group
                            os.killpg(handler.proc.pid, signal.SIGCONT)
                closed.wait(_CONTINUE_EVERY_S)

        continuer = threading.Thread(target=keep_continuing, name="pipec-continue-workers", daemon=True)
        continuer.start()
        try:
            return original(self, death_sig, min(timeout, SHUTDOWN_TIMEOUT_S))
        finally:
            closed.set()
            continuer.join()

    PContext.close = close
    try:
        yield
    finally:
        PContext.close = original


@contextlib.contextmanager
def _quiet_launcher_logs() -> Iterator[None]:
    """Silence the elastic agent's log lines (SIGTERM sent, 'failed (exitcode: 1)'): the report says it better."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


class _OutputFollower:
    """Copies the workers' stdout (or stderr) files to our stdout, or to ``on_line``, while they run (the
    launcher writes them to files)."""

    def __init__(self, log_dir: str, nproc: int, on_line: Callable[[int, str], None] | None, echo: bool,
                 first: int = 0, name: str = "stdout.log"):
        self.log_dir = log_dir
        self.name = name  # the worker file followed: stdout.log, or stderr.log
        self.nproc = nproc
        self.first = first  # the global rank of this node's first worker
        self.on_line = on_line
        self.echo = echo
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="pipec-run-output", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def _follow(self) -> None:
        handles: dict[int, object] = {}
        partial = {rank: "" for rank in range(self.nproc)}
        try:
            while True:
                finished = self.done.is_set()  # read before the last pass, so nothing written before stop is lost
                for rank in range(self.nproc):
                    if rank not in handles:
                        path = _worker_file(self.log_dir, rank, self.name)
                        if path is None:
                            continue
                        handles[rank] = open(path, encoding="utf-8", errors="replace")
                    partial[rank] = self._emit(self.first + rank, partial[rank] + handles[rank].read(), finished)
                if finished:
                    return
                self.done.wait(FOLLOW_INTERVAL_S)
        finally:
            for handle in handles.values():
                handle.close()

    def _emit(self, rank: int, text: str, flush_partial: bool) -> str:
        """Emit the complete lines of ``text``, global rank ``rank``'s; return the unfinished rest
        (all of it is emitted at the end)."""
        *lines, rest = text.split("\n")
        if flush_partial and rest:
            lines.append(rest)
            rest = ""
        for line in lines:
            if self.on_line is not None:
                self.on_line(rank, line)
            if self.echo:
                sys.stdout.write(line + "\n" if rank == 0 else f"[rank {rank}] {line}\n")
        if lines and self.echo:
            sys.stdout.flush()
        return rest
