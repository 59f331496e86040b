"""``pipec costs --trace RUN.json``: the cost file a run measured, for ``--costs``.

Per model chunk, the median time of each compute op over the run's steps (the
first left out when there are more), and the median time a rank spends posting
one message, in milliseconds (``compiler.measured_costs``).
With ``-o FILE`` it writes the JSON file and prints a table of what it found;
without, it prints the JSON. Then ``pipec simulate OTHER --costs FILE``
predicts another schedule on the same chunks with the times of this machine.

TARGET and -D default to what the trace records; give them for a trace that
does not.
"""
from __future__ import annotations

from pipec.commands._common import (describe_params, dump_json, named_by_trace, read_json, target_of_run,
                                    write_output)
from pipec.errors import printable_name


def register(sub) -> None:
    parser = sub.add_parser(
        "costs",
        help="measure a cost file from a `pipec run --trace` file (median compute time per chunk and op)",
        description="Write the cost file a run measured: per model chunk, the median time of F, B, I, W in ms.",
    )
    parser.add_argument("--trace", metavar="RUN.json", required=True, help="a `pipec run --trace` file")
    parser.add_argument(
        "target", nargs="?", metavar="TARGET",
        help="the schedule that ran (default: the one the trace records)",
    )
    parser.add_argument(
        "-D", dest="defines", action="append", default=[], metavar="NAME=VALUE", help="set a schedule parameter (repeatable)"
    )
    parser.add_argument("-o", dest="output", metavar="FILE", help="write the cost file here (default: print it)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.costs import SPLITS, load_costs
    from pipec.compiler.driver import compile_target
    from pipec.compiler.measured_costs import UNIT, measure_costs
    from pipec.compiler.ops import COMPUTE_OPS
    from pipec.compiler.trace_events import recorded

    trace = read_json(args.trace, "trace")
    target, defines = target_of_run(args, trace, "costs")
    ran_with = recorded(trace, "costs")  # the run's order may have depended on it: compile the same program
    with named_by_trace(args.trace, target, args.target is None):
        program = compile_target(target, defines, costs=load_costs(ran_with) if ran_with else None).program
    measured = measure_costs(trace, program, args.trace)
    if not args.output:
        write_output(dump_json(measured.data), None)
        return 0
    write_output(dump_json(measured.data), args.output)
    per_chunk = measured.data["compute"]["per_chunk"]
    ops = [op for op in COMPUTE_OPS if any(op in times for times in per_chunk.values())]
    steps = measured.steps
    lines = [
        f"{printable_name(program.name)} ({describe_params(program.params)}), steps {steps[0]}..{steps[-1]} "
        f"of {args.trace}: "
        f"median compute time per task, {UNIT}",
        "  chunk " + "".join(f"{op:>9}     " for op in ops) + "  widest spread (max - min) / median",
    ]
    for chunk, times in per_chunk.items():
        cells = "".join(_cell(times.get(op), measured.samples.get((int(chunk), op)), SPLITS.get(op, ())) for op in ops)
        lines.append(f"  {chunk:>5} {cells}  {_widest(measured.spreads, int(chunk))}")
    if measured.messages:
        lines.append(f"  posting one message: {measured.data['links']['post']:.4g} {UNIT} (median of {measured.messages})")
    lines.append(f"wrote {args.output} (message travel not measured: add latency and bandwidth to \"links\" by hand)")
    write_output("\n".join(lines), None)
    _warn_noise(measured, program, trace)
    return 0


def _warn_noise(measured, program, trace) -> None:
    """On stderr, what made the run's times noise: ranks sharing cores, or repeats spread wide."""
    import sys

    from pipec.compiler.spread import noise_warnings
    from pipec.compiler.trace_events import recorded

    cores = recorded(trace, "cores", int)  # the running machine's; a trace without it: this one's
    spreads = {f"chunk {chunk} {op}": spread for (chunk, op), spread in measured.spreads.items()}
    processes = len(set(program.devices)) if program.devices else program.num_ranks  # torchrun's processes
    for warning in noise_warnings(spreads, processes, cores):
        sys.stderr.write(f"warning: {warning}\n")


def _widest(spreads, chunk: int) -> str:
    """The op of ``chunk`` whose repeats spread most, with its min / median / max: ``B min 2.1 / ...``."""
    mine = [(op, spread) for (at, op), spread in spreads.items() if at == chunk]
    if not mine:
        return ""
    op, spread = max(mine, key=lambda item: item[1].relative)
    return f"{op} {spread.text()}"


def _cell(time, samples, parts) -> str:
    """``  1.541 x12``: the median and how many tasks it is over; ``=I+W`` for a B derived from its ``parts``."""
    if time is None:
        return " " * 14
    return f"{time:>8.4g} {'x' + str(samples) if samples else '=' + '+'.join(parts):<5}"
