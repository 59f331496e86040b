"""Blockwise attention: the arithmetic ring attention, zigzag and TASP run on every rank.

Context parallelism cuts a sequence into chunks; attention then needs every
query chunk to meet every key/value chunk, one block (q chunk, kv chunk) at a
time, on whichever rank holds both at that moment. This module is the exact
arithmetic of one block and of combining blocks, with the kernels torch
already has (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward on CPU; the same entry points the CUDA flash kernel offers):

* ``block_kind``: under a causal mask, a block of equal chunks is whole
  (kv chunk before the q chunk), diagonal (the same chunk: causal inside) or
  skipped (kv chunk after it); without a mask every block is whole.
* ``block_forward``: a block's output and the log-sum-exp of its rows.
* ``merge``: two partial results of the same queries into one, in the stable
  form ``out - sigmoid(lse_b - lse) * (out - out_b)`` and
  ``lse - logsigmoid(lse - lse_b)`` (the naive ``exp`` form overflows: a
  reported bug of the public code), computed in fp32 at least.
* ``block_backward``: a block's dQ, dK, dV from the *global* output and
  log-sum-exp of its queries (what the forward merged over every block), so
  that the blocks' gradients sum to the whole attention's exactly.
* ``chunked_attention``: a whole attention computed block by block on one
  process, forward and backward, for any placement of chunks: the reference
  every ring schedule is held to, and a check of the arithmetic itself against
  ``torch.nn.functional.scaled_dot_product_attention``.

Tensors are laid out as torch's attention takes them: (batch, heads, length,
head dim); a log-sum-exp is (batch, heads, length).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

WHOLE, DIAGONAL, SKIPPED = "whole", "diagonal", "skipped"

_forward_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def block_kind(q_chunk: int, kv_chunk: int, causal: bool) -> str:
    """How a block of equal-length chunks (global positions ``q_chunk``, ``kv_chunk``) is masked."""
    if not causal or kv_chunk < q_chunk:
        return WHOLE
    return DIAGONAL if kv_chunk == q_chunk else SKIPPED


def _accumulating(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged in: fp32, or the inputs' when wider (float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and its rows' log-sum-exp.

    Args:
        q: (B, H, Lq, D) queries; k, v: (B, H, Lk, D) one key/value chunk.
        kind: ``WHOLE`` or ``DIAGONAL`` (``SKIPPED`` blocks are never computed).
        scale: the softmax scale; 1/sqrt(D) when None.
    Returns:
        (out, lse): out in the accumulating dtype (fp32 or float64), lse (B, H, Lq) likewise.
    """
    if kind == SKIPPED:
        raise ValueError("a skipped block is masked out entirely; it has no output")
    out, lse = _forward_kernel(q, k, v, 0.0, kind == DIAGONAL, scale=scale)
    wide = _accumulating(q.dtype)
    return out.to(wide), lse.to(wide)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a block's (out_b, lse_b) into the running (out, lse) of the same queries (stable form).

    With ``out`` None the block's result is the running result.
    """
    if out is None:
        return out_b, lse_b
    weight = torch.sigmoid(lse_b - lse).unsqueeze(-1)
    return out - weight * (out - out_b), lse - F.logsigmoid(lse - lse_b)


def block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, kind: str, scale: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv), given the queries' global output and log-sum-exp.

    Args:
        grad_out: (B, H, Lq, D) the gradient of the queries' global output.
        q, k, v: the block's queries and key/value chunk, as in the forward.
        out, lse: the global (merged over every block) output and log-sum-exp of these queries.
        kind: ``WHOLE`` or ``DIAGONAL``.
    Returns:
        the block's contributions, in the accumulating dtype: dq to add over the
        query's blocks, dk and dv over the key/value chunk's blocks.
    """
    if kind == SKIPPED:
        raise ValueError("a skipped block contributes no gradient")
    dtype = q.dtype
    dq, dk, dv = _backward_kernel(grad_out.to(dtype), q, k, v, out.to(dtype), lse.to(dtype), 0.0,
                                  kind == DIAGONAL, scale=scale)
    wide = _accumulating(dtype)
    return dq.to(wide), dk.to(wide), dv.to(wide)


class ChunkedResult(NamedTuple):
    """A whole attention computed block by block: the output and the gradients of q, k, v, whole-sequence."""

    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, chunks: int,
                      causal: bool, order: Sequence[int] | None = None) -> ChunkedResult:
    """Attention of the whole sequence computed in ``chunks`` equal chunks, block by block, forward and backward.

    Args:
        q, k, v: (B, H, L, D), L a multiple of ``chunks``.
        grad_out: (B, H, L, D) the gradient of the output.
        chunks: how many chunks the sequence is cut into.
        causal: the causal mask (else full attention).
        order: the order the key/value chunks are met in for every query chunk
            (a ring's order; the result must not depend on it); 0..chunks-1 when None.
    Returns:
        out, dq, dk, dv over the whole sequence, in the accumulating dtype.
    """
    length = q.shape[-2]
    if length % chunks:
        raise ValueError(f"a sequence of {length} cannot be cut into {chunks} equal chunks")
    size = length // chunks
    cut = [slice(c * size, (c + 1) * size) for c in range(chunks)]
    order = list(range(chunks)) if order is None else list(order)
    outs, lses = [], []
    for i in range(chunks):
        out = lse = None
        for j in order:
            kind = block_kind(i, j, causal)
            if kind != SKIPPED:
                out, lse = merge(out, lse, *block_forward(q[..., cut[i], :], k[..., cut[j], :], v[..., cut[j], :], kind))
        outs.append(out)
        lses.append(lse)
    wide = outs[0].dtype
    dq = torch.zeros(q.shape, dtype=wide)
    dk = torch.zeros(k.shape, dtype=wide)
    dv = torch.zeros(v.shape, dtype=wide)
    for i in range(chunks):
        for j in order:
            kind = block_kind(i, j, causal)
            if kind == SKIPPED:
                continue
            bq, bk, bv = block_backward(grad_out[..., cut[i], :], q[..., cut[i], :], k[..., cut[j], :],
                                        v[..., cut[j], :], outs[i], lses[i], kind)
            dq[..., cut[i], :] += bq
            dk[..., cut[j], :] += bk
            dv[..., cut[j], :] += bv
    return ChunkedResult(torch.cat(outs, dim=-2), dq, dk, dv)


def zigzag_chunks(ranks: int) -> list[tuple[int, int]]:
    """Zigzag placement: rank r holds chunks r and 2P-1-r of 2P, so causal work is equal on every rank."""
    return [(r, 2 * ranks - 1 - r) for r in range(ranks)]


__all__ = ["DIAGONAL", "SKIPPED", "WHOLE", "ChunkedResult", "block_backward", "block_forward", "block_kind",
           "chunked_attention", "merge", "zigzag_chunks"]
