"""One flat buffer behind many parameters' gradients.

Both families keep a module's (or a shard's) gradients as views into one
flat tensor: the replica all-reduce and the weight-passing gradient folds are
then one call on one tensor, and zeroing a step's gradients is one fill.
"""
from __future__ import annotations

from typing import Sequence

import torch


def bind_flat_grads(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Make every parameter's ``.grad`` a view into one zeroed buffer (their dtype and device); return it.

    Autograd accumulates into an existing ``.grad`` in place, so the views stay
    bound for the whole run: never set a bound ``.grad`` to None.
    """
    if not params:
        return torch.zeros(0)
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat
