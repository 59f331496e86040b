"""Blockwise attention: the arithmetic ring attention, zigzag and TASP run on every rank.

Context parallelism cuts a sequence into chunks; attention then needs every
query chunk to meet every key/value chunk, one block at a time, on whichever
rank holds both at that moment. This module is the exact arithmetic of one
block and of combining blocks, so that a ring's blocks give the whole
attention's result whatever order they meet in: for blocks of whole chunks
``block_kind``, ``block_forward``, ``merge`` (a stable form) and
``block_backward`` (from the queries' *global* output and log-sum-exp); for
the pieces ``runtime/rings.py`` cuts KV into, their counterparts by global
positions (``block_segments``, ``block_forward_at``, ``merge_rows``,
``block_backward_at``). ``chunked_attention`` and ``pieced_attention``
compute a whole attention so on one process: the reference every ring
schedule is held to.

The kernels are torch's: its flash-attention entry points on the CPU
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), its
CUDA flash kernel for the inputs that kernel takes (``_cuda_flash``: no GPU
was lent to this project's checks, so this path is proven by its arguments,
not its numbers), and elsewhere (fp32 or fp64 on a GPU) the same arithmetic
with matmuls (``_math_forward``, ``_math_backward``) in the accumulating
dtype. Tensors are laid out as torch's attention takes them: (batch, heads,
length, head dim); a log-sum-exp is (batch, heads, length).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

WHOLE, DIAGONAL, SKIPPED = "whole", "diagonal", "skipped"

_forward_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_cuda_forward_kernel = torch.ops.aten._scaled_dot_product_flash_attention
_cuda_backward_kernel = torch.ops.aten._scaled_dot_product_flash_attention_backward


def block_kind(q_chunk: int, kv_chunk: int, causal: bool) -> str:
    """How a block of equal-length chunks (global positions ``q_chunk``, ``kv_chunk``) is masked.

    Under a causal mask a block is whole (kv chunk before the q chunk), diagonal (the same chunk:
    causal inside) or skipped (kv chunk after it); without a mask every block is whole.
    """
    if not causal or kv_chunk < q_chunk:
        return WHOLE
    return DIAGONAL if kv_chunk == q_chunk else SKIPPED


def accumulating_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged in: fp32, or the inputs' when wider (float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the CPU flash kernel's log-sum-exp: the inputs' for fp32 and fp64, fp32 for fp16 and bf16."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


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
    wide = accumulating_dtype(q.dtype)
    return out.to(wide), lse.to(wide)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a block's (out_b, lse_b) into the running (out, lse) of the same queries (stable form).

    With ``out`` None the block's result is the running result. The stable form is
    ``out - sigmoid(lse_b - lse) * (out - out_b)`` and ``lse - logsigmoid(lse - lse_b)``: the naive
    ``exp`` form overflows (a reported bug of the public code). It is computed in the dtype of its
    inputs, the accumulating one (fp32 at least) the block functions return.
    """
    if out is None:
        return out_b, lse_b
    weight = torch.sigmoid(lse_b - lse).unsqueeze(-1)
    return out - weight * (out - out_b), lse - F.logsigmoid(lse - lse_b)


def block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, kind: str, scale: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv), given the queries' global output and log-sum-exp.

    The global (out, lse), what the forward merged over every block, makes the blocks'
    gradients sum to the whole attention's exactly.

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
    dq, dk, dv = _backward_kernel(grad_out.to(dtype), q, k, v, out.to(dtype), lse.to(_lse_dtype(dtype)), 0.0,
                                  kind == DIAGONAL, scale=scale)
    wide = accumulating_dtype(dtype)
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

    For any placement of chunks: the reference every ring schedule is held to, and a check of the
    arithmetic itself against ``torch.nn.functional.scaled_dot_product_attention``.

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


# ------------------------------------------------------------- by positions
#
# A block placed by the global positions of its first query and first key:
# what the ring runtime runs when a chunk's keys are cut into pieces.


