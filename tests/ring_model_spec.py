"""A user's model that trains with a sequence ring: two attention blocks on vectors, declared by ``ring_model``.

What a user writes to train with ``ring_attention``, ``zigzag_ring`` or
``tasp`` (``runtime/sequence.py``'s contract): ``ring_model(config) ->
RingModel(seq_len, causal)``; a model whose forward takes ``positions=`` (the
global positions of the tokens it is given: a learned position embedding reads
them) and ``attend=`` (each block's attention calls it; without it, causal
``scaled_dot_product_attention`` over the tokens given); inputs and targets of
shape (rows, seq_len, width), the sequence in dimension 1; a loss that is a
mean over tokens (``mse_loss``). The task: map each token's vector to the
running mean of the vectors up to it (causal, so attention has work to do).

Tests put this folder on the workers' PYTHONPATH: ``--model ring_model_spec:SPEC``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipec.errors import UsageError
from pipec.runtime.model import ModelSpec, RingModel, stream_seed


@dataclass(frozen=True)
class Config:
    seq_len: int = 8
    width: int = 6
    heads: int = 2
    head_dim: int = 3
    rows: int = 2
    blocks: int = 2


class Block(nn.Module):
    """Pre-norm attention with a residual: the one place the model mixes tokens."""

    def __init__(self, config: Config):
        super().__init__()
        self.heads, self.head_dim = config.heads, config.head_dim
        self.norm = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.heads * config.head_dim)
        self.out = nn.Linear(config.heads * config.head_dim, config.width)

    def forward(self, x: torch.Tensor, attend=None) -> torch.Tensor:
        rows, tokens, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(rows, tokens, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        mixed = attend(q, k, v) if attend is not None else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(mixed.transpose(1, 2).reshape(rows, tokens, -1))


class RingReady(nn.Module):
    """Position embedding, ``blocks`` attention blocks, a linear head; ``forward(x, positions=, attend=)``."""

    def __init__(self, config: Config):
        super().__init__()
        self.position = nn.Embedding(config.seq_len, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.blocks))
        self.head = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, attend=None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        x = x + self.position(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x)


def build_model(config: Config, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return RingReady(config)


def build_chunk(config: Config, chunk: int, num_chunks: int, seed: int) -> nn.Module:
    if num_chunks != 1:
        raise UsageError("ring_model_spec trains with sequence rings (the whole model on every rank) only")
    return build_model(config, seed)


def synthetic_batch(config: Config, step: int, num_microbatches: int, seed: int):
    generator = torch.Generator().manual_seed(stream_seed(seed, 1000 + step))
    inputs = torch.randn(num_microbatches * config.rows, config.seq_len, config.width, generator=generator)
    counts = torch.arange(1, config.seq_len + 1, dtype=inputs.dtype).view(1, -1, 1)
    return inputs, inputs.cumsum(dim=1) / counts


def ring_model(config: Config) -> RingModel:
    return RingModel(config.seq_len, causal=True)


def make_optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.2)


SPEC = ModelSpec(build_chunk=build_chunk, build_model=build_model, synthetic_batch=synthetic_batch,
                 loss_fn=F.mse_loss, make_optimizer=make_optimizer, config=Config(), ring_model=ring_model)
# The same model without the declaration: a ring refuses it.
UNDECLARED = ModelSpec(build_chunk=build_chunk, build_model=build_model, synthetic_batch=synthetic_batch,
                       loss_fn=F.mse_loss, make_optimizer=make_optimizer, config=Config())
