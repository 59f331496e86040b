"""Measure a model layer by layer: what ``pipec profile`` writes into a cost file's ``layers``.

A model spec's ``layers(config, seed)`` gives the model's layers in order (an
``nn.Sequential`` or a list of modules, built as ``runtime/layered.py`` builds them for
training), each taking the previous one's output (a payload: ``runtime/payload.py``), the
first taking a microbatch's inputs and the last giving what ``loss_fn`` takes. For each layer this measures, on one microbatch (microbatch 0 of step 0,
drawn from the spec's data source as training draws it: ``data.BatchSource``):

* ``F``, ``B``: its forward and its backward alone, in milliseconds. Every layer runs on a
  detached copy of its input whose floating leaves are autograd leaves
  (``payload.input_leaves``), so its graph is its own: its forward is timed, then, last
  layer first, its backward from the gradient the next layer's backward left on that
  layer's input leaves (the last layer's from the loss, which its forward computes, as the
  runtime's last stage does).
* ``activation``: the bytes of its output's tensors (what a cut after it sends; 0 for a last
  layer whose output, which only ``loss_fn`` takes, is no payload).
* ``parameters``: the bytes of its parameters.

It also times the whole model's forward and backward as one autograd pass over the chain
(no detaching, one ``backward`` of the loss): what the layers' times should add up to, give
or take what cutting the graph at every layer costs (on the built-in model's CPU runs the
sum comes out some 8% above the whole: a backward call and an input gradient per layer).

Each pass runs ``warmup`` times unmeasured (allocator, autograd's first use), then
``repeats`` times; a layer's F and B are the medians of its times, the whole model's time
the median of its. Gradients are dropped before every pass, so each backward allocates them
as a step's first microbatch does. On CUDA (when ``torch.cuda.is_available()``) the model
and the data move to the GPU and every timing is bracketed by ``torch.cuda.synchronize``.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from pipec.compiler.costs import LAYER_KEYS
from pipec.compiler.spread import Spread
from pipec.errors import UsageError
from pipec.runtime import payload
from pipec.runtime.config import DEFAULT_PROFILE_TIMEOUT_S, DEFAULT_REPEATS
from pipec.runtime.data import BatchSource
from pipec.runtime.layered import build_layers
from pipec.runtime.model import ModelSpec, call_spec_function, spec_label

# Passes run before the measured ones.
WARMUP = 3
_MS_PER_SECOND = 1000.0


@dataclass(frozen=True)
class LayerProfile:
    """What one layer measured (the fields of a cost file's ``layers`` entry, ``costs.LayerCost``).

    Attributes:
        name: the layer's name (``model_layers``).
        F: median forward time, ms.
        B: median backward time, ms.
        activation: bytes of its output for one microbatch.
        parameters: bytes of its parameters.
    """

    name: str
    F: float
    B: float
    activation: int
    parameters: int


@dataclass(frozen=True)
class Profile:
    """A model's layers measured (``profile_layers``).

    Attributes:
        layers: each layer's measurements, in order.
        whole: median time of one forward and backward of the whole chain, ms.
        device: where it ran (``cpu``, ``cuda``).
        repeats: how many measured passes each median is over.
        spreads: what the repeats spread over, ms (``compiler.spread``): each layer's F + B
            by its name, and the whole model's under ``"whole model"``.
    """

    layers: tuple[LayerProfile, ...]
    whole: float
    device: str
    repeats: int
    spreads: dict = field(default_factory=dict)

    @property
    def layer_sum(self) -> float:
        """The layers' F + B, summed: what ``whole`` is compared with."""
        return sum(layer.F + layer.B for layer in self.layers)

    def cost_data(self) -> dict[str, Any]:
        """The cost file (a JSON value ``costs.costs_from_json`` reads) with these layers as its ``layers``."""
        return {"layers": [{key: getattr(layer, key) for key in LAYER_KEYS} for layer in self.layers]}


def model_layers(spec: ModelSpec, config: Any, seed: int, name: str = "") -> list[tuple[str, nn.Module]]:
    """The spec's layers in order with their names, built as training builds them
    (``layered.build_layers``: an ``nn.Sequential``'s keys, else ``"0"``, ``"1"``, ...).

    Args:
        spec: the model spec.
        config: its config, overrides applied.
        seed: the parameters' seed.
        name: how messages name the spec (``--model``'s text).
    Raises:
        UsageError: ``model spec NAME: ...``: the spec has no ``layers``, or
            ``build_layers``' refusals (a function that fails, no layers, not modules, tied weights).
    """
    if spec.layers is None:
        raise UsageError(f"{spec_label(name)} has no layers(config, seed) function, which pipec profile measures "
                         "(see docs/costs.md, \"Profile a model\")")
    try:
        return build_layers(spec.layers, config, seed)
    except UsageError as error:
        raise UsageError(f"{spec_label(name)}: {error}") from None


def profile_layers(spec: ModelSpec, config: Any, seed: int, *, repeats: int = DEFAULT_REPEATS,
                   warmup: int = WARMUP, name: str = "", timeout: float = DEFAULT_PROFILE_TIMEOUT_S) -> Profile:
    """Measure every layer of ``spec`` and the whole chain (see the module docstring).

    Args:
        spec: the model spec (with ``layers``).
        config: its config, overrides applied.
        seed: the parameters' and the data's seed.
        repeats: measured passes, at least 1.
        warmup: unmeasured passes before them.
        name: how messages name the spec.
        timeout: the longest one call (a layer's forward or backward, the whole pass) may take, seconds;
            past it the process ends (``_Deadline``): a layer that hangs ends the profile naming it.
    Returns:
        the ``Profile``.
    Raises:
        UsageError: ``model_layers``' refusals, the data source's, or a layer whose forward,
            output or backward fails (naming the layer).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    named = model_layers(spec, config, seed, name)
    modules = [module.to(device) for _, module in named]
    inputs, targets = BatchSource(spec, config, seed, 1, device=device, name=name).batch(0)
    chain = _Chain(modules, [layer_name for layer_name, _ in named], inputs[0], targets[0], spec.loss_fn, name, device)
    chain.deadline.seconds = timeout
    forwards: list[list[float]] = [[] for _ in modules]
    backwards: list[list[float]] = [[] for _ in modules]
    wholes: list[float] = []
    for index in range(warmup + repeats):
        layer_times = chain.layer_by_layer()
        whole = chain.whole()
        if index >= warmup:
            for layer, (forward, backward) in enumerate(layer_times):
                forwards[layer].append(forward)
                backwards[layer].append(backward)
            wholes.append(whole)
    layers = tuple(
        LayerProfile(layer_name, median(forwards[i]) * _MS_PER_SECOND, median(backwards[i]) * _MS_PER_SECOND,
                     chain.activation_bytes[i], sum(_nbytes(p) for p in modules[i].parameters()))
        for i, (layer_name, _) in enumerate(named))
    spreads = {layer_name: _spread_ms([f + b for f, b in zip(forwards[i], backwards[i])])
               for i, (layer_name, _) in enumerate(named)}
    spreads["whole model"] = _spread_ms(wholes)
    return Profile(layers, median(wholes) * _MS_PER_SECOND, device.type, repeats, spreads)


def _spread_ms(seconds: list[float]) -> Spread:
    """The spread of some repeats timed in seconds, in ms."""
    return Spread.of([value * _MS_PER_SECOND for value in seconds])


class _Step(NamedTuple):
    """One layer's forward in a layer-by-layer pass: what its backward needs, and how long it took."""

    leaves: list  # its input's autograd leaves (what its backward leaves gradients on)
    output: Any
    root: Any  # what its backward starts from: the output, or the loss for the last layer
    layout: payload.Layout | None  # None: the last layer's output, when it is no payload
    seconds: float


class _Chain:
    """The layers and one microbatch, with the two timed passes."""

    def __init__(self, modules: list[nn.Module], names: list[str], inputs: Any, targets: Any,
                 loss_fn: Callable, spec_name: str, device: torch.device):
        self.modules, self.names, self.inputs, self.targets = modules, names, inputs, targets
        self.loss_fn, self.spec_name = loss_fn, spec_name
        self.synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.activation_bytes: list[int] = []
        self.deadline = _Deadline(DEFAULT_PROFILE_TIMEOUT_S, spec_label(spec_name))

    def clock(self) -> float:
        """Now, once the device has done what it was given."""
        self.synchronize()
        return time.perf_counter()

    def forward(self, index: int, value: Any) -> tuple[Any, Any]:
        """Layer ``index``'s forward on ``value``, and the last layer's loss after it (as the runtime's last
        stage computes it in its forward): (output, what a backward starts from). Failures are named."""
        what = f"layer {index} ({self.names[index]})"
        with self.deadline.watching(f"{what}'s forward"):
            output = call_spec_function(self.spec_name, f"{what}'s forward", payload.call, self.modules[index], value)
        if index < len(self.modules) - 1:
            return output, output
        with self.deadline.watching(f"loss_fn({what}'s output, targets)"):
            return output, call_spec_function(self.spec_name, f"loss_fn({what}'s output, targets)", self.loss_fn,
                                              output, self.targets)

    def layout(self, index: int, output: Any) -> payload.Layout | None:
        """The layout of layer ``index``'s output; None for the last layer's when it is no payload (it goes
        to ``loss_fn`` only: nothing a cut would send)."""
        try:
            return payload.layout_of(output, f"layer {index} ({self.names[index]})'s output")
        except UsageError as error:
            if index == len(self.modules) - 1:
                return None
            raise UsageError(f"{spec_label(self.spec_name)}: {error}") from None

    def backward(self, index: int, roots: list, grads: list | None) -> None:
        what = f"layer {index} ({self.names[index]})'s backward"
        with self.deadline.watching(what):
            call_spec_function(self.spec_name, what, torch.autograd.backward, roots, grads)

    def drop_gradients(self) -> None:
        for module in self.modules:
            for parameter in module.parameters():
                parameter.grad = None

    def layer_by_layer(self) -> list[tuple[float, float]]:
        """One pass, every layer on a detached input: (forward, backward) seconds per layer."""
        self.drop_gradients()
        steps: list[_Step] = []
        value = self.inputs
        for index in range(len(self.modules)):
            leaves: list = []
            if index:
                value, leaves = payload.input_leaves(steps[-1].layout, value)
            start = self.clock()
            output, root = self.forward(index, value)
            seconds = self.clock() - start
            steps.append(_Step(leaves, output, root, self.layout(index, output), seconds))
            value = output
        self.activation_bytes = [_nbytes(step.output) if step.layout else 0 for step in steps]
        backwards = [0.0] * len(steps)
        for index in range(len(steps) - 1, -1, -1):
            step = steps[index]
            if index == len(steps) - 1:
                roots, grads = [step.root], None
            else:
                roots, grads = payload.backward_roots(step.layout, step.output,
                                                      payload.leaf_grads(steps[index + 1].leaves))
            if roots:  # else nothing trainable made this layer's output: it has no backward
                start = self.clock()
                self.backward(index, roots, grads)
                backwards[index] = self.clock() - start
        return [(step.seconds, backward) for step, backward in zip(steps, backwards)]

    def whole(self) -> float:
        """One forward and backward of the whole chain, as one autograd graph: seconds."""
        self.drop_gradients()
        start = self.clock()
        value = self.inputs
        for index in range(len(self.modules)):
            _, value = self.forward(index, value)
        self.backward(len(self.modules) - 1, [value], None)
        return self.clock() - start


class _Deadline:
    """Ends the process when one watched call runs past ``seconds``, naming it.

    A thread, not a signal: a layer stuck in native code (a kernel, a lock) never returns to Python to
    act on one. The profile writes nothing before it ends, so ending it at once loses nothing; the
    message is what ``pipec profile`` prints for any error, and the status is 1.
    """

    def __init__(self, seconds: float, label: str):
        self.seconds, self.label = seconds, label
        self.current: tuple[str, float] | None = None
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    @contextmanager
    def watching(self, what: str):
        with self.lock:
            self.current = (what, time.monotonic() + self.seconds)
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="pipec-profile-deadline", daemon=True)
                self.thread.start()
        try:
            yield
        finally:
            with self.lock:
                self.current = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.1, self.seconds / 4))
            with self.lock:
                current = self.current
            if current is not None and time.monotonic() > current[1]:
                sys.stdout.flush()
                sys.stderr.write(f"{self.label}: {current[0]} did not return within {self.seconds:g} s "
                                 "(pipec profile --timeout): nothing was written\n")
                sys.stderr.flush()
                os._exit(1)


def _nbytes(value: Any) -> int:
    """The bytes of a payload's tensors."""
    return sum(tensor.numel() * tensor.element_size() for tensor in payload.leaves_of(value))


__all__ = ["DEFAULT_REPEATS", "LayerProfile", "Profile", "WARMUP", "model_layers", "profile_layers"]
