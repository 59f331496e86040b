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

from pipec.compiler.ir import Program
from pipec.compiler.versions import version_plan
from pipec.runtime.data import BatchSource
from pipec.runtime.model import LLAMA, ModelSpec
from pipec.runtime.payload import arguments, call
from pipec.runtime.precision import FP32, Precision
from pipec.runtime.stash import loss_scales


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


def async_reference_run(program: Program, config, steps: int, seed: int, spec: ModelSpec = LLAMA, *,
                        precision: Precision = FP32) -> ReferenceRun:
    """Train ``spec``'s model on one process with the staleness of ``program``'s updates.

    The oracle of asynchronous training (optimizer updates in the order:
    ``compiler/versions.py``). Nothing is pipelined, but every weight a
    pipelined run would use is the same: the forward and the backward of
    microbatch m at chunk c run on version ``version_of[c, m]`` of the
    chunk's weights, and the chunk's update k applies the gradients of the
    microbatches the plan names, in that order, to version k, making version
    k + 1, with the chunk's own optimizer. Versions are made when first
    needed (an update needs its microbatches' gradients, whose forwards need
    earlier versions of every chunk), so no order of the pipelined run is
    assumed beyond the plan. Loss scales are the run's (``stash.loss_scales``).

    Args:
        program: an activation-passing program with updates, one pipeline.
        config, steps, seed, spec, precision: as for ``reference_run``; each step runs the program's
            N microbatches of batch ``step``.
    Returns:
        the final parameters (the chunks' state_dicts merged) and the mean loss of each step's microbatches.
    Raises:
        ValueError: a program without updates, or with more than one pipeline.
    """
    plan = version_plan(program)
    if plan is None or len(program.pipelines) != 1:
        raise ValueError("async_reference_run needs a program of one pipeline with updates in its order")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _AsyncEmulation(program, plan, config, seed, spec, precision).train(steps)
    finally:
        torch.set_num_threads(threads)


class _AsyncEmulation:
    """The state of ``async_reference_run``: chunks, their optimizers, and one step's versions and gradients."""

    def __init__(self, program: Program, plan, config, seed: int, spec: ModelSpec, precision: Precision):
        self.program, self.plan, self.spec, self.precision = program, plan, spec, precision
        self.stages = program.pipelines[0]
        count = len(self.stages)
        self.chunks = [spec.build_chunk(config, c, count, seed) for c in range(count)]
        self.optimizers = [spec.make_optimizer(chunk.parameters()) for chunk in self.chunks]
        self.data = BatchSource(spec, config, seed, program.num_microbatches)
        self.scales = loss_scales(program, plan)

    def train(self, steps: int) -> ReferenceRun:
        losses = []
        for step in range(steps):
            self.inputs, self.targets = self.data.batch(step)
            # chunk -> version -> {name: tensor}; version 0 is the weights the step starts with
            self.versions = [[self._copy(c)] for c in range(len(self.chunks))]
            self.grads: dict[tuple[int, int], list[torch.Tensor]] = {}
            self.losses: dict[int, float] = {}
            self.started: set[int] = set()
            for c in range(len(self.chunks)):
                self._version(c, len(self.plan.updates.get(self.stages[c], ())))
            losses.append(sum(self.losses[m] for m in sorted(self.losses)) / self.program.num_microbatches)
        state: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            state.update({name: tensor.detach().clone() for name, tensor in chunk.state_dict().items()})
        return ReferenceRun(state, losses)

    def _copy(self, c: int) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.chunks[c].named_parameters()}

    def _version(self, c: int, version: int) -> dict[str, torch.Tensor]:
        """Chunk c's weights at ``version``, making the updates before it (and what they apply) first."""
        made = self.versions[c]
        while len(made) <= version:
            update = self.plan.updates[self.stages[c]][len(made) - 1]
            for mb in update.applies:
                self._microbatch(mb)
            params = [p for p in self.chunks[c].parameters()]
            for p in params:
                p.grad = torch.zeros_like(p)
            for mb in update.applies:
                for p, g in zip(params, self.grads.pop((c, mb))):
                    p.grad += g
            self.optimizers[c].step()
            made.append(self._copy(c))
        return made[version]

    def _microbatch(self, mb: int) -> None:
        """Forward and backward of microbatch ``mb`` through every chunk, each on its forward's version."""
        if mb in self.losses:
            return
        if mb in self.started:
            raise ValueError(f"microbatch {mb}'s forward needs a version its own backward makes: the plan is "
                             "not causal (a program the checks did not pass?)")
        self.started.add(mb)
        leaves = []
        value = self.inputs[mb]
        for c, stage in enumerate(self.stages):
            weights = {name: t.detach().requires_grad_(True)
                       for name, t in self._version(c, self.plan.version_of[stage, mb]).items()}
            leaves.append(weights)
            with self.precision.autocast("cpu"):
                value = _call_on(self.chunks[c], weights, value)
        with self.precision.autocast("cpu"):
            loss = self.spec.loss_fn(value, self.targets[mb])
        self.losses[mb] = loss.item()
        flat = [t for weights in leaves for t in weights.values()]
        grads = torch.autograd.grad(loss * self.scales[mb], flat, allow_unused=True)
        at = 0
        for c, weights in enumerate(leaves):
            part = grads[at:at + len(weights)]
            at += len(weights)
            self.grads[c, mb] = [torch.zeros_like(t) if g is None else g for t, g in zip(weights.values(), part)]


def _call_on(module: torch.nn.Module, weights: dict[str, torch.Tensor], value):
    """``payload.call`` of ``module`` with ``weights`` in place of its parameters."""
    args, kwargs = arguments(value)
    return torch.func.functional_call(module, weights, tuple(args), kwargs, strict=False)
