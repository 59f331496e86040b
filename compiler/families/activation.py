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

    def note(self, program):
        # A PP x CP composition's stage ring says what its rings could not be (TASP on 4 or 6 ranks), as the
        # ring alone does.
        ring = program.stage_ring
        return f"in the stage ring: {ring.rings.note}" if ring is not None and ring.rings.note else ""

    def proof_text(self, program, memory_text):
        note = self.note(program)
        return super().proof_text(program, memory_text) + (f"\nnote: {note}" if note else "")


FAMILY = register(ActivationPassing(), None)
