"""``pipec search`` at scale: sizes, methods, times, makespans, bounds and gaps (issue 27's benchmark).

Each row searches one placement (1F1B's, ZB-H1's, the V of zbv) at one size under one cost model, with the
memory the shipped order holds (1F1B and ZB-H1: rank r keeps P - r activations; zbv: 2P per rank), by one
method (``compiler/search_method.py``): the heuristic at P = 8, N = 32 (512 to 1536 tasks), ``auto`` there
(the heuristic for half the time, then CP-SAT hinted with its order), and the exact model at about 200 tasks.
The order found is written, compiled, proved at the memory limit and re-simulated: the makespan printed
is the simulator's, beside the shipped order's (``shipped``), the lower bound and the gap between them.

Usage:
    python benchmarks/search.py [--time-limit 30] [--evaluations 20000] [--seed 0] [--rows heuristic,auto,exact]
"""
from __future__ import annotations

import argparse
import time

from pipec.commands.search import resolve_target_text
from pipec.compiler.costs import CostModel, costs_from_json
from pipec.compiler.driver import compile_spec, compile_target, lower_spec, resolve_target
from pipec.compiler.memory_counts import peak_activations
from pipec.compiler.search_heuristic import HEURISTIC, HeuristicResult
from pipec.compiler.search_method import AUTO, EXACT, search_by_method
from pipec.compiler.search_pipe import order_to_pipe
from pipec.compiler.simulate import simulate

UNIT = "unit"
LATENCY = "latency 0.5"
COSTS = {UNIT: None, LATENCY: {"links": {"latency": 0.5}}}
# (rows group, target, P, N, costs, method, time limit in seconds (None: --time-limit))
ROWS = [
    *((HEURISTIC, target, 8, 32, costs, HEURISTIC, None) for costs in (UNIT, LATENCY)
      for target in ("1f1b", "zb_h1", "zbv")),
    (AUTO, "zb_h1", 8, 32, LATENCY, AUTO, 60),
    (AUTO, "zbv", 8, 32, LATENCY, AUTO, 60),
    (EXACT, "zb_h1", 4, 16, LATENCY, EXACT, 60),
    (EXACT, "1f1b", 4, 24, LATENCY, EXACT, 60),
]


def shipped_memory(target: str, P: int) -> list[int]:
    """The activations per rank the shipped order holds: the limit every search row keeps."""
    return [2 * P] * P if target == "zbv" else [P - r for r in range(P)]


def run_row(target: str, P: int, N: int, costs: CostModel | None, method: str, time_limit: float, seed: int,
            evaluations: int) -> dict:
    """Search one row; its figures, the found order's makespan re-simulated from the written, proved file."""
    defines = {"P": str(P), "N": str(N)}
    spec = resolve_target(target).evaluate(defines)
    compute, _ = lower_spec(spec, costs)
    memory = shipped_memory(target, P)
    began = time.monotonic()
    searched = search_by_method(method, compute, costs, memory, time_limit=time_limit, spec=spec, seed=seed,
                                evaluations=evaluations)
    seconds = time.monotonic() - began
    result = searched.result
    written = compile_spec(resolve_target_text(order_to_pipe(compute, result.order)), costs=costs,
                           memory_budget=max(memory))
    assert all(peak <= limit for peak, limit in zip(peak_activations(written.program), memory))
    return {
        "tasks": sum(len(row) for row in compute.ranks),
        "method": searched.method,
        "seconds": seconds,
        "makespan": simulate(written.program, costs).makespan,
        "bound": float(result.bound),
        "gap": float(result.gap),
        "status": result.status,
        "shipped": simulate(compile_target(target, {"P": P, "N": N}, costs=costs).program, costs).makespan,
        "moves": result.evaluations if isinstance(result, HeuristicResult) else "-",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per heuristic row (default 30)")
    parser.add_argument("--evaluations", type=int, default=20_000, help="the heuristic's moves (default 20000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", default=f"{HEURISTIC},{AUTO},{EXACT}", help="which groups of rows to run")
    args = parser.parse_args(argv)
    groups = set(args.rows.split(","))
    header = ("target", "P", "N", "tasks", "costs", "method", "time", "makespan", "bound", "gap", "status",
              "shipped", "moves")
    print(" | ".join(header))
    for group, target, P, N, costs_name, method, limit in ROWS:
        if group not in groups:
            continue
        costs = costs_from_json(COSTS[costs_name]) if COSTS[costs_name] else None
        row = run_row(target, P, N, costs, method, limit or args.time_limit, args.seed, args.evaluations)
        print(" | ".join(map(str, (
            target, P, N, row["tasks"], costs_name, row["method"], f"{row['seconds']:.1f} s", f"{row['makespan']:g}",
            f"{row['bound']:g}", f"{row['gap']:.1%}", row["status"], f"{row['shipped']:g}", row["moves"]))), flush=True)


if __name__ == "__main__":
    main()
