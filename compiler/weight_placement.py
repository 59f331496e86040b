"""A weight-passing program on a mesh: TawPipe (or WeiPipe) x DP (docs/compose.md, "Weight passing x DP").

``place_weights_on_mesh`` is a pure pass from a compiled weight-passing
program of P ranks (owners, groups, routes: ``ir.WeightPlan``) to the same
schedule on a mesh of a ``pp`` axis of P and a data axis of D: D replicas of
the weight-passing program. The member of the data group at pp coordinate r
and data coordinate d:

* runs rank r's list, every peer (a send's, a receive's, a broadcast's or a
  reduce's root) moved to the rank at the peer's pp coordinate and data
  coordinate d: weights and gradient partials move inside its replica only;
* meets its replica's copy of each weight-passing group (the plan's groups
  numbered per replica, one communicator each, created in one order);
* takes rows share d of D of each microbatch (every stage is placed on the
  data group of its pp coordinate, ``ir.Placement``, as PP x DP places it);
* owns the layers rank r owns; after the last fold of an owned layer's
  gradient into it (its own last contribution, or the wait of the last
  exchange that brings it a partial: a reduce's sum, a received partial), it
  all-reduces the layer's gradient over its data group (``SYNC_GRAD`` of its
  stage of the layer, posted by an EXCHANGE there and waited at the end of the
  list), so the meeting of the replicas overlaps the rest of the step.

Routes whose collectives span every rank (a ring, ``all_gather``,
``reduce_scatter``) would meet across replicas and are refused, as is a
sharded data axis (a weight-passing layer already has one owner per replica).
The pass knows no schedule: it reads only the rule table and the program.
"""
from __future__ import annotations

from dataclasses import replace

from pipec.compiler import ops
from pipec.compiler.ir import Action, Communicator, Mesh, Placement, Program, StageInfo, weight_communicators
from pipec.compiler.mesh_placement import DataParallel, _moved
from pipec.errors import UsageError

_CONTRIBUTORS = frozenset(ops.GRADIENT_CONTRIBUTORS)
# The parts that fold a partial into the rank they arrive on: a reduce (at its root) and a received partial.
_FOLDS = frozenset((ops.REDUCE_G, ops.RECV_G))
# Routes whose collectives meet on every rank of the program, which would join the replicas.
_WORLD_ROUTES = {"ring", "all_gather", "reduce_scatter"}


def place_weights_on_mesh(program: Program, mesh: Mesh, pp_axis: str, data: DataParallel,
                          name: str | None = None) -> Program:
    """``program``'s schedule on ``mesh``: pp rank r's list on every member of the data group at r (module docstring).

    Args:
        program: a compiled weight-passing program (``weights`` set) with communication, one rank per
            pipeline coordinate, ``mesh.axis_size(pp_axis)`` ranks.
        mesh: the composed program's axes, ``pp_axis`` and ``data.axis``.
        pp_axis: the axis the weight-passing ranks run along.
        data: the data axis; replicated (``sharded`` is refused).
    Returns:
        A new program of ``mesh.size`` ranks (``program`` is not changed), ``mesh`` set; with a data axis of
        size 1, ``program`` with ``mesh`` set.
    Raises:
        UsageError: a program or mesh this composition does not take, with the reason.
    """
    plan = program.weights
    _check_composable(program, mesh, pp_axis, data)
    if mesh.axis_size(data.axis) == 1:
        return replace(program, mesh=mesh, name=name or program.name)
    pp_of = tuple(mesh.coords(rank)[pp_axis] for rank in range(mesh.size))
    replica_of = [mesh.coords(rank)[data.axis] for rank in range(mesh.size)]
    per_replica = max(plan.groups) + 1
    placed_plan = replace(plan, groups=tuple(replica_of[r] * per_replica + plan.groups[pp_of[r]]
                                             for r in range(mesh.size)), pipeline_ranks=pp_of)
    communicators = weight_communicators(placed_plan, mesh.size)
    data_groups = [mesh.members(mesh.rank_at({pp_axis: p, data.axis: 0}), (data.axis,))
                   for p in range(program.num_ranks)]
    for p, group in enumerate(data_groups):
        communicators.append(Communicator(len(communicators), group, ops.STAGE_GROUP, p))
    first_group = len(communicators) - len(data_groups)
    stages = [StageInfo(info.id, data_groups[info.rank][0], info.pipeline, info.position,
                        Placement(data_groups[info.rank], first_group + info.rank)) for info in program.stages]
    stage_of = {(info.rank, info.position): info.id for info in program.stages}
    first_number = 1 + max((a.mb for row in program.ranks for a in row if a.op in ops.EXCHANGE_OPS), default=-1)
    rows = []
    for rank in range(mesh.size):
        coords = mesh.coords(rank)

        def peer_of(pp_peer: int, coords=coords) -> int:  # the rank at pp_peer in this rank's replica
            return mesh.rank_at(dict(coords, **{pp_axis: pp_peer}))

        pp_rank = pp_of[rank]
        owned = {layer: stage_of[(pp_rank, layer)] for layer, owner in enumerate(plan.owners) if owner == pp_rank}
        rows.append(_member_row(program, program.ranks[pp_rank], peer_of, owned, first_number))
    return replace(program, name=name or program.name, num_ranks=mesh.size, stages=stages, ranks=rows,
                   communicators=communicators, devices=None, mesh=mesh, weights=placed_plan)


