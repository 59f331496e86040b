"""``pipec simulate``: predict makespan, bubble ratio and memory per rank."""
from __future__ import annotations

from pipec.commands._common import (
    add_target_arguments,
    compile_from_args,
    describe_params,
    describe_peak_bytes,
    dump_json,
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


def run(args) -> int:
    from pipec.compiler.family import families_of
    from pipec.compiler.guarded_read import checked_total
    from pipec.compiler.ops import memory_deltas
    from pipec.compiler.simulate import plain_number, simulate
    from pipec.compiler.versions import flushed_makespan, version_plan, version_summary

    costs = load_costs(args)
    compiled = compile_from_args(args, costs)
    # the cost file's bytes per size class, if it has any: peak bytes per rank (else the output is as without)
    sizes = costs.sizes if costs is not None else {}
    result = simulate(compiled.program, costs, sizes=sizes or None)
    program = compiled.program
    plan = version_plan(program)
    # asynchronous training: the same updates with a flush after each, for the throughput it gains
    flushed = None if plan is None else flushed_makespan(program, plan, costs)
    if flushed is not None:
        checked_total(flushed, "the makespan with a flush after every update", costs.source if costs else "")
    if args.json:
        out = result.to_json()
        if plan is not None:
            out["versions"] = {**version_summary(program, plan), "flushed_makespan": plain_number(flushed)}
        write_output(dump_json(out, "the simulation's JSON"), None)
        return 0
    lines = [
        f"{printable_name(compiled.spec.name)} ({describe_params(compiled.program.params)}): "
        f"makespan {number_text(result.makespan)}, "
        f"bubble ratio {result.bubble_text()}"
    ]
    # a split backward: some op leaves a weight gradient waiting (I), counted in peak_waiting_w
    leaves_w_waiting = {op for op, delta in memory_deltas("waiting_w").items() if delta > 0}
    split = any(action.op in leaves_w_waiting for row in compiled.program.ranks for action in row)
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
    if plan is not None:  # asynchronous training: how often each stage updates, and what it keeps for it
        summary = version_summary(program, plan)
        updates = max(summary["updates"])
        lines.append(f"  updates per stage {summary['updates']}: one every {number_text(result.makespan / updates)} "
                     f"on average; weight versions per stage {summary['weight_versions']}")
        lines.append(f"  with a flush after every update: makespan {number_text(flushed)}; without, "
                     f"{number_text(flushed / result.makespan)} times the throughput")
    if result.links is not None:
        lines.append(f"  links: something moved for {number_text(result.links['communication'])}, "
                     f"directed links busy {result.links['utilisation']:.3f} of the time meanwhile")
    lines.extend(f"note: {note}" for note in (family.note(program) for family in families) if note)
    write_output("\n".join(lines), None)
    return 0
