"""Split backward on one decoder chunk: I and W against one B, side by side with torch's pipelining.

For a middle chunk of the runtime's LLaMA-style model, times (best of
``--repeat``, one thread, forward not counted):
  B              one backward into the input and the weights;
  pipec I, W     runtime.split_backward.input_grad / weight_grad;
  torch I, W     torch.distributed.pipelining._backward.stage_backward_input / _weight;
  naive W        a second backward from the output into the weights only
                 (what a split costs without recording where weights branch off).
Zero-bubble schedules assume I + W ~ B; the last column says how close each is.

Usage: python benchmarks/split_backward.py [--repeat K] [--config NAME=VALUE ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import time

SIZES = [
    {"dim": 64, "hidden": 128, "seq_len": 32, "heads": 4, "layers": 8},
    {"dim": 256, "hidden": 512, "seq_len": 128, "heads": 8, "layers": 8, "microbatch_size": 4},
    {"dim": 512, "hidden": 1024, "seq_len": 256, "heads": 8, "layers": 8, "microbatch_size": 4},
]


def measure(config, repeat: int) -> dict[str, float]:
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from pipec.runtime.model import activation_shape, build_chunk
    from pipec.runtime.split_backward import input_grad, weight_grad

    chunk = build_chunk(config, 1, 4, seed=0)
    params = [p for p in chunk.parameters() if p.requires_grad]
    x = torch.randn(activation_shape(config))
    grad = torch.randn(chunk(x).shape)

    def best(run_i, run_w=None, detachable=False) -> tuple[float, float]:
        times = []
        for _ in range(repeat):
            chunk.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_()
            out = chunk(leaf)
            if detachable:  # torch's I detaches the output in place, which a view (the chunk's reshape) refuses
                out = out.clone()
            start = time.perf_counter()
            kept = run_i(out, leaf)
            middle = time.perf_counter()
            if run_w is not None:
                run_w(out, leaf, kept)
            times.append((middle - start, time.perf_counter() - middle))
        return min(t[0] for t in times), min(t[1] for t in times)

    b, _ = best(lambda out, leaf: torch.autograd.backward(out, grad))
    pipec_i, pipec_w = best(lambda out, leaf: input_grad(out, grad, leaf, params)[1],
                            lambda out, leaf, pending: weight_grad(pending))
    torch_i, torch_w = best(lambda out, leaf: stage_backward_input([out], [grad], [leaf], iter(params))[1],
                            lambda out, leaf, groups: stage_backward_weight(iter(params), groups), detachable=True)
    _, naive_w = best(lambda out, leaf: torch.autograd.grad(out, leaf, grad, retain_graph=True),
                      lambda out, leaf, _: torch.autograd.backward(out, grad, inputs=params))
    return {"B": b, "pipec I": pipec_i, "pipec W": pipec_w, "torch I": torch_i, "torch W": torch_w, "naive W": naive_w}


def main(argv: list[str] | None = None) -> int:
    import torch

    from pipec.runtime.model import ModelConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="best of K runs (default 20)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("  dim  seq |    B ms | pipec I    W   I+W/B | torch I    W   I+W/B | naive W  I+W/B")
    for size in SIZES:
        config = dataclasses.replace(ModelConfig(), **size)
        t = {k: v * 1e3 for k, v in measure(config, args.repeat).items()}
        print(f"{config.dim:5d} {config.seq_len:4d} | {t['B']:7.2f} | "
              f"{t['pipec I']:7.2f} {t['pipec W']:6.2f} {(t['pipec I'] + t['pipec W']) / t['B']:5.2f} | "
              f"{t['torch I']:7.2f} {t['torch W']:6.2f} {(t['torch I'] + t['torch W']) / t['B']:5.2f} | "
              f"{t['naive W']:7.2f} {(t['pipec I'] + t['naive W']) / t['B']:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
