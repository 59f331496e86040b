"""Asynchronous training against the flushed schedules that update as often: predicted, then measured.

PipeDream updates every stage after every microbatch, PipeDream-2BW after
every M; neither flushes. The same update frequency with a flush is 1F1B with
one microbatch per step (PipeDream) or M (2BW). Part 1 prints, under unit
costs (F = 1, B = 2, U = 0), the simulator's time per update of each and the
ratio (the throughput asynchronous training gains): (N + P - 1) / N against P
for PipeDream, against (M + P - 1) / M for 2BW. Part 2 runs both on 4 gloo
CPU ranks (``pipec run``, the built-in model) and prints the measured wall time
per microbatch of a step, the median over steps 2..K, side by side in one run.
On 2 cores the 4 ranks time-share, so part 2 shows the runtime's overhead of
stashing more than the parallelism the simulator predicts.

Usage:
    python benchmarks/async_throughput.py [--ranks 2,4,8] [--microbatches 32] [--steps 4] [--skip-measured]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate


def _makespan(name: str, **params) -> float:
    return float(simulate(compile_target(name, {k: str(v) for k, v in params.items()}).program).makespan)


def predicted(ranks: list[int], n: int) -> None:
    print(f"predicted, unit costs, N = {n} microbatches per step: time per update (flushed / asynchronous)")
    print(f"  {'P':>3} {'pipedream':>10} {'1f1b N=1':>9} {'gain':>6}   {'2bw M=P':>8} {'1f1b N=M':>9} {'gain':>6}")
    for P in ranks:
        async_1 = _makespan("pipedream", P=P, N=n) / n
        flushed_1 = _makespan("1f1b", P=P, N=1)
        async_m = _makespan("pipedream_2bw", P=P, M=P, N=n) / (n // P)
        flushed_m = _makespan("1f1b", P=P, N=P)
        print(f"  {P:>3} {async_1:>10.3f} {flushed_1:>9.3f} {flushed_1 / async_1:>6.2f}   "
              f"{async_m:>8.3f} {flushed_m:>9.3f} {flushed_m / async_m:>6.2f}")


def _step_seconds(trace_path: str) -> list[float]:
    """Per step, first instruction start to last end over every rank (seconds), from a run's trace."""
    with open(trace_path, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    spans: dict[int, list[float]] = {}
    for event in events:
        step = event.get("args", {}).get("step")
        if event.get("ph") == "X" and step is not None:
            span = spans.setdefault(step, [float("inf"), 0.0])
            span[0] = min(span[0], event["ts"])
            span[1] = max(span[1], event["ts"] + event["dur"])
    return [(end - start) / 1e6 for _, (start, end) in sorted(spans.items())]


def measured(n: int, steps: int) -> None:
    print(f"\nmeasured, 4 gloo CPU ranks, built-in model: wall time per microbatch (median of steps 2..{steps})")
    # (schedule, its defines, microbatches per step, what it stands for)
    runs = [("pipedream", ["-D", f"N={n}"], n, "an update per microbatch, no flush"),
            ("1f1b", ["-D", "N=1"], 1, "an update per microbatch, flushed"),
            ("pipedream_2bw", ["-D", f"N={n}", "-D", "M=4"], n, "an update per 4 microbatches, no flush"),
            ("1f1b", ["-D", "N=4"], 4, "an update per 4 microbatches, flushed")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as folder:
        for index, (name, defines, per_step, words) in enumerate(runs):
            trace = os.path.join(folder, f"{index}.json")
            subprocess.run([sys.executable, "-m", "pipec", "run", name, "-D", "P=4", *defines, "--steps", str(steps),
                            "--trace", trace], check=True, env=env, stdout=subprocess.DEVNULL)
            seconds = statistics.median(_step_seconds(trace)[1:])
            print(f"  {name:<14} N={per_step:<3} {1000 * seconds / per_step:8.2f} ms per microbatch   ({words})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args()
    predicted([int(p) for p in args.ranks.split(",")], args.microbatches)
    if not args.skip_measured:
        measured(args.microbatches, args.steps)


if __name__ == "__main__":
    main()
