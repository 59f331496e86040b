"""Training-step time: pipec's runtime against torch.distributed.pipelining, on the same model and schedule.

For GPipe, 1F1B, interleaved 1F1B (v = 2) and ZB-V (split backward, two
chunks per rank in a V) at P = 2 and 4 ranks, N = 8
microbatches, one set of P worker processes (gloo, CPU, started through
``pipec run``'s launcher) holds two copies of the same model chunks
(``runtime/model.py``, built from the same seed): one run by pipec's
interpreter over the compiled program, one wrapped in ``PipelineStage`` and
run by torch's ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` /
``ScheduleZBVZeroBubble``.
Both train on the same batches with the same optimizer. Steps alternate,
pipec then torch, then torch then pipec (so that neither always goes first),
each between two barriers; a step is forward, backward and the optimizer step.

Per case it prints the median step time of each, the median of the per-pair
ratios pipec/torch (target: at most 1.0), where pipec's step time went on a
rank (compute, waiting for messages, posting them, frees, optimizer, and the
interpreter's own loop between instructions), and pipec's efficiency: the
simulator's makespan for the program under op costs measured in this run,
divided by pipec's median step time (target: at least 0.9). The op costs are
the mean duration of each F, B, I and W per model chunk in pipec's instruction
timings, less the time the instruction spent waiting for a message (a
receive is waited at its first use, inside the F or B that reads it; the
interpreter reports each instruction's wait), with communication free.
So efficiency is how close the runtime comes to the schedule's ideal for its
own compute speed; the rest is messaging, Python dispatch and the optimizer.
Each rank needs a core of its own (OMP_NUM_THREADS=1) plus some for gloo's
threads: with fewer cores than ranks the ranks time-share, the simulator's
parallel makespan is out of reach and single pairs vary widely.

Usage:
    python benchmarks/runtime_vs_torch.py [--pairs 9] [--warmup 2] [--ranks 2,4]
        [--schedules gpipe,1f1b,interleaved_1f1b] [--config dim=128 ...] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# The model of every case: big enough that a chunk's forward is not all
# Python overhead, small enough for CPU ranks. ModelConfig fields.
DEFAULT_CONFIG = {"dim": 128, "heads": 4, "hidden": 256, "seq_len": 64, "microbatch_size": 4, "layers": 8}
NUM_MICROBATCHES = 8
SEED = 0
# Schedule name (shipped .pipe) -> (extra -D values, torch's schedule class, chunks per rank, placement).
# Placement of chunk c of C on P ranks: "loop" puts it on rank c % P (both sides' interleaving);
# "v" on rank c for c < P, else 2P - 1 - c (ZB-V's V, both sides).
CASES = {
    "gpipe": ({}, "ScheduleGPipe", 1, "loop"),
    "1f1b": ({}, "Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ({"v": 2}, "ScheduleInterleaved1F1B", 2, "loop"),
    "zbv": ({}, "ScheduleZBVZeroBubble", 2, "v"),
}
PLACEMENTS = {
    "loop": lambda c, world: c % world,
    "v": lambda c, world: c if c < world else 2 * world - 1 - c,
}
OPS = ("F", "B", "I", "W")
RESULT_PREFIX = "RESULT "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=9, help="alternating pipec/torch step pairs per case (default 9, at least 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (default 2)")
    parser.add_argument("--ranks", default="2,4", help="comma-separated P values (default 2,4)")
    parser.add_argument("--schedules", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=INT", help="override a model size")
    parser.add_argument("--json", metavar="FILE", help="also write every case's numbers as JSON")
    parser.add_argument("--worker", metavar="SCHEDULE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = dict(DEFAULT_CONFIG, **_int_pairs(args.config))
    if args.worker:  # ends as pipec's workers end: no interpreter teardown after the group is left
        from pipec.runtime.worker import end_process

        end_process(_worker(args.worker, config, args.pairs, args.warmup))
    return _compare(args, config)


def _int_pairs(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name.strip()] = int(value)
    return out


# ------------------------------------------------------------------- parent


def _compare(args, config: dict[str, int]) -> int:
    from pipec.commands.run import launch

    results = []
    print(f"model: {config}, N = {NUM_MICROBATCHES}, {args.pairs} alternating pairs per case, "
          f"gloo on CPU, {os.cpu_count()} cores")
    print(f"{'case':<24} {'pipec ms':>9} {'torch ms':>9} {'ratio':>7} {'sim ms':>8} {'effic.':>7}  pairs (pipec/torch)")
    for ranks in [int(p) for p in args.ranks.split(",")]:
        for schedule in args.schedules.split(","):
            lines: list[str] = []
            worker = [os.path.abspath(__file__), "--worker", schedule, "--pairs", str(args.pairs),
                      "--warmup", str(args.warmup), *[f"--config={k}={v}" for k, v in config.items()]]
            outcome = launch(worker, ranks, on_line=lambda rank, line: lines.append(line), echo=False)
            if not outcome.ok:
                sys.stderr.write(outcome.report)
                return 1
            result = json.loads(next(line for line in lines if line.startswith(RESULT_PREFIX))[len(RESULT_PREFIX):])
            result.update(schedule=schedule, ranks=ranks)
            results.append(result)
            _print_case(result)
    ratios = [r["ratio"] for r in results]
    efficiencies = [r["efficiency"] for r in results]
    print(f"worst ratio {max(ratios):.3f} (target <= 1.0); worst efficiency {min(efficiencies):.3f} (target >= 0.9)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"config": config, "cases": results}, handle, indent=2)
    return 0


def _print_case(r: dict) -> None:
    name = f"{r['schedule']} P={r['ranks']}"
    pairs = " ".join(f"{p:.2f}" for p in r["pair_ratios"])
    print(
        f"{name:<24} {r['pipec_ms']:>9.2f} {r['torch_ms']:>9.2f} {r['ratio']:>7.3f} "
        f"{r['simulated_ms']:>8.2f} {r['efficiency']:>7.3f}  {pairs}",
        flush=True,
    )
    # where pipec's step went, averaged over ranks (ms per step)
    names = r["breakdown_ms"][0].keys()
    mean = {name: statistics.fmean(rank[name] for rank in r["breakdown_ms"]) for name in names}
    print("    pipec per rank and step: " + ", ".join(f"{name} {value:.2f}" for name, value in mean.items()), flush=True)


# ------------------------------------------------------------------- worker


def _worker(schedule: str, sizes: dict[str, int], pairs: int, warmup: int) -> int:
    import torch.distributed as dist

    from pipec.runtime.model import ModelConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ModelConfig(**sizes)
    pipec_side = _PipecSide(schedule, rank, world, config)
    torch_side = _TorchSide(schedule, rank, world, config)
    sides = (pipec_side, torch_side)
    for step in range(warmup):
        for side in sides:
            _timed(side, step)
    times = {side: [] for side in sides}
    pipec_side.recording = True
    for pair in range(pairs):
        for side in sides if pair % 2 == 0 else reversed(sides):
            times[side].append(_timed(side, warmup + pair))
    summaries = _gather(pipec_side.summary(), rank, world)
    if rank == 0:
        from pipec.compiler.costs import costs_from_json
        from pipec.compiler.simulate import simulate

        costs = _cost_file(summaries)
        makespan = simulate(pipec_side.program, costs_from_json(costs)).makespan
        pipec_times, torch_times = times[pipec_side], times[torch_side]
        pipec_median = statistics.median(pipec_times)
        pair_ratios = [a / b for a, b in zip(pipec_times, torch_times)]
        result = {
            "pipec_ms": pipec_median * 1e3,
            "torch_ms": statistics.median(torch_times) * 1e3,
            "ratio": statistics.median(pair_ratios),
            "pair_ratios": pair_ratios,
            "simulated_ms": makespan * 1e3,
            "efficiency": makespan / pipec_median,
            "op_costs_ms": {k: round(v * 1e3, 4) for k, v in costs["compute"].items() if k != "per_chunk"},
            "per_chunk_ms": {c: {op: round(t * 1e3, 4) for op, t in ops.items()} for c, ops in costs["compute"]["per_chunk"].items()},
            # per rank, mean ms per step
            "breakdown_ms": [{name: round(t * 1e3, 3) for name, t in summary["breakdown"].items()} for summary in summaries],
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _timed(side, step: int) -> float:
    """One training step of ``side`` between two barriers, in seconds (the same on every rank, up to the barrier)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    side.step(step)
    dist.barrier()
    return time.perf_counter() - start


