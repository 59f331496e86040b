"""Model specs of ``tests/test_data.py`` that workers import (``tests/`` on their PYTHONPATH).

``MICROBATCH``: the built-in decoder fed by a ``microbatch`` function, each
microbatch drawn from its own generator (the permutation task on its own
tokens). With ``CALL_LOG`` set to a folder, every call appends ``step m`` to
``rank-R.log`` there (R: the process's RANK), so a test can see which ranks
asked for which microbatches.
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from pipec.runtime import model
from pipec.runtime.model import ModelConfig, stream_seed

CALL_LOG = "PIPEC_TEST_DATA_CALLS"
# Apart from the built-in model's parameter and data streams.
_DOMAIN = 1 << 44


def microbatch(config: ModelConfig, step: int, m: int, num_microbatches: int, seed: int):
    """Microbatch m of ``step``: ``microbatch_size`` sequences of random tokens and their permuted targets."""
    folder = os.environ.get(CALL_LOG)
    if folder:
        with open(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}.log"), "a", encoding="utf-8") as log:
            log.write(f"{step} {m}\n")
    generator = torch.Generator().manual_seed(stream_seed(stream_seed(seed, _DOMAIN + step), m))
    inputs = torch.randint(config.vocab, (config.microbatch_size, config.seq_len), generator=generator)
    return inputs, model.task_permutation(config, seed)[inputs]


# the built-in model's spec, its batches drawn per microbatch
MICROBATCH = replace(model.LLAMA, synthetic_batch=None, microbatch=microbatch)


def calls(folder, rank: int) -> set[tuple[int, int]]:
    """The (step, microbatch) calls rank ``rank`` logged in ``folder`` (empty: it made none)."""
    path = os.path.join(folder, f"rank-{rank}.log")
    if not os.path.exists(path):
        return set()
    with open(path, encoding="utf-8") as log:
        return {tuple(map(int, line.split())) for line in log if line.strip()}
