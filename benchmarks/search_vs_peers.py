"""The V placement searched against the orders people run on it: pipec's zbv and torch's own generators.

Issue 27 asks for the order the search finds on the V placement (2P stages, rank r holds r and
2P - 1 - r, backward split) under a link latency of 1/2 (unit compute: F = I = W = 1), set against
zbv's and the explicit orders the peers ship: torch's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``, read through torch's own CSV writer (``placement_vs_torch.torch_class_programs``)
and lowered by pipec. Each peer order is simulated under the costs; then the search runs at that
order's own peak activations per rank, so every searched figure is an order that holds no more than
the one it is set against. The searched order is written, compiled and re-simulated; its makespan
printed is the simulator's.

Usage:
    python benchmarks/search_vs_peers.py [--sizes 4x8] [--latency 0.5] [--time-limit 60]
"""
from __future__ import annotations

import argparse
import os
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from placement_vs_torch import torch_class_programs  # noqa: E402

from pipec.commands.search import resolve_target_text  # noqa: E402
from pipec.compiler.costs import CostModel, Link  # noqa: E402
from pipec.compiler.driver import compile_spec, compile_target, lower_spec, resolve_target  # noqa: E402
from pipec.compiler.memory_counts import peak_activations  # noqa: E402
from pipec.compiler.search import search_order  # noqa: E402
from pipec.compiler.search_pipe import order_to_pipe  # noqa: E402
from pipec.compiler.simulate import simulate  # noqa: E402


def peer_orders(P: int, N: int, costs: CostModel) -> list[tuple[str, object]]:
    """(label, program with its communication) of every order set against the search, all on the V placement."""
    return [
        ("pipec zbv (compiled under these costs)", compile_target("zbv", {"P": P, "N": N}, costs=costs).program),
        ("pipec zbv (compiled under unit costs)", compile_target("zbv", {"P": P, "N": N}).program),
        ("torch ZBVZeroBubble", torch_class_programs("ScheduleZBVZeroBubble", P, N)[0]),
        ("torch DualPipeV", torch_class_programs("ScheduleDualPipeV", P, N)[0]),
    ]


def _number(value) -> str:
    return f"{float(value):g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x8", help="P x N pairs, comma-separated (default: %(default)s)")
    parser.add_argument("--latency", default="0.5", help="link latency (default: %(default)s)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per search (default 60)")
    args = parser.parse_args(argv)
    costs = CostModel(link=Link(Fraction(args.latency)))
    print(f"V placement, unit compute, link latency {args.latency}; makespans simulated")
    print("| P x N | order | its makespan | its peak activations | searched at that peak | bound | status | solve s |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        P, N = map(int, size.split("x"))
        compute, _ = lower_spec(resolve_target("zbv").evaluate({"P": str(P), "N": str(N)}), costs)
        searched = {}  # peak -> (simulated makespan of the written order, result)
        for label, peer in peer_orders(P, N, costs):
            peaks = tuple(peak_activations(peer))
            if peaks not in searched:
                result = search_order(compute, costs, list(peaks), time_limit=args.time_limit, workers=2)
                written = compile_spec(resolve_target_text(order_to_pipe(compute, result.order)), costs=costs)
                searched[peaks] = simulate(written.program, costs).makespan, result
            found, result = searched[peaks]
            print(f"| {P} x {N} | {label} | {_number(simulate(peer, costs).makespan)} | {list(peaks)} | "
                  f"{_number(found)} | {_number(result.bound)} | {result.status} | {result.seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
