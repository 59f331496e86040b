"""A user's model spec whose chunks hand each other two tensors: a hidden state and a mask.

Chunk 0 reads a batch of feature sequences [rows, seq, width]; a position
takes part when its first feature is positive, which gives a bool mask
[rows, seq] that every later chunk receives beside the hidden state and uses:
each block adds ``tanh(block(x))`` only where the mask is set. The last chunk
returns the hidden state; the loss is the MSE against the targets. The mask
carries no gradient (bool), the hidden state does. ``FORM`` picks whether a
chunk hands over a tuple ``(hidden, mask)`` (the next chunk's positional
arguments) or a dict ``{"hidden": ..., "mask": ...}`` (keywords); ``SPEC``
declares the layout, ``PROBED`` leaves it to the runtime to find.

Tests put this folder on the workers' PYTHONPATH: ``--model payload_model:SPEC``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from pipec.errors import UsageError
from pipec.runtime.model import ModelSpec, stream_seed
from pipec.runtime.payload import TensorSpec


@dataclass(frozen=True)
class Config:
    width: int = 8
    blocks: int = 8
    rows: int = 3            # sequences per microbatch
    seq: int = 5
    form: str = "tuple"      # or "dict"


class Chunk(nn.Module):
    def __init__(self, config: Config, blocks: range, first: bool, last: bool, seed: int):
        super().__init__()
        self.config, self.first, self.last = config, first, last
        # keys "blocks.5.weight": the global block index, as in the whole model
        self.blocks = nn.ModuleDict({str(i): nn.Linear(config.width, config.width) for i in blocks})
        with torch.no_grad():
            for i in blocks:
                generator = torch.Generator().manual_seed(stream_seed(seed, i))
                for parameter in self.blocks[str(i)].parameters():
                    parameter.normal_(0.0, 0.3, generator=generator)

    def forward(self, hidden, mask=None):
        if self.first:
            mask = hidden[..., 0] > 0
        gate = mask.unsqueeze(-1).to(hidden.dtype)
        for block in self.blocks.values():
            hidden = hidden + torch.tanh(block(hidden)) * gate
        if self.last:
            return hidden
        return {"hidden": hidden, "mask": mask} if self.config.form == "dict" else (hidden, mask)


def build_chunk(config: Config, chunk: int, num_chunks: int, seed: int) -> Chunk:
    if config.blocks % num_chunks:
        raise UsageError(f"{config.blocks} blocks do not split into {num_chunks} chunks")
    per = config.blocks // num_chunks
    return Chunk(config, range(chunk * per, (chunk + 1) * per), chunk == 0, chunk == num_chunks - 1, seed)


def build_model(config: Config, seed: int) -> Chunk:
    return build_chunk(config, 0, 1, seed)


def synthetic_batch(config: Config, step: int, num_microbatches: int, seed: int):
    generator = torch.Generator().manual_seed(stream_seed(seed, 1_000_000 + step))
    inputs = torch.randn(num_microbatches * config.rows, config.seq, config.width, generator=generator)
    return inputs, inputs.flip(-1) * 0.5


def activation_shape(config: Config):
    hidden = TensorSpec((config.rows, config.seq, config.width))
    mask = TensorSpec((config.rows, config.seq), torch.bool)
    return {"hidden": hidden, "mask": mask} if config.form == "dict" else (hidden, mask)


SPEC = ModelSpec(
    build_chunk=build_chunk,
    build_model=build_model,
    synthetic_batch=synthetic_batch,
    loss_fn=nn.functional.mse_loss,
    make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    config=Config(),
    activation_shape=activation_shape,
)
PROBED = replace(SPEC, activation_shape=None)
