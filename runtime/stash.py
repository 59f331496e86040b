"""Weight stashing and the optimizer updates of asynchronous training (PipeDream, PipeDream-2BW).

A program whose order holds updates (``U(s, m)``: ``compiler/versions.py``)
steps each stage's optimizer inside the list. The compiler's ``VersionPlan``
says which microbatches' backwards run after an update of their stage
(``stashed``) and on which version; this module keeps those versions:

* A forward of a stashed microbatch runs on a copy of the stage's weights as
  they are then (one copy per version, made at the first forward that needs
  it, shared by the others), through ``torch.func.functional_call``; its
  recompute and backward run on the same copy, because autograd saved it.
  The copy's leaves share the masters' ``.grad`` views, so the backward's
  weight gradients accumulate into the stage's flat gradient buffer as any
  other's do. The copy is dropped after the last backward that ran on it.
* Every other forward runs on the masters themselves: no update comes
  between it and its backward.
* ``U`` steps the stage's parameters (the rank's one optimizer, the other
  stages' gradients hidden meanwhile: torch's optimizers skip a parameter
  without a gradient), then zeroes the stage's gradient buffer.

The loss of microbatch m is scaled by 1 / (the number of microbatches its
update applies, at the last stage): each update applies the mean gradient of
its minibatch, as PipeDream's SGD steps do, however many microbatches a step's
list holds (``loss_scales``).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

import torch
from torch import nn

from pipec.compiler.ir import Program
from pipec.compiler.versions import VersionPlan, has_updates
from pipec.errors import UsageError
from pipec.runtime.config import RunConfig


def check_update_options(config: RunConfig, program: Program) -> None:
    """Refuse the run options that assume one optimizer step after the list, for a program with updates.

    Args:
        config: the run's configuration.
        program: the program it trains.

    Raises:
        UsageError: ``--clip-grad-norm`` (it scales a whole step's gradients by
            their global norm over every rank; here each stage updates by itself).
    """
    if config.clip_grad_norm is not None and has_updates(program):
        raise UsageError(f"--clip-grad-norm clips a whole step's gradients by their norm over every rank, but "
                         f"{program.name} updates each stage inside its list (U): drop --clip-grad-norm")


def loss_scales(program: Program, plan: VersionPlan) -> list[float]:
    """Microbatch -> the factor of its loss: 1 / the size of the update that applies it at its last stage.

    Args:
        program: the program (``plan`` is its ``version_plan``).
        plan: its version plan.
    Returns:
        one float per microbatch.
    """
    scales = [1.0 / program.num_microbatches] * program.num_microbatches
    for pipeline in program.pipelines:
        for update in plan.updates.get(pipeline[-1], ()):
            for mb in update.applies:
                scales[mb] = 1.0 / len(update.applies)
    return scales


class WeightStash:
    """One rank's weight versions for a program with updates (``interpreter.make_context`` builds it once).

    Attributes:
        plan: the program's version plan.
        modules: stage -> its module, for this rank's stages.
        params: stage -> its module's trainable parameters (the masters), in order.
        names: stage -> the names of those parameters (for ``functional_call``).
        uses: (stage, version) -> how many stashed microbatches of one step run on it.
        copies: (stage, version) -> the copy of the stage's weights at that version, while a backward needs it.
        left: (stage, version) -> stashed backwards still to run on it in this step.
        loss_scales: see ``loss_scales``.
    """

    def __init__(self, program: Program, plan: VersionPlan, modules: dict[int, nn.Module]):
        self.plan = plan
        self.modules = modules
        self.params = {s: [p for p in m.parameters() if p.requires_grad] for s, m in modules.items()}
        self.names = {s: [n for n, p in m.named_parameters() if p.requires_grad] for s, m in modules.items()}
        self.uses = Counter((s, plan.version_of[s, m]) for s, m in plan.stashed if s in modules)
        self.copies: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.left: Counter = Counter()
        self.loss_scales = loss_scales(program, plan)

    def start_step(self) -> None:
        """Forget the copies of the last step (all released by its backwards) and count this step's uses."""
        self.copies.clear()
        self.left = Counter(self.uses)

    def module_for(self, stage: int, mb: int) -> Callable:
        """What the forward (or recompute) of (stage, mb) calls: the stage's module, or, for a stashed
        microbatch, the module on the copy of its forward's version (made now if it is the first)."""
        if (stage, mb) not in self.plan.stashed:
            return self.modules[stage]
        key = (stage, self.plan.version_of[stage, mb])
        copy = self.copies.get(key)
        if copy is None:
            copy = []
            for master in self.params[stage]:
                leaf = master.detach().clone().requires_grad_(True)
                leaf.grad = master.grad  # the same view: gradients land in the stage's flat buffer
                copy.append(leaf)
            self.copies[key] = copy
        module, weights = self.modules[stage], dict(zip(self.names[stage], copy))

        def on_copy(*args, **kwargs):
            return torch.func.functional_call(module, weights, args, kwargs, strict=False)
        return on_copy

    def params_for(self, stage: int, mb: int) -> Sequence[torch.Tensor]:
        """The parameters the backward of (stage, mb) runs on: the masters, or its version's copy."""
        if (stage, mb) not in self.plan.stashed:
            return self.params[stage]
        return self.copies[stage, self.plan.version_of[stage, mb]]

    def backward_done(self, stage: int, mb: int) -> None:
        """The weight gradient of (stage, mb) is made: drop its version's copy after its last user."""
        if (stage, mb) not in self.plan.stashed:
            return
        key = (stage, self.plan.version_of[stage, mb])
        self.left[key] -= 1
        if self.left[key] == 0:
            self.copies.pop(key, None)


    def update(self, stage: int, optimizer: torch.optim.Optimizer, flat_grad: torch.Tensor) -> None:
        """U: step ``optimizer`` on ``stage``'s parameters only, then zero the stage's gradient buffer.

        Args:
            stage: the stage to update.
            optimizer: the rank's optimizer (over every stage it holds).
            flat_grad: the stage's flat gradient buffer (its parameters' ``.grad`` views it).
        """
        step_only(optimizer, [p for s, ps in self.params.items() if s != stage for p in ps])
        flat_grad.zero_()


def step_only(optimizer: torch.optim.Optimizer, others: Sequence[torch.Tensor]) -> None:
    """Step ``optimizer`` but not on ``others``: their gradients are hidden during the step (torch's
    optimizers skip a parameter whose ``.grad`` is None), then put back."""
    hidden = [(p, p.grad) for p in others]
    for p, _ in hidden:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in hidden:
            p.grad = grad
