"""``pipec simulate``: predict makespan, bubble ratio and memory per rank.

TARGET may also be a torch.distributed.pipelining schedule CSV (``pipec compile --format torch-csv``),
read and checked as ``pipec import-torch`` does.
"""
from __future__ import annotations

from pipec.commands._common import (
    add_target_arguments,
    byte_budget_from_args,
    checked_import,
    compile_from_args,
    describe_params,
    describe_peak_bytes,
    dump_json,
    is_torch_csv,
    load_costs,
    number_text,
    write_output,
)
from pipec.errors import printable_name


def register(sub) -> None:
    parser = sub.add_parser("simulate", help="simulate a schedule under a cost model")
    add_target_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def _program(args, costs):
    """The checked ``pipec.api.Program`` of TARGET: a schedule compiled, or a torch schedule CSV imported
    and checked."""
    if not is_torch_csv(args.target):
        return compile_from_args(args, costs)
    from pipec.api import Program
    from pipec.commands._common import parse_defines

    program = checked_import(args.target, parse_defines(args.defines), memory_budget=args.budget,
                             byte_budget=byte_budget_from_args(args, costs),
                             sizes=costs.sizes if costs is not None else {})
    return Program(program, costs)


def run(args) -> int:
    from pipec.compiler.family import families_of
    from pipec.compiler.ops import memory_deltas
    from pipec.compiler.versions import staleness_note

    compiled = _program(args, load_costs(args))  # the cost file read first, as it always was
    simulation = compiled.simulate()
    result, program = simulation.result, compiled.ir
    _warn_mixed_units(args, program)
    if args.json:
        write_output(dump_json(simulation.to_json(), "the simulation's JSON"), None)
        return 0
    lines = [
        f"{printable_name(compiled.name)} ({describe_params(program.params) or 'a torch schedule CSV'}): "
        f"makespan {number_text(result.makespan)}, "
        f"bubble ratio {result.bubble_text()}"
    ]
    # a split backward: some op leaves a weight gradient waiting (I), counted in peak_waiting_w
    leaves_w_waiting = {op for op, delta in memory_deltas("waiting_w").items() if delta > 0}
    split = any(action.op in leaves_w_waiting for row in program.ranks for action in row)
    # a sequence ring keeps no activations between stages: its memory is KV
    families = families_of(program)
    activations = all(family.counts_activations for family in families)
    for rank, stats in enumerate(result.ranks):
        lines.append(
            f"  rank {rank}: busy {number_text(stats.busy)}, idle {number_text(stats.idle)}"
            + (f", peak activations {stats.peak_activations}" if activations else "")
            + (f", W waiting at most {stats.peak_waiting_w}" if split else "")
            + (f", kept inputs at most {stats.peak_kept_inputs}" if stats.peak_kept_inputs is not None else "")
            + (f", peak bytes {describe_peak_bytes(stats.peak_bytes)}" if stats.peak_bytes else "")
        )
    if simulation.versions is not None:  # asynchronous training: how often each stage updates, and what it keeps for it
        summary, flushed = simulation.versions, simulation.flushed_makespan
        updates = max(summary["updates"])
        lines.append(f"  updates per stage {summary['updates']}: one every {number_text(result.makespan / updates)} "
                     f"on average; weight versions per stage {summary['weight_versions']}")
        lines.append(f"  with a flush after every update: makespan {number_text(flushed)}; without, "
                     f"{number_text(flushed / result.makespan)} times the throughput")
        lines.append(f"note: {staleness_note(program)}")
    if result.links is not None:
        lines.append(f"  links: something moved for {number_text(result.links['communication'])}, "
                     f"directed links busy {result.links['utilisation']:.3f} of the time meanwhile")
    lines.extend(f"note: {note}" for note in (family.note(program) for family in families) if note)
    write_output("\n".join(lines), None)
    return 0


def _warn_mixed_units(args, program) -> None:
    """On stderr: the cost file prices some compute ops and leaves the program's others at unit costs."""
    if not args.costs:
        return
    import sys

    from pipec.compiler.costs import unit_priced_ops
    from pipec.compiler.guarded_read import COSTS, read_json
    from pipec.errors import CostFileError

    used = {action.op for row in program.ranks for action in row}
    left = unit_priced_ops(read_json(args.costs, COSTS, CostFileError), used)
    if left:
        sys.stderr.write(f"warning: {args.costs} prices some compute ops but not {', '.join(left)}, which keep "
                         f"unit costs: the makespan adds its times to units it cannot be compared with; give "
                         f"{', '.join(left)} in its \"compute\" (docs/costs.md)\n")