def shard_refusal(name: str, axis: str) -> str:
    """Why a weight-passing schedule is not sharded over a data axis."""
    return (f"{name} passes weights: each layer has one owner per replica, which keeps its master and optimizer "
            f"state, so there is nothing to shard over the data axis (write `replicate over {axis}`)")


def _check_composable(program: Program, mesh: Mesh, pp_axis: str, data: DataParallel) -> None:
    plan, name = program.weights, program.name or "this program"
    if set(mesh.names) != {pp_axis, data.axis} or pp_axis == data.axis:
        raise UsageError(f"a data-parallel composition runs on a mesh of two axes, the pipeline's ({pp_axis}) and "
                         f"the data axis ({data.axis}); this mesh has {', '.join(mesh.names)}")
    if mesh.axis_size(pp_axis) != program.num_ranks:
        raise UsageError(f"the weight-passing schedule {name} runs on {program.num_ranks} ranks, but the mesh's "
                         f"{pp_axis} axis has {mesh.axis_size(pp_axis)}")
    if program.mesh is not None or program.placed_on_groups or len(program.plans) > 1:
        raise UsageError(f"{name} is composed already; a data axis composes with a plain weight-passing program")
    if data.sharded:
        raise UsageError(shard_refusal(name, data.axis))
    worldwide = sorted({plan.route, plan.gradients} & _WORLD_ROUTES)
    if worldwide or plan.owners is None:
        route = worldwide[0] if worldwide else "all_gather"
        raise UsageError(f"{name} moves weights or gradients by '{route}', a collective of every rank, which would "
                         "meet across the replicas; a data axis composes with routes inside groups (direct, staged, "
                         "reduce: TawPipe's)")


def _member_row(program: Program, row: list[Action], peer_of, owned: dict[int, int], first_number: int) -> list[Action]:
    """One member's list: ``row`` with peers moved to its replica, and after the last fold of each owned
    layer's gradient an EXCHANGE of its SYNC_GRAD, waited at the end of the list."""
    layer_of = [info.position for info in program.stages]
    last_fold: dict[int, int] = {}          # owned layer -> index in row after which its gradient is whole here
    folding: dict[int, set[int]] = {}       # exchange number -> owned layers a part of it folds here
    for index, action in enumerate(row):
        if action.is_compute and action.op in _CONTRIBUTORS and layer_of[action.stage] in owned:
            last_fold[layer_of[action.stage]] = index
        elif action.op in ops.EXCHANGE_OPS:
            for part in action.parts:
                if part.op in _FOLDS and part.stage >= 0 and layer_of[part.stage] in owned:
                    folding.setdefault(action.mb, set()).add(layer_of[part.stage])
        elif action.op in ops.EXCHANGE_WAIT_OPS:
            for layer in folding.pop(action.mb, ()):
                last_fold[layer] = index
    after: dict[int, list[int]] = {}
    for layer in sorted(last_fold):
        after.setdefault(last_fold[layer], []).append(layer)
    out: list[Action] = []
    waits: list[Action] = []
    for index, action in enumerate(row):
        out.append(_moved(action, peer_of))
        for layer in after.get(index, ()):
            number = first_number + len(waits)
            out.append(Action(-1, ops.EXCHANGE, number, parts=(Action(owned[layer], ops.SYNC_GRAD),)))
            waits.append(Action(-1, ops.EXCHANGE_WAIT, number))
    return out + waits

