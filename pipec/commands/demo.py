"""``pipec demo``: the tour a new user runs first.

Compiles a shipped schedule (BitPipe on 4 ranks by default), proves it safe,
prints its per-rank instruction grid and its simulated timeline figures; then
trains the built-in model with it for a few steps on CPU worker processes
(gloo), started through torch's elastic launcher exactly as ``pipec run``
starts them (they load the program compiled here), and prints the loss per step, whether it fell, and where the
Chrome/Perfetto trace of every instruction went.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile

from pipec.commands._common import describe_params, write_output
from pipec.compiler.defines import parse_defines, value_text
from pipec.compiler.guarded_read import count_arg
from pipec.errors import counted

DEFAULT_STEPS = 10
# The worker's per-step line (runtime.worker): "step K loss X".
_LOSS_LINE = re.compile(r"^step (\d+) loss (\S+)$")


def register(sub) -> None:
    parser = sub.add_parser("demo", help="compile, check, simulate and run a shipped schedule (BitPipe, 4 CPU ranks)")
    parser.add_argument("--schedule", default="bitpipe", help="a shipped schedule or .pipe file (default bitpipe)")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--steps", type=count_arg, default=DEFAULT_STEPS, metavar="K",
        help=f"training steps on CPU ranks (default {DEFAULT_STEPS}; 0: compile, check and simulate only)",
    )
    parser.add_argument("--trace", metavar="FILE",
                        help="where to write the run's trace (default: trace.json in a new private folder, printed)")
    parser.add_argument(
        "--timeline", metavar="FILE",
        help="where to draw the predicted timeline (.html, .svg or .json; default: timeline.html in a new private folder, printed)"
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.checks import peak_activations
    from pipec.compiler.driver import compile_target
    from pipec.compiler.emit import format_timeline
    from pipec.compiler.simulate import simulate

    # the schedule's own defaults (BitPipe's: P = 4, N = P), -D on top
    defines = parse_defines(args.defines)
    compiled = compile_target(args.schedule, defines)
    program = compiled.program
    if args.steps > 0 and args.trace is not None:
        from pipec.compiler.atomic_write import check_writable

        check_writable(args.trace, "the trace (--trace)")  # before drawing and training, not after
    result = simulate(program)
    from pipec.compiler.render import write_timeline

    folder = _DemoFolder()
    timeline = args.timeline or folder.file("timeline.html")
    write_timeline(result, program, timeline)
    args.trace = args.trace or (folder.file("trace.json") if args.steps > 0 else None)
    bubble = result.bubble_text()
    lines = [
        f"== {args.schedule} ({describe_params(program.params)}) from {compiled.spec.path}",
        f"compiled: {counted(program.num_ranks, 'rank')}, {counted(len(program.stages), 'stage')}, "
        f"{counted(program.instruction_count(), 'instruction')}",
        "checked: every task once on its home, every message matched in FIFO order, "
        "deadlock-free under rendezvous semantics, no buffer conflict",
        f"simulated (unit costs F=1 B=2): makespan {result.makespan}, bubble ratio {bubble}, "
        f"peak activations per rank {peak_activations(program)}",
        "",
        "timeline (one column per unit of time; '..' is a bubble, '--' a backward's second unit):",
        format_timeline(result),
        f"timeline drawn: {timeline} (open it in a browser; pipec render also writes .svg and .json)",
        f"the per-rank instruction lists: pipec compile {args.schedule} "
        + " ".join(f"-D {name}={value_text(value)}" for name, value in program.params.items())
        + " --format text",
    ]
    if folder.path is not None:
        lines.append(f"the demo's files are in {folder.path} (a new folder, yours alone; remove it when done)")
    write_output("\n".join(lines), None)
    if args.steps <= 0:
        return 0
    return _train(args, defines, program)


def _train(args, defines: dict[str, str], program) -> int:
    """Run the program for ``args.steps`` steps on CPU ranks and report the loss and the trace."""
    from pipec.commands.run import check_launch, launch_program, worker_arguments
    from pipec.runtime.model import LLAMA

    config = dataclasses.replace(LLAMA.config, layers=_fitting_layers(LLAMA.config.layers, program.num_chunks))
    run_args = argparse.Namespace(
        target=args.schedule,
        defines=[f"{name}={value}" for name, value in defines.items()],
        nproc=None,
        steps=args.steps,
        backend="gloo",
        trace=args.trace,
        save=None,
        seed=None,
        timeout=None,
        model=None,
        config=[] if config == LLAMA.config else [f"layers={config.layers}"],
        costs=None,
        inject=None,
    )
    nproc = check_launch(run_args, program)
    write_output(
        f"\nrunning {args.steps} training steps on {nproc} CPU ranks (gloo; one worker process per rank, "
        f"started as `pipec run` starts them)\nmodel: {LLAMA.describe(config)}",
        None,
    )
    losses: list[float] = []

    def collect(rank: int, line: str) -> None:
        match = _LOSS_LINE.match(line)
        if rank == 0 and match:
            losses.append(float(match.group(2)))

    # the workers run the program compiled above, as `pipec run`'s do
    result = launch_program(program, worker_arguments(run_args), nproc, on_line=collect)
    if not result.ok:
        sys.stderr.write(result.report)
        return 1
    if len(losses) >= 2:
        verdict = "fell" if losses[-1] < losses[0] else "did not fall"
        write_output(f"loss {verdict}: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps", None)
    write_output(f"trace of every instruction on every rank: {run_args.trace} (open it in https://ui.perfetto.dev)", None)
    if args.steps >= 2:
        write_output(_prediction_from_trace(run_args.trace, program), None)
    return 0


def _prediction_from_trace(path: str, program) -> str:
    """The run's median step beside the simulator's makespan under the costs the run measured (``pipec costs``)."""
    import statistics

    from pipec.commands._common import read_json
    from pipec.compiler.costs import costs_from_json
    from pipec.compiler.measured_costs import measure_costs
    from pipec.compiler.render import timeline_from_trace
    from pipec.compiler.simulate import simulate

    trace = read_json(path, "trace")
    measured = measure_costs(trace, program, path)
    predicted = simulate(program, costs_from_json(measured.data)).makespan
    step_ms = statistics.median(timeline_from_trace(trace, program, step).makespan for step in measured.steps)
    cores = os.cpu_count() or 1
    shared = (f"; {program.num_ranks} ranks share {cores} cores here, and the prediction gives each rank a core of its own"
              if cores < program.num_ranks else "")
    return (f"this machine: median step {step_ms:.1f} ms; the simulator, priced with the times this run measured, "
            f"predicts {predicted:.1f} ms{shared} (pipec costs --trace {path} -o costs.json, then --costs costs.json)")


class _DemoFolder:
    """Where the demo puts the files the user did not name: a new private folder (``tempfile.mkdtemp``, mode
    0700), made on first use, never a fixed name in the shared temp folder, where another user could plant a
    link to a file of yours."""

    def __init__(self):
        self.path: str | None = None

    def file(self, name: str) -> str:
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="pipec-demo-")
        return os.path.join(self.path, name)


def _fitting_layers(layers: int, num_chunks: int) -> int:
    """The smallest multiple of ``num_chunks`` that is at least ``layers``: a model depth the program can cut."""
    return num_chunks * -(-layers // num_chunks)
