"""Compositions on a mesh: a pipeline program whose stages are data-parallel or fully sharded groups.

``place_on_mesh`` is a pure pass from a compiled pipeline program (one rank
per pipeline coordinate, activation passing) to the same schedule on a mesh
of rank axes (``ir.Mesh``): the pipeline runs along the ``pp`` axis and every
stage placed at pp coordinate p spans the group of ranks at p (the data
axis, ``dp``). Every member of a group runs its pp rank's list on its share
of each microbatch's rows (``ir.Placement``), hands each activation and
gradient to the member of the next (or previous) group with the same data
coordinate, and meets its group in three kinds of step (docs/compose.md):

* replicated weights (PP x DP): the stage's weight gradient is all-reduced
  over the group (``SYNC_GRAD``) as soon as the stage's last backward on the
  rank ends, posted by an EXCHANGE and waited at the end of the list, so it
  overlaps the rest of the schedule (BitPipe's eager sync);
* sharded weights (PP x FSDP): each member keeps a shard; the stage's first
  compute holds a ``GATHER`` sub-step that makes its weights whole, a
  ``RESHARD`` drops the whole copy after the stage's last compute (or,
  ``reshard_after_forward``, after its last forward too, gathered again for
  the backward that follows: ZeRO-3's memory), and its gradient is
  reduce-scattered (``REDUCE_GRAD``) where a replicated stage's is
  all-reduced. Without ``reshard_after_forward`` the weights stay whole from
  the first forward to the last backward: ZeRO-2's memory inside a step.
* hybrid sharded weights (PP x HSDP, ``DataParallel.replicas``): the group at
  p spans two data axes, the shard axis and the replica axis; a member's
  weights are sharded over its *shard group* (the members that differ from it
  along the shard axis only: inside a node when it is the inner axis) and
  replicated across the shard groups. Its GATHER, RESHARD and REDUCE_GRAD are
  FSDP's, on its shard group; once the REDUCE_GRAD's exchange is waited, a
  second exchange all-reduces the member's shard of the gradient over its
  *replica group* (the members that differ from it along the replica axis
  only, one per shard group: ``SYNC_SHARD``), torch's HSDP order. Rows are
  shared over the whole group: member i is the i-th of the group in
  ascending rank order.

The pass knows no schedule: it reads only the rule table and the program.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pipec.compiler import ops
from pipec.compiler.family import runs_in_stages
from pipec.compiler.ir import (ROW_SHARE, SEQUENCE_SHARE, Action, Communicator, Mesh, Placement, Program,
                               StageInfo)
from pipec.errors import UsageError

# The computes that make a stage's activation (a forward, run again or not by a recompute): after the last
# of them a stage that reshards after forward drops its whole weights.
_FORWARDS = frozenset(ops.FORWARD_COMPUTE_OPS)
_GRADIENT_CONTRIBUTORS = frozenset(ops.GRADIENT_CONTRIBUTORS)


@dataclass(frozen=True)
class DataParallel:
    """How the stages of a composed program share their data axis.

    Attributes:
        axis: the mesh axis a stage's group spans (``dp``).
        sharded: the stage's weights are sharded over the group (FSDP) rather than replicated (DP).
        reshard_after_forward: a sharded stage drops its whole weights after its last forward as well
            as after its last compute (ZeRO-3); otherwise it keeps them whole in between (ZeRO-2).
        replicas: HSDP: a second data axis the sharded weights are replicated over (``axis`` is then the
            axis they are sharded over); None for a group on ``axis`` alone.
    """

    axis: str
    sharded: bool = False
    reshard_after_forward: bool = False
    replicas: str | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        """The data axes a stage's group spans, the replica axis first."""
        return (self.axis,) if self.replicas is None else (self.replicas, self.axis)

    @property
    def split(self) -> str:
        return ROW_SHARE