def _gather(obj, rank: int, world: int):
    import torch.distributed as dist

    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


class _PipecSide:
    """pipec's interpreter over the compiled program; records each instruction's time less its waits."""

    def __init__(self, schedule: str, rank: int, world: int, config):
        from pipec.compiler.driver import compile_target
        from pipec.runtime.interpreter import make_context, stage_modules
        from pipec.runtime.model import LLAMA

        extra = CASES[schedule][0]
        defines = {"P": str(world), "N": str(NUM_MICROBATCHES), **{k: str(v) for k, v in extra.items()}}
        self.program = compile_target(schedule, defines).program
        self.rank, self.config = rank, config
        self.stages = stage_modules(self.program, rank, lambda chunk: LLAMA.build_chunk(config, chunk, self.program.num_chunks, SEED))
        self.context = make_context(
            self.program, rank, self.stages, loss_fn=LLAMA.loss_fn, make_optimizer=LLAMA.make_optimizer,
            activation_shape=(config.microbatch_size, config.seq_len, config.dim),
        )
        self.recording = False
        self.steps: list[list] = []  # run_step's events of each recorded step

    def step(self, step: int) -> None:
        from pipec.runtime.interpreter import run_step
        from pipec.runtime.model import LLAMA, split_microbatches

        micro = split_microbatches(LLAMA.synthetic_batch(self.config, step, NUM_MICROBATCHES, SEED), NUM_MICROBATCHES)
        self.context.iteration = step + 1
        _, events = run_step(self.program, self.rank, self.stages, ([m[0] for m in micro], [m[1] for m in micro]), self.context)
        if self.recording:
            self.steps.append(events)

    def summary(self) -> dict:
        """This rank's measurements: F/B compute samples per chunk, and where a step's time went.

        Returns:
            {"samples": [(op, chunk, seconds)], "breakdown": {category: mean seconds per step}}.
            An instruction's compute time is its duration less its wait (a
            receive is waited inside the compute that first reads it). Categories:
            compute (F, B, I, W), waiting (for messages and all-reduces, and for the
            step's sends before the optimizer step),
            messaging (posting sends/receives/batches/all-reduces), freeing,
            optimizer, and loop (time between instructions: the interpreter's own overhead).
        """
        row, stages = self.context.row, self.program.stages
        ops = [action.op for action in row] + ["OPTIMIZER"]
        samples = []
        totals = dict.fromkeys(("compute", "waiting", "messaging", "freeing", "optimizer", "loop"), 0.0)
        for events in self.steps:
            busy = 0.0
            for index, start, end, waited in events:
                op = ops[index]
                own = end - start - waited
                busy += end - start
                totals["waiting"] += waited
                totals[_CATEGORY.get(op, "messaging")] += own
                if op in OPS:
                    samples.append((op, stages[row[index].stage].position, own))
            # before the optimizer (the last event) the step waits for its sends: no event covers that
            settle = events[-1][1] - events[-2][2] if len(events) > 1 else 0.0
            totals["waiting"] += settle
            totals["loop"] += (events[-1][2] - events[0][1]) - busy - settle
        count = max(len(self.steps), 1)
        return {"samples": samples, "breakdown": {name: value / count for name, value in totals.items()}}


