"""``pipec check``: compile a schedule and prove it safe; one line on success.

TARGET may also be a compiled program (``pipec compile --format json``),
recognised by its content: it is read through the guarded reader and gets the
same checks (``check_all``) and the same one-line answer. What the line says
the program is made of and what was proved is each family's to say
(``Family.shape_text``, ``Family.proof_text``): a sequence ring names its
blocks and rings instead of activation counts.
"""
from __future__ import annotations

from pipec.commands._common import (add_target_arguments, byte_budget_from_args, compile_from_args, describe_params,
                                    human_bytes, load_costs, parse_byte_budget, write_output)
from pipec.errors import UsageError, counted, printable_name


def register(sub) -> None:
    parser = sub.add_parser("check", help="compile and check a schedule, or check a compiled program .json "
                                          "(exit 0 if safe, 1 with the error)")
    add_target_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.family import families_of
    from pipec.compiler.guarded_read import looks_like_program

    if looks_like_program(args.target):
        checked = _checked_program_file(args)
    else:
        checked = compile_from_args(args, load_costs(args))  # the cost file read first, as it always was
    name, program = checked.name, checked.ir
    families = families_of(program)
    sizes = checked.costs.sizes if checked.costs is not None else {}
    shape = ", ".join(family.shape_text(program) for family in families)
    proof = "; ".join(family.proof_text(program, lambda: _memory_text(program, sizes)) for family in families)
    write_output(f"ok: {printable_name(name)} ({describe_params(program.params)}): {counted(program.num_ranks, 'rank')}, "
                 f"{shape}, {counted(program.instruction_count(), 'instruction')}; {proof}", None)
    return 0


def _memory_text(program, sizes) -> str:
    """Peak activations per rank (and kept inputs, and bytes per size class the cost file sizes), and what
    a program with updates in its order keeps."""
    from pipec.compiler.checks import peak_activations
    from pipec.compiler.memory_counts import peak_bytes, peak_kept_inputs, recomputes

    peaks = peak_activations(program)
    if recomputes(program):  # recomputed stages keep their inputs instead, counted apart
        peaks = f"{peaks}, peak kept inputs per rank {[peak_kept_inputs(row) for row in program.ranks]}"
    in_bytes = ""
    if sizes:  # the cost file gives bytes per size class: each class's peak per rank
        per_rank = peak_bytes(program, sizes)
        in_bytes = "; peak bytes per rank " + ", ".join(
            f"{size_class} [{', '.join(human_bytes(rank[size_class]) for rank in per_rank)}]"
            for size_class in per_rank[0])  # the sized classes, and a composition's shard derived from its weight
    return f"peak activations per rank {peaks}{in_bytes}{_versions(program)}"


def _versions(program) -> str:
    """For a program with updates in its order: what its stages keep (``compiler/versions.py``); else ""."""
    from pipec.compiler.versions import version_plan, version_summary

    plan = version_plan(program)
    if plan is None:
        return ""
    summary = version_summary(program, plan)
    return (f"; every backward on its forward's weights, every gradient applied: updates per stage "
            f"{summary['updates']}, weight versions per stage {summary['weight_versions']}")


def _checked_program_file(args):
    """The compiled program file ``args.target`` (a ``pipec.api.Program``), checked as the compiler checks what
    it emits."""
    from pipec.api import load_file

    if args.defines:
        raise UsageError(f"-D sets parameters of a .pipe schedule; the compiled program '{args.target}' has its own")
    parse_byte_budget(getattr(args, "budget_bytes", None) or [])  # named before the cost file is read
    costs = load_costs(args)
    byte_budget = byte_budget_from_args(args, costs)
    program = load_file(args.target, costs=costs, check=False)
    program.check(memory_budget=args.budget, byte_budget=byte_budget)
    return program
