"""One rank of torch's own ``_PipelineScheduleRuntime`` running a CSV that pipec exported.

Run as a script by ``tests/test_torch_runtime_export.py`` (through
``runtime_util._launch``, which sets torchrun's environment): joins a gloo group
once, then for each CSV builds the stages of a fresh ``tiny_model()`` that the
CSV puts on this rank, loads the CSV with ``_load_csv(path,
format="compute_comms")``, trains ``STEPS`` SGD steps and saves each step's
gradients and the final parameters of its stages to ``CSV.rank<R>.pt``. The
test compares them with ``reference()``, the same training in one process.
(One set of processes for every CSV: starting one costs seconds of imports.)

Usage: torch_runtime_worker.py N CSV [CSV ...]   (N: microbatches)
"""
from __future__ import annotations

import copy
import sys

import torch
from torch import nn

WIDTH, BATCH, NUM_STAGES, STEPS, LR = 8, 8, 4, 2, 0.1


def tiny_model(num_stages: int = NUM_STAGES) -> nn.Sequential:
    """``num_stages`` chunks of Linear + Tanh, seeded: every process builds the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages)])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (input, target) batch per step, the same in every process."""
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))
            for _ in range(STEPS)]


def reference(num_stages: int = NUM_STAGES) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Each step's gradients and the final parameters of the whole model, trained in one process (mean loss)."""
    model = tiny_model(num_stages)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for x, y in batches():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    return grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def stages_in_csv(path: str, rank: int) -> list[int]:
    """The stages whose compute (F) the CSV puts on ``rank``, in ascending order."""
    import re

    with open(path) as handle:
        row = handle.read().splitlines()[rank]
    return sorted({int(m[1]) for m in (re.fullmatch(r"(\d+)F\d+", cell) for cell in row.split(",")) if m})


def main(num_microbatches: int, paths: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for path in paths:
        train(path, num_microbatches, dist.get_rank())
        dist.barrier()
    dist.destroy_process_group()


def train(path: str, num_microbatches: int, rank: int) -> None:
    """Train on the CSV's schedule with torch's runtime; save this rank's gradients and parameters beside the CSV."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    model = tiny_model()
    ids = stages_in_csv(path, rank)
    chunks = {s: copy.deepcopy(model[s]) for s in ids}
    stages = [PipelineStage(chunks[s], s, NUM_STAGES, torch.device("cpu")) for s in ids]
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=num_microbatches, loss_fn=nn.functional.mse_loss)
    schedule._load_csv(path, format="compute_comms")
    optimizer = torch.optim.SGD([p for s in ids for p in chunks[s].parameters()], lr=LR)
    grads = []
    for x, y in batches():
        optimizer.zero_grad()
        schedule.step(x, target=y)
        grads.append({f"{s}.{name}": p.grad.clone() for s in ids for name, p in chunks[s].named_parameters()})
        optimizer.step()
    final = {f"{s}.{name}": p.detach().clone() for s in ids for name, p in chunks[s].named_parameters()}
    torch.save({"grads": grads, "params": final}, f"{path}.rank{rank}.pt")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
