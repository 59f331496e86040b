"""A composed program (pipeline stages on data-parallel or fully sharded groups of a mesh) as torch's CSV rows.

torch's ``_PipelineScheduleRuntime`` runs one list per pipeline rank; with
FSDP2 every member of a stage's data group runs that list on its own rows,
its pipeline messages going to the member of the neighbouring group with its
own data coordinate (torch's pp process group of that coordinate), and
FSDP2's modules own the data axis: ``fully_shard`` for a sharded stage,
``replicate`` (FSDP2's data parallelism, which torch's pipelining stages
handle as they handle ``fully_shard``) for a replicated one. So a PP x FSDP
or PP x DP program (``mesh_placement.place_on_mesh``) is written as one row per pp
coordinate, read off any member of the group:

* a compute holding a ``GATHER`` sub-step is preceded by ``sUNSHARD``
  (torch's runtime posts the all-gather there and waits for it at the
  compute, which is what the sub-step means);
* a ``RESHARD`` is torch's ``sRESHARD``;
* an ``EXCHANGE`` holding ``REDUCE_GRAD`` (reduce-scatter) or ``SYNC_GRAD``
  (all-reduce) is ``sREDUCE_GRAD`` at its place: torch's one token for a
  stage's gradient reduction over its data group, which the module wrapping
  the stage carries out, then torch's division by N. Its ``EXCHANGE_WAIT``
  writes nothing: torch's reduction completes in place;
* HSDP (a stage sharded over its shard group and replicated across them,
  ``mesh_placement``'s hybrid placement): the same row as PP x FSDP, the
  exchange holding the shard's all-reduce (``SYNC_SHARD``) writing nothing:
  FSDP2's ``fully_shard`` on the 2-D (replica, shard) sub-mesh reduce-scatters
  over the shard dimension and all-reduces over the replica dimension inside
  its one ``REDUCE_GRAD``, in that order (torch's HSDP);
* a replicated stage has nothing to gather, but torch's runtime requires an
  FSDP2 module to be "unsharded" whenever it computes (for ``replicate``, a
  gather over a shard group of one rank: no communication), so its first
  compute is preceded by ``sUNSHARD`` and its ``sREDUCE_GRAD`` followed by
  ``sRESHARD``.

Everything else is written as for a single pipeline (the caller's
``cells_of``). What torch's runtime cannot run is refused with the reason:
a context-parallel composition (PP x CP: torch's schedule CSV has no step for a
stage's ring attention over its cp group, and FSDP2 splits rows, not sequences),
a mesh of other than a pipeline axis and one data axis (or, for HSDP, a
replica axis and a shard axis), sub-steps other than
a sharded stage's gather, members of a group that do not run one order,
messages that cross data coordinates.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from pipec.compiler import ops
from pipec.compiler.ir import SEQUENCE_SHARE, Action, Mesh, Program
from pipec.errors import UsageError

# torch's token of FSDP's all-gather of a stage's weights (pipec's GATHER sub-step has no token of torch's).
UNSHARD = "UNSHARD"


class MeshAxes(NamedTuple):
    """The axes of a composed program's mesh: the pipeline's and the data axis its stage groups span (under
    HSDP the axis its weights are sharded over, and ``replicas`` the axis the shards are replicated over)."""

    pp: str
    data: str
    replicas: str | None = None

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Every axis a stage's group spans: FSDP2's sub-mesh (replica dimension first)."""
        return (self.data,) if self.replicas is None else (self.replicas, self.data)


def mesh_axes(program: Program) -> MeshAxes:
    """The pipeline and data axes of a composed program torch's runtime can run over FSDP2.

    Raises:
        UsageError: a context-parallel composition; the mesh has other axes, or a stage is not placed on a
            whole group of the one data axis.
    """
    name, mesh = program.name or "this program", program.mesh
    split = next((info for info in program.stages if info.placement is not None
                  and info.placement.split == SEQUENCE_SHARE), None)
    if split is not None or program.stage_ring is not None:
        ring = program.stage_ring.name if program.stage_ring is not None else "a ring"
        raise UsageError(f"{name} splits its stages' sequences over a context axis (PP x CP, {ring} inside every "
                         "stage); torch's schedule CSV has no step for a stage's ring attention over its group, "
                         "and FSDP2 splits a stage's rows, not its sequences: run it with `pipec run`")
    if any(info.placement is not None and info.placement.hybrid for info in program.stages):
        return _hybrid_axes(program)
    if len(mesh.axes) != 2:
        raise UsageError(f"{name} runs on a mesh of {len(mesh.axes)} axes ({', '.join(mesh.names)}); torch's "
                         "schedule CSV runs one pipeline axis, with FSDP2 on one data axis")
    spans = {_axis_spanned(mesh, info.ranks, name, info.id) for info in program.stages}
    if len(spans) != 1:
        raise UsageError(f"{name} places its stages along different axes ({', '.join(sorted(spans))}); torch's "
                         "schedule CSV has one data axis, FSDP2's, shared by every stage")
    data = spans.pop()
    return MeshAxes(next(axis for axis in mesh.names if axis != data), data)


