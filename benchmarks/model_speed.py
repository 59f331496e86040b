"""The built-in model's speed, moved here from two unit tests that asserted times (issue 25, item 8):
a loaded machine made them fail, and a unit test asserts properties, not the machine's speed.

Prints, on this machine,

* the forward and backward of one microbatch of the default model (best of 5 rounds of 10 passes; it
  should stay a few ms on a slow core: the tests run many multi-process trainings on 2 cores), and
* ``pipec profile``'s layers' summed F + B against the whole model's forward and backward, timed as one
  autograd pass (about 1.08 on a quiet machine; docs/costs.md), with the spread of the repeats.

Usage: python benchmarks/model_speed.py [--repeats N]
"""
from __future__ import annotations

import argparse
import math
import time

from pipec.runtime.model import LLAMA, ModelConfig, build_model, loss_fn, split_microbatches, synthetic_batch
from pipec.runtime.profile import profile_layers


def microbatch_ms(config: ModelConfig) -> float:
    """Best time of one forward and backward of one microbatch, in ms (best of 5 rounds of 10)."""
    model = build_model(config, 0)
    inputs, targets = split_microbatches(synthetic_batch(config, 0, 1, seed=0), 1)[0]
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            loss_fn(model(inputs), targets).backward()
        best = min(best, (time.perf_counter() - start) / 10)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100, help="passes each profile median is over")
    args = parser.parse_args()
    config = ModelConfig()
    print(f"default model, one microbatch forward + backward: {microbatch_ms(config):.2f} ms (best of 5 x 10)")
    measured = profile_layers(LLAMA, ModelConfig(layers=2), 0, repeats=args.repeats)
    print(f"2-layer model, layers' F + B summed {measured.layer_sum:.4f} ms, whole {measured.whole:.4f} ms: "
          f"sum / whole {measured.layer_sum / measured.whole:.3f} (medians of {args.repeats})")


if __name__ == "__main__":
    main()
