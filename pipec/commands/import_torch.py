"""``pipec import-torch CSV``: read a torch.distributed.pipelining schedule CSV,
complete it with communication if it has none, check it, and simulate it.

Prints one summary line, or with ``--json`` the simulation as JSON plus the
schedule's shape. Any problem with the file or the schedule is a pipec error
(exit 1, no traceback).
"""
from __future__ import annotations

import json
import os

# How a user without a CSV at hand gets one: the chain README's "Using it" follows.
MAKE_ONE = "make one with `pipec compile 1f1b -D P=4 -D N=8 --format torch-csv -o schedule.csv`"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "import-torch",
        help="check and simulate a torch.distributed.pipelining schedule CSV",
        description=(
            "Read a torch.distributed.pipelining schedule CSV (compute-only or with communication), "
            f"prove it safe with pipec's checks and simulate it. {MAKE_ONE[0].upper()}{MAKE_ONE[1:]}; "
            "`pipec render CSV -o x.html` draws it."
        ),
    )
    parser.add_argument("csv", metavar="CSV", help=f"torch schedule CSV, one row per rank ({MAKE_ONE})")
    parser.add_argument("--json", action="store_true", help="print the simulation as JSON")
    parser.add_argument("--costs", metavar="FILE", help="cost model file for the simulator (unit costs by default)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.import_torch import import_and_check

    # the file (missing, a folder, a FIFO, too large, not UTF-8) is judged by the guarded reader in import_and_check
    if not os.path.lexists(args.csv):
        from pipec.compiler.guarded_read import quote
        from pipec.errors import UsageError

        raise UsageError(f"no file {quote(args.csv)}: {MAKE_ONE}")
    costs = _load_costs(args.costs) if args.costs else None
    program, result = import_and_check(args.csv, costs=costs)
    if args.json:
        report = result.to_json()
        report.update(
            num_ranks=program.num_ranks,
            num_stages=len(program.stages),
            num_microbatches=program.num_microbatches,
        )
        print(json.dumps(report))
    else:
        print(_summary(program, result))
    return 0


def _load_costs(path: str):
    from pipec.compiler.costs import load_costs

    return load_costs(path)  # a missing or bad file is a CostFileError


def _summary(program, result) -> str:
    from pipec.errors import counted

    peaks = " ".join(str(rank.peak_activations) for rank in result.ranks)
    return (
        f"{program.name}: {counted(program.num_ranks, 'rank')}, {counted(len(program.stages), 'stage')}, "
        f"{counted(program.num_microbatches, 'microbatch')}, {counted(program.instruction_count(), 'instruction')}, "
        f"makespan {result.makespan:g}, bubble ratio {result.bubble_ratio:.4f}, "
        f"peak activations per rank [{peaks}]"
    )