def _hybrid_axes(program: Program) -> MeshAxes:
    """The pipeline, shard and replica axes of an HSDP program, which FSDP2 runs as ``fully_shard`` on the
    (replica, shard) sub-mesh: every stage hybrid, its shard groups whole groups of one axis and its
    replica groups of another, the same two for every stage."""
    name, mesh = program.name or "this program", program.mesh
    spans = set()
    for info in program.stages:
        placement = info.placement
        if placement is None or not placement.hybrid:
            raise UsageError(f"{name} shards some stages over part of their group (HSDP) but not stage {info.id}; "
                             "torch's schedule CSV runs one FSDP2 sub-mesh for every stage")
        spans.add(tuple(_axis_spanned(mesh, program.communicators[ids[0]].ranks, name, info.id)
                        for ids in (placement.shard_groups, placement.replica_groups)))
    if len(spans) != 1 or len(mesh.axes) != 3:
        raise UsageError(f"{name} places its stages' shards along different axes, or runs on a mesh of other "
                         f"than three axes ({', '.join(mesh.names)}); torch's schedule CSV runs HSDP on one "
                         "pipeline axis and one (replica, shard) sub-mesh")
    shard, replicas = spans.pop()
    return MeshAxes(next(axis for axis in mesh.names if axis not in (shard, replicas)), shard, replicas)


def _axis_spanned(mesh: Mesh, ranks: tuple[int, ...], name: str, stage: int) -> str:
    """The one mesh axis along which ``ranks`` (a stage's group) differ."""
    coords = [mesh.coords(rank) for rank in ranks]
    varying = [axis for axis in mesh.names if len({c[axis] for c in coords}) > 1]
    if len(varying) != 1 or len(ranks) != mesh.axis_size(varying[0]):
        raise UsageError(f"{name} places stage {stage} on ranks {', '.join(map(str, ranks))}, which is not one "
                         "whole group of a mesh axis; torch's FSDP2 spans a stage over one sub-mesh")
    return varying[0]


def composed_rows(program: Program, with_comms: bool,
                  cells_of: Callable[[Action], list[str] | None]) -> list[list[str]]:
    """torch's cells, one list per pp coordinate, of a PP x FSDP or PP x DP program.

    Args:
        program: a program with ``mesh`` set and every stage placed on a group of its data axis.
        with_comms: write messages and the UNSHARD/RESHARD/REDUCE_GRAD steps (torch's "compute_comms");
            otherwise computes only (torch's "compute_only": its lowering then places those steps itself).
        cells_of: how a single-pipeline action is written (torch's tokens, stage ids as positions).
    Returns:
        the cells of pp rank p's row, for every p in order.
    Raises:
        UsageError: what torch's runtime cannot run (``mesh_axes``, and per rank and step: a sub-step
            other than a gather, a message across data coordinates, members of one group whose orders differ).
    """
    axes = mesh_axes(program)
    mesh = program.mesh
    rows = []
    for pp_rank in range(mesh.axis_size(axes.pp)):
        members = mesh.members(mesh.rank_at(dict.fromkeys(mesh.names, 0) | {axes.pp: pp_rank}), axes.data_axes)
        written = [_member_cells(program, rank, axes, with_comms, cells_of) for rank in members]
        for rank, steps in zip(members[1:], written[1:]):
            if steps != written[0]:
                step = next((i for i, (a, b) in enumerate(zip(steps, written[0])) if a != b),
                            min(len(steps), len(written[0])))
                raise UsageError(f"rank {rank}, step {step}: its order differs from rank {members[0]}'s, the other "
                                 f"member of pp {pp_rank}'s group; torch's runtime runs one order per pp rank")
        rows.append([cell for step in written[0] for cell in step])
    return rows


