"""Blockwise attention (runtime/attention.py) against torch's whole attention, forward and backward.

In float64 a sequence cut into any number of chunks, its blocks met in any
order and merged in the stable form, reproduces
``torch.nn.functional.scaled_dot_product_attention`` and its gradients to
1e-12; in float32 to 5e-6 of the largest magnitude. This is the arithmetic
every ring schedule (ring, zigzag, TASP) runs on its ranks.

The position-based helpers (a block placed by the global positions of its
first query and first key, split into skipped rows, a causal square and whole
rows) do the same with every chunk's keys cut into 1, 2 or 3 pieces (TASP),
and with query and key cuts that do not line up at all; rows that see no key
leave the running result as it was, without NaN.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipec.runtime.attention import (
    DIAGONAL, SKIPPED, WHOLE, Segment, _math_backward, _math_forward, _segment_backward, _segment_forward,
    block_backward_at, block_forward, block_forward_at, block_kind, block_segments, chunk_cuts, chunked_attention,
    empty_result, merge, merge_rows, pieced_attention, zigzag_chunks,
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


# ---------------------------------------------------------------- by positions


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunks, pieces", [(1, 1), (2, 1), (2, 2), (3, 2), (2, 3), (4, 3)])
def test_pieces_by_position_reproduce_whole_attention_in_float64(chunks, pieces, causal):
    """Query chunks against key pieces, each block split by global positions: SDPA to 1e-12."""
    q, k, v, grad = _inputs(torch.float64)
    length = q.shape[-2]
    got = pieced_attention(q, k, v, grad, chunk_cuts(length, chunks), chunk_cuts(length, chunks, pieces), causal)
    for name, mine, want in zip(("out", "dq", "dk", "dv"), got, _reference(q, k, v, grad, causal)):
        assert (mine - want).abs().max().item() <= 1e-12, name


@pytest.mark.parametrize("causal", [True, False])
def test_cuts_that_do_not_line_up_and_any_order_still_reproduce_whole_attention(causal):
    """Query blocks [0, 5) [5, 11) [11, 24) against key blocks [0, 3) [3, 9) [9, 14) [14, 24), met backwards:
    some queries start inside a key block (a whole part before the diagonal), some rows see nothing."""
    q, k, v, grad = _inputs(torch.float64)
    got = pieced_attention(q, k, v, grad, [0, 5, 11, 24], [0, 3, 9, 14, 24], causal, order=[3, 2, 1, 0])
    for name, mine, want in zip(("out", "dq", "dk", "dv"), got, _reference(q, k, v, grad, causal)):
        assert (mine - want).abs().max().item() <= 1e-12, name


def test_float32_pieces_stay_within_five_millionths_of_the_largest_magnitude():
    q, k, v, grad = _inputs(torch.float32, length=48)
    got = pieced_attention(q, k, v, grad, chunk_cuts(48, 4), chunk_cuts(48, 4, 3), True)
    for name, mine, want in zip(("out", "dq", "dk", "dv"), got,
                                _reference(*(t.double() for t in (q, k, v, grad)), True)):
        assert (mine.double() - want).abs().max().item() <= 5e-6 * want.abs().max().item(), name


def test_a_block_splits_into_skipped_rows_a_causal_square_and_whole_rows():
    # queries 8..15 against the piece 10..11: rows 8, 9 see nothing, 10..11 the square, 12..15 the whole piece
    assert block_segments(8, 8, 10, 2, True) == (Segment((2, 4), (0, 2), True), Segment((4, 8), (0, 2), False))
    assert block_segments(8, 8, 8, 2, True) == (Segment((0, 2), (0, 2), True), Segment((2, 8), (0, 2), False))
    assert block_segments(8, 8, 14, 2, True) == (Segment((6, 8), (0, 2), True),)
    assert block_segments(8, 8, 0, 4, True) == (Segment((0, 8), (0, 4), False),)      # every key before
    assert block_segments(8, 8, 16, 4, True) == ()                                       # every key after
    assert block_segments(8, 8, 16, 4, False) == (Segment((0, 8), (0, 4), False),)
    # queries starting inside the keys: the keys before them whole, then the square
    assert block_segments(5, 6, 3, 6, True) == (Segment((0, 4), (0, 2), False), Segment((0, 4), (2, 6), True),
                                                Segment((4, 6), (0, 6), False))


def test_rows_that_see_nothing_leave_the_running_result_finite():
    q, k, v, _ = _inputs(torch.float64)
    queries = q[..., 8:16, :]
    assert block_forward_at(queries, k[..., 16:20, :], v[..., 16:20, :], 8, 16, True) is None
    block = block_forward_at(queries, k[..., 12:14, :], v[..., 12:14, :], 8, 12, True)
    assert block.first == 4 and block.out.shape[-2] == 4
    out, lse = empty_result(queries)
    merge_rows(out, lse, block)
    assert torch.equal(out[..., :4, :], torch.zeros_like(out[..., :4, :])) and torch.isneginf(lse[..., :4]).all()
    earlier = block_forward_at(queries, k[..., :8, :], v[..., :8, :], 8, 0, True)
    merge_rows(out, lse, earlier)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    dq, dk, dv = block_backward_at(torch.ones_like(queries), queries, k[..., 16:20, :], v[..., 16:20, :], out, lse,
                                   8, 16, True)
    assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("causal", [True, False])
def test_the_matmul_path_for_other_devices_matches_the_cpu_kernel(causal):
    """Off the CPU (a ring under NCCL) a segment is computed by matmuls; on the CPU they agree to 1e-13."""
    q, k, v, grad = (t[..., :8, :] for t in _inputs(torch.float64))
    want = _segment_forward(q, k, v, causal, None)
    got = _math_forward(q, k, v, causal, None)
    for mine, theirs in zip(got, want):
        assert (mine - theirs).abs().max().item() <= 1e-13
    for mine, theirs in zip(_math_backward(grad, q, k, v, *want, causal, None),
                            _segment_backward(grad, q, k, v, *want, causal, None)):
        assert (mine - theirs).abs().max().item() <= 1e-13


# -------------------------------------------------- the CUDA flash kernel's plumbing

def test_the_cuda_flash_path_hands_its_kernel_what_it_takes(monkeypatch):
    """No GPU here: the CUDA kernels are stood in for by the CPU ones, behind a check of every argument the
    CUDA entry points take (dense inputs, no dropout, the global output and an fp32 log-sum-exp), so that
    the plumbing of the CUDA path (``_cuda_flash``) runs, and must give the CPU path's result."""
    from pipec.runtime import attention

    calls = {"forward": 0, "backward": 0}

    def forward(q, k, v, dropout, causal, debug_mask, *, scale=None):
        assert dropout == 0.0 and debug_mask is False and q.dtype == torch.bfloat16
        calls["forward"] += 1
        out, lse = attention._forward_kernel(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float(), None, None, q.shape[-2], k.shape[-2], None, None, None

    def backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, seed, offset, *, scale=None):
        assert cum_q.numel() == cum_k.numel() == seed.numel() == offset.numel() == 0
        assert (max_q, max_k) == (q.shape[-2], k.shape[-2]) and dropout == 0.0
        assert lse.dtype == torch.float32 and out.dtype == grad.dtype == q.dtype == torch.bfloat16
        calls["backward"] += 1
        return attention._backward_kernel(grad, q, k, v, out, lse, 0.0, causal, scale=scale)

    generator = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(1, 2, 24, 8, generator=generator).to(torch.bfloat16) for _ in range(4))
    cuts = chunk_cuts(24, 3, 2)
    want = pieced_attention(q, k, v, grad, chunk_cuts(24, 3), cuts, True)
    monkeypatch.setattr(attention, "_cuda_flash", lambda tensor: True)
    monkeypatch.setattr(attention, "_cuda_forward_kernel", forward)
    monkeypatch.setattr(attention, "_cuda_backward_kernel", backward)
    got = pieced_attention(q, k, v, grad, chunk_cuts(24, 3), cuts, True)
    assert calls["forward"] and calls["backward"]
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
