"""``pipec check``: compile a schedule and prove it safe; one line on success."""
from __future__ import annotations

from pipec.commands._common import add_target_arguments, compile_from_args, describe_params, human_bytes, load_costs, write_output


def register(sub) -> None:
    parser = sub.add_parser("check", help="compile and check a schedule (exit 0 if safe, 1 with the error)")
    add_target_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.checks import peak_activations
    from pipec.compiler.memory_counts import peak_bytes

    costs = load_costs(args)
    compiled = compile_from_args(args, costs)
    program = compiled.program
    peaks = peak_activations(program)
    in_bytes = ""
    sizes = costs.sizes if costs is not None else {}
    if sizes:  # the cost file gives bytes per size class: each class's peak per rank
        per_rank = peak_bytes(program, sizes)
        in_bytes = "; peak bytes per rank " + ", ".join(
            f"{size_class} [{', '.join(human_bytes(rank[size_class]) for rank in per_rank)}]" for size_class in sizes)
    write_output(
        f"ok: {compiled.spec.name} ({describe_params(program.params)}): {program.num_ranks} ranks, "
        f"{len(program.stages)} stages, {program.num_microbatches} microbatches, "
        f"{program.instruction_count()} instructions; well-formed, messages matched, deadlock-free, "
        f"no conflict; peak activations per rank {peaks}{in_bytes}",
        None,
    )
    return 0
