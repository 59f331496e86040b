"""Construction time of the Hamiltonian ring decompositions, per n.

For every n from 2 to 128 (and the rail shapes the tests use) times a cold
construction, verification included: the cache is cleared first, so an even n
built by doubling also pays for the K*_{n/2+1} it starts from. n = 4 and 6 time
the exhaustive search for the largest arc-disjoint set. Prints one line per n
and whether every n took under the 1 second limit; exits 1 if one did not.

Usage: python benchmarks/rings.py [--max N] [--repeat K]
"""
from __future__ import annotations

import argparse
import sys
import time

LIMIT_SECONDS = 1.0
RAIL_SHAPES = [(2, 8), (4, 8), (3, 4), (8, 8), (16, 8), (3, 6), (3, 42)]  # the last two: tabled paths (odd M, K % 4 == 2)


def cold(build, *args) -> float:
    from pipec.compiler import rings

    rings.decompose.cache_clear()
    rings.max_disjoint_rings.cache_clear()
    start = time.perf_counter()
    build(*args)
    return time.perf_counter() - start


def best_of(repeat: int, build, *args) -> float:
    return min(cold(build, *args) for _ in range(repeat))


def main(argv: list[str] | None = None) -> int:
    from pipec.compiler.rings import construction_name, hamiltonian_rings, rail_rings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=128, help="largest n (default 128)")
    parser.add_argument("--repeat", type=int, default=3, help="best of K cold runs (default 3)")
    args = parser.parse_args(argv)

    print(f"{'n':>4}  {'ms':>8}  construction")
    worst = (0.0, 0)
    for n in range(2, args.max + 1):
        seconds = best_of(args.repeat, hamiltonian_rings, n)
        worst = max(worst, (seconds, n))
        print(f"{n:>4}  {seconds * 1e3:>8.2f}  {construction_name(n)}")
    print()
    print(f"{'M x K':>7}  {'ms':>8}")
    for M, K in RAIL_SHAPES:
        seconds = best_of(args.repeat, rail_rings, M, K)
        print(f"{f'{M} x {K}':>7}  {seconds * 1e3:>8.2f}")
    ok = worst[0] < LIMIT_SECONDS
    print(f"\nslowest: n = {worst[1]} in {worst[0] * 1e3:.2f} ms; every n under {LIMIT_SECONDS:g} s: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
