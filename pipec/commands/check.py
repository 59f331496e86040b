"""``pipec check``: compile a schedule and prove it safe; one line on success.

TARGET may also be a compiled program (``pipec compile --format json``),
recognised by its content: it is read through the guarded reader and gets the
same checks (``check_all``) and the same one-line answer. A sequence ring
(``Program.rings``) is proved by ``check_rings`` (through ``check_all``), and
its line says what that proved instead of activation counts.
"""
from __future__ import annotations

from pipec.commands._common import (add_target_arguments, byte_budget_from_args, compile_from_args, describe_params,
                                    human_bytes, load_costs, parse_byte_budget, write_output)
from pipec.errors import UsageError


def register(sub) -> None:
    parser = sub.add_parser("check", help="compile and check a schedule, or check a compiled program .json "
                                          "(exit 0 if safe, 1 with the error)")
    add_target_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.checks import peak_activations
    from pipec.compiler.guarded_read import looks_like_program
    from pipec.compiler.memory_counts import peak_bytes, peak_kept_inputs, peak_weight_buffers, recomputes

    if looks_like_program(args.target):
        name, program, costs = _checked_program_file(args)
    else:
        costs = load_costs(args)
        compiled = compile_from_args(args, costs)
        name, program = compiled.spec.name, compiled.program
    if program.rings is not None:  # sequence rings: check_all ran check_rings, which proves other things
        write_output(_rings_ok(name, program), None)
        return 0
    peaks = peak_activations(program)
    if recomputes(program):  # recomputed stages keep their inputs instead, counted apart
        peaks = f"{peaks}, peak kept inputs per rank {[peak_kept_inputs(row) for row in program.ranks]}"
    in_bytes = ""
    sizes = costs.sizes if costs is not None else {}
    if sizes:  # the cost file gives bytes per size class: each class's peak per rank
        per_rank = peak_bytes(program, sizes)
        in_bytes = "; peak bytes per rank " + ", ".join(
            f"{size_class} [{', '.join(human_bytes(rank[size_class]) for rank in per_rank)}]" for size_class in sizes)
    weights = _versions(program)
    if program.weights is not None:  # weight passing: its extra proofs and its buffers
        weights = (f"; weights where every task runs, gradients folded into their owners once, "
                   f"peak borrowed weight buffers per rank {peak_weight_buffers(program)}")
    write_output(
        f"ok: {name} ({describe_params(program.params)}): {program.num_ranks} ranks, "
        f"{len(program.stages)} stages, {program.num_microbatches} microbatches, "
        f"{program.instruction_count()} instructions; well-formed, messages matched, deadlock-free, "
        f"no conflict; peak activations per rank {peaks}{in_bytes}{weights}",
        None,
    )
    return 0


def _versions(program) -> str:
    """For a program with updates in its order: what its stages keep (``compiler/versions.py``); else ""."""
    from pipec.compiler.versions import version_plan, version_summary

    plan = version_plan(program) if program.weights is None else None
    if plan is None:
        return ""
    summary = version_summary(program, plan)
    return (f"; every backward on its forward's weights, every gradient applied: updates per stage "
            f"{summary['updates']}, weight versions per stage {summary['weight_versions']}")


def _rings_ok(name: str, program) -> str:
    """The one line for a sequence-ring program that passed ``check_rings``: what it proved.

    Blocks, KV and partials are what a ring moves and computes; it has no
    stages' activations, so their counts (all zero) are not shown.
    """
    plan = program.rings
    blocks = sum(1 for q in range(plan.chunks) for kv in range(plan.chunks) for piece in range(plan.pieces)
                 if plan.visible(q, kv, piece))
    pieces = f"{plan.pieces} KV piece{'s' if plan.pieces != 1 else ''}"
    return (f"ok: {name} ({describe_params(program.params)}): {program.num_ranks} ranks, {plan.chunks} chunks of "
            f"{pieces} on {len(plan.rings)} ring{'s' if len(plan.rings) != 1 else ''}, "
            f"{program.instruction_count()} instructions; each of the {blocks} visible blocks computed once forward "
            "and once backward, KV where every block runs, every dK, dV contribution home once, messages matched, "
            "deadlock-free" + (f"\nnote: {plan.note}" if plan.note else ""))


def _checked_program_file(args):
    """(name, program, costs) of a compiled program file, checked as the compiler checks what it emits."""
    from pipec.compiler.checks import check_all
    from pipec.compiler.guarded_read import read_program

    if args.defines:
        raise UsageError(f"-D sets parameters of a .pipe schedule; the compiled program '{args.target}' has its own")
    parse_byte_budget(getattr(args, "budget_bytes", None) or [])  # named before the cost file is read
    costs = load_costs(args)
    byte_budget = byte_budget_from_args(args, costs)
    program = read_program(args.target)
    check_all(program, semantics="rendezvous", memory_budget=args.budget, byte_budget=byte_budget,
              sizes=costs.sizes if costs is not None else {})
    return program.name, program, costs