@dataclass(frozen=True)
class ContextParallel:
    """Context parallelism: every stage's group splits each sequence by ``ring``'s chunks and runs its attention
    through ``ring``.

    Attributes:
        axis: the mesh axis a stage's group spans (``cp``).
        ring: a compiled sequence-ring program (``Program.rings`` set) of as many ranks as the axis; None on an
            axis of one rank, where no sequence is split and the pipeline runs as it is (as a data axis of one).
    """

    axis: str
    ring: Program | None
    sharded = False
    reshard_after_forward = False
    replicas = None  # no second data axis (HSDP's, ``DataParallel.replicas``)

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,)

    @property
    def split(self) -> str:
        return SEQUENCE_SHARE


# The parts of a split compute (B -> I, W): a context-parallel stage takes none, since each attention's ring
# backward runs once per forward, inside a whole B (I then W would need it twice).
_SPLIT_PARTS = frozenset(part for parts in ops.SPLITS.values() for part in parts)


def place_on_mesh(program: Program, mesh: Mesh, pp_axis: str, data: "DataParallel | ContextParallel",
                  name: str | None = None) -> Program:
    """``program``'s schedule on ``mesh``: pp rank p's list on every rank of the data group at p.

    Args:
        program: a compiled activation-passing program with communication, one pipeline, one rank per
            stage, ``mesh.axis_size(pp_axis)`` ranks.
        mesh: the composed program's axes: ``pp_axis`` and ``data.axes``, in the order that lays ranks out.
        pp_axis: the axis the pipeline runs along.
        data: how each stage's group holds its weights, splits its values and reduces its gradients.
        name: the composed program's name (default: ``program``'s).
    Returns:
        A new program of ``mesh.size`` ranks (``program`` is not changed), each stage placed on its group
        (one communicator per pp coordinate, in pp order; under HSDP its shard and replica groups,
        ``_place_hybrid``), ``mesh`` set, and under ``ContextParallel`` ``stage_ring`` set. With data axes
        of size 1 it is ``program`` with ``mesh`` set: each stage is on one rank (a ring of one rank has
        nothing to exchange).
    Raises:
        UsageError: a program or mesh this composition does not take, with the reason.
    """
    _check_composable(program, mesh, pp_axis, data)
    data = _without_single_axes(data, mesh)
    if data is None:
        return replace(program, mesh=mesh, name=name or program.name)
    if data.replicas is not None:
        return _place_hybrid(program, mesh, pp_axis, data, name)
    groups = [mesh.members(mesh.rank_at(dict.fromkeys(mesh.names, 0) | {pp_axis: p}), (data.axis,))
              for p in range(program.num_ranks)]
    communicators = [Communicator(p, group, ops.STAGE_GROUP, p) for p, group in enumerate(groups)]
    stages = [StageInfo(info.id, groups[info.rank][0], info.pipeline, info.position,
                        Placement(groups[info.rank], info.rank, data.sharded, data.split)) for info in program.stages]
    rows: list[list[Action]] = []
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        pp_rank = coords[pp_axis]

        def peer_of(pp_peer: int, coords=coords) -> int:  # the member of pp_peer's group at this data coordinate
            return mesh.rank_at(dict(coords, **{pp_axis: pp_peer}))

        rows.append(_member_row(program.ranks[pp_rank], peer_of, data))
    return replace(program, name=name or program.name, num_ranks=mesh.size, stages=stages, ranks=rows,
                   communicators=communicators, devices=None, mesh=mesh,
                   stage_ring=data.ring if isinstance(data, ContextParallel) else None)


def _without_single_axes(data: DataParallel, mesh: Mesh) -> DataParallel | None:
    """``data`` without its data axes of one rank: HSDP with one shard group is FSDP on the shard axis, with
    shard groups of one rank (whole weights on every member) DP on the replica axis; None when no data
    axis has two ranks (each stage on one rank)."""
    if data.replicas is None:
        return data if mesh.axis_size(data.axis) > 1 else None
    if mesh.axis_size(data.axis) == 1:
        return _without_single_axes(DataParallel(data.replicas), mesh)
    if mesh.axis_size(data.replicas) == 1:
        return replace(data, replicas=None)
    return data


