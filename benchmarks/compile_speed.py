"""Compile speed: pipec against torch.distributed.pipelining, side by side.

For interleaved 1F1B at growing sizes, times

* pipec: parse + evaluate + order + communication + every check (well-formed,
  matching, deadlock, conflict, memory) + liveness + simulation, and
* torch: ``get_schedule_ops("Interleaved1F1B", P, N, v, with_comms=True)``, its
  schedule generation and communication lowering (no simulation, fewer checks),

and prints instructions per second for each, the speed-up, and pipec's time
per instruction relative to the smallest size (linear scaling keeps it flat).

Usage: python benchmarks/compile_speed.py [--repeat K] [--sizes 8x64x2,16x128x2,...]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

DEFAULT_SIZES = [(8, 64, 2), (16, 128, 2), (32, 256, 2), (64, 512, 2)]


def time_pipec(P: int, N: int, v: int) -> tuple[float, int]:
    from pipec.compiler.driver import compile_target
    from pipec.compiler.simulate import simulate

    start = time.perf_counter()
    compiled = compile_target("interleaved_1f1b", {"P": P, "N": N, "v": v})
    simulate(compiled.program)
    elapsed = time.perf_counter() - start
    return elapsed, _count(compiled.program.ranks)


def time_torch(P: int, N: int, v: int) -> tuple[float, int]:
    import logging

    logging.disable(logging.WARNING)
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    start = time.perf_counter()
    ops = get_schedule_ops("Interleaved1F1B", P, N, num_stages_per_rank=v, with_comms=True)
    elapsed = time.perf_counter() - start
    return elapsed, sum(1 for row in ops for action in row if action is not None)


def _count(ranks) -> int:
    """Point-to-point operations and computations, a batch counted by its parts (as torch lists them)."""
    total = 0
    for row in ranks:
        for action in row:
            total += len(action.parts) if action.parts else 1
    return total


def best_of(fn, repeat: int, *args) -> tuple[float, int]:
    times, count = [], 0
    for _ in range(repeat):
        gc.collect()
        elapsed, count = fn(*args)
        times.append(elapsed)
    return min(times), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per size for pipec; the best is kept (torch runs once)")
    parser.add_argument("--sizes", default=",".join("x".join(map(str, s)) for s in DEFAULT_SIZES))
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in item.split("x")) for item in args.sizes.split(",")]

    header = f"{'P':>4} {'N':>5} {'v':>2} | {'pipec s':>8} {'instr':>8} {'instr/s':>10} {'us/instr':>8} | {'torch s':>8} {'instr':>8} {'instr/s':>10} | {'speed-up':>8}"
    print(header)
    print("-" * len(header))
    per_instruction = []
    # One untimed compile first: the first one in a process also pays for loading
    # the grammar tables and the modules (~15 ms), a constant, not a cost per instruction.
    time_pipec(*sizes[0])
    # What the pipec command line does once its imports are done (pipec.cli.main):
    # freeze the long-lived objects and turn the collector off for the command.
    # The compiler's passes only pause it; the rest is the process's call.
    gc.freeze()
    gc.disable()
    for P, N, v in sizes:
        pipec_time, pipec_count = best_of(time_pipec, args.repeat, P, N, v)
        per_instruction.append(pipec_time / pipec_count)
        row = f"{P:>4} {N:>5} {v:>2} | {pipec_time:>8.3f} {pipec_count:>8} {pipec_count / pipec_time:>10.0f} {1e6 * pipec_time / pipec_count:>8.2f} |"
        if args.skip_torch:
            print(row)
            continue
        torch_time, torch_count = best_of(time_torch, 1, P, N, v)
        row += f" {torch_time:>8.3f} {torch_count:>8} {torch_count / torch_time:>10.0f} | {torch_time / pipec_time:>7.1f}x"
        print(row, flush=True)
    growth = per_instruction[-1] / per_instruction[0]
    print(f"\npipec time per instruction, largest size / smallest: {growth:.2f} (linear scaling: close to 1)")
    print(f"median pipec time per instruction: {1e6 * statistics.median(per_instruction):.2f} us")


if __name__ == "__main__":
    main()
