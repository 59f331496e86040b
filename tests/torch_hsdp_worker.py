"""One rank of torch's ``_PipelineScheduleRuntime`` running pipec's HSDP export over FSDP2's ``fully_shard`` on a
2-D (ddp, fsdp) DeviceMesh.

Run as a script by ``tests/test_compose_hsdp.py`` (through ``runtime_util._launch``) on P x R x S gloo
processes: builds a ``DeviceMesh`` (pp, ddp, fsdp) laid out as pipec's mesh, wraps each stage of its pp
coordinate (from a fresh ``tiny_model``) in ``fully_shard`` on the (ddp, fsdp) sub-mesh, FSDP2's own
reshard after forward off (the CSV's ``UNSHARD`` and ``RESHARD`` say where), loads the CSV with
``_load_csv(format="compute_comms")`` and trains torch_runtime_worker's SGD steps; member i of the R x S
members of its pp coordinate (ascending rank order, pipec's) feeds rows share i of every microbatch. Each
step's whole gradients, the final whole parameters and the last step's FSDP2 collectives are saved to
``CSV.rank<R>.pt``.

Usage: torch_hsdp_worker.py CSV P R S N
"""
from __future__ import annotations

import copy
import re
import sys

import torch
from torch import nn

from torch_fsdp_worker import counted_collectives, share
from torch_runtime_worker import LR, batches, tiny_model


def main(path: str, P: int, R: int, S: int, N: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (P, R, S), mesh_dim_names=("pp", "ddp", "fsdp"))
    counts = counted_collectives()
    with open(path) as handle:
        rows = handle.read().splitlines()
    num_stages = len({m[1] for m in re.finditer(r"(\d+)F\d+", ",".join(rows))})
    pp_rank = mesh["pp"].get_local_rank()
    member = mesh["ddp"].get_local_rank() * S + mesh["fsdp"].get_local_rank()
    ids = sorted({int(m[1]) for m in re.finditer(r"(\d+)F\d+", rows[pp_rank])})
    model = tiny_model(num_stages)
    chunks = {s: fully_shard(copy.deepcopy(model[s]), mesh=mesh["ddp", "fsdp"], reshard_after_forward=False)
              for s in ids}
    stages = [PipelineStage(chunks[s], s, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for s in ids]
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=N, loss_fn=nn.functional.mse_loss)
    schedule._load_csv(path, format="compute_comms")
    optimizer = torch.optim.SGD([p for s in ids for p in chunks[s].parameters()], lr=LR)
    grads = []
    for x, y in batches():
        optimizer.zero_grad()
        counts.clear()
        schedule.step(share(x, N, member, R * S), target=share(y, N, member, R * S))
        grads.append({f"{s}.{name}": p.grad.full_tensor() for s in ids for name, p in chunks[s].named_parameters()})
        optimizer.step()
    final = {f"{s}.{name}": p.full_tensor().detach() for s in ids for name, p in chunks[s].named_parameters()}
    torch.save({"grads": grads, "params": final, "collectives": dict(counts), "pp_rank": pp_rank},
               f"{path}.rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
