"""The built-in model whose chunks take a while to build on worker rank 1: a large model on a loaded machine.

``build_chunk`` sleeps ``SLOW_BUILD_S`` on the worker whose ``RANK`` is 1 (the
launcher's own check of the model, which has no ``RANK``, builds at once), so
rank 1's build outlasts ``--timeout`` + 3 s and rank 0 waits that long for it at
the barrier before the first step: getting ready, which ``--timeout`` (the
deadline of one wait of a training step) must not bound.

Tests put this folder on the workers' PYTHONPATH: ``--model slow_build_spec:SPEC``.
"""
from __future__ import annotations

import dataclasses
import os
import time

from pipec.runtime.model import LLAMA, build_chunk

SLOW_BUILD_S = 6.0


def slow_build_chunk(config, chunk: int, num_chunks: int, seed: int):
    if os.environ.get("RANK") == "1":
        time.sleep(SLOW_BUILD_S)
    return build_chunk(config, chunk, num_chunks, seed)


SPEC = dataclasses.replace(LLAMA, build_chunk=slow_build_chunk)
