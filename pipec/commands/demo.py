"""``pipec demo``: the tour a new user runs first.

Compiles a shipped schedule (BitPipe on 4 ranks by default), proves it safe,
prints its per-rank instruction grid and its simulated timeline figures. (Running
it on CPU ranks and drawing it come with the runtime and the renderer.)
"""
from __future__ import annotations

from pipec.commands._common import describe_params, parse_defines, write_output


def register(sub) -> None:
    parser = sub.add_parser("demo", help="compile, check and simulate a shipped schedule (BitPipe, 4 ranks)")
    parser.add_argument("--schedule", default="bitpipe", help="a shipped schedule or .pipe file (default bitpipe)")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.checks import peak_activations
    from pipec.compiler.driver import compile_target
    from pipec.compiler.emit import format_timeline
    from pipec.compiler.simulate import simulate

    defines = {"P": "4", "N": "4"}
    defines.update(parse_defines(args.defines))
    compiled = compile_target(args.schedule, defines)
    program = compiled.program
    result = simulate(program)
    fraction = result.bubble_fraction()
    bubble = f"{fraction} = {float(fraction):.4f}" if fraction is not None else f"{result.bubble_ratio:.4f}"
    lines = [
        f"== {compiled.spec.name} ({describe_params(program.params)}) from {compiled.spec.path}",
        f"compiled: {program.num_ranks} ranks, {len(program.stages)} stages, "
        f"{program.instruction_count()} instructions",
        "checked: every task once on its home, every message matched in FIFO order, "
        "deadlock-free under rendezvous semantics, no buffer conflict",
        f"simulated (unit costs F=1 B=2): makespan {result.makespan}, bubble ratio {bubble}, "
        f"peak activations per rank {peak_activations(program)}",
        "",
        "timeline (one column per unit of time; '..' is a bubble, '--' a backward's second unit):",
        format_timeline(result),
        "the per-rank instruction lists: pipec compile bitpipe -D P=4 -D N=4 --format text",
    ]
    write_output("\n".join(lines), None)
    return 0
