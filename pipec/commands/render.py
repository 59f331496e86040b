"""``pipec render``: draw a schedule; the output's suffix picks the drawing.

* ``.svg`` / ``.html``: the simulated timeline (HTML: hover tips, zoom, legend);
  with ``--trace RUN.json`` (written by ``pipec run --trace``), the measured
  timeline of one training step above the predicted one, which, without
  ``--costs``, is priced with the times the run measured (``pipec costs``), so
  both panels are in milliseconds, on one time axis (the longer sets the
  scale), under a title with the measured makespan, then the predicted one.
  An SVG is bounded whatever the costs (``render.svg``: a plot at most 10,000
  px wide, boxes under a pixel merged, at most 25,000 boxes and message bars,
  under 7 MB);
* ``.json``: the simulated timeline as a Chrome / Perfetto trace;
* ``.dot`` / ``.png``: the task dependency graph, ranks as clusters. A program
  that fails the deadlock check is still drawn, its wait-for cycle in red (a
  note on stderr says so; the exit status stays 0, the drawing was made).

TARGET is a ``.pipe`` file, a shipped schedule, a program ``.json`` from
``pipec compile`` (edited or not), or a torch.distributed.pipelining schedule
CSV (``*.csv``, or a file that starts with an action such as ``0F0``; as
``pipec import-torch`` reads it). With ``--trace`` it may be left out: the
trace records what ran (the target, a file's path made absolute, its
parameters and its cost file, which is also the default ``--costs``).
"""
from __future__ import annotations

import os
import sys

from pipec.commands._common import (checked_import, imported_program, is_torch_csv, load_costs, named_by_trace, read_json,
                                    target_of_run, write_output)
from pipec.compiler.guarded_read import count_arg, looks_like_program, positive_count_arg
from pipec.compiler.trace_events import recorded
from pipec.errors import UsageError, printable_name


def register(sub) -> None:
    parser = sub.add_parser(
        "render",
        help="draw a schedule: timeline (.svg, .html), Chrome trace (.json), task graph (.dot, .png)",
        description="Draw TARGET into FILE; FILE's suffix picks the drawing (.svg, .html, .json, .dot, .png).",
    )
    parser.add_argument(
        "target", nargs="?", metavar="TARGET",
        help="a .pipe file, a shipped schedule's name, a program .json from `pipec compile`, or a torch "
             "schedule .csv "
             "(with --trace: default, the schedule the trace names)",
    )
    parser.add_argument(
        "-D", dest="defines", action="append", default=[], metavar="NAME=VALUE", help="set a schedule parameter (repeatable)"
    )
    parser.add_argument("-o", dest="output", required=True, metavar="FILE", help="the drawing to write")
    parser.add_argument("--costs", metavar="FILE", help="a JSON cost file (default: unit costs F=1 B=2 I=W=1)")
    parser.add_argument("--budget", type=count_arg, metavar="N", help="fail if a rank holds more than N chunk activations")
    parser.add_argument(
        "--trace", metavar="RUN.json",
        help="a `pipec run --trace` file: draw its measured timeline above the predicted one (.svg, .html)",
    )
    parser.add_argument("--step", type=positive_count_arg, metavar="K", help="the training step of --trace to draw (default: the last)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.render import GRAPH_FORMS, TIMELINE_FORMS, form_of, write_graph, write_timeline

    form = form_of(args.output)
    trace = read_json(args.trace, "trace") if args.trace else None
    if trace is not None and form not in TIMELINE_FORMS:
        raise UsageError("--trace draws the measured timeline above the predicted one: write .svg or .html")
    if args.step is not None and trace is None:
        raise UsageError("--step picks a step of --trace; give --trace RUN.json")
    target, defines = target_of_run(args, trace, "render")
    priced_by_run = trace is not None and args.costs is None
    if priced_by_run:
        args.costs = recorded(trace, "costs")  # compile what ran: its order may have depended on these
    costs = load_costs(args)
    from_trace = trace is not None and args.target is None
    if form in GRAPH_FORMS:
        with named_by_trace(args.trace, target, from_trace):
            program, cycle = _program_for_graph(target, defines, costs, args.budget)
        write_graph(program, args.output, cycle=cycle)
        if cycle:
            sys.stderr.write(f"note: {printable_name(program.name)} fails the deadlock check; its wait-for cycle "
                             "is drawn in red "
                             f"({len(cycle)} rank(s))\n")
    else:
        from pipec.compiler.render import timeline_from_trace
        from pipec.compiler.simulate import simulate

        with named_by_trace(args.trace, target, from_trace):
            program = _checked_program(target, defines, costs, args.budget)
        measured, pricing, unit = None, costs, ""
        if trace is not None:
            measured = timeline_from_trace(trace, program, args.step, name=os.path.basename(args.trace))
        if priced_by_run:  # no --costs: the prediction is priced with the times the run measured, in its ms
            from pipec.compiler.costs import costs_from_json
            from pipec.compiler.measured_costs import UNIT, measure_costs

            measured_costs = measure_costs(trace, program, args.trace).data
            pricing, unit = costs_from_json(measured_costs, f"the costs measured from {args.trace}"), UNIT
        write_timeline(simulate(program, pricing), program, args.output, measured=measured, unit=unit)
    write_output(f"wrote {args.output}", None)
    return 0


def _is_program_file(target: str) -> bool:
    return looks_like_program(target)  # by content: a JSON object, whatever the file's suffix


def _load_program(target: str, defines: dict[str, str]):
    """A program .json (``pipec compile``), unchecked, as a ``pipec.api.Program``."""
    from pipec.api import load_file

    if defines:
        raise UsageError("-D sets parameters of a .pipe schedule; a compiled program .json already has its own")
    return load_file(target, check=False)  # the one guarded reader


def _checked_program(target: str, defines: dict[str, str], costs, budget):
    """The program to simulate (the compiler's): compiled and checked, or loaded and checked, by the API."""
    from pipec.api import compile as compile_program

    if is_torch_csv(target):  # pipec compile --format torch-csv, or torch's own schedule
        return checked_import(target, defines, memory_budget=budget)
    if not _is_program_file(target):
        return compile_program(target, defines, costs=costs, memory_budget=budget).ir
    program = _load_program(target, defines)
    program.check(memory_budget=budget)
    return program.ir


def _program_for_graph(target: str, defines: dict[str, str], costs, budget):
    """The program to draw and its deadlock cycle (empty when it passes).

    The driver's phases up to the checks, then the checks with a deadlock kept
    for drawing: every other failure is raised as usual.
    """
    from pipec.compiler.checks import check_all
    from pipec.compiler.driver import lower_spec, resolve_target
    from pipec.errors import DeadlockError

    semantics = "rendezvous"
    if is_torch_csv(target):
        program, semantics = imported_program(target, defines)
    elif _is_program_file(target):
        program = _load_program(target, defines).ir
    else:
        _, program = lower_spec(resolve_target(target).evaluate(defines), costs)
    try:
        check_all(program, semantics=semantics, memory_budget=budget)
    except DeadlockError as deadlock:
        return program, deadlock.cycle
    return program, []
