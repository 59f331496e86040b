"""The family hooks and registries that stand where family switches stood.

The compiler asks a program's families (``compiler/family.py``) and the front
end asks a schedule's declared families (``dsl/families.py``); a family that
overrides nothing answers as activation passing does; every ``Program`` is
built by ``ir.build_program``, each plan going to its field by its type.
"""
from __future__ import annotations

from fractions import Fraction

from pipec.commands.attention import ring_plan
from pipec.compiler.driver import compile_target
from pipec.compiler.emit.json_program import program_from_json, program_to_json
from pipec.compiler.family import Family, all_families, families_of
from pipec.compiler.ir import Action, build_program
from pipec.compiler.ops import ACTIVATION_PASSING, SEQUENCE_RING, TENSOR_PARALLEL, WEIGHT_PASSING
from pipec.dsl.families import declared_families, declared_in


def _program(name: str, **params):
    return compile_target(name, params).program


def test_every_family_is_registered_plan_less_first_weights_read_before_rings():
    assert [family.name for family in all_families()] == [ACTIVATION_PASSING, WEIGHT_PASSING, SEQUENCE_RING,
                                                          TENSOR_PARALLEL]


def test_a_family_that_overrides_nothing_answers_as_activation_passing():
    family, program = Family(), _program("1f1b", P=2, N=2)
    send = next(a for a in program.ranks[0] if a.op == "SEND_F")
    assert family.plan_of(program) is None and family.note(program) == ""
    assert family.value_share(program, send, "act") is None
    assert family.ring_step_giver(program, 0) is None
    assert family.block_area(program, Action(0, "AF", 0)) is None
    assert family.grid_shape_text(program) == family.shape_text(program) == "2 stages, 2 microbatches"
    assert family.instruction_bounds(None, "F", (2, 2, 2)) == (2, 2, 2)
    assert family.instruction_bounds(None, "AF", (2, 2, 2)) is None  # a ring's op, kept to ring programs
    assert family.counts_activations and not family.keeps_own_ops
    assert family.refuse_search(program) is None and not family.searches_itself  # CP-SAT's exact model


def test_the_families_answer_from_their_plans():
    weights, ring = _program("weipipe", P=4, N=8), _program("tasp", P=5)
    (passing,), (rings,) = families_of(weights), families_of(ring)
    assert passing.plan_of(weights) is weights.weights and rings.plan_of(ring) is ring.rings
    assert [passing.ring_step_giver(weights, r) for r in range(4)] == [3, 0, 1, 2]  # ring_by 1: from r - 1
    send = next(p for a in ring.ranks[0] for p in (a.parts or (a,)) for p in (p.parts or (p,)) if p.op == "SEND_KV")
    assert rings.value_share(ring, send, "kv") == ring.rings.bundle_share(send.stage)
    plan = ring.rings  # a diagonal block of a causal mask, one of its pieces: a share of the op's cost
    assert rings.block_area(ring, Action(0, "AF", 0)) == plan.block_area(0, *plan.unblock(0)) < Fraction(1, 2)
    assert rings.block_area(ring, Action(ring.rings.chunks, "AF", 0)) is None
    assert not rings.counts_activations and rings.grid_shape_text(ring).startswith(rings.shape_text(ring) + " (")


def test_attention_finds_the_ring_plan_through_the_family():
    assert ring_plan(_program("zigzag_ring", P=2)) is not None
    assert ring_plan(_program("weipipe", P=4, N=8)) is None and ring_plan(_program("gpipe", P=2)) is None


def test_build_program_puts_each_plan_in_its_field_and_derives_communicators_from_it():
    for program in (_program("1f1b", P=2, N=2), _program("fsdp", P=4, N=8), _program("zigzag_ring", P=2)):
        built = build_program(program.name, program.num_ranks, program.num_microbatches, program.stages,
                              program.pipelines, program.mb_pipeline, program.ranks, plans=program.plans,
                              params=program.params, devices=program.devices, source=program.source,
                              weight_versions=program.weight_versions)
        assert built == program, program.name
        assert program_from_json(program_to_json(program)) == program, program.name


def test_the_front_end_asks_the_declared_families():
    assert {family.field for family in declared_families()} == {"weights", "rings", "tensor"}
    assert declared_in(compile_target("1f1b", {"P": 2, "N": 2}).spec) == []
    (family, declared), = declared_in(compile_target("weipipe", {"P": 4, "N": 8}).spec)
    assert family.field == "weights" and family.at_steps and family.step_refusal(declared, 99, 4) is None
    spec = compile_target("zigzag_ring", {"P": 2}).spec
    (family, declared), = declared_in(spec)
    assert family.field == "rings" and declared is spec.rings and family.written_blocks(declared).pieces == 1
    assert family.step_refusal(declared, 3, 2) is None and "past a sequence ring's last" in family.step_refusal(
        declared, 4, 2)
