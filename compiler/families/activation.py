"""Activation passing (GPipe, 1F1B, interleaved, zero bubble, Chimera, BitPipe, PipeDream).

Its programs carry no plan: the stages, pipelines and the rule table's F, B,
I, W (and FC, R, U) say everything, so the base ``Family``'s answers are its
own. Lowering derives the messages from placement and dataflow
(``lower_comms``), after the list scheduler or the written order.
"""
from __future__ import annotations

from pipec.compiler.build import compute_program
from pipec.compiler.family import Family, register
from pipec.compiler.lower_comms import insert_communication
from pipec.compiler.ops import ACTIVATION_PASSING


class ActivationPassing(Family):
    name = ACTIVATION_PASSING
    runs_ops_of = (ACTIVATION_PASSING,)

    def lower(self, spec, costs):
        compute = compute_program(spec, costs)
        return compute, insert_communication(compute)


FAMILY = register(ActivationPassing(), None)
