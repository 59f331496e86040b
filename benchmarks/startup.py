"""Start-up time: a compile-side command against ``import torch`` alone (issue 25, "commands start at once").

Times, as fresh processes and in the same run,

* pipec: ``python -m pipec check 1f1b -D P=4 -D N=8`` (what the ``pipec`` script runs), and
* torch: ``python -c "import torch"``, what every command paid before the
  compile-side ones stopped importing it (tests/test_no_torch_import.py), and
* python: ``python -c pass``, the interpreter's own start, below which nothing goes,

alternating them so that a busy machine slows each alike, and prints the best
wall time of each and pipec's time over torch's import (the issue wants under 0.3).

Usage: python benchmarks/startup.py [--repeat K]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

COMMANDS = {
    "pipec check 1f1b -D P=4 -D N=8": [sys.executable, "-m", "pipec", "check", "1f1b", "-D", "P=4", "-D", "N=8"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    "python -c pass": [sys.executable, "-c", "pass"],
}
TARGET_RATIO = 0.3


def wall_time(argv: list[str]) -> float:
    """Seconds from starting ``argv`` to its exit; raises if it fails."""
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command; the best counts (default 5)")
    args = parser.parse_args()
    for argv in COMMANDS.values():  # once unmeasured: the files in the page cache, .pyc written
        wall_time(argv)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeat):
        for name, argv in COMMANDS.items():
            times[name].append(wall_time(argv))
    best = {name: min(runs) for name, runs in times.items()}
    width = max(map(len, COMMANDS))
    print(f"wall time, best of {args.repeat} ({sys.executable}):")
    for name, seconds in best.items():
        print(f"  {name:<{width}}  {seconds:7.3f} s")
    pipec, torch = best["pipec check 1f1b -D P=4 -D N=8"], best['python -c "import torch"']
    ratio = pipec / torch
    verdict = "under" if ratio < TARGET_RATIO else "NOT under"
    print(f"pipec check / import torch: {ratio:.3f} ({verdict} the issue's {TARGET_RATIO})")


if __name__ == "__main__":
    main()
