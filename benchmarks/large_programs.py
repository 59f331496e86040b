"""Large programs: time and peak memory per million instructions, for one schedule of each family.

Issue 24 asks that checking and simulating stay linear in instructions up to
the language's limits. For schedules of each family (activation passing:
``zb_h1``; asynchronous: ``pipedream``; weight passing: ``weipipe``,
``tawpipe``, ``fsdp``; sequence rings: ``zigzag_ring``, ``tasp``; tensor
parallel: ``megatron_mlp``) at a size that takes a few seconds, this runs, each in
a fresh process so that one run's memory does not hide another's,

* ``check``: ``pipec check`` (parse, evaluate, order, communication, every check), and
* ``simulate``: ``pipec simulate --json`` (the same, then the simulation and,
  for an asynchronous order, the same updates with a flush after each),

and prints the instructions, the CPU seconds and the peak resident memory the
command added to the process (``resource.getrusage``'s maxrss, less its value
after a run at the default size, which made pipec's imports), in all and per
million instructions. Linear work keeps the per-million figures flat as
``--scale`` grows. Where it does not (the weight-passing prover, sequence rings
at hundreds of ranks) a limit in ``dsl/limits.py`` refuses the program up front
(``MAX_PASSING_STEP_CELLS``, ``MAX_RING_BLOCKS``); a case past it prints the refusal.

Usage: python benchmarks/large_programs.py [--scale 1.0] [--only pipedream,...]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import subprocess
import sys
import time

# (schedule, its parameters at --scale 1): each check or simulate takes a few seconds on one core
CASES = [
    ("zb_h1", {"P": 16, "N": 4000}),
    ("pipedream", {"P": 16, "N": 4000}),
    ("weipipe", {"P": 16, "N": 1024}),
    ("tawpipe", {"P": 16, "N": 512}),
    ("fsdp", {"P": 16, "N": 256}),
    ("zigzag_ring", {"P": 128}),
    ("tasp", {"P": 24}),
    ("megatron_mlp", {"P": 8, "L": 64, "N": 64}),
]
# each case's family, as the table names it
FAMILY = {"zb_h1": "activation", "pipedream": "activation (async)", "weipipe": "weight passing",
          "tawpipe": "weight passing", "fsdp": "weight passing", "zigzag_ring": "rings", "tasp": "rings",
          "megatron_mlp": "tensor parallel"}
# the parameter --scale multiplies, and what it stays a multiple of (WeiPipe: N % P == 0; a sequence
# ring grows with its ranks, quadratically in instructions)
_SCALED = {"zb_h1": ("N", 1), "pipedream": ("N", 1), "weipipe": ("N", 16), "tawpipe": ("N", 16), "fsdp": ("N", 16),
           "zigzag_ring": ("P", 2), "tasp": ("P", 1), "megatron_mlp": ("N", 1)}


def _maxrss_bytes() -> int:
    # Linux reports kilobytes, macOS bytes
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def measure_one(command: str, name: str, params: dict[str, int]) -> dict:
    """Run ``pipec COMMAND NAME -D ...`` in this process; its CPU time, wall time, added peak memory
    and the program's instruction count (counted after the measured run)."""
    from pipec.cli import main
    from pipec.compiler.driver import compile_target

    extra = ["--json"] if command == "simulate" else []
    argv = [command, name, *(arg for k, v in params.items() for arg in ("-D", f"{k}={v}"))] + extra
    with contextlib.redirect_stdout(io.StringIO()):  # the imports and tables a run makes once, at its default size
        main([command, name] + extra)
    before = _maxrss_bytes()
    cpu, wall = time.process_time(), time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    added = _maxrss_bytes() - before
    if code != 0:
        raise SystemExit(f"pipec {' '.join(argv)} exited {code}")
    instructions = compile_target(name, {k: str(v) for k, v in params.items()}).program.instruction_count()
    return {"command": command, "schedule": name, "params": params, "instructions": instructions,
            "cpu_s": cpu, "wall_s": wall, "peak_added_bytes": added}


def measure(command: str, name: str, params: dict[str, int]) -> dict:
    """``measure_one`` in a fresh Python process (its own peak memory)."""
    child = subprocess.run([sys.executable, __file__, "--child", json.dumps([command, name, params])],
                           capture_output=True, text=True, check=False)
    if child.returncode != 0:  # a size past a limit: the refusal's last line, in place of the figures
        lines = child.stderr.strip().splitlines() or ["failed"]
        return {"command": command, "schedule": name, "params": params, "refused": lines[-1][:160]}
    return json.loads(child.stdout.strip().splitlines()[-1])


def row(result: dict) -> str:
    if "refused" in result:
        return f"{result['command']:<9} {result['schedule']:<12} refused: {result['refused']}"
    millions = result["instructions"] / 1e6
    params = ", ".join(f"{k}={v}" for k, v in result["params"].items())
    mib = result["peak_added_bytes"] / 2**20
    return (f"{result['command']:<9} {result['schedule']:<12} {params:<22} {result['instructions']:>11,} "
            f"{result['cpu_s']:>7.2f} {mib:>8.0f} {result['cpu_s'] / millions:>9.2f} {mib / millions:>10.0f}  "
            f"{FAMILY[result['schedule']]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply each case's size (N, or P of a ring)")
    parser.add_argument("--only", default="", help="comma-separated schedule names")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        command, name, params = json.loads(args.child)
        print(json.dumps(measure_one(command, name, params)))
        return
    only = set(filter(None, args.only.split(",")))
    print(f"{'command':<9} {'schedule':<12} {'params':<22} {'instructions':>11} {'cpu s':>7} {'peak MiB':>8} "
          f"{'s/M instr':>9} {'MiB/M instr':>10}  family")
    for name, params in CASES:
        if only and name not in only:
            continue
        key, step = _SCALED[name]
        scaled = {**params, key: max(2, step, round(params[key] * args.scale / step) * step)}
        for command in ("check", "simulate"):
            print(row(measure(command, name, scaled)), flush=True)


if __name__ == "__main__":
    main()
