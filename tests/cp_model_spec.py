"""A user's model that trains with context parallelism inside pipeline stages (PP x CP): chunked and ring-ready.

``ring_model_spec``'s model (a position embedding, attention blocks on vectors,
a linear head; the task: each token's running mean) cut into pipeline chunks:
chunk 0 holds the position embedding, the last the head, and the blocks are
shared out evenly. Every chunk's forward takes ``positions=`` (the global
positions of the tokens it is given; the first chunk's embedding reads them)
and ``attend=`` (each block's attention calls it), which is what a stage of a
context-parallel composition calls it with (``runtime/placed.py``). Each part
is drawn from its own seeded stream, so that a chunk holds the whole model's
parameters under the whole model's names (``blocks.3.qkv.weight``).

Tests put this folder on the workers' PYTHONPATH: ``--model cp_model_spec:SPEC``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipec.errors import UsageError
from pipec.runtime.model import ModelSpec, stream_seed
from ring_model_spec import Block, make_optimizer, ring_model, synthetic_batch
from ring_model_spec import Config as RingConfig

# The streams of the position embedding and the head (a block's is its index).
_POSITION, _HEAD = 1 << 20, (1 << 20) + 1


@dataclass(frozen=True)
class Config(RingConfig):
    blocks: int = 4  # 2 chunks (1f1b at P = 2) or 4 (interleaved 1F1B at P = 2)


def _seeded(seed: int, owner: int, make):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, owner))
        return make()


class Chunk(nn.Module):
    """Blocks ``blocks`` of the model, with the position embedding if ``first`` and the head if ``last``."""

    def __init__(self, config: Config, blocks: range, first: bool, last: bool, seed: int):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.position = _seeded(seed, _POSITION, lambda: nn.Embedding(config.seq_len, config.width))
        self.blocks = nn.ModuleDict({str(i): _seeded(seed, i, lambda: Block(config)) for i in blocks})
        if last:
            self.head = _seeded(seed, _HEAD, lambda: nn.Linear(config.width, config.width))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, attend=None) -> torch.Tensor:
        if self.first:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            x = x + self.position(positions)
        for block in self.blocks.values():
            x = block(x, attend)
        return self.head(x) if self.last else x


def build_chunk(config: Config, chunk: int, num_chunks: int, seed: int) -> Chunk:
    if config.blocks % num_chunks:
        raise UsageError(f"{config.blocks} blocks do not split into {num_chunks} chunks")
    per = config.blocks // num_chunks
    return Chunk(config, range(chunk * per, (chunk + 1) * per), chunk == 0, chunk == num_chunks - 1, seed)


def build_model(config: Config, seed: int) -> Chunk:
    return build_chunk(config, 0, 1, seed)


SPEC = ModelSpec(build_chunk=build_chunk, build_model=build_model, synthetic_batch=synthetic_batch,
                 loss_fn=F.mse_loss, make_optimizer=make_optimizer, config=Config(), ring_model=ring_model)
# The same model without the declaration: a context-parallel composition refuses it.
UNDECLARED = ModelSpec(build_chunk=build_chunk, build_model=build_model, synthetic_batch=synthetic_batch,
                       loss_fn=F.mse_loss, make_optimizer=make_optimizer, config=Config())