class Segment(NamedTuple):
    """One rectangle of a block's visible part, in the block's local rows and keys.

    Attributes:
        rows: query rows [start, end) of the block.
        keys: key rows [start, end) of the block.
        causal: a square whose row i sees keys 0..i (``is_causal=True``, top-left); else every key.
    """

    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool


def block_segments(q_start: int, q_len: int, k_start: int, k_len: int, causal: bool) -> tuple[Segment, ...]:
    """The rectangles a block's visible part splits into, by global positions.

    Queries are positions [q_start, q_start + q_len), keys [k_start, k_start + k_len);
    under ``causal`` key j is visible to query i iff j <= i. The rows split into
    those that see nothing (left out), the rows on the keys' diagonal (a
    causal square; when the queries start inside the keys, the keys before
    them are a whole rectangle over the same rows) and the rows after every
    key (whole). Segments over the same rows come next to each other.

    Returns:
        the segments, rows ascending; empty when no query sees any key.
    """
    if q_len <= 0 or k_len <= 0:
        return ()
    if not causal:
        return (Segment((0, q_len), (0, k_len), False),)
    q_end, k_end = q_start + q_len, k_start + k_len
    first = max(q_start, k_start)  # the first query that sees a key
    if first >= q_end:
        return ()
    square_end = max(first, min(q_end, k_end))
    out = []
    if square_end > first:
        rows = (first - q_start, square_end - q_start)
        if first > k_start:  # keys before the first query: seen whole by the diagonal's rows
            out.append(Segment(rows, (0, first - k_start), False))
        out.append(Segment(rows, (first - k_start, square_end - k_start), True))
    if q_end > square_end:
        out.append(Segment((square_end - q_start, q_len), (0, k_len), False))
    return tuple(out)


class BlockOutput(NamedTuple):
    """A block's forward over the query rows that see some key.

    Attributes:
        first: the first such row; every row from it to the block's last sees some key.
        out: (B, H, rows, D) in the accumulating dtype.
        lse: (B, H, rows) likewise.
    """

    first: int
    out: torch.Tensor
    lse: torch.Tensor


def _on_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _cuda_flash(q: torch.Tensor) -> bool:
    """Whether torch's CUDA flash kernel takes these inputs: half precision on a CUDA device, a head dim
    that is a multiple of 8 up to 256."""
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def _flash_cuda_forward(q, k, v, causal: bool, scale: float | None):
    """(out, lse) of torch's CUDA flash kernel, in the accumulating dtype (its lse is fp32 already)."""
    out, lse = _cuda_forward_kernel(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out.float(), lse.float()


def _flash_cuda_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float | None):
    """The CUDA flash kernel's backward from the global (out, lse): dense inputs (no cumulative
    sequence lengths), no dropout (so no random state)."""
    dtype, empty = q.dtype, q.new_empty(0, dtype=torch.int64)
    dq, dk, dv = _cuda_backward_kernel(
        grad_out.to(dtype), q, k, v, out.to(dtype), lse.float().contiguous(), empty, empty, q.shape[-2], k.shape[-2],
        0.0, causal, empty, empty, scale=scale)
    return dq.float(), dk.float(), dv.float()


def _segment_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    if _cuda_flash(q):
        return _flash_cuda_forward(q, k, v, causal, scale)
    if not _on_cpu(q):
        return _math_forward(q, k, v, causal, scale)
    out, lse = _forward_kernel(q, k, v, 0.0, causal, scale=scale)
    wide = accumulating_dtype(q.dtype)
    return out.to(wide), lse.to(wide)


