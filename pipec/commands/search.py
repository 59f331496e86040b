"""``pipec search``: the fastest per-rank order of TARGET's tasks under a cost model and a memory limit,
found exactly with OR-Tools CP-SAT (``compiler/search.py``) or by a heuristic against a lower bound
(``compiler/search_heuristic.py``; ``--method``, ``compiler/search_method.py``), written as an explicit-order
``.pipe`` (``compiler/search_pipe.py``) that is compiled, proved and re-simulated before it is reported.

TARGET's family is asked first (``Family.refuse_search``, ``Family.searches_itself``): a family that
searches its own choices (sequence rings' rings, weight passing's step grid) prices its candidates with
the simulator (``Family.search``); its answer is compiled, proved and re-simulated here the same way.
"""
from __future__ import annotations

import os

from pipec.commands._common import byte_budget_from_args, load_costs, number_text, parse_byte_budget, write_output
from pipec.compiler.atomic_write import check_writable
from pipec.compiler.guarded_read import count_arg, plain_int, positive_count_arg, quote, seconds_arg
from pipec.errors import UsageError

# CP-SAT's worker threads: more than a machine's cores only share them (and the solver refuses absurd counts).
MOST_WORKERS = 64


def register(sub) -> None:
    parser = sub.add_parser("search", help="search the fastest order of a schedule's tasks (OR-Tools CP-SAT)")
    parser.add_argument("target", metavar="TARGET", help="a .pipe file or a shipped schedule: its placement and tasks")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                        help="set a schedule parameter (repeatable)")
    parser.add_argument("--costs", metavar="FILE", help="a JSON cost file (default: unit costs F=1 B=2 I=W=1)")
    parser.add_argument("--memory", metavar="N[,N...]",
                        help="the most live activations per rank: one N for every rank, or one per rank")
    parser.add_argument("--budget-bytes", dest="budget_bytes", action="append", default=[], metavar="CLASS=BYTES",
                        help="the most bytes of live values of size class CLASS per rank, as `pipec check "
                             "--budget-bytes` counts them; the cost file's \"sizes\" gives the bytes of one value "
                             "(repeatable)")
    parser.add_argument("--recompute", choices=("target", "choose"), default="target",
                        help="target: recompute the stages TARGET recomputes (default); choose: the solver "
                             "chooses per stage whether its forward keeps only its input and recomputes")
    parser.add_argument("--time-limit", dest="time_limit", type=seconds_arg, default=30.0, metavar="S",
                        help="the solver's limit in seconds (default 30)")
    parser.add_argument("--hint", metavar="TARGET",
                        help="a .pipe file or shipped schedule (compiled with the same -D) whose order of the same "
                             "tasks the solver starts from (default: TARGET's own order; 'none' for no hint)")
    parser.add_argument("--workers", type=positive_count_arg, default=2, metavar="K",
                        help="CP-SAT worker threads (default 2)")
    parser.add_argument("--candidates", type=positive_count_arg, metavar="K",
                        help="for a family that searches its own candidates (sequence rings, weight passing): the "
                             "most candidates to price (default: every ring set; 2000 step grids)")
    parser.add_argument("--method", choices=("exact", "heuristic", "auto"), default="auto",
                        help="exact: CP-SAT; heuristic: local search from the target's, the hint's and list-scheduled "
                             "orders, against an analytic lower bound; auto (default): exact up to 200 tasks, past "
                             "them the heuristic for half the time, then CP-SAT hinted with its order")
    parser.add_argument("--seed", type=count_arg, default=0, help="the heuristic's random seed (default 0)")
    parser.add_argument("--evaluations", type=positive_count_arg, default=None, metavar="K",
                        help="the most moves the heuristic tries (default 20000); with --seed it fixes the result, "
                             "--time-limit only stops it early")
    parser.add_argument("-o", dest="output", metavar="FILE", help="write the searched order as a .pipe file")
    parser.set_defaults(func=run)


