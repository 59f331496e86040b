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

The pass knows no schedule: it reads only the rule table and the program.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pipec.compiler import ops
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
    """

    axis: str
    sharded: bool = False
    reshard_after_forward: bool = False

    @property
    def split(self) -> str:
        return ROW_SHARE


@dataclass(frozen=True)
class ContextParallel:
    """Context parallelism: every stage's group splits each sequence by ``ring``'s chunks and runs its attention
    through ``ring``.

    Attributes:
        axis: the mesh axis a stage's group spans (``cp``).
        ring: a compiled sequence-ring program (``Program.rings`` set) of as many ranks as the axis.
    """

    axis: str
    ring: Program
    sharded = False
    reshard_after_forward = False

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
        mesh: the composed program's axes: ``pp_axis`` and ``data.axis``, in the order that lays ranks out.
        pp_axis: the axis the pipeline runs along.
        data: how each stage's group holds its weights, splits its values and reduces its gradients.
        name: the composed program's name (default: ``program``'s).
    Returns:
        A new program of ``mesh.size`` ranks (``program`` is not changed), each stage placed on its group
        (one communicator per pp coordinate, in pp order), ``mesh`` set, and under ``ContextParallel``
        ``stage_ring`` set. With a data axis of size 1 it is ``program`` with ``mesh`` set: each stage is
        on one rank (a ring of one rank has nothing to exchange).
    Raises:
        UsageError: a program or mesh this composition does not take, with the reason.
    """
    _check_composable(program, mesh, pp_axis, data)
    if mesh.axis_size(data.axis) == 1:
        return replace(program, mesh=mesh, name=name or program.name)
    groups = [mesh.members(mesh.rank_at({pp_axis: p, data.axis: 0}), (data.axis,))
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


def _check_composable(program: Program, mesh: Mesh, pp_axis: str, data: DataParallel) -> None:
    if set(mesh.names) != {pp_axis, data.axis} or pp_axis == data.axis:
        raise UsageError(f"a data-parallel composition runs on a mesh of two axes, the pipeline's ({pp_axis}) and "
                         f"the data axis ({data.axis}); this mesh has {', '.join(mesh.names)}")
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
    if isinstance(data, ContextParallel):
        _check_context(program, mesh, data, used)


def _check_context(program: Program, mesh: Mesh, context: ContextParallel, used: set[str]) -> None:
    ring = context.ring
    if ring.rings is None or ring.mesh is not None:
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
        if data.sharded and (index == last[stage]
                             or (data.reshard_after_forward and index == last_forward.get(stage))):
            out.append(Action(stage, ops.RESHARD))
            whole.discard(stage)
    return out + waits


def _moved(action: Action, peer_of) -> Action:
    """``action`` with its peer (and its parts' peers) moved from a pp rank to that rank's group member."""
    if action.parts:
        action = action._replace(parts=tuple(_moved(part, peer_of) for part in action.parts))
    if action.peer >= 0:
        action = action._replace(peer=peer_of(action.peer))
    return action
