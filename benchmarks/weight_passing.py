"""Weight passing against activation passing and FSDP: step times here, and the prediction for TawPipe's cluster.

Part 1, measured: the step time of ``weipipe``, ``tawpipe`` (G = 2), ``fsdp``
and ``1f1b`` training the same built-in model (``--config``) on 4 CPU ranks
(``pipec run``, gloo), side by side in one run: the median over steps 2..K of
a step's span on the trace (first instruction start to last end, every rank).
On 2 cores the 4 ranks time-share, so the figures compare the schedules'
overheads more than their parallelism.

Part 2, predicted. TawPipe's paper trains a LLaMA-2 model (48 layers, sequence 16384, global batch
1536 sequences, activation checkpointing, bf16) on 3 nodes of 8 GPUs joined by
10 GbE, and reports tokens per GPU per second:

    H = 4096:  TawPipe 1377.6, WeiPipe 1232.4, 1F1B 1114.2, FSDP 956.1
    H = 1024:  TawPipe 8914,   WeiPipe 8412,   1F1B 5594

This script prices pipec's shipped schedules (``tawpipe`` with G = 3,
``weipipe``, ``1f1b``, ``fsdp``, P = 24, a stage being 2 of the 48 layers) on
that cluster with pipec's two-level network (``links.nic``: the 10 GbE port a
node's 8 GPUs share; ``links.contention``) and prints, for each microbatch size
b (sequences) and 10 GbE efficiency e (the share of 1.25 GB/s a transfer
really gets), the predicted tokens/GPU/s and the ratios to TawPipe next to the
paper's; then the (b, e) whose ratios are nearest the paper's.

Assumptions, stated once (change them with the flags):
* a GPU runs ``--tflops`` (150) TFLOP/s; a layer's forward is
  24 H^2 + 2 S H FLOPs per token (its 12 H^2 weights twice, causal attention
  half of 4 S H); a backward with checkpointing is 3 forwards;
* weights and weight gradients are bf16 (24 H^2 bytes a layer); an activation
  crossing a stage boundary is b S H bf16;
* GPUs of a node talk over ``--intra-gbs`` (100) GB/s links.

Usage:
    python benchmarks/weight_passing.py [--steps 6] [--config dim=128 ...] [--skip-measured]
        [--hidden 4096,1024] [--microbatch 1,2,4,8]
        [--efficiency 0.25,0.5,0.75,1.0] [--tflops 150] [--intra-gbs 100] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate

LAYERS, SEQUENCE, GLOBAL_BATCH, NODES, PER_NODE = 48, 16384, 1536, 3, 8
RANKS = NODES * PER_NODE
TEN_GBE = 1.25e9  # bytes/s
PAPER = {
    4096: {"tawpipe": 1377.6, "weipipe": 1232.4, "1f1b": 1114.2, "fsdp": 956.1},
    1024: {"tawpipe": 8914.0, "weipipe": 8412.0, "1f1b": 5594.0},
}
SCHEDULES = {  # name -> extra -D values
    "tawpipe": {"G": NODES},
    "weipipe": {},
    "1f1b": {},
    "fsdp": {},
}


# Part 1: the schedules run here (name -> -D values), on 4 ranks.
MEASURED = {
    "weipipe": {"P": 4, "N": 8},
    "tawpipe": {"P": 4, "N": 8, "G": 2},
    "fsdp": {"P": 4, "N": 8},
    "1f1b": {"P": 4, "N": 8},
}
DEFAULT_CONFIG = ["dim=128", "heads=4", "hidden=256", "seq_len=64", "microbatch_size=4", "layers=8"]


def measure(name: str, defines: dict, steps: int, config: list[str], folder: str) -> list[float]:
    """Step times (seconds) of ``pipec run NAME`` on 4 gloo ranks, from its trace, the first step left out."""
    trace = os.path.join(folder, f"{name}.json")
    command = [sys.executable, "-m", "pipec", "run", name, "--steps", str(steps), "--trace", trace]
    command += [arg for key, value in defines.items() for arg in ("-D", f"{key}={value}")]
    command += [arg for item in config for arg in ("--config", item)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"pipec run {name} failed:\n{done.stdout}{done.stderr}")
    with open(trace) as handle:
        events = json.load(handle)["traceEvents"]
    spans: dict[int, list[float]] = {}
    for event in events:
        step = event.get("args", {}).get("step")
        if event.get("ph") == "X" and isinstance(step, int):
            first, last = spans.get(step, (math.inf, -math.inf))
            spans[step] = (min(first, event["ts"]), max(last, event["ts"] + event["dur"]))
    return [(end - start) / 1e6 for step, (start, end) in sorted(spans.items()) if step > 1]


def measured_part(args) -> dict:
    print(f"Part 1: step time on 4 CPU ranks (gloo), the same model ({' '.join(args.config)}), "
          f"median of steps 2..{args.steps}")
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, defines in MEASURED.items():
            times = measure(name, defines, args.steps, args.config, folder)
            out[name] = statistics.median(times)
    base = out["1f1b"]
    for name, seconds in out.items():
        print(f"  {name:>8} {' '.join(f'{k}={v}' for k, v in MEASURED[name].items()):<14} "
              f"{seconds * 1e3:8.1f} ms   x{seconds / base:.2f} of 1f1b")
    return out


def stage_costs(hidden: int, microbatch: int, efficiency: float, tflops: float, intra_gbs: float) -> dict:
    """The cost file of one (H, b, e): a stage is LAYERS / RANKS layers; times in seconds, sizes in bytes."""
    layers = LAYERS // RANKS
    flops = layers * (24 * hidden ** 2 + 2 * SEQUENCE * hidden) * SEQUENCE * microbatch
    forward = flops / (tflops * 1e12)
    activation = microbatch * SEQUENCE * hidden * 2
    weights = layers * 12 * hidden ** 2 * 2
    inter = TEN_GBE * efficiency
    return {
        "compute": {"F": forward, "B": 3 * forward},
        "links": {"bandwidth": intra_gbs * 1e9, "latency": 1e-5, "node_size": PER_NODE,
                  "inter_node": {"bandwidth": inter, "latency": 5e-5}, "nic": {"bandwidth": inter},
                  "contention": True, "bytes": {"act": activation, "grad": activation}},
        "sizes": {"weight": weights, "activation": activation},
    }


def predict(name: str, hidden: int, microbatch: int, efficiency: float, tflops: float, intra_gbs: float) -> float:
    """Predicted tokens per GPU per second of ``name`` on the paper's cluster."""
    microbatches = GLOBAL_BATCH // microbatch
    program = compile_target(name, {"P": RANKS, "N": microbatches, **SCHEDULES[name]}).program
    costs = costs_from_json(stage_costs(hidden, microbatch, efficiency, tflops, intra_gbs))
    makespan = simulate(program, costs).makespan
    return GLOBAL_BATCH * SEQUENCE / (makespan * RANKS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--config", action="append", default=None)
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--hidden", default="4096,1024")
    parser.add_argument("--microbatch", default="1,2,4,8")
    parser.add_argument("--efficiency", default="0.25,0.5,0.75,1.0")
    parser.add_argument("--tflops", type=float, default=150.0)
    parser.add_argument("--intra-gbs", type=float, default=100.0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    args.config = args.config or DEFAULT_CONFIG
    measured = {} if args.skip_measured else measured_part(args)
    print("\nPart 2: predicted on TawPipe's cluster (3 nodes x 8 GPUs, 10 GbE)")
    out = []
    started = time.perf_counter()
    for hidden in map(int, args.hidden.split(",")):
        paper = PAPER[hidden]
        names = list(paper)
        print(f"\nH = {hidden}: tokens/GPU/s predicted (ratio to TawPipe); paper: "
              + " / ".join(f"{name} {paper[name]:g}" for name in names)
              + "  ratios " + " / ".join(f"{paper[name] / paper['tawpipe']:.3f}" for name in names))
        print(f"{'b':>3} {'e':>5}  " + "  ".join(f"{name:>16}" for name in names) + "  distance")
        best = None
        for microbatch in map(int, args.microbatch.split(",")):
            for efficiency in map(float, args.efficiency.split(",")):
                got = {name: predict(name, hidden, microbatch, efficiency, args.tflops, args.intra_gbs)
                       for name in names}
                ratios = {name: got[name] / got["tawpipe"] for name in names}
                distance = math.sqrt(sum((ratios[n] - paper[n] / paper["tawpipe"]) ** 2 for n in names))
                print(f"{microbatch:>3} {efficiency:>5.2f}  "
                      + "  ".join(f"{got[n]:>8.1f} ({ratios[n]:.3f})" for n in names) + f"  {distance:.3f}")
                row = {"hidden": hidden, "microbatch": microbatch, "efficiency": efficiency, "tokens": got,
                       "ratios": ratios, "distance": distance}
                out.append(row)
                if best is None or distance < best["distance"]:
                    best = row
        print(f"nearest the paper's ratios at H = {hidden}: b = {best['microbatch']}, e = {best['efficiency']:.2f} "
              f"(distance {best['distance']:.3f}): "
              + " / ".join(f"{n} {best['ratios'][n]:.3f} (paper {paper[n] / paper['tawpipe']:.3f})" for n in names))
    print(f"\n({time.perf_counter() - started:.1f} s)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"measured_s": measured, "predicted": out}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
