"""TASP against ring attention: the end-to-end speed-up as a function of the communication-to-compute ratio.

TASP's paper reports "up to 3.58x" over ring attention. On a full mesh of n
devices with one link per ordered pair, TASP moves a step's KV over the n - 1
links of each device at once (n - 1 pieces on n - 1 arc-disjoint Hamiltonian
rings) where a ring uses one, so a step's communication is n - 1 times
shorter; the end-to-end gain depends on how much of a step communication
takes: with compute C and communication M per step, overlapped, a step costs
max(C, M) on a ring and max(C, M / (n - 1)) under TASP.

This script does not assume that formula: it prices pipec's shipped-shape
programs (``zigzag_ring`` and ``tasp``: zigzag chunks, causal, KV again in
backward, dK, dV behind) with pipec's simulator on a full mesh
(``links.contention``: messages sharing a link share its bandwidth), for
ratios rho = (time one step's KV takes over one link, ring) / (one step's
forward compute on a rank), forward and backward (a backward block costs two
forward ones, and dK, dV partials move too), and prints the speed-up
makespan(ring) / makespan(tasp) for each rho, then the smallest rho at which
it reaches 3.58x (bisection), and the link utilisation while KV moves.

Usage:
    python benchmarks/ring_attention.py [--ranks 8] [--ratios 0.25,0.5,1,2,4,8,16,64] [--target 3.58]
"""
from __future__ import annotations

import argparse
from fractions import Fraction

from pipec.compiler.costs import CostModel, Link
from pipec.compiler.ir import RingPlan
from pipec.compiler.lower_rings import lower_plan
from pipec.compiler.rings import hamiltonian_rings
from pipec.compiler.simulate import simulate


def shapes(n: int):
    """The zigzag ring and TASP programs on n ranks (causal), as the shipped schedules compile them."""
    holders = tuple(c if c < n else 2 * n - 1 - c for c in range(2 * n))
    rings = hamiltonian_rings(n)
    ring = lower_plan(RingPlan(2 * n, holders, 1, (tuple(range(n)),), True), "zigzag_ring")
    tasp = lower_plan(RingPlan(2 * n, holders, len(rings.cycles), rings.cycles, True, transfer="all_to_all"), "tasp")
    return ring, tasp, rings.note


def costs(rho: float) -> CostModel:
    """A full mesh where a ring step's KV (two chunks: a zigzag pair) takes ``rho`` times a step's
    forward compute (two whole blocks of cost 1 on every rank, on average)."""
    return CostModel(ops=(("AB", 2), ("AF", 1), ("B", 2), ("F", 1), ("I", 1), ("W", 1)), link=Link(0, 1),
                     contention=True, value_bytes=(("kv", rho),))


def speedup(ring, tasp, rho: float) -> tuple[float, dict, dict]:
    a, b = simulate(ring, costs(rho)), simulate(tasp, costs(rho))
    return float(Fraction(a.makespan) / Fraction(b.makespan)), a.links or {}, b.links or {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--ratios", default="0.25,0.5,1,2,4,8,16,64")
    parser.add_argument("--target", type=float, default=3.58)
    args = parser.parse_args(argv)
    ring, tasp, note = shapes(args.ranks)
    n = args.ranks
    print(f"n = {n} ranks, full mesh, zigzag chunks, causal; TASP on {len(tasp.rings.rings)} rings" +
          (f" ({note})" if note else ""))
    print(f"{'rho':>8} {'ring makespan':>14} {'tasp makespan':>14} {'speed-up':>9} {'ring links':>11} {'tasp links':>11}")
    for rho in (float(x) for x in args.ratios.split(",")):
        a, b = simulate(ring, costs(rho)), simulate(tasp, costs(rho))
        print(f"{rho:>8g} {float(a.makespan):>14.2f} {float(b.makespan):>14.2f} "
              f"{float(a.makespan) / float(b.makespan):>8.2f}x {(a.links or {}).get('utilisation', 0):>11.3f} "
              f"{(b.links or {}).get('utilisation', 0):>11.3f}")
    low, high = 0.0, 1.0
    while speedup(ring, tasp, high)[0] < args.target:
        high *= 2
        if high > 1e6:
            print(f"the speed-up never reaches {args.target}x (its limit is {n - 1}x)")
            return 0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if speedup(ring, tasp, mid)[0] < args.target else (low, mid)
    print(f"the speed-up reaches {args.target}x at rho = {high:.3f}: a ring step's KV transfer {high:.2f} times its "
          f"forward compute (communication-dominated steps, as in long-context prefill); the limit is {n - 1}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
