"""Message placement: pipec's lowering of a compute order against torch's own, in simulated makespan.

Two sets of orders, each lowered both ways and simulated under the same costs:

* torch's schedule classes (GPipe, Interleaved1F1B, LoopedBFS,
  InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; Schedule1F1B's order is
  refused, as torch's own validator refuses it: tests/test_import_torch.py):
  torch writes the order twice with its own CSV writer, compute only (pipec
  reads it and inserts its communication) and with the communication torch's
  ``_PipelineScheduleRuntime`` lowering added (pipec reads it as it is);
* pipec's shipped activation schedules that torch's CSV can hold (one chain
  of stages, one rank each): pipec compiles them as usual; torch gets their
  compute order (``write_torch_csv``, compute only), loads it with
  ``_PipelineScheduleRuntime._load_csv`` (its validator, then its
  communication lowering) and writes it back with communication, which pipec
  reads as it is.

A row prints both makespans under each cost set (``COST_SETS``). pipec posts
every send right after the compute that makes its tensor
(``compiler/lower_comms.py``), so with links not shared and free posting its
makespan is that of the compute order itself, the least any placement gets;
``tests/test_placement_vs_torch.py`` holds every row to pipec <= torch.

Usage:
    python benchmarks/placement_vs_torch.py [--sizes 2x4,4x8,3x6]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from fractions import Fraction
from unittest import mock

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.stage import PipelineStage

from pipec.compiler.costs import CostModel, Link
from pipec.compiler.driver import compile_target
from pipec.compiler.emit import write_torch_csv
from pipec.compiler.import_torch import prepare_imported, read_torch_csv
from pipec.compiler.simulate import simulate

SIZES = ((2, 4), (4, 8), (3, 6))
# a heavier backward than the unit costs' (F = 1, B = 2, I = W = 1): a split one's I and W share its 3
_HEAVY_BACKWARD = (("B", 3), ("F", 1), ("I", 2), ("W", 1))
_BYTES = (("act", 8), ("grad", 8))
# name -> the cost model; 8 bytes over bandwidth 4: 2 units a message, plus its latency
COST_SETS = {
    "unit": CostModel(),
    "latency 1/2": CostModel(link=Link(Fraction(1, 2))),
    "latency 1": CostModel(link=Link(1)),
    "B=3 latency 1": CostModel(ops=_HEAVY_BACKWARD, link=Link(1)),
    "bandwidth 4, 8 bytes": CostModel(link=Link(Fraction(1, 4), 4), message_bytes=_BYTES),
    "same, shared links": CostModel(link=Link(Fraction(1, 4), 4), message_bytes=_BYTES, contention=True),
}
# torch's classes with more than one stage per rank; GPipe is a single-stage class (``_torch_gpipe``)
TORCH_MULTI = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
               "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
# pipec's shipped activation schedules torch's CSV can hold, with their parameters beyond P and N
PIPEC_SCHEDULES = {"1f1b": {}, "gpipe": {}, "interleaved_1f1b": {"v": 2}, "zb_h1": {}, "zbv": {}}


def _mock_stages(pp: int, local_stages: int, num_stages: int) -> list:
    """Stand-ins for PipelineStage, as torch's _schedule_visualizer builds them: enough for its lowering."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = pp
    stage.submod = None
    stage.num_stages = num_stages
    return [stage] * local_stages


def _dumped(schedule, folder: str, fmt: str) -> str:
    """The schedule as torch's own ``_dump_csv`` writes it."""
    path = os.path.join(folder, f"{fmt}.csv")
    schedule._dump_csv(path, format=fmt)
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _torch_gpipe(pp: int, nmb: int):
    """torch's GPipe order in its multi-stage runtime (REDUCE_GRAD, a data-parallel token, left out)."""
    single = torch_schedules.ScheduleGPipe(_mock_stages(pp, 1, pp)[0], nmb)
    order = {rank: [a for a in actions if a is not None and a.computation_type != torch_schedules.REDUCE_GRAD]
             for rank, actions in single.pipeline_order.items()}
    runtime = torch_schedules._PipelineScheduleRuntime(_mock_stages(pp, 1, pp), nmb)
    runtime.pipeline_order = order
    runtime._prepare_schedule_with_comms(order)
    return runtime


def torch_class_programs(name: str, pp: int, nmb: int) -> tuple:
    """(pipec's lowering, torch's lowering) of torch class ``name``'s order at ``pp`` ranks and ``nmb``
    microbatches, both checked (``prepare_imported``)."""
    if name == "ScheduleGPipe":
        schedule = _torch_gpipe(pp, nmb)
    else:
        schedule = getattr(torch_schedules, name)(_mock_stages(pp, 2, 2 * pp), nmb)
    with tempfile.TemporaryDirectory() as folder:
        texts = [_dumped(schedule, folder, fmt) for fmt in ("compute_only", "compute_comms")]
    return tuple(prepare_imported(*read_torch_csv(text)) for text in texts)


def pipec_schedule_programs(name: str, pp: int, nmb: int) -> tuple:
    """(pipec's compiled program, torch's lowering of its compute order, checked) for shipped schedule ``name``."""
    compiled = compile_target(name, {"P": pp, "N": nmb, **PIPEC_SCHEDULES[name]})
    compute = compiled.compute
    num_stages = len(compute.stages)
    runtime = torch_schedules._PipelineScheduleRuntime(_mock_stages(pp, num_stages // pp, num_stages), nmb)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "pipec.csv")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(write_torch_csv(compute, with_comms=False))
        runtime._load_csv(path, format="compute_only")  # torch validates, then lowers with its own placement
        text = _dumped(runtime, folder, "compute_comms")
    return compiled.program, prepare_imported(*read_torch_csv(text))


def rows(sizes=SIZES):
    """Per (set, name, size): {cost set: (pipec's makespan, torch's)}."""
    cases = [("torch", name, torch_class_programs) for name in ("ScheduleGPipe", *TORCH_MULTI)]
    cases += [("pipec", name, pipec_schedule_programs) for name in PIPEC_SCHEDULES]
    for origin, name, lowered in cases:
        for pp, nmb in sizes:
            ours, theirs = lowered(name, pp, nmb)
            yield origin, name, (pp, nmb), {label: (simulate(ours, costs).makespan, simulate(theirs, costs).makespan)
                                           for label, costs in COST_SETS.items()}


def _number(value) -> str:
    return f"{float(value):g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(f"{p}x{n}" for p, n in SIZES),
                        help="P x N pairs, comma-separated (default: %(default)s)")
    args = parser.parse_args(argv)
    sizes = [tuple(map(int, size.split("x"))) for size in args.sizes.split(",")]
    labels = list(COST_SETS)
    print("makespan pipec / torch (simulated); order from: torch = torch's class, pipec = pipec's shipped schedule")
    print("| order | P x N | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    worse = 0
    for origin, name, (pp, nmb), found in rows(sizes):
        cells = []
        for label in labels:
            ours, theirs = found[label]
            worse += ours > theirs
            cells.append(f"{_number(ours)} / {_number(theirs)}" + (" **worse**" if ours > theirs else ""))
        print(f"| {origin}: {name.removeprefix('Schedule')} | {pp} x {nmb} | " + " | ".join(cells) + " |")
    print(f"rows where pipec is slower: {worse}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
