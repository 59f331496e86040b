"""Training on one process: the oracle every pipelined run is compared with.

One step does what a pipeline schedule does, minus the pipeline: for each
microbatch in order, forward the whole model, ``loss_fn(...) / N``, backward
(gradients accumulate); then, when asked, clipping by the global gradient norm
(``torch.nn.utils.clip_grad_norm_``), and one optimizer step. Under a mixed
precision the forward and the loss run under its autocast, as a pipelined
run's forwards do. The step's loss is the sum of
the scaled microbatch losses, i.e. their mean. A schedule is exact when its
parameters after K steps equal these, to fp32 rounding.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from pipec.runtime.data import BatchSource
from pipec.runtime.model import LLAMA, ModelSpec
from pipec.runtime.payload import call
from pipec.runtime.precision import FP32, Precision


class ReferenceRun(NamedTuple):
    """What ``reference_run`` returns.

    Attributes:
        state_dict: the whole model's parameters after the last step (detached copies).
        losses: the loss of each step's batch, before that step's update.
    """

    state_dict: dict[str, torch.Tensor]
    losses: list[float]


def reference_run(config, steps: int, num_microbatches: int, seed: int, spec: ModelSpec = LLAMA, *,
                  precision: Precision = FP32, clip_grad_norm: float | None = None) -> ReferenceRun:
    """Train ``spec``'s whole model on one process.

    Args:
        config: passed to the spec's functions (for ``LLAMA``, a ``ModelConfig``).
        steps: optimizer steps; step k trains on batch k of the spec's data source, every microbatch
            (``data.BatchSource(spec, config, seed, N).batch(k)``: for ``LLAMA``,
            ``synthetic_batch(config, k, N, seed)``).
        num_microbatches: N; each microbatch's loss is scaled by 1/N before backward.
        seed: the run's seed (parameters and data).
        spec: the model spec (default: the built-in decoder).
        precision: the compute precision (autocast around forward and loss).
        clip_grad_norm: clip the gradients' global norm to this before each step (None: no clipping).
    Returns:
        the final parameters and the per-step losses.
    """
    threads = torch.get_num_threads()
    # One thread, like every torchrun worker (its default): faster for a small
    # model, and on a loaded machine torch's worker threads otherwise wait on
    # each other for tens of milliseconds per kernel.
    torch.set_num_threads(1)
    try:
        return _train(config, steps, num_microbatches, seed, spec, precision, clip_grad_norm)
    finally:
        torch.set_num_threads(threads)


def _train(config, steps: int, num_microbatches: int, seed: int, spec: ModelSpec, precision: Precision,
           clip_grad_norm: float | None) -> ReferenceRun:
    model = spec.build_model(config, seed)
    optimizer = spec.make_optimizer(model.parameters())
    data = BatchSource(spec, config, seed, num_microbatches)
    losses: list[float] = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for inputs, targets in zip(*data.batch(step)):
            with precision.autocast("cpu"):
                loss = spec.loss_fn(call(model, inputs), targets) / num_microbatches
            loss.backward()
            step_loss += loss.item()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        optimizer.step()
        losses.append(step_loss)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return ReferenceRun(state, losses)


def train_reference(config, steps: int, num_microbatches: int, seed: int, spec: ModelSpec = LLAMA) -> dict[str, torch.Tensor]:
    """The whole model's state_dict after ``steps`` one-process steps (see ``reference_run``)."""
    return reference_run(config, steps, num_microbatches, seed, spec).state_dict
