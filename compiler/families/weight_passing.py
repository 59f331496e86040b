"""Weight passing (WeiPipe, TawPipe, FSDP): weights travel, activations stay home (docs/weights.md).

Its programs carry a ``WeightPlan`` (owners, groups, routes). Lowering puts
the weight and gradient exchanges at step boundaries (``lower_weights``);
the plan's groups are the nodes when a cost file gives no node size; the
borrowed weight buffers count as weight bytes; an optimizer update cannot
stand in the lists (each layer's owner steps after them); torch's CSV has no
form for it. A program file's ``owners`` and ``weights`` are read here.
"""
from __future__ import annotations

from dataclasses import replace

from pipec.compiler.build import compute_program
from pipec.compiler.family import Family, register
from pipec.compiler.guarded_read import read_int_list
from pipec.compiler.ir import GRADIENT_ROUTES, WEIGHT_ROUTES, WeightPlan
from pipec.compiler.lower_weights import insert_weight_exchanges
from pipec.compiler.memory_counts import peak_weight_buffers
from pipec.compiler.mesh_placement import ContextParallel
from pipec.compiler.weight_placement import place_weights_on_mesh, shard_refusal
from pipec.compiler.ops import ACTIVATION_PASSING, WEIGHT_PASSING
from pipec.errors import ImportError_


class WeightPassing(Family):
    name = WEIGHT_PASSING
    runs_ops_of = (WEIGHT_PASSING, ACTIVATION_PASSING)
    searches_itself = True

    def plan_of(self, program):
        return program.weights

    def plan_from_json(self, data, header):
        return _read_weights(data, header["num_ranks"], len(header["pipelines"][0]) if header["pipelines"] else 0)

    def plan_to_json(self, program):
        plan = program.weights
        return {"owners": None if plan.owners is None else list(plan.owners),
                "weights": {"groups": list(plan.groups), "route": plan.route, "ring_by": plan.ring_by,
                            "gradients": plan.gradients, "prefetch": plan.prefetch, "buffers": plan.buffers,
                            "num_steps": plan.num_steps,
                            # on a mesh only: rank -> the weight-passing rank it runs (its pp coordinate)
                            **({} if plan.pipeline_ranks is None else {"pipeline_ranks": list(plan.pipeline_ranks)})}}

    def spec_plan(self, spec):
        return spec.weights

    def lower(self, spec, costs):
        compute = compute_program(spec, costs)
        return compute, insert_weight_exchanges(compute, spec)

    def search(self, spec, program, costs, memory, *, time_limit, candidates, seed=0):
        """The step grid and prefetch distance, by a walk of moves (``weight_search``)."""
        from pipec.compiler.families.weight_search import search_grid  # it compiles candidates

        return search_grid(spec, program, costs, memory, time_limit=time_limit, candidates=candidates, seed=seed)

    def refuse_torch_csv(self, name):
        return (f"{name} passes weights between ranks (weight passing); torch's schedule CSV moves activations "
                "between the stages of one pipeline and has no form for it")

    def refuse_updates(self):
        return "under weight passing each layer's owner steps its optimizer after it"

    def reduced_stages(self, program):
        """On a mesh each replica's owner of a layer all-reduces its gradient over its data group; the other
        ranks' partials were folded into it (``compiler/weight_placement.py``)."""
        plan = program.weights
        return frozenset(info.id for info in program.stages if plan.owns(info.rank, info.position))

    def ring_step_giver(self, program, rank):
        return (rank - program.weights.ring_by) % program.num_ranks

    def node_of(self, program):
        return program.weights.groups.__getitem__

    def borrowed_buffers(self, program):
        return peak_weight_buffers(program)

    def refuse_mesh_policy(self, program, data):
        name = program.name or "this pipeline"
        if isinstance(data, ContextParallel):
            return (f"{name} passes weights; a context axis composes with an activation-passing pipeline (gpipe, "
                    "1f1b, interleaved_1f1b): weight passing x CP is not built")
        return shard_refusal(name, data.axis) if data.sharded else None

    def place_composed(self, compute, program, mesh, pp_axis, data, name):
        """The placed program stands for both: its compute-only form is its computes (``weight_placement``)."""
        placed = place_weights_on_mesh(program, mesh, pp_axis, data, name=name)
        return replace(placed, ranks=[[a for a in row if a.is_compute] for row in placed.ranks]), placed

    def proof_text(self, program, memory_text):
        return (f"{super().proof_text(program, memory_text)}; weights where every task runs, gradients folded into "
                f"their owners once, peak borrowed weight buffers per rank {peak_weight_buffers(program)}")


def _read_weights(data: dict, num_ranks: int, num_layers: int) -> WeightPlan | None:
    """The ``WeightPlan`` of a program file's ``owners`` and ``weights`` (both null or absent for the
    other families)."""
    raw, owners = data.get("weights"), data.get("owners")
    if raw is not None and data.get("rings") is not None:
        raise ImportError_("a program has one family: \"rings\" (a sequence ring) and \"weights\" (weight passing) "
                           "cannot both be set")
    if raw is None:
        if owners is not None:
            raise ImportError_("field \"owners\" needs \"weights\" (a weight-passing program has both)")
        return None
    if not isinstance(raw, dict):
        raise ImportError_("field \"weights\" must be an object or null")
    if owners is not None:
        if not isinstance(owners, list) or len(owners) != num_layers:
            raise ImportError_(f"field \"owners\" must list the owner rank of each of the {num_layers} layers")
        owners = tuple(read_int_list(owners, "owners", num_ranks))
    groups = raw.get("groups")
    if not isinstance(groups, list) or len(groups) != num_ranks:
        raise ImportError_(f"weights.groups must list the group of each of the {num_ranks} ranks")
    groups = tuple(read_int_list(groups, "weights.groups", num_ranks))
    route, gradients = raw.get("route"), raw.get("gradients")
    if route not in WEIGHT_ROUTES:
        raise ImportError_(f"weights.route is {route!r}; known: {', '.join(WEIGHT_ROUTES)}")
    if gradients not in GRADIENT_ROUTES:
        raise ImportError_(f"weights.gradients is {gradients!r}; known: {', '.join(GRADIENT_ROUTES)}")
    if (owners is None) != (route == "all_gather"):
        raise ImportError_("\"owners\" is null exactly when weights.route is all_gather (every rank keeps a shard)")
    numbers = {}
    for key, low in (("ring_by", None), ("prefetch", 0), ("num_steps", 0)):
        value = raw.get(key)
        if type(value) is not int or (low is not None and value < low):
            raise ImportError_(f"weights.{key} must be an integer{'' if low is None else f' >= {low}'}, got {value!r}")
        numbers[key] = value
    buffers = raw.get("buffers")
    if buffers is not None and (type(buffers) is not int or buffers < 1):
        raise ImportError_(f"weights.buffers must be a positive integer or null, got {buffers!r}")
    pipeline_ranks = raw.get("pipeline_ranks")
    if pipeline_ranks is not None:
        if not isinstance(pipeline_ranks, list) or len(pipeline_ranks) != num_ranks:
            raise ImportError_(f"weights.pipeline_ranks must list the weight-passing rank of each of the "
                               f"{num_ranks} ranks")
        pipeline_ranks = tuple(read_int_list(pipeline_ranks, "weights.pipeline_ranks", num_ranks))
    return WeightPlan(owners, groups, route, numbers["ring_by"], gradients, numbers["prefetch"], buffers,
                      numbers["num_steps"], pipeline_ranks)


FAMILY = register(WeightPassing(), WeightPlan)