def _place_hybrid(program: Program, mesh: Mesh, pp_axis: str, data: DataParallel, name: str | None) -> Program:
    """``place_on_mesh`` for HSDP: the group at pp p spans both data axes; its communicators, created in this
    order, are per p its shard groups (in replica-axis order), then its replica groups (in shard-axis order)."""
    communicators: list[Communicator] = []

    def add(ranks: tuple[int, ...], purpose: str, p: int) -> int:
        communicators.append(Communicator(len(communicators), ranks, purpose, p))
        return len(communicators) - 1

    placements = []  # pp coordinate -> the placement of every stage there (they share its groups)
    for p in range(program.num_ranks):
        corner = {pp_axis: p, data.axis: 0, data.replicas: 0}
        shards = tuple(add(mesh.members(mesh.rank_at(dict(corner, **{data.replicas: r})), (data.axis,)),
                           ops.STAGE_GROUP, p) for r in range(mesh.axis_size(data.replicas)))
        replicas = tuple(add(mesh.members(mesh.rank_at(dict(corner, **{data.axis: s})), (data.replicas,)),
                             ops.SHARD_REPLICAS, p) for s in range(mesh.axis_size(data.axis)))
        members = mesh.members(mesh.rank_at(corner), data.axes)
        # a member holds the shard of its place along the shard axis: its index in its shard group
        placements.append(Placement(members, -1, True, shard_groups=shards, replica_groups=replicas,
                                    shards=tuple(mesh.coords(r)[data.axis] for r in members)))
    stages = [StageInfo(info.id, placements[info.rank].ranks[0], info.pipeline, info.position, placements[info.rank])
              for info in program.stages]
    rows = [_member_row(program.ranks[mesh.coords(rank)[pp_axis]], _peer_mover(mesh, pp_axis, rank), data)
            for rank in range(mesh.size)]
    return replace(program, name=name or program.name, num_ranks=mesh.size, stages=stages, ranks=rows,
                   communicators=communicators, devices=None, mesh=mesh)


def _peer_mover(mesh: Mesh, pp_axis: str, rank: int):
    """pp rank -> the member of that pp rank's group at ``rank``'s data coordinates."""
    coords = mesh.coords(rank)
    return lambda pp_peer: mesh.rank_at(dict(coords, **{pp_axis: pp_peer}))


def _check_composable(program: Program, mesh: Mesh, pp_axis: str, data: DataParallel) -> None:
    if set(mesh.names) != {pp_axis, *data.axes} or pp_axis in data.axes or len(set(data.axes)) < len(data.axes):
        if data.replicas is not None:
            raise UsageError(f"a hybrid sharded composition runs on a mesh of three axes, the pipeline's "
                             f"({pp_axis}), the shard axis ({data.axis}) and the replica axis ({data.replicas}); "
                             f"this mesh has {', '.join(mesh.names)}")
        raise UsageError(f"a data-parallel composition runs on a mesh of two axes, the pipeline's ({pp_axis}) and "
                         f"the data axis ({data.axis}); this mesh has {', '.join(mesh.names)}")
    if data.replicas is not None and not data.sharded:
        raise UsageError(f"a replica axis ({data.replicas}) replicates sharded weights; the data axis "
                         f"({data.axis}) is not sharded")
    if mesh.axis_size(pp_axis) != program.num_ranks:
        raise UsageError(f"the pipeline {program.name or 'program'} runs on {program.num_ranks} ranks, but the "
                         f"mesh's {pp_axis} axis has {mesh.axis_size(pp_axis)}")
    if program.plans:
        raise UsageError(f"{program.name or 'this program'} is not an activation-passing pipeline; only one "
                         "composes with a data axis today")
    if len(program.pipelines) > 1 or program.placed_on_groups or program.mesh is not None:
        raise UsageError(f"{program.name or 'this program'} replicates its stages already (two pipelines, or "
                         "stages on groups); a data axis composes with a single pipeline of one rank per stage")
    used = {a.op for row in program.ranks for a in row}
    held = sorted(used & set(ops.UPDATE_OPS))
    if held:
        raise UsageError(f"{program.name or 'this program'} updates weights inside its order ({held[0]}); "
                         "a data axis composes with a synchronous pipeline")
    if isinstance(data, ContextParallel) and data.ring is not None:
        _check_context(program, mesh, data, used)


