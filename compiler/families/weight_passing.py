"""Weight passing (WeiPipe, TawPipe, FSDP): weights travel, activations stay home (docs/weights.md).

Its programs carry a ``WeightPlan`` (owners, groups, routes). Lowering puts
the weight and gradient exchanges at step boundaries (``lower_weights``);
the plan's groups are the nodes when a cost file gives no node size; the
borrowed weight buffers count as weight bytes; an optimizer update cannot
stand in the lists (each layer's owner steps after them); torch's CSV has no
form for it.
"""
from __future__ import annotations

from pipec.compiler.build import compute_program
from pipec.compiler.family import Family, register
from pipec.compiler.ir import WeightPlan
from pipec.compiler.lower_weights import insert_weight_exchanges
from pipec.compiler.memory_counts import peak_weight_buffers
from pipec.compiler.ops import ACTIVATION_PASSING, WEIGHT_PASSING


class WeightPassing(Family):
    name = WEIGHT_PASSING
    runs_ops_of = (WEIGHT_PASSING, ACTIVATION_PASSING)

    def plan_to_json(self, program):
        plan = program.weights
        return {"owners": None if plan.owners is None else list(plan.owners),
                "weights": {"groups": list(plan.groups), "route": plan.route, "ring_by": plan.ring_by,
                            "gradients": plan.gradients, "prefetch": plan.prefetch, "buffers": plan.buffers,
                            "num_steps": plan.num_steps}}

    def spec_plan(self, spec):
        return spec.weights

    def lower(self, spec, costs):
        compute = compute_program(spec, costs)
        return compute, insert_weight_exchanges(compute, spec)

    def refuse_torch_csv(self, name):
        return (f"{name} passes weights between ranks (weight passing); torch's schedule CSV moves activations "
                "between the stages of one pipeline and has no form for it")

    def refuse_updates(self):
        return "under weight passing each layer's owner steps its optimizer after it"

    def node_of(self, program):
        return program.weights.groups.__getitem__

    def borrowed_buffers(self, program):
        return peak_weight_buffers(program)

    def proof_text(self, program, memory_text):
        return (f"{super().proof_text(program, memory_text)}; weights where every task runs, gradients folded into "
                f"their owners once, peak borrowed weight buffers per rank {peak_weight_buffers(program)}")


FAMILY = register(WeightPassing(), WeightPlan)
