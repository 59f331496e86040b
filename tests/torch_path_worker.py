"""One rank of a user's own training loop: torch.distributed.pipelining stages, a pipec schedule.

Run as a script by ``tests/test_torch_path.py`` (through ``runtime_util._launch``,
which sets torchrun's environment). It joins a gloo group once; then, for each
case ``NAME:FORM:TARGET:JSON_PARAMS`` (FORM: ``comms`` or ``compute``, the CSV form torch
is loaded with, or ``titan``: compute only, as torchtitan loads it, with ``scale_grads=False`` and the
loss divided by the microbatch count instead), it does what docs/torch.md tells a user to do:
compiles the schedule with ``pipec.compile``, cuts its own model into the
program's stages, builds a ``PipelineStage`` for each stage the program places
on this rank, asks ``pipec.torch.schedule_for`` for the schedule, and trains
``STEPS`` SGD steps with ``schedule.step``. It saves this rank's final
parameters, named as in the whole model, to ``OUT/NAME.rank<R>.pt``; the test
compares them with ``reference()``, the same training in one process.

Usage: torch_path_worker.py OUT CASE [CASE ...]   (CASE: NAME:FORM:TARGET:{"P": 4, ...})
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
from torch import nn

WIDTH, BATCH, LAYERS, STEPS, LR = 8, 16, 8, 3, 0.1


def tiny_model() -> nn.Sequential:
    """LAYERS blocks of Linear + Tanh, seeded: every process builds the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (input, target) batch per step, the same in every process."""
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))
            for _ in range(STEPS)]


def reference() -> dict[str, torch.Tensor]:
    """The whole model's final parameters, trained in one process on the same batches (mean loss)."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def layers_of(stage: int, num_stages: int) -> range:
    """The model's layers stage ``stage`` of ``num_stages`` holds: an even cut."""
    per = LAYERS // num_stages
    return range(stage * per, (stage + 1) * per)


def train(case: str, out: str, rank: int) -> None:
    """One case: compile, build this rank's stages, train, save this rank's parameters."""
    import pipec
    import pipec.torch
    from torch.distributed.pipelining import PipelineStage

    name, form, rest = case.split(":", 2)
    target, params = rest.split(":{", 1)
    params = "{" + params
    program = pipec.compile(target, json.loads(params))
    model = tiny_model()
    chunks = {s: copy.deepcopy(nn.Sequential(*(model[i] for i in layers_of(s, program.num_stages))))
              for s in program.stages_on(rank)}
    stages = [PipelineStage(chunk, s, program.num_stages, torch.device("cpu")) for s, chunk in chunks.items()]
    if form == "titan":  # as torchtitan loads a CSV: compute only, scale_grads=False, the loss divided by the user
        count = program.num_microbatches
        schedule = pipec.torch.schedule_for(program, stages, loss_fn=lambda out, y: nn.functional.mse_loss(out, y) / count,
                                            comms=False, scale_grads=False)
    else:
        schedule = pipec.torch.schedule_for(program, stages, loss_fn=nn.functional.mse_loss, comms=form == "comms")
    optimizer = torch.optim.SGD([p for chunk in chunks.values() for p in chunk.parameters()], lr=LR)
    for x, y in batches():
        optimizer.zero_grad()
        schedule.step(x, target=y)
        optimizer.step()
    final = {}
    for s, chunk in chunks.items():
        for offset, layer in enumerate(layers_of(s, program.num_stages)):
            for key, p in chunk[offset].named_parameters():
                final[f"{layer}.{key}"] = p.detach().clone()
    torch.save(final, os.path.join(out, f"{name}.rank{rank}.pt"))


def main(out: str, cases: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for case in cases:
        train(case, out, dist.get_rank())
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
