"""Sequence rings (ring, zigzag and TASP attention): KV travels rings of ranks (docs/rings.md).

Its programs carry a ``RingPlan`` (chunks, holders, rings). Lowering writes
the whole program, order and exchanges, from the rings (``lower_rings``); its
buffers are replaced by its exchanges, never freed, and its memory is KV
bytes, which the ring check bounds, so activation and byte budgets do not
apply; block times are exact fractions, reported as plain numbers; torch's
CSV has no form for it.
"""
from __future__ import annotations

from dataclasses import replace

from pipec.compiler.family import Family, register
from pipec.compiler.ir import RingPlan
from pipec.compiler.lower_rings import lower_rings
from pipec.compiler.memory_counts import peak_kv_bytes
from pipec.compiler.ops import SEQUENCE_RING, SIZE_KV


class SequenceRings(Family):
    name = SEQUENCE_RING
    runs_ops_of = (SEQUENCE_RING,)
    stage_checks = False
    frees_values = False
    exact_times = True

    def plan_to_json(self, program):
        plan = program.rings
        return {"rings": {"chunks": plan.chunks, "holders": list(plan.holders), "pieces": plan.pieces,
                          "rings": [list(ring) for ring in plan.rings], "causal": plan.causal, "kv": plan.kv,
                          "dkv": plan.dkv, "transfer": plan.transfer, "note": plan.note}}

    def spec_plan(self, spec):
        return spec.rings

    def lower(self, spec, costs):
        program = lower_rings(spec)
        return replace(program, ranks=[[a for a in row if a.is_compute] for row in program.ranks]), program

    def refuse_memory_budget(self, name):
        return (f"'{name}' is a sequence ring: its memory is KV buffers, which the ring check bounds "
                "(two per piece under `kv again`); activation and byte budgets do not apply to it")

    def refuse_torch_csv(self, name):
        return (f"{name} is a sequence ring (ring attention: KV moves between ranks holding chunks of one "
                "sequence); torch's schedule CSV moves activations between the stages of one pipeline and has no "
                "form for it")

    def peak_bytes(self, program, sizes):
        kv = peak_kv_bytes(program, sizes[SIZE_KV]) if SIZE_KV in sizes else [0] * len(program.ranks)
        return [{size_class: kv[rank] if size_class == SIZE_KV else 0 for size_class in sizes}
                for rank in range(len(program.ranks))]

    def shape_text(self, program):
        plan = program.rings
        pieces = f"{plan.pieces} KV piece{'s' if plan.pieces != 1 else ''}"
        return f"{plan.chunks} chunks of {pieces} on {len(plan.rings)} ring{'s' if len(plan.rings) != 1 else ''}"

    def proof_text(self, program, memory_text):
        # Blocks, KV and partials are what a ring moves and computes; it has no stages' activations.
        plan = program.rings
        blocks = sum(1 for q in range(plan.chunks) for kv in range(plan.chunks) for piece in range(plan.pieces)
                     if plan.visible(q, kv, piece))
        return (f"each of the {blocks} visible blocks computed once forward and once backward, KV where every "
                "block runs, every dK, dV contribution home once, messages matched, deadlock-free"
                + (f"\nnote: {plan.note}" if plan.note else ""))


FAMILY = register(SequenceRings(), RingPlan)