def _check_output(output: str, target: str) -> None:
    """``-o`` can be written, and is not the TARGET file itself (the searched order would replace the user's
    schedule, which the search read)."""
    check_writable(output, "the searched order (-o)")
    if os.path.exists(output) and os.path.exists(target) and os.path.samefile(output, target):
        raise UsageError(f"-o {quote(output, 60)} is TARGET itself: the searched order would replace the schedule "
                         "it was searched from; write it to another file")


def _memory(text: str | None, ranks: int) -> list[int] | None:
    if text is None:
        return None
    limits = [plain_int(part, "--memory N or N,N,...", low=1) for part in text.split(",")]  # as every option's
    if len(limits) == 1:
        return limits * ranks
    if len(limits) != ranks:
        raise UsageError(f"--memory gives {len(limits)} limits for {ranks} ranks: give one, or one per rank")
    return limits


def _hint(args, compute, costs):
    """The order the solver starts from: TARGET's own (``compute``), another target's compiled with the same
    defines, or None for ``--hint none``."""
    from pipec.commands._common import parse_defines
    from pipec.compiler.driver import lower_spec, resolve_target

    if args.hint is None:
        return compute.ranks
    if args.hint == "none":
        return None
    hinted, _ = lower_spec(resolve_target(args.hint).evaluate(parse_defines(args.defines)), costs)
    if hinted.num_ranks != compute.num_ranks:
        raise UsageError(f"--hint {args.hint} has {hinted.num_ranks} ranks; the target has {compute.num_ranks}")
    return hinted.ranks


def run(args) -> int:
    from pipec.commands._common import parse_defines
    from pipec.compiler.driver import compile_spec, lower_spec, resolve_target
    from pipec.compiler.family import first_answer, first_refusal, families_of
    from pipec.compiler.memory_counts import holds_more_activations
    from pipec.compiler.search import refuse_weight_versions
    from pipec.compiler.search_heuristic import DEFAULT_EVALUATIONS
    from pipec.compiler.search_method import search_by_method
    from pipec.compiler.search_pipe import order_to_pipe, refuse_unwritable
    from pipec.compiler.simulate import simulate

    # the parser read every number (ASCII digits, in range: at least 1, seconds above 0); the workers' top here
    if args.workers > MOST_WORKERS:
        raise UsageError(f"--workers takes 1 to {MOST_WORKERS}")
    if args.output is not None:  # before the search, not after it
        _check_output(args.output, args.target)
    evaluations = DEFAULT_EVALUATIONS if args.evaluations is None else args.evaluations
    parse_byte_budget(args.budget_bytes)  # a mistake here is named before the cost file is read
    costs = load_costs(args)
    byte_budget = byte_budget_from_args(args, costs)
    spec = resolve_target(args.target).evaluate(parse_defines(args.defines))
    compute, program = lower_spec(spec, costs)
    refusal = first_refusal(program, lambda family: family.refuse_search(program))
    if refusal is not None:
        raise UsageError(f"pipec search: {refusal}")
    searcher = first_answer(families_of(program), lambda family: family if family.searches_itself else None)
    if searcher is not None:
        return _family_search(args, searcher, spec, program, costs)
    if args.candidates is not None:
        raise UsageError("--candidates caps a family's own search (sequence rings, weight passing); activation "
                         "passing is searched exactly by CP-SAT (--time-limit bounds it)")
    refuse_weight_versions(compute)  # named for what it is, before the writer's list of the ops it writes
    refuse_unwritable(compute, program)  # the final program holds the family plans
    memory = _memory(args.memory, compute.num_ranks)
    hint = _hint(args, compute, costs)
    searched = search_by_method(args.method, compute, costs, memory, byte_budget=byte_budget,
                                recompute=args.recompute, time_limit=args.time_limit, workers=args.workers,
                                hint=hint, spec=spec, seed=args.seed, evaluations=evaluations)
    result = searched.result
    text = order_to_pipe(compute, result.order)
    # the written order, proved (at the byte budget too) and priced by the real simulator
    written = compile_spec(resolve_target_text(text), costs=costs, byte_budget=byte_budget)
    simulated = simulate(written.program, costs).makespan
    if [list(row) for row in written.compute.ranks] != result.order:
        raise UsageError("pipec search: the written order does not compile to the searched one (a pipec bug)")
    if holds_more_activations(written.program, memory):
        raise UsageError("pipec search: the written order holds more activations than --memory (a pipec bug)")
    print(f"status {result.status}, makespan {number_text(result.makespan)}, lower bound "
          f"{number_text(result.bound)}, gap {float(result.gap):.1%}, simulated makespan {number_text(simulated)} "
          f"({result.seconds:.2f} s)")
    print(_method_line(searched))
    if result.recomputed:  # as the language names them: positions along a pipeline (every replica of a chunk)
        chunks = sorted({compute.stages[stage].position for stage in result.recomputed})
        print("recomputed stages " + ", ".join(map(str, chunks)))
    if args.output is not None:
        write_output(text, args.output)
    return 0