def _segment_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float | None):
    if _cuda_flash(q):
        return _flash_cuda_backward(grad_out, q, k, v, out, lse, causal, scale)
    if not _on_cpu(q):
        return _math_backward(grad_out, q, k, v, out, lse, causal, scale)
    dtype = q.dtype
    dq, dk, dv = _backward_kernel(grad_out.to(dtype), q, k, v, out.to(dtype), lse.to(_lse_dtype(dtype)), 0.0,
                                  causal, scale=scale)
    wide = accumulating_dtype(dtype)
    return dq.to(wide), dk.to(wide), dv.to(wide)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None) -> torch.Tensor:
    """Scaled scores q k^T in the accumulating dtype, -inf above the top-left diagonal under ``causal``."""
    wide = accumulating_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.to(wide) @ k.to(wide).transpose(-2, -1)) * scale
    if causal:
        rows, keys = scores.shape[-2:]
        hidden = torch.ones(rows, keys, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _math_forward(q, k, v, causal: bool, scale: float | None):
    """The flash kernel's (out, lse) by matmuls, in the accumulating dtype (any device)."""
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(scores.dtype)
    return out, lse


def _math_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float | None):
    """The flash kernel's backward by matmuls, from the global (out, lse), in the accumulating dtype."""
    scores = _scores(q, k, causal, scale)
    wide = scores.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    grad_out, out = grad_out.to(wide), out.to(wide)
    probs = torch.exp(scores - lse.to(wide).unsqueeze(-1))
    dv = probs.transpose(-2, -1) @ grad_out
    dprobs = grad_out @ v.to(wide).transpose(-2, -1)
    dscores = probs * (dprobs - (grad_out * out).sum(-1, keepdim=True))
    return (dscores @ k.to(wide)) * scale, (dscores.transpose(-2, -1) @ q.to(wide)) * scale, dv


def block_forward_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int, causal: bool,
                     scale: float | None = None) -> BlockOutput | None:
    """One block's attention by global positions: its (out, lse) over the rows that see some key.

    Args:
        q: (B, H, Lq, D) queries at positions [q_start, q_start + Lq).
        k, v: (B, H, Lk, D) keys and values at positions [k_start, k_start + Lk).
        causal: the causal mask (key j visible to query i iff j <= i), else full attention.
        scale: the softmax scale; 1/sqrt(D) when None.
    Returns:
        a ``BlockOutput`` (accumulating dtype), or None when no query sees any key.
    """
    segments = block_segments(q_start, q.shape[-2], k_start, k.shape[-2], causal)
    if not segments:
        return None
    outs, lses, rows, out, lse = [], [], None, None, None
    for segment in segments:
        if segment.rows != rows and out is not None:
            outs.append(out)
            lses.append(lse)
            out = lse = None
        rows = segment.rows
        (r0, r1), (c0, c1) = segment.rows, segment.keys
        out, lse = merge(out, lse, *_segment_forward(q[..., r0:r1, :], k[..., c0:c1, :], v[..., c0:c1, :],
                                                     segment.causal, scale))
    outs.append(out)
    lses.append(lse)
    first = segments[0].rows[0]
    if len(outs) == 1:
        return BlockOutput(first, outs[0], lses[0])
    return BlockOutput(first, torch.cat(outs, dim=-2), torch.cat(lses, dim=-1))


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A query chunk's running (out, lse) before any block: out 0 and lse -inf, in the accumulating dtype."""
    wide = accumulating_dtype(q.dtype)
    return (torch.zeros(q.shape, dtype=wide, device=q.device),
            torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device))


def merge_rows(out: torch.Tensor, lse: torch.Tensor, block: BlockOutput) -> None:
    """Fold a block's rows into a running (out, lse) in place (the stable form of ``merge``).

    Rows the running result has not met yet (lse -inf) take the block's as
    they are, so no -inf - -inf (NaN) arises; rows before ``block.first`` are untouched.
    """
    rows_out, rows_lse = out[..., block.first:, :], lse[..., block.first:]
    fresh = torch.isneginf(rows_lse)
    weight = torch.sigmoid(block.lse - rows_lse).unsqueeze(-1)  # 1 where the running rows are fresh
    merged_lse = torch.where(fresh, block.lse, rows_lse - F.logsigmoid(rows_lse - block.lse))
    rows_out.sub_(weight * (rows_out - block.out))
    rows_lse.copy_(merged_lse)


