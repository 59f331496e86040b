"""Mixed precision: a run's compute dtype (``--dtype``) and what follows from it.

Under ``bf16`` the forwards (and the losses) run under ``torch.autocast``
with bfloat16, on CPU and GPU alike; everything that is kept across steps
stays fp32: the parameters are the master weights, the optimizer state is
theirs, every gradient lands in an fp32 ``.grad`` (autograd accumulates in
the parameter's dtype) and is reduced (all-reduced, sent to an owner,
reduce-scattered) in fp32. What a stage hands the next travels in bfloat16
(``payload.Wire``'s ``wire_dtype``), half the bytes of fp32. ``fp32`` changes
nothing. fp16 is not offered: it would need loss scaling, which bf16's range
makes unnecessary.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, NamedTuple

import torch

from pipec.errors import UsageError


class Precision(NamedTuple):
    """A compute precision.

    Attributes:
        name: as ``--dtype`` writes it.
        compute: the dtype the forwards compute in.
    """

    name: str
    compute: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """What floating activations and their gradients travel in: the compute dtype; None under fp32."""
        return self.compute if self.mixed else None

    def autocast(self, device: torch.device | str) -> ContextManager:
        """The context forwards run in on ``device``: autocast to the compute dtype, or nothing under fp32."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.compute)


FP32 = Precision("fp32", torch.float32)
BF16 = Precision("bf16", torch.bfloat16)
PRECISIONS = {p.name: p for p in (FP32, BF16)}


def precision(name: str | None) -> Precision:
    """The precision ``--dtype NAME`` names (None: fp32).

    Raises:
        UsageError: an unknown name.
    """
    if name is None:
        return FP32
    found = PRECISIONS.get(name)
    if found is None:
        raise UsageError(f"--dtype {name!r}: expected one of {', '.join(PRECISIONS)}")
    return found


__all__ = ["BF16", "FP32", "PRECISIONS", "Precision", "precision"]
