"""Stages placed on rank groups in the runtime: PP x DP, PP x FSDP, PP x CP (``mesh_placement.place_on_mesh``).

A composed program places every stage on a group of k ranks (``ir.Placement``);
member i of k runs each of the stage's computes on rows [i*b/k, (i+1)*b/k) of a
microbatch of b rows (``BatchSource``'s ``share``) and weighs its loss by its share,
1/k, so that the sum over the group of the members' gradients is the whole
microbatch's. This module is what activation passing adds for such programs:

* ``PlacedContext`` (once per run): the groups' process groups (every
  communicator made on every rank in list order, ``comm.communicator_groups``),
  this rank's share, and its sharded stages (``ShardedStage``).
* A replicated stage keeps its whole weights; ``SYNC_GRAD`` all-reduces its flat
  gradient over the group (posted by its EXCHANGE, waited at its EXCHANGE_WAIT).
* A sharded stage keeps shard i of k of its flat weights (padded at the end to a
  multiple of k), which its optimizer steps. Its module's parameters are views
  of one whole flat vector whose storage exists only between a GATHER and the
  RESHARD after it: ``GATHER``, a sub-step run before its compute's body, gives
  the vector its storage back and all-gathers the shards into it; ``RESHARD``
  frees the storage (``resize_(0)``, as FSDP2 frees an unsharded parameter);
  ``REDUCE_GRAD`` reduce-scatters the whole flat gradient so that the member
  keeps the group's sum of its shard, the shard's gradient.
* A hybrid sharded stage (HSDP, ``Placement.hybrid``) is a sharded stage whose
  weights are cut over the member's shard group only (GATHER, RESHARD and
  REDUCE_GRAD there); ``SYNC_SHARD``, posted once the REDUCE_GRAD was waited,
  all-reduces the shard's gradient over its replica group (the members holding
  the same shard), so every replica steps on the whole group's sum.

A context-parallel stage (PP x CP, ``Placement.split`` = ``SEQUENCE_SHARE``) keeps
its whole weights and all-reduces its gradient as a replicated one; member i runs
every row of each microbatch, but of each sequence only ring rank i's chunks of
``Program.stage_ring`` (``data.TokenShare``), and hands the next stage's member i
its tokens. Each call of the stage's module is given ``positions=`` (those
tokens' global positions) and ``attend=`` (every attention runs ``stage_ring``'s
row i over the group: ``StageRing``, ``sequence.ring_attend``), so each F, FC and R
is a meeting of the group (the ring's forward half settles inside the call) and
so is each B (the ring's backward halves, as autograd reaches them). Its loss
weighs 1/C, the mean over its tokens of equal shares.

The parameters stay the same ``nn.Parameter`` objects, viewing the same storage,
throughout, so autograd, the flat gradient buffer their ``.grad`` views, and
split backward (I, W) see one set of parameters; what a forward saved for its
backward views that storage too, so it is freed at a RESHARD between the two and
holds the gathered weights again when the backward runs. Why not torch's FSDP2
(``fully_shard``): docs/runtime.md, "Stages on rank groups".
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from pipec.compiler import ops
from pipec.compiler.ir import Action, Program
from pipec.dsl.composition import PP_AXIS
from pipec.errors import RuntimeFault, UsageError
from pipec.runtime import comm
from pipec.runtime.exchange import Exchange, check_all_waited, post_exchange, wait_exchange
from pipec.runtime.data import TokenShare
from pipec.runtime.family import share_of
from pipec.runtime.flat import bind_flat_grads
from pipec.runtime.model import RingModel
from pipec.runtime.rings import RingContext, token_positions
from pipec.runtime.sequence import check_ring_model, ring_attend


@dataclass
class ShardedStage:
    """One sharded stage's weights on this member.

    Attributes:
        stage: the stage id.
        params: the module's trainable parameters, views of ``whole``.
        names: their names in the module (``named_parameters``), the whole model's names.
        shapes: their shapes.
        size: the flat vector's length; ``padded``: rounded up to whole shards, ``shard * members``.
        shard: this member's piece of the flat weights, what the optimizer steps (its ``.grad`` bound).
        member, members: this rank's place in the group its weights are sharded over, and its size.
        group: that group's process group (under HSDP the member's shard group).
        whole: the padded flat weights the parameters view; its storage is freed while resharded.
        gathered: whether ``whole`` has its storage (and, once its gather is waited, the weights).
        replicas: HSDP: the process group of the members holding this shard (its replica group), else None.
        counted: whether this member counts its shard's gradient in the global norm (under HSDP only the
            first of its replica group: the replicas' are equal).
    """

    stage: int
    params: list[nn.Parameter]
    names: list[str]
    shapes: list[torch.Size]
    size: int
    padded: int
    shard: nn.Parameter
    member: int
    members: int
    group: comm.ReplicaGroup
    whole: torch.Tensor
    gathered: bool = True
    replicas: comm.ReplicaGroup | None = None
    counted: bool = True

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat``'s pieces shaped like the parameters, in order."""
        out, offset = [], 0
        for shape in self.shapes:
            out.append(flat[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out

    def make_room(self) -> torch.Tensor:
        """``whole`` with its storage back (its contents undefined until a gather fills it)."""
        if not self.gathered:
            self.whole.untyped_storage().resize_(self.whole.numel() * self.whole.element_size())
            self.gathered = True
        return self.whole

    def drop_whole(self) -> None:
        """Free ``whole``'s storage: neither the module nor what autograd saved of it keeps a whole copy."""
        self.whole.untyped_storage().resize_(0)
        self.gathered = False


@dataclass
class StageRing:
    """A context-parallel member's ring: what every attention of its stages' forwards runs.

    Attributes:
        contexts: communicator id -> ``stage_ring``'s row of this member's ring rank over that communicator's
            group: a stage's attentions run on its own group's communicator, where the prover counts them
            (``checks/placement.py``), whatever communicator the rank's other stages meet on.
        positions: the global positions of the member's tokens (on the run's device), ``positions=`` of every call.
    """

    contexts: dict[int, RingContext]
    positions: torch.Tensor


@dataclass
class PlacedContext:
    """What a rank of a composed program keeps across steps.

    Attributes:
        share: (i, k): this rank's share of each microbatch's rows (member i of a group of k).
        groups: communicator id -> this rank's process group, for those it is in.
        stage_group: stage id -> its group's communicator id, for this rank's stages.
        sharded: stage id -> its ``ShardedStage``, for this rank's sharded stages.
        ring: a context-parallel member's ``StageRing`` (``start_ring``); None otherwise.
    """

    share: tuple[int, int]
    groups: dict[int, comm.ReplicaGroup]
    stage_group: dict[int, int]
    sharded: dict[int, ShardedStage] = field(default_factory=dict)
    ring: StageRing | None = None


# ------------------------------------------------------------------ what runs


def make_placed(program: Program, rank: int, chunk_modules: dict[int, nn.Module],
                trainable: Callable[[nn.Module], list]) -> tuple[PlacedContext, dict[int, torch.Tensor], list]:
    """Make the groups and cut this rank's shards; collective (every rank, in the same state).

    Args:
        program: a composed program (``family.placed_refusal`` is None for it).
        rank: this rank.
        chunk_modules: chunk -> this rank's module of it (whole weights, as built or resumed).
        trainable: module -> its trainable parameters.
    Returns:
        (the ``PlacedContext``; chunk -> the flat gradient buffer its parameters' ``.grad`` view, padded to
        whole shards for a sharded chunk; the tensors the optimizer steps: a replicated chunk's parameters,
        a sharded chunk's shard).
    """
    groups = comm.communicator_groups(program, rank)
    share = share_of(program, rank)
    mine = [info for info in program.stages if rank in info.ranks]
    placed = PlacedContext(share, groups, {info.id: info.placement.communicator for info in mine})
    flat_grads, stepped = {}, []
    for info in mine:
        module = chunk_modules[info.position]
        params = trainable(module)
        if not info.placement.sharded:
            flat_grads[info.position] = bind_flat_grads(params)
            stepped += params
            continue
        where, group, replicas = _shard_place(program, info, rank, groups)
        sharded, flat_grads[info.position] = shard_stage(info.id, module, params, where, group)
        sharded.replicas, sharded.counted = replicas, not info.placement.hybrid or _first_of_replicas(program, info, rank)
        placed.sharded[info.id] = sharded
        stepped.append(sharded.shard)
    return placed, flat_grads, stepped


def _shard_place(program: Program, info, rank: int, groups: dict) -> tuple[tuple[int, int], comm.ReplicaGroup,
                                                                          comm.ReplicaGroup | None]:
    """((i, k): this rank is member i of the k its stage's weights are sharded over, their process group, the
    process group of the members holding its shard or None): the whole group, or under HSDP its shard and
    replica groups (``Program.communicator_on``)."""
    shard = info.placement.shard_of(rank)  # as stated: the prover proved it is the member's place in the group
    if not info.placement.hybrid:
        return (shard, len(info.ranks)), groups[info.placement.communicator], None
    shard_group = program.communicator_on(Action(info.id, ops.GATHER), rank)
    replica_group = program.communicator_on(Action(info.id, ops.SYNC_SHARD), rank)
    return (shard, len(shard_group.ranks)), groups[shard_group.id], groups.get(replica_group.id)


def _first_of_replicas(program: Program, info, rank: int) -> bool:
    """Whether ``rank`` is the first of the members holding its shard of HSDP stage ``info``."""
    return program.communicator_on(Action(info.id, ops.SYNC_SHARD), rank).ranks[0] == rank


def start_ring(placed: PlacedContext, program: Program, rank: int, seq_len: int | None, device: torch.device,
               timeout: float, synchronize: Callable[[], None] | None = None) -> None:
    """Give a context-parallel member its ``StageRing`` (nothing for another composed program): ring rank
    i of ``program.stage_ring`` over its stages' group, whose process group ``make_placed`` made.

    Raises:
        UsageError: no ``seq_len`` (the model's, ``stage_ring_model``) for a context-parallel program.
    """
    ring = program.stage_ring
    if ring is None:
        return
    if seq_len is None:
        raise UsageError(f"{program.name or 'this program'} splits each sequence over its stages' groups: its "
                         "ranks need the model's seq_len (ring_model(config))")
    member, _ = placed.share  # ring rank i is the member of share i: the prover proved it is group rank i
    contexts = {}
    for info in program.stages:
        communicator = info.placement.communicator
        if rank in info.ranks and communicator not in contexts:
            contexts[communicator] = RingContext(ring, member, timeout=timeout, members=info.placement.ranks,
                                                 group=placed.groups[communicator].group)
            contexts[communicator].synchronize = synchronize
    placed.ring = StageRing(contexts, token_positions(ring.rings, member, seq_len).to(device))


def sequence_arguments(step, stage: int, mb: int) -> dict:
    """The keywords a call of ``stage``'s module takes besides its input: on a context-parallel member
    ``positions=`` and a fresh ``attend=`` (a recompute runs the ring forward again), else none."""
    placed = step.ctx.placed
    if placed is None or placed.ring is None:
        return {}
    attend = ring_attend(placed.ring.contexts[placed.stage_group[stage]], step.ctx.iteration,
                         f"stage {stage}, microbatch {mb}, ")
    return {"positions": placed.ring.positions, "attend": attend}


def stage_ring_model(spec, config, program: Program, name: str) -> RingModel:
    """Check, before any worker starts, that a context-parallel program's stage ring can train the spec's
    model exactly (``sequence.check_ring_model``: the declaration, the mask, the cut); its ``RingModel``."""
    ring = program.stage_ring
    composition = program.name or "this program"
    why = f"{composition} runs every stage's attention through the ring {ring.name} over the stage's group (PP x CP)"
    # the ring is compiled by the composition, from its `context over` line: the mask is an argument there
    axis = next((axis for axis in (program.mesh.names if program.mesh else ()) if axis != PP_AXIS), "AXIS")
    target = os.path.splitext(os.path.basename(ring.source))[0] if ring.source else ring.name
    fix = (f"give the ring the mask in {composition}'s `context over` line: context over {axis} ring "
           f"{ring.name}(causal = {{causal}}) from \"{target}\"")
    return check_ring_model(spec, config, ring, name, why, fix)


def token_share(program: Program, rank: int, seq_len: int) -> TokenShare | None:
    """A context-parallel member's tokens of each sequence (``data.TokenShare``); None for any other rank."""
    share = share_of(program, rank)
    if program.stage_ring is None or share is None:
        return None
    return TokenShare(token_positions(program.stage_ring.rings, share[0], seq_len), seq_len)


def shard_stage(stage: int, module: nn.Module, params: list, share: tuple[int, int],
                   group: comm.ReplicaGroup) -> tuple[ShardedStage, torch.Tensor]:
    """This member's shard of the module's flat weights (a new leaf for the optimizer), the whole copy
    dropped, and the stage's whole flat gradient buffer (``sharded_grads``, bound while the parameters
    still have their shapes: torch refuses a ``.grad`` of another shape)."""
    if len({p.dtype for p in params}) > 1:
        raise UsageError(f"stage {stage} is sharded over its group as one flat vector, so its trainable "
                         f"parameters need one dtype; it has {sorted(str(p.dtype) for p in params)}")
    member, members = share
    size = sum(p.numel() for p in params)
    piece = max(1, -(-size // members))  # a stage with no trainable weights still meets its group: one zero each
    like = params[0] if params else torch.zeros(0)
    whole = torch.zeros(piece * members, dtype=like.dtype, device=like.device)
    if params:
        whole[:size] = torch.cat([p.detach().reshape(-1) for p in params])
    shard = nn.Parameter(whole[member * piece:(member + 1) * piece].clone())
    bind_flat_grads([shard])
    names = {id(p): name for name, p in module.named_parameters()}
    sharded = ShardedStage(stage, params, [names[id(p)] for p in params], [p.shape for p in params], size,
                           piece * members, shard, member, members, group, whole)
    grads = sharded_grads(sharded)
    for p, view in zip(params, sharded.views(whole)):  # the module's weights live in ``whole`` from now on
        p.data = view
    sharded.drop_whole()
    return sharded, grads


def sharded_grads(sharded: ShardedStage) -> torch.Tensor:
    """The whole flat gradient buffer of a sharded stage, padded to whole shards (the reduce-scatter cuts it
    into equal pieces); every parameter's ``.grad`` a view of its front."""
    flat = torch.zeros(sharded.padded, dtype=sharded.shard.dtype, device=sharded.shard.device)
    for p, view in zip(sharded.params, sharded.views(flat)):
        p.grad = view
    return flat


# ------------------------------------------------------------------ the handlers


def _fault(step, index: int, message: str) -> RuntimeFault:
    return RuntimeFault(message, step.ctx.rank, index, step.ctx.row[index].text())


def _sharded(step, action: Action, index: int) -> ShardedStage:
    """The sharded stage ``action`` (at ``index`` of the list) names, or the fault of a stage that is not one."""
    sharded = step.ctx.placed.sharded.get(action.stage)
    if sharded is None:
        raise _fault(step, index, f"{action.text()} needs stage {action.stage} sharded on this rank (a program the "
                                  "checks did not pass?)")
    return sharded


def _gather(step, part: Action, ex: Exchange) -> None:
    """GATHER: give the stage's whole flat vector its storage back and all-gather the shards into it."""
    sharded = _sharded(step, part, ex.index)
    whole = sharded.make_room()
    ex.works += comm.start_all_gather(whole, sharded.shard.detach(), sharded.group)
    ex.peers.update(sharded.group.peers)
    ex.keep.append(whole)


def _sync_grad(step, part: Action, ex: Exchange) -> None:
    """SYNC_GRAD: all-reduce (sum) the replicated stage's flat gradient over its group, in place."""
    ctx = step.ctx
    group = ctx.placed.groups[ctx.placed.stage_group[part.stage]]
    flat = ctx.flat_grads[ctx.program.stages[part.stage].position]
    ex.works += comm.start_allreduce(flat, group)
    ex.peers.update(group.peers)
    ex.keep.append(flat)


def _reduce_grad(step, part: Action, ex: Exchange) -> None:
    """REDUCE_GRAD: reduce-scatter (sum) the stage's whole flat gradient; the shard's gradient takes this
    member's piece on arrival."""
    sharded = _sharded(step, part, ex.index)
    flat = step.ctx.flat_grads[step.ctx.program.stages[part.stage].position]
    works, mine = comm.start_reduce_scatter(flat, sharded.member, sharded.group)
    ex.works += works
    ex.peers.update(sharded.group.peers)
    ex.keep += [flat, mine]
    ex.arrivals.append(lambda: sharded.shard.grad.copy_(mine))


def _sync_shard(step, part: Action, ex: Exchange) -> None:
    """SYNC_SHARD: all-reduce (sum) this member's shard gradient over the members holding the same shard, in
    place (its REDUCE_GRAD's exchange was waited: the shard's gradient holds the shard group's sum)."""
    sharded = _sharded(step, part, ex.index)
    if sharded.replicas is None:
        raise _fault(step, ex.index, f"{part.text()} needs stage {part.stage} sharded over part of its group "
                                     "(HSDP) on this rank (a program the checks did not pass?)")
    ex.works += comm.start_allreduce(sharded.shard.grad, sharded.replicas)
    ex.peers.update(sharded.replicas.peers)
    ex.keep.append(sharded.shard.grad)


# part op -> its poster (step, part, exchange) -> None: inside an EXCHANGE, or as a compute's sub-step
PART_POSTERS: dict[str, Callable[..., None]] = {ops.GATHER: _gather, ops.SYNC_GRAD: _sync_grad,
                                                 ops.REDUCE_GRAD: _reduce_grad, ops.SYNC_SHARD: _sync_shard}


def _faults(step) -> Callable[[int, str], RuntimeFault]:
    return lambda index, message: _fault(step, index, message)


def exchange(step, action: Action, index: int) -> None:
    """EXCHANGE: post the group collectives it holds (SYNC_GRAD, REDUCE_GRAD, SYNC_SHARD); the list goes on."""
    post_exchange(step, action, index, step.exchanges, PART_POSTERS, fault=_faults(step),
                  refusal="a composed program's exchange cannot hold")


def exchange_wait(step, action: Action, index: int) -> None:
    """EXCHANGE_WAIT: wait for the exchange's collectives, then run their arrivals."""
    wait_exchange(action, index, step.exchanges, step.ctx.row, fault=_faults(step), site=step.site,
                  wait=lambda ex, site: step.wait(ex.works, site))


def reshard(step, action: Action, index: int) -> None:
    """RESHARD: the stage's module drops its whole weights."""
    _sharded(step, action, index).drop_whole()


def run_substeps(step, action: Action, index: int) -> None:
    """A compute's sub-steps (its ``parts``), in order, each waited before the next and the compute's body."""
    for part in action.parts:
        poster = PART_POSTERS.get(part.op)
        if poster is None:
            raise _fault(step, index, f"a compute cannot hold the sub-step {part.text()}")
        ex = Exchange(-1, index)
        poster(step, part, ex)
        if ex.works:
            text = f"{part.text()}, a sub-step of {action.text()}"
            step.wait(ex.works, step.site(index, text, tuple(sorted(ex.peers))))
        for arrive in ex.arrivals:
            arrive()


def with_substeps(handler: Callable) -> Callable:
    """``handler`` of a compute, running the compute's sub-steps first when it holds any."""
    def run(step, action: Action, index: int) -> None:
        if action.parts:
            run_substeps(step, action, index)
        handler(step, action, index)
    return run


def finish(step, end: int) -> None:
    """At the end of a list: no exchange is left open."""
    check_all_waited(step.exchanges, _faults(step))


# op -> handler of the instructions a composed program adds to activation passing's table
HANDLERS: dict[str, Callable] = {ops.EXCHANGE: exchange, ops.EXCHANGE_WAIT: exchange_wait, ops.RESHARD: reshard}


# ------------------------------------------------------------------ checkpoints


def _cpu(value):
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _gathered(context, sharded: ShardedStage, shard: torch.Tensor, what: str,
              whole: torch.Tensor | None = None) -> torch.Tensor:
    """Every member's ``shard`` (a tensor as long as a shard) joined in member order, into ``whole`` (None: a
    new tensor), done when this returns (``comm.settle``: on the CPU for gloo and NCCL alike), within the
    run's timeout."""
    if whole is None:
        whole = torch.empty(sharded.padded, dtype=shard.dtype, device=shard.device)
    site = comm.Site(context.rank, len(context.row), what, sharded.group.peers, context.iteration)
    comm.settle(comm.start_all_gather(whole, shard.detach(), sharded.group), context.timeout, site)
    return whole


def whole_state(context, module: nn.Module, stage: int) -> dict[str, torch.Tensor]:
    """The sharded stage's module state_dict with its whole weights (CPU): its shards all-gathered;
    collective over the stage's group (every member calls it at the same point)."""
    sharded = context.placed.sharded[stage]
    was = sharded.gathered
    _gathered(context, sharded, sharded.shard, f"the checkpoint's gather of stage {stage}'s shards",
              sharded.make_room())
    state = {name: tensor.detach().cpu().clone() for name, tensor in module.state_dict().items()}
    if not was:
        sharded.drop_whole()
    return state


def whole_optimizer_state(context, stage: int) -> dict[str, dict]:
    """The named optimizer state of a sharded stage's parameters (CPU): a state tensor as long as the
    shard (a momentum) all-gathered from every member and cut per parameter; anything else (a step count)
    is the same on every member. Collective over the stage's group."""
    sharded = context.placed.sharded[stage]
    optimizer = context.optimizer
    state = optimizer.state.get(sharded.shard, {}) if optimizer is not None else {}
    out: dict[str, dict] = {}
    for key, value in sorted(state.items()):  # every member's state has the same keys: the same order
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            whole = _gathered(context, sharded, value, f"the checkpoint's gather of stage {stage}'s {key}")
            for name, view in zip(sharded.names, sharded.views(whole)):
                out.setdefault(name, {})[key] = view.detach().cpu().clone()
        else:
            for name in sharded.names:
                out.setdefault(name, {})[key] = _cpu(value)
    return out


def checkpoint_part(context, stages: dict) -> dict:
    """This rank's part of a checkpoint of a composed program (CPU copies); collective over each group.

    A stage's state is given by its saver only (``Placement.saver``, as the program states it: a replicated
    stage's members hold equal weights; a sharded stage's shards are all-gathered first, ``whole_state``), so
    that the merge keeps one copy of each.
    """
    model, optimizer = {}, {}
    own = context.placed
    names = {id(p): name for module in stages.values() for name, p in module.named_parameters()}
    for stage in sorted(stages):
        module, first = stages[stage], context.program.stages[stage].placement.saver == context.rank
        if stage in own.sharded:
            state = whole_state(context, module, stage)
            moments = whole_optimizer_state(context, stage)
        else:
            state = {name: tensor.detach().cpu().clone() for name, tensor in module.state_dict().items()}
            params = [p for p in module.parameters() if p.requires_grad]
            moments = {names[id(p)]: {key: _cpu(value) for key, value in context.optimizer.state[p].items()}
                       for p in params if context.optimizer is not None and context.optimizer.state.get(p)}
        if first:
            model.update(state)
            optimizer.update(moments)
    return {"model": model, "optimizer": optimizer}


def optimizer_names(context, stages: dict, saved: dict) -> tuple[dict[int, str], dict]:
    """(id of every tensor this rank's optimizer steps -> a name, the named state to load by them): a replicated
    stage's parameters by their own names, a sharded stage's shard by ``stage S's shard`` with its piece of
    the checkpoint's state (``shard_state``)."""
    names = {id(p): name for module in stages.values() for name, p in module.named_parameters()}
    state = dict(saved)
    for stage, sharded in context.placed.sharded.items():
        name = f"stage {stage}'s shard"
        names[id(sharded.shard)] = name
        piece = shard_state(sharded, saved)
        if piece is not None:
            state[name] = piece
    return names, state


def counted_gradients(context) -> list[torch.Tensor]:
    """The gradients this rank counts in the global norm: a replicated stage's by its saver (``Placement.saver``),
    a sharded stage's shard by every member (the shards are disjoint, their padding zero), under HSDP by the
    first member of its replica group (``ShardedStage.counted``)."""
    own, program = context.placed, context.program
    counted = [s.shard.grad for s in own.sharded.values() if s.counted]
    saved = {program.stages[stage].position for stage in own.stage_group
             if stage not in own.sharded and program.stages[stage].placement.saver == context.rank}
    counted += [flat for chunk, flat in context.flat_grads.items() if chunk in saved]
    return counted


def shard_state(sharded: ShardedStage, saved: dict) -> dict | None:
    """This member's shard of the named state ``saved`` keeps for the stage's parameters (the inverse of
    ``whole_optimizer_state``), or None when the checkpoint holds none for them."""
    entries = [saved.get(name) for name in sharded.names]
    if not entries or not all(entries):
        return None
    piece = sharded.padded // sharded.members
    out = {}
    for key, first in entries[0].items():
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            flat = torch.zeros(sharded.padded, dtype=first.dtype)
            flat[:sharded.size] = torch.cat([entry[key].reshape(-1) for entry in entries])
            out[key] = flat[sharded.member * piece:(sharded.member + 1) * piece].clone()
        else:
            out[key] = first
    return out


__all__ = ["HANDLERS", "PART_POSTERS", "PlacedContext", "ShardedStage", "StageRing", "checkpoint_part",
           "counted_gradients", "exchange", "exchange_wait", "finish", "make_placed", "optimizer_names", "reshard",
           "run_substeps", "sequence_arguments", "shard_stage", "shard_state", "sharded_grads", "stage_ring_model",
           "start_ring", "token_share", "whole_optimizer_state", "whole_state", "with_substeps"]