def _check_context(program: Program, mesh: Mesh, context: ContextParallel, used: set[str]) -> None:
    ring = context.ring
    if not runs_in_stages(ring) or ring.mesh is not None:
        raise UsageError(f"{ring.name or 'the ring'} is not a sequence-ring program; a context axis runs each "
                         "stage's attention through a ring (ring_attention, zigzag_ring, tasp)")
    if ring.num_ranks != mesh.axis_size(context.axis):
        raise UsageError(f"the ring {ring.name or 'program'} runs on {ring.num_ranks} ranks, but the mesh's "
                         f"{context.axis} axis has {mesh.axis_size(context.axis)}")
    split = sorted(used & _SPLIT_PARTS)
    if split:
        raise UsageError(f"{program.name or 'this program'} splits its backward ({split[0]}); a context-parallel "
                         "stage runs each attention's ring backward once, inside a whole backward B, so it "
                         "composes with a pipeline whose backward is not split (gpipe, 1f1b, interleaved_1f1b)")


def _member_row(row: list[Action], peer_of, data: DataParallel) -> list[Action]:
    """One member's list: its pp rank's ``row`` with peers moved to its data coordinate, the gathers,
    reshards and gradient reductions of ``data`` inserted, and the waits of those reductions at the end."""
    last = {}           # stage -> index of its last compute in row
    last_forward = {}   # stage -> index of its last forward
    last_gradient = {}  # stage -> index of its last gradient contribution
    for index, action in enumerate(row):
        if action.is_compute:
            last[action.stage] = index
            if action.op in _FORWARDS:
                last_forward[action.stage] = index
            if action.op in _GRADIENT_CONTRIBUTORS:
                last_gradient[action.stage] = index
    reduce_op = ops.REDUCE_GRAD if data.sharded else ops.SYNC_GRAD
    whole: set[int] = set()  # the sharded stages whose weights are whole on this member now
    out: list[Action] = []
    waits: list[Action] = []
    reduced: list[int] = []  # the stage whose gradient each exchange (by number) reduces
    for index, action in enumerate(row):
        if not action.is_compute:
            out.append(_moved(action, peer_of))
            continue
        stage = action.stage
        if data.sharded and stage not in whole:
            action = action._replace(parts=(Action(stage, ops.GATHER, action.mb),))
            whole.add(stage)
        out.append(action)
        if index == last_gradient.get(stage):
            number = len(waits)
            out.append(Action(-1, ops.EXCHANGE, number, parts=(Action(stage, reduce_op),)))
            waits.append(Action(-1, ops.EXCHANGE_WAIT, number))
            reduced.append(stage)
        if data.sharded and (index == last[stage]
                             or (data.reshard_after_forward and index == last_forward.get(stage))):
            out.append(Action(stage, ops.RESHARD))
            whole.discard(stage)
    if data.replicas is not None:
        return out + _shard_syncs(waits, reduced)
    return out + waits


def _shard_syncs(waits: list[Action], reduced: list[int]) -> list[Action]:
    """HSDP's end of a list: each reduce-scatter's wait followed by the exchange that all-reduces the shard
    it left over the replica group (numbered after the reduce-scatters'), then those exchanges' waits."""
    out, syncs = [], []
    for wait, stage in zip(waits, reduced):
        number = len(waits) + len(syncs)
        out += [wait, Action(-1, ops.EXCHANGE, number, parts=(Action(stage, ops.SYNC_SHARD),))]
        syncs.append(Action(-1, ops.EXCHANGE_WAIT, number))
    return out + syncs


def _moved(action: Action, peer_of) -> Action:
    """``action`` with its peer (and its parts' peers) moved from a pp rank to that rank's group member."""
    if action.parts:
        action = action._replace(parts=tuple(_moved(part, peer_of) for part in action.parts))
    if action.peer >= 0:
        action = action._replace(peer=peer_of(action.peer))
    return action
