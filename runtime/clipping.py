"""Clipping by the global gradient norm (``--clip-grad-norm X``), across ranks.

One process clips with ``torch.nn.utils.clip_grad_norm_``: the norm of every
parameter's gradient taken together, ``total``; every gradient is multiplied
by ``min(1, X / (total + 1e-6))``. A pipelined rank holds only some of the
gradients, so after the step's gradients are complete (replica all-reduces
waited; under weight passing, every contribution folded into its owner's
master) each rank sums the squares of the gradients it *counts*, one
all-reduce adds those sums over every rank, and every rank scales all of its
gradients by the same factor, computed from the same total:

* a replicated chunk (BitPipe, Chimera: the same chunk on two ranks, whose
  gradients the all-reduce made equal) is counted by the lowest rank that
  holds it only, and replicas on one rank share one module;
* under weight passing a layer's gradient lives on its owner only, and under
  ``all_gather`` the shards are disjoint (their padding is zero).

The sums are taken in float64, so the order in which ranks add them does not
show in the factor beyond fp32 rounding.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipec.runtime import comm
from pipec.runtime.family import runtime_family

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
EPSILON = 1e-6


def counted_gradients(context) -> list[torch.Tensor]:
    """The flat gradient buffers this rank counts in the global norm (see the module docstring), as the
    program's family says (``RuntimeFamily.counted_gradients``)."""
    return runtime_family(context.program).counted_gradients(context)


def all_gradients(context) -> list[torch.Tensor]:
    """Every flat gradient buffer of this rank (every one is scaled)."""
    return runtime_family(context.program).all_gradients(context)


def clip_gradients(context, max_norm: float, site: comm.Site) -> float:
    """Clip this rank's gradients by the global norm over every rank; collective.

    Args:
        context: the rank's ``RankContext``, its step's gradients complete.
        max_norm: the largest global norm allowed.
        site: where the all-reduce waits, for its fault message (within ``context.timeout``).
    Returns:
        the global norm before clipping (the same on every rank).
    Raises:
        RuntimeFault: the all-reduce did not complete within the timeout.
    """
    square = torch.zeros((), dtype=torch.float64, device=context.device)
    for flat in counted_gradients(context):
        square += flat.detach().pow(2).sum(dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.settle([dist.all_reduce(square, op=dist.ReduceOp.SUM, async_op=True)], context.timeout, site)
    total = square.sqrt()
    factor = (max_norm / (total + EPSILON)).clamp(max=1.0)
    for flat in all_gradients(context):
        flat.mul_(factor.to(flat.dtype))
    return total.item()


__all__ = ["EPSILON", "all_gradients", "clip_gradients", "counted_gradients"]
