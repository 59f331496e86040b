"""``pipec compile --format json``, the whole command, against torch's schedule generation and lowering.

For interleaved 1F1B at each size, runs in fresh processes

* pipec: the command line ``pipec compile interleaved_1f1b -D P -D N -D v
  --format json -o FILE`` (start-up, imports, compile, every check, JSON
  written), timed from outside; and, for a like-for-like figure, the same
  compile and write inside a process, imports excluded ("in-proc s"), and
* torch: ``get_schedule_ops("Interleaved1F1B", P, N, v, with_comms=True)``,
  its schedule generation and communication lowering, timed inside its
  process without the imports (as ``benchmarks/compile_speed.py`` times it),

and prints each one's seconds and peak resident memory (``ru_maxrss`` of that
process, from ``os.wait4``), the JSON file's size, and how many times faster
pipec's whole command is than torch's call (the target: at least 10 at
P=64, N=512; at small sizes the command's ~0.7 s of start-up and imports
dominates, which is what "in-proc" leaves out).

Usage: python benchmarks/compile_json_speed.py [--sizes 16x128x2,64x512x2] [--repeat K] [--skip-torch]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

DEFAULT_SIZES = [(16, 128, 2), (64, 512, 2)]
_PIPEC = [sys.executable, "-m", "pipec"]
# pipec's compile and JSON write in their own process, imports excluded, as the command does them.
_PIPEC_IN_PROCESS = """
import gc, sys, time
from pipec.compiler.driver import compile_target
from pipec.commands._common import atomic_output
from pipec.compiler.emit.json_program import write_program_json
P, N, v = map(int, sys.argv[1:4])
gc.freeze(); gc.disable()  # as pipec.cli.main does
start = time.perf_counter()
program = compile_target("interleaved_1f1b", {"P": P, "N": N, "v": v}).program
with atomic_output(sys.argv[4]) as out:
    write_program_json(program, out)
print(time.perf_counter() - start)
"""
# Runs torch's side in its own process and prints the seconds of the call alone.
_TORCH = """
import logging, sys, time
logging.disable(logging.WARNING)
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
P, N, v = map(int, sys.argv[1:4])
start = time.perf_counter()
get_schedule_ops("Interleaved1F1B", P, N, num_stages_per_rank=v, with_comms=True)
print(time.perf_counter() - start)
"""


def run_measured(command: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak resident KiB, stdout) of ``command`` in a fresh process."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait4 gives this child's own rusage; RUSAGE_CHILDREN would mix in every earlier run
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{err}")
    return elapsed, usage.ru_maxrss, out


def time_pipec(P: int, N: int, v: int, repeat: int) -> tuple[float, int, int, float]:
    """Best wall seconds and its peak KiB of the whole ``pipec compile --format json`` command, the file's
    bytes, and the best seconds of the compile and write alone (imports excluded)."""
    best, inner = None, None
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "program.json")
        for _ in range(repeat):
            elapsed, peak, _ = run_measured(_PIPEC + ["compile", "interleaved_1f1b", "-D", f"P={P}", "-D", f"N={N}",
                                                      "-D", f"v={v}", "--format", "json", "-o", path])
            if best is None or elapsed < best[0]:
                best = (elapsed, peak)
            _, _, out = run_measured([sys.executable, "-c", _PIPEC_IN_PROCESS, str(P), str(N), str(v), path])
            inner = min(float(out.split()[-1]), inner or float("inf"))
        return best[0], best[1], os.path.getsize(path), inner


def time_torch(P: int, N: int, v: int) -> tuple[float, int]:
    """torch's generation + lowering seconds (imports excluded) and its process's peak KiB."""
    _, peak, out = run_measured([sys.executable, "-c", _TORCH, str(P), str(N), str(v)])
    return float(out.split()[-1]), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join("x".join(map(str, s)) for s in DEFAULT_SIZES))
    parser.add_argument("--repeat", type=int, default=1, help="runs of pipec's command per size; the fastest is kept")
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in item.split("x")) for item in args.sizes.split(",")]

    header = (f"{'P':>4} {'N':>5} {'v':>2} | {'pipec s':>8} {'peak MiB':>8} {'JSON MiB':>8} {'in-proc s':>9} | "
              f"{'torch s':>8} {'peak MiB':>8} | {'speed-up':>8} {'in-proc':>8}")
    print(header)
    print("-" * len(header))
    for P, N, v in sizes:
        seconds, peak, size, inner = time_pipec(P, N, v, args.repeat)
        row = f"{P:>4} {N:>5} {v:>2} | {seconds:>8.2f} {peak / 1024:>8.0f} {size / 2**20:>8.1f} {inner:>9.2f} |"
        if args.skip_torch:
            print(row, flush=True)
            continue
        torch_seconds, torch_peak = time_torch(P, N, v)
        row += (f" {torch_seconds:>8.2f} {torch_peak / 1024:>8.0f} | {torch_seconds / seconds:>7.1f}x"
                f" {torch_seconds / inner:>7.1f}x")
        print(row, flush=True)


if __name__ == "__main__":
    main()