def _family_search(args, family, spec, program, costs) -> int:
    """``family``'s own search of TARGET (``Family.search``), its written answer compiled, proved and re-simulated
    before it is printed and written."""
    from pipec.compiler.driver import compile_spec
    from pipec.compiler.family import first_refusal
    from pipec.compiler.memory_counts import holds_more_activations
    from pipec.compiler.simulate import simulate

    exact_only = [flag for flag, given in (("--budget-bytes", args.budget_bytes), ("--hint", args.hint is not None),
                                           ("--recompute choose", args.recompute != "target"),
                                           (f"--method {args.method}", args.method != "auto"),
                                           ("--evaluations", args.evaluations is not None)) if given]
    if exact_only:
        raise UsageError(f"pipec search: only activation passing's search takes {', '.join(exact_only)}; "
                         f"{spec.name} is a {family.name} schedule, searched over its own candidates")
    memory = _memory(args.memory, program.num_ranks)
    if memory is not None:
        refusal = first_refusal(program, lambda each: each.refuse_memory_budget(spec.name))
        if refusal is not None:
            raise UsageError(f"pipec search: {refusal}")
    result = family.search(spec, program, costs, memory, time_limit=args.time_limit, candidates=args.candidates,
                           seed=args.seed)
    written = compile_spec(resolve_target_text(result.text), costs=costs)
    simulated = simulate(written.program, costs).makespan
    if simulated != result.makespan:
        raise UsageError("pipec search: the written schedule does not simulate to the searched makespan (a pipec bug)")
    if holds_more_activations(written.program, memory):
        raise UsageError("pipec search: the written schedule holds more activations than --memory (a pipec bug)")
    bound = "none" if result.bound is None else number_text(result.bound)
    of = "" if result.total is None else f" of {result.total:,}"
    print(f"status {result.status}, makespan {number_text(result.makespan)}, shipped {number_text(result.shipped)}, "
          f"lower bound {bound}, candidates {result.tried:,}{of}, simulated makespan {number_text(simulated)} "
          f"({result.seconds:.2f} s)")
    print(result.choice)
    if args.output is not None:
        write_output(result.text, args.output)
    return 0
def _method_line(searched) -> str:
    """Which method produced the order and, for the heuristic, its moves, its best seed and its bound's reason."""
    from pipec.compiler.search_heuristic import HeuristicResult

    result = searched.result
    if not isinstance(result, HeuristicResult):
        return f"method {searched.method}"
    seeds = f"{len(result.seeds)} seed" + ("s" if len(result.seeds) > 1 else "")
    return (f"method {searched.method}: {result.evaluations} moves from {result.seed_name} "
            f"({number_text(result.seeds[0][1])} best of {seeds}); bound: {result.bound_reason}")


def resolve_target_text(text: str):
    """The evaluated spec of a searched order's text (parsed and resolved like a target's)."""
    from pipec.compiler.driver import task_kinds
    from pipec.dsl import parse, resolve

    schedule = parse(text, "<searched>").schedules[0]
    return resolve(schedule, "<searched>", text, task_kinds()).evaluate({})
