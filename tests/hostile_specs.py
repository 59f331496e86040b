"""Hostile model specs of ``tests/test_hostile_runtime.py`` that workers import (``tests/`` on their PYTHONPATH).

Each is the built-in decoder with one function made wrong. Faults meant for one
rank read the worker's RANK from the environment, so the parent's checks before
launching (which run chunk 0 in a process without RANK) still pass and the fault
happens inside the run, on that rank only.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import torch
from torch import nn

from pipec.runtime import model

# The rank a one-rank fault happens on.
FAULTY_RANK = "1"


def _on_faulty_rank() -> bool:
    return os.environ.get("RANK") == FAULTY_RANK


class Refusal(BaseException):
    """Not an Exception: what a model raises when it means to get past ``except Exception``."""


class InterruptLike(KeyboardInterrupt):
    """A subclass of KeyboardInterrupt a model raises itself (no signal came)."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, error):
        ctx.error = error
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ctx.error


def _failing_chunks(error: BaseException, where: str):
    """build_chunk of the built-in model, its chunks made to raise ``error`` in their forward or backward
    on the faulty rank (hooks: the chunk and its parameter names stay the model's)."""

    def raise_before(module, args):
        if _on_faulty_rank():
            raise error

    def raise_in_backward(module, args, out):
        return _RaiseInBackward.apply(out, error) if _on_faulty_rank() else out

    def build_chunk(config, chunk, num_chunks, seed):
        built = model.build_chunk(config, chunk, num_chunks, seed)
        if where == "forward":
            built.register_forward_pre_hook(raise_before)
        else:
            built.register_forward_hook(raise_in_backward)
        return built

    return build_chunk


def _failing_spec(error: BaseException, where: str) -> model.ModelSpec:
    return replace(model.LLAMA, build_chunk=_failing_chunks(error, where), layers=None)


FORWARD_RAISES = _failing_spec(ValueError("forward exploded on purpose"), "forward")
BACKWARD_RAISES = _failing_spec(ArithmeticError("backward exploded on purpose"), "backward")
RAISES_BASE_EXCEPTION = _failing_spec(Refusal("not an Exception"), "forward")
RAISES_INTERRUPT_SUBCLASS = _failing_spec(InterruptLike("raised by the model, not by a signal"), "forward")
EXITS_IN_FORWARD = _failing_spec(SystemExit(0), "forward")


def _loss_raises(logits, targets):
    raise RuntimeError("loss exploded on purpose")


def _loss_not_a_tensor(logits, targets):
    return "a string, not a loss"


def _optimizer_raises(params):
    raise TypeError("optimizer factory exploded on purpose")


def _optimizer_none(params):
    list(params)
    return None


def _optimizer_not_one(params):
    return [p for p in params]


LOSS_RAISES = replace(model.LLAMA, loss_fn=_loss_raises)
LOSS_NOT_A_TENSOR = replace(model.LLAMA, loss_fn=_loss_not_a_tensor)
OPTIMIZER_RAISES = replace(model.LLAMA, make_optimizer=_optimizer_raises)
OPTIMIZER_NONE = replace(model.LLAMA, make_optimizer=_optimizer_none)
OPTIMIZER_NOT_ONE = replace(model.LLAMA, make_optimizer=_optimizer_not_one)


def _exit_zero(*args):
    sys.exit(0)


# sys.exit(0) where each kind of spec function runs: at build time, and in the optimizer factory
EXITS_IN_BUILD = replace(model.LLAMA, build_chunk=lambda *args: _exit_zero(), layers=None)
EXITS_IN_OPTIMIZER = replace(model.LLAMA, make_optimizer=_exit_zero)


class _Hanging(nn.Module):
    """A layer whose forward never returns (for ``pipec profile``): sleeps in short ticks, as a stuck loop."""

    def forward(self, x):
        while True:
            time.sleep(0.05)


def _layers_with_a_hang(config, seed):
    layers = list(model.llama_layers(config, seed))
    return nn.Sequential(layers[0], _Hanging(), *layers[1:])


HANGING_LAYER = replace(model.LLAMA, build_chunk=None, build_model=None, layers=_layers_with_a_hang,
                        activation_shape=None)
