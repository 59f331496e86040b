"""Build the compute-only ``Program`` of an evaluated schedule.

Contract: ``compute_program(spec, costs)`` places every stage (``StageInfo``),
records the pipelines and the microbatch routing, and fills each rank's list
with its compute tasks (F, B or I and W; FC and R on a recomputed stage) in
order: the explicit order the schedule wrote, or the list scheduler's order
under a policy, with the recomputes an order leaves out placed right before
their backward (``recompute.place_recomputes``). No communication yet; that
is ``lower_comms``'s job.
"""
from __future__ import annotations

from pipec.compiler.costs import CostModel
from pipec.compiler.ir import NO_PEER, Action, Program, StageInfo, build_program
from pipec.compiler.list_schedule import greedy_order
from pipec.compiler.recompute import place_recomputes
from pipec.dsl.spec import ScheduleSpec


def compute_program(spec: ScheduleSpec, costs: CostModel | None = None) -> Program:
    """Args: spec: an evaluated schedule; costs: for the list scheduler only.
    Returns: the compute-only Program (fresh lists; the spec is not changed)."""
    S = spec.num_stages
    stages = [
        StageInfo(p * S + s, rank, p, s) for p, row in enumerate(spec.placement) for s, rank in enumerate(row)
    ]
    pipelines = [[p * S + s for s in range(S)] for p in range(spec.num_pipelines)]
    order = spec.order if spec.order is not None else greedy_order(spec, costs)
    if spec.recomputed:
        order = place_recomputes(order)
    make = Action._make  # the NamedTuple constructor's fast path
    ranks = [[make((sid, kind, m, NO_PEER, ())) for kind, sid, m in row] for row in order]
    return build_program(spec.name, spec.num_ranks, spec.num_microbatches, stages, pipelines, list(spec.mb_pipeline),
                         ranks, params=dict(spec.params), devices=spec.devices, source=spec.path,
                         weight_versions=spec.weight_versions)