def _member_cells(program: Program, rank: int, axes: MeshAxes, with_comms: bool,
                  cells_of: Callable[[Action], list[str] | None]) -> list[list[str]]:
    """One member's list in torch's tokens, step by step (see the module's docstring for what each becomes)."""
    position = {stage: pos for pos, stage in enumerate(program.pipelines[0])}
    sharded = {info.id for info in program.stages if info.placement.sharded}

    def token(stage: int, op: str) -> str:  # a data-axis step's token, the stage numbered by its pipeline position
        return f"{position[stage]}{op}"

    opened: set[int] = set()  # the replicated stages written as unsharded so far
    steps: list[list[str]] = []
    for step, action in enumerate(program.ranks[rank]):
        where = f"rank {rank}, step {step}: {action.text()}"
        cells: list[str] = []
        if action.is_compute:
            unsharded = [gather.stage for gather in _gathers(action, sharded, where)]
            if action.stage not in sharded and action.stage not in opened:  # torch's bookkeeping only
                opened.add(action.stage)
                unsharded.append(action.stage)
            cells.extend(token(stage, UNSHARD) for stage in unsharded if with_comms)
            cells.extend(_written(cells_of, action._replace(parts=()), where))
        elif action.op == ops.RESHARD:
            cells.extend([token(action.stage, ops.RESHARD)] if with_comms else ())
        elif action.op == ops.EXCHANGE:
            cells.extend(_reductions(action, sharded, where, token) if with_comms else ())
        elif action.op != ops.EXCHANGE_WAIT:  # torch's REDUCE_GRAD finishes in place: nothing left to wait for
            _check_peers(program.mesh, rank, action, axes, where)
            cells.extend(_written(cells_of, action, where))
        steps.append(cells)
    return steps


def _written(cells_of: Callable[[Action], list[str] | None], action: Action, where: str) -> list[str]:
    """``action``'s cells as a single pipeline writes them; an op with no torch token is refused."""
    cells = cells_of(action)
    if cells is None:
        raise UsageError(f"{where} has no torch.distributed.pipelining token")
    return cells


def _gathers(compute: Action, sharded: set[int], where: str) -> tuple[Action, ...]:
    """A compute's sub-steps, which torch's CSV can only write as gathers of a sharded stage's own weights."""
    for part in compute.parts:
        if part.op != ops.GATHER or part.stage != compute.stage or part.stage not in sharded:
            raise UsageError(f"{where}: torch's schedule CSV has no form for a {part.op} inside a compute "
                             "(only FSDP's unshard of a sharded stage's own weights, UNSHARD)")
    return compute.parts


# The gradient reduction each kind of stage makes, all written as torch's REDUCE_GRAD.
_REDUCTION = {True: ops.REDUCE_GRAD, False: ops.SYNC_GRAD}
_SHARD_SYNCS = frozenset(ops.SHARD_REPLICA_OPS)


def _reductions(exchange: Action, sharded: set[int], where: str, token: Callable[[int, str], str]) -> list[str]:
    """An exchange's gradient reductions as torch's tokens; a replicated stage's closes its unshard; an HSDP
    shard's all-reduce writes nothing (FSDP2's REDUCE_GRAD on the 2-D sub-mesh did it)."""
    out = []
    for part in exchange.parts:
        if part.op in _SHARD_SYNCS and part.stage in sharded:
            continue
        if part.op != _REDUCTION[part.stage in sharded]:
            raise UsageError(f"{where}: torch's schedule CSV has no form for {part.op} here (only a sharded "
                             "stage's REDUCE_GRAD and a replicated stage's SYNC_GRAD, both its REDUCE_GRAD)")
        out.append(token(part.stage, ops.REDUCE_GRAD))
        if part.stage not in sharded:
            out.append(token(part.stage, ops.RESHARD))
    return out


def _check_peers(mesh: Mesh, rank: int, action: Action, axes: MeshAxes, where: str) -> None:
    """Every message of ``action`` stays on ``rank``'s data coordinate: torch's pp group of that coordinate
    carries it, and the CSV names no peers."""
    def at(coords: dict) -> str:
        return ", ".join(f"{axis} {coords[axis]}" for axis in axes.data_axes)

    own = mesh.coords(rank)
    for comm in action.comms():
        theirs = mesh.coords(comm.peer)
        if any(theirs[axis] != own[axis] for axis in axes.data_axes):
            raise UsageError(f"{where} goes to rank {comm.peer} at {at(theirs)}, but rank {rank} is at "
                             f"{at(own)}; torch's runtime sends within the pp group of one "
                             f"{' x '.join(axes.data_axes)} coordinate")
