"""Blockwise attention (runtime/attention.py) against torch's whole attention, forward and backward.

In float64 a sequence cut into any number of chunks, its blocks met in any
order and merged in the stable form, reproduces
``torch.nn.functional.scaled_dot_product_attention`` and its gradients to
1e-12; in float32 to 5e-6 of the largest magnitude. This is the arithmetic
every ring schedule (ring, zigzag, TASP) runs on its ranks.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipec.runtime.attention import (
    DIAGONAL, SKIPPED, WHOLE, block_forward, block_kind, chunked_attention, merge, zigzag_chunks,
)


def _inputs(dtype, length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 3, length, 8)
    q, k, v, grad = (torch.randn(shape, generator=generator, dtype=dtype) for _ in range(4))
    return q, k, v, grad


def _reference(q, k, v, grad, causal):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(grad)
    return out.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 6])
def test_blocks_reproduce_whole_attention_in_float64(chunks, causal):
    q, k, v, grad = _inputs(torch.float64)
    got = chunked_attention(q, k, v, grad, chunks, causal)
    for name, mine, want in zip(("out", "dq", "dk", "dv"), got, _reference(q, k, v, grad, causal)):
        assert (mine - want).abs().max().item() <= 1e-12, name


@pytest.mark.parametrize("causal", [True, False])
def test_the_order_blocks_are_met_in_does_not_matter(causal):
    """A ring meets the key/value chunks in a rotated order on every rank; the merge is order-free."""
    q, k, v, grad = _inputs(torch.float64)
    forward = chunked_attention(q, k, v, grad, 4, causal)
    rotated = chunked_attention(q, k, v, grad, 4, causal, order=[2, 3, 0, 1])
    for mine, want in zip(rotated, forward):
        assert (mine - want).abs().max().item() <= 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_float32_stays_within_five_millionths_of_the_largest_magnitude(causal):
    q, k, v, grad = _inputs(torch.float32, length=64)
    got = chunked_attention(q, k, v, grad, 8, causal)
    for name, mine, want in zip(("out", "dq", "dk", "dv"), got, _reference(*(t.double() for t in (q, k, v, grad)),
                                                                          causal)):
        assert (mine.double() - want).abs().max().item() <= 5e-6 * want.abs().max().item(), name


def test_the_stable_merge_does_not_overflow_where_the_exp_form_does():
    """Two blocks whose log-sum-exps are 1000 apart: exp() overflows, the sigmoid form does not."""
    out_a, out_b = torch.ones(1, 1, 2, 4), torch.full((1, 1, 2, 4), 3.0)
    lse_a, lse_b = torch.full((1, 1, 2), 1000.0), torch.full((1, 1, 2), 1000.0 + 1e-3)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.allclose(out, torch.full_like(out, 2.0), atol=1e-3)  # nearly equal weights
    naive = torch.exp(lse_a) + torch.exp(lse_b)
    assert not torch.isfinite(naive).all()


def test_block_kinds_under_a_causal_mask():
    assert [block_kind(2, j, True) for j in range(4)] == [WHOLE, WHOLE, DIAGONAL, SKIPPED]
    assert {block_kind(2, j, False) for j in range(4)} == {WHOLE}
    with pytest.raises(ValueError, match="skipped"):
        block_forward(*_inputs(torch.float32)[:3], SKIPPED)


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_zigzag_gives_every_rank_the_same_causal_work(ranks):
    """Rank r holds chunks r and 2P-1-r: counted in half-blocks (a diagonal block 1, a whole one 2), every
    rank's queries do the same causal work; a contiguous cut into P chunks gives rank r 2r + 1."""
    chunks = 2 * ranks

    def work(owned):
        return sum(2 if block_kind(i, j, True) == WHOLE else 1 if block_kind(i, j, True) == DIAGONAL else 0
                   for i in owned for j in range(chunks))

    zigzag = [work(pair) for pair in zigzag_chunks(ranks)]
    assert len(set(zigzag)) == 1
    contiguous = [sum(2 if block_kind(r, j, True) == WHOLE else 1 if block_kind(r, j, True) == DIAGONAL else 0
                      for j in range(ranks)) for r in range(ranks)]
    assert contiguous == [2 * r + 1 for r in range(ranks)]
