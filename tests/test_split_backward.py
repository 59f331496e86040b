"""Split backward (runtime.split_backward): I then W gives B's gradients, and W does not walk the input path again."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipec.runtime.model import ModelConfig, activation_shape, build_chunk
from pipec.runtime.split_backward import input_grad, weight_grad


class CountingIdentity(torch.autograd.Function):
    """The identity, counting how often its backward runs."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CountingIdentity.calls += 1
        return grad


class TwoLayers(nn.Module):
    """Two linear layers, a counted identity between: each weight branches off the input path once."""

    def __init__(self, width: int = 6, shared: bool = False):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = self.first if shared else nn.Linear(width, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        y = torch.tanh(self.first(x))
        y = CountingIdentity.apply(y)
        return self.second(y) * self.scale


def full_backward(module, x, output_grad, loss=None):
    """B: (input gradient, parameter gradients)."""
    module.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    out = module(leaf) if loss is None else loss(module(leaf))
    torch.autograd.backward(out, output_grad)
    return leaf.grad, [p.grad.clone() for p in module.parameters()]


def split(module, x, output_grad, loss=None, leaf_grad=True):
    """I then W: (input gradient, parameter gradients)."""
    module.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(leaf_grad)
    out = module(leaf) if loss is None else loss(module(leaf))
    params = list(module.parameters())
    grad, pending = input_grad(out, output_grad, leaf if leaf_grad else None, params)
    assert all(p.grad is None for p in params)  # I leaves the weights alone
    weight_grad(pending)
    return grad, [p.grad.clone() for p in params]


def assert_same(got, want):
    (got_input, got_params), (want_input, want_params) = got, want
    if want_input is not None:
        assert torch.allclose(got_input, want_input, atol=1e-6, rtol=0)
    assert len(got_params) == len(want_params)
    for got_param, want_param in zip(got_params, want_params):
        assert torch.allclose(got_param, want_param, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk", [1, 2])
def test_a_decoder_chunk_split_gives_the_full_backward_gradients(chunk):
    config = dataclasses.replace(ModelConfig(), layers=6)
    module = build_chunk(config, chunk, 3, seed=1)  # a middle chunk, and the last one (its output is logits)
    torch.manual_seed(2)
    x = torch.randn(activation_shape(config))
    out_shape = module(x).shape
    g = torch.randn(out_shape)
    assert_same(split(module, x, g), full_backward(module, x, g))


def test_a_last_stage_splits_from_its_scalar_loss():
    module = TwoLayers(shared=True)
    loss = lambda out: (out ** 2).mean()
    x = torch.randn(3, 6)
    assert_same(split(module, x, None, loss=loss), full_backward(module, x, None, loss=loss))


def test_w_does_not_walk_the_input_path_again():
    module = TwoLayers()
    torch.manual_seed(3)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    want = full_backward(module, x, g)
    CountingIdentity.calls = 0
    assert_same(split(module, x, g), want)
    # I ran the backward of the identity between the layers once; W, which needs only the gradients
    # recorded where the weights branch off, did not run it again (a second backward from the output would)
    assert CountingIdentity.calls == 1


def test_a_weight_used_twice_along_the_input_path_is_counted_once_per_use():
    module = TwoLayers(shared=True)  # its branch nodes lie one above the other
    torch.manual_seed(4)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    assert_same(split(module, x, g), full_backward(module, x, g))


def test_a_first_stage_has_no_input_gradient_and_w_does_the_whole_backward():
    module = TwoLayers(shared=True)
    x, g = torch.randn(2, 6), torch.randn(2, 6)
    grad, params = split(module, x, g, leaf_grad=False)
    assert grad is None
    _, want = full_backward(module, x, g)
    assert_same((None, params), (None, want))


def test_weight_grads_accumulate_over_microbatches_like_backward():
    module = TwoLayers(shared=True)
    xs, gs = torch.randn(3, 2, 6), torch.randn(3, 2, 6)
    params = list(module.parameters())
    module.zero_grad(set_to_none=True)
    for x, g in zip(xs, gs):
        torch.autograd.backward(module(x.clone().requires_grad_()), g)
    want = [p.grad.clone() for p in params]
    module.zero_grad(set_to_none=True)
    pendings = []
    for x, g in zip(xs, gs):  # every I first, then every W, as a zero-bubble schedule may order them
        leaf = x.clone().requires_grad_()
        pendings.append(input_grad(module(leaf), g, leaf, params)[1])
    for pending in pendings:
        weight_grad(pending)
    for param, expected in zip(params, want):
        assert torch.allclose(param.grad, expected, atol=1e-6, rtol=0)
