"""A user's model given by its layers only: an ``nn.Sequential`` of Linear + Tanh blocks, no ``build_chunk``.

What a user writes when pipec cuts the model (``runtime/layered.py``): the
layers in order, a data source, a loss and an optimizer. The layers draw
their initial values from torch's global generator (``nn.Linear``'s default
initialisation), which pipec seeds with the run's seed. The task: map a
random vector to a fixed smooth function of it.

Tests put this folder on the workers' PYTHONPATH: ``--model layered_model:SPEC``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipec.runtime.model import ModelSpec, stream_seed


@dataclass(frozen=True)
class Config:
    width: int = 8
    depth: int = 12
    rows: int = 3  # rows per microbatch


def layers(config: Config, seed: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh())
                           for _ in range(config.depth)))


def microbatch(config: Config, step: int, microbatch: int, num_microbatches: int, seed: int):
    generator = torch.Generator().manual_seed(stream_seed(seed, (step * num_microbatches + microbatch) << 8))
    inputs = torch.randn(config.rows, config.width, generator=generator)
    return inputs, torch.sin(inputs.flip(-1))


SPEC = ModelSpec(
    layers=layers,
    microbatch=microbatch,
    loss_fn=nn.functional.mse_loss,
    make_optimizer=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9, foreach=False),
    config=Config(),
)