# Where an instruction's own time goes in the breakdown (anything else: messaging).
_CATEGORY = {"F": "compute", "B": "compute", "I": "compute", "W": "compute", "FREE_F": "freeing", "OPTIMIZER": "optimizer"}


def _cost_file(summaries: list[dict]) -> dict:
    """A cost file's JSON (compute only: mean F, B, I, W per chunk as measured, seconds) from every rank's summary."""
    samples: dict[tuple[str, int], list[float]] = {}
    for summary in summaries:
        for op, chunk, seconds in summary["samples"]:
            samples.setdefault((op, chunk), []).append(seconds)
    means = {key: statistics.fmean(values) for key, values in samples.items()}
    overall = {op: statistics.fmean(v for (o, _), v in means.items() if o == op)
               for op in OPS if any(o == op for o, _ in means)}
    per_chunk: dict[str, dict[str, float]] = {}
    for (op, chunk), mean in means.items():
        per_chunk.setdefault(str(chunk), {})[op] = mean
    return {"compute": {**overall, "per_chunk": per_chunk}}


# torch schedules whose backward detaches each stage's output in place.
_DETACHES_OUTPUT = ("ScheduleZBVZeroBubble",)


def _OwnedOutput(chunk):
    """``chunk`` wrapped so that its output owns its memory (not a view)."""
    from torch import nn

    class OwnedOutput(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.chunk = inner

        def forward(self, x):
            return self.chunk(x).clone()

    return OwnedOutput(chunk)


class _TorchSide:
    """torch.distributed.pipelining's schedule over PipelineStage-wrapped copies of the same chunks."""

    def __init__(self, schedule: str, rank: int, world: int, config):
        import torch
        from torch.distributed import pipelining

        from pipec.runtime.model import LLAMA

        _, class_name, per_rank, placement = CASES[schedule]
        num_chunks = per_rank * world
        self.config, self.rank = config, rank
        on_rank = PLACEMENTS[placement]  # the placement torch's schedule expects, and pipec's program has
        self.chunks = {c: LLAMA.build_chunk(config, c, num_chunks, SEED) for c in range(num_chunks)
                       if on_rank(c, world) == rank}
        # torch's split backward detaches a stage's output in place, which a view (the chunk's last
        # reshape) refuses: there the output is copied first (one activation-sized copy per forward)
        wrap = _OwnedOutput if class_name in _DETACHES_OUTPUT else (lambda module: module)
        stages = [pipelining.PipelineStage(wrap(module), c, num_chunks, torch.device("cpu"))
                  for c, module in self.chunks.items()]
        schedule_class = getattr(pipelining, class_name)
        self.schedule = schedule_class(stages if per_rank > 1 else stages[0], NUM_MICROBATCHES, loss_fn=LLAMA.loss_fn)
        self.optimizer = LLAMA.make_optimizer([p for m in self.chunks.values() for p in m.parameters()])
        self.first, self.last = 0 in self.chunks, num_chunks - 1 in self.chunks

    def step(self, step: int) -> None:
        from pipec.runtime.model import LLAMA

        inputs, targets = LLAMA.synthetic_batch(self.config, step, NUM_MICROBATCHES, SEED)
        args = (inputs,) if self.first else ()
        self.schedule.step(*args, target=targets if self.last else None, losses=[] if self.last else None,
                           return_outputs=False)  # pipec returns no outputs either
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)


if __name__ == "__main__":
    raise SystemExit(main())
