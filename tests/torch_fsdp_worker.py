"""One rank of torch's ``_PipelineScheduleRuntime`` running pipec's PP x FSDP export over FSDP2-wrapped stages.

Run as a script by ``tests/test_compose_torch.py`` (through ``runtime_util._launch``):
joins a gloo group, builds a ``DeviceMesh`` (pp, dp) laid out as pipec's mesh
(dp contiguous), and for each CSV builds the stages the CSV's row for this
rank's pp coordinate names, from a fresh ``tiny_model``, each wrapped in
``fully_shard`` on the dp sub-mesh (a sharded case) or in FSDP2's
``replicate`` (a replicated one, PP x DP: the wrapper torch's pipelining
stages handle as they handle ``fully_shard``). FSDP2's own reshard after each
forward is off, so that its all-gathers and reshards happen exactly at the
CSV's ``UNSHARD`` and ``RESHARD`` (the program's policy, ZeRO-3 or
ZeRO-2-like, is in where those tokens are). The runtime loads the CSV with ``_load_csv(path,
format="compute_comms")`` and trains ``STEPS`` SGD steps; member i of the dp
group feeds rows share i of every microbatch (pipec's placement semantics).
Each step's whole gradients, the final whole parameters and, per step, the
all-gathers and reduce-scatters FSDP2 ran are saved to ``CSV.rank<R>.pt``.
A case named ``CASE@schedule_for`` runs the same program through
``pipec.torch.schedule_for`` (which makes the schedule from the program) instead.

Usage: torch_fsdp_worker.py FOLDER CASE [CASE ...]   (FOLDER/CASE.csv written by the test)
"""
from __future__ import annotations

import copy
import functools
import re
import sys
from collections import Counter

import torch
from torch import nn

from torch_runtime_worker import LR, batches, tiny_model

PP, DP, NUM_MICROBATCHES = 2, 2, 4
# case -> (schedule, its parameters, sharded (FSDP) or replicated (DP), reshard after forward)
CASES = {
    "1f1b_zero3": ("1f1b", {}, True, True),
    "1f1b_kept": ("1f1b", {}, True, False),
    "zbv_zero3": ("zbv", {}, True, True),
    "interleaved_zero3": ("interleaved_1f1b", {"v": 2}, True, True),
    "1f1b_dp": ("1f1b", {}, False, False),
    "zbv_dp": ("zbv", {}, False, False),
}
VIA_SCHEDULE_FOR = "@schedule_for"


def pipeline(case: str):
    """The case's pipeline program (one rank per pp coordinate)."""
    from pipec.compiler.driver import compile_target

    name, params, _, _ = CASES[case]
    return compile_target(name, {"P": PP, "N": NUM_MICROBATCHES, **params}).program


def composed(case: str):
    """The case's PP x FSDP or PP x DP program on the (pp, dp) mesh."""
    from pipec.compiler.mesh_placement import DataParallel, place_on_mesh
    from pipec.compiler.ir import Mesh

    mesh = Mesh((("pp", PP), ("dp", DP)))
    return place_on_mesh(pipeline(case), mesh, "pp", DataParallel("dp", *CASES[case][2:]))


def share(batch: torch.Tensor, num_microbatches: int, member: int, members: int) -> torch.Tensor:
    """Rows share ``member`` of ``members`` of every microbatch of ``batch``, microbatch after microbatch:
    torch's step splits it into the same ``num_microbatches`` chunks, each this member's share."""
    per = batch.view(num_microbatches, -1, *batch.shape[1:])
    rows = per.shape[1] // members
    return per[:, member * rows:(member + 1) * rows].reshape(-1, *batch.shape[1:])


def counted_collectives() -> Counter:
    """A counter FSDP2's all-gathers ("gather") and gradient reductions ("reduce") add to from now on."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    counts: Counter = Counter()

    def counting(name, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return wrapper

    group.foreach_all_gather = counting("gather", group.foreach_all_gather)
    group.foreach_reduce = counting("reduce", group.foreach_reduce)
    return counts


def main(folder: str, cases: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    counts = counted_collectives()
    for case in cases:
        train(f"{folder}/{case}.csv", case, mesh, counts)
        dist.barrier()
    dist.destroy_process_group()


def train(path: str, case: str, mesh, counts: Counter) -> None:
    """Train on the case's CSV with torch's runtime over FSDP2; save what the test compares beside the CSV."""
    import torch.distributed as dist
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    sharded = CASES[case.split("@")[0]][2]
    wrap = functools.partial(fully_shard, reshard_after_forward=False) if sharded else replicate
    with open(path) as handle:
        rows = handle.read().splitlines()
    num_stages = len({m[1] for m in re.finditer(r"(\d+)F\d+", ",".join(rows))})
    pp_rank, member, members = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["dp"].size()
    ids = sorted({int(m[1]) for m in re.finditer(r"(\d+)F\d+", rows[pp_rank])})
    model = tiny_model(num_stages)
    chunks = {s: wrap(copy.deepcopy(model[s]), mesh=mesh["dp"]) for s in ids}
    stages = [PipelineStage(chunks[s], s, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for s in ids]
    schedule = _schedule(path, case, stages)
    optimizer = torch.optim.SGD([p for s in ids for p in chunks[s].parameters()], lr=LR)
    grads, collectives = [], []
    for x, y in batches():
        optimizer.zero_grad()
        counts.clear()
        schedule.step(share(x, NUM_MICROBATCHES, member, members),
                      target=share(y, NUM_MICROBATCHES, member, members))
        collectives.append(dict(counts))
        grads.append({f"{s}.{name}": p.grad.full_tensor() for s in ids for name, p in chunks[s].named_parameters()})
        optimizer.step()
    final = {f"{s}.{name}": p.full_tensor().detach() for s in ids for name, p in chunks[s].named_parameters()}
    torch.save({"grads": grads, "params": final, "collectives": collectives, "pp_rank": pp_rank},
               f"{path}.rank{dist.get_rank()}.pt")


def _schedule(path: str, case: str, stages: list):
    """torch's runtime loaded with the CSV as torch loads one, or made by pipec.torch.schedule_for."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    if case.endswith(VIA_SCHEDULE_FOR):
        import pipec.api
        import pipec.torch

        program = pipec.api.Program(composed(case[:-len(VIA_SCHEDULE_FOR)]))
        return pipec.torch.schedule_for(program, stages, loss_fn=nn.functional.mse_loss)
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=NUM_MICROBATCHES, loss_fn=nn.functional.mse_loss)
    schedule._load_csv(path, format="compute_comms")
    return schedule


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