def block_backward_at(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, q_start: int, k_start: int, causal: bool, scale: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv) by global positions, from the queries' global output and log-sum-exp.

    Args:
        grad_out, q: (B, H, Lq, D) at positions [q_start, q_start + Lq).
        k, v: (B, H, Lk, D) at positions [k_start, k_start + Lk).
        out, lse: the global (every block merged) output and log-sum-exp of these queries.
        causal: the causal mask, else full attention.
    Returns:
        dq (Lq rows), dk and dv (Lk rows) in the accumulating dtype; zero where the mask hides everything.
    """
    wide = accumulating_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    dk = torch.zeros(k.shape, dtype=wide, device=k.device)
    dv = torch.zeros(v.shape, dtype=wide, device=v.device)
    for segment in block_segments(q_start, q.shape[-2], k_start, k.shape[-2], causal):
        (r0, r1), (c0, c1) = segment.rows, segment.keys
        bq, bk, bv = _segment_backward(grad_out[..., r0:r1, :], q[..., r0:r1, :], k[..., c0:c1, :], v[..., c0:c1, :],
                                       out[..., r0:r1, :], lse[..., r0:r1], segment.causal, scale)
        dq[..., r0:r1, :] += bq
        dk[..., c0:c1, :] += bk
        dv[..., c0:c1, :] += bv
    return dq, dk, dv


def pieced_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                     query_cuts: Sequence[int], key_cuts: Sequence[int], causal: bool,
                     order: Sequence[int] | None = None) -> ChunkedResult:
    """Attention of the whole sequence, block by block by global positions, forward and backward.

    Args:
        q, k, v, grad_out: (B, H, L, D).
        query_cuts: where the query blocks start and end, ascending from 0 to L
            (``[0, 8, 16]``: two query blocks of 8).
        key_cuts: likewise for the key/value blocks (a ring's pieces:
            ``chunk_cuts(L, chunks, pieces)``); they need not line up with the queries'.
        causal: the causal mask, else full attention.
        order: the order the key blocks are met in (the result must not depend on it).
    Returns:
        out, dq, dk, dv over the whole sequence, in the accumulating dtype.
    """
    spans = list(zip(query_cuts[:-1], query_cuts[1:]))
    keys = list(zip(key_cuts[:-1], key_cuts[1:]))
    order = range(len(keys)) if order is None else order
    results = []
    for q0, q1 in spans:
        out, lse = empty_result(q[..., q0:q1, :])
        for j in order:
            k0, k1 = keys[j]
            block = block_forward_at(q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :], q0, k0, causal)
            if block is not None:
                merge_rows(out, lse, block)
        results.append((out, lse))
    wide = accumulating_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=wide) for t in (q, k, v))
    for (q0, q1), (out, lse) in zip(spans, results):
        for j in order:
            k0, k1 = keys[j]
            bq, bk, bv = block_backward_at(grad_out[..., q0:q1, :], q[..., q0:q1, :], k[..., k0:k1, :],
                                           v[..., k0:k1, :], out, lse, q0, k0, causal)
            dq[..., q0:q1, :] += bq
            dk[..., k0:k1, :] += bk
            dv[..., k0:k1, :] += bv
    return ChunkedResult(torch.cat([out for out, _ in results], dim=-2), dq, dk, dv)


def chunk_cuts(length: int, chunks: int, pieces: int = 1) -> list[int]:
    """The cuts of a sequence of ``length`` into ``chunks`` equal chunks of ``pieces`` equal pieces each."""
    if length % (chunks * pieces):
        raise ValueError(f"a sequence of {length} cannot be cut into {chunks} chunks of {pieces} equal pieces")
    size = length // (chunks * pieces)
    return [i * size for i in range(chunks * pieces + 1)]


__all__ = ["DIAGONAL", "SKIPPED", "WHOLE", "BlockOutput", "ChunkedResult", "Segment", "accumulating_dtype", "block_backward",
           "block_backward_at", "block_forward", "block_forward_at", "block_kind", "block_segments", "chunk_cuts",
           "chunked_attention", "empty_result", "merge", "merge_rows", "pieced_attention", "zigzag_chunks"]
