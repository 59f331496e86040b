"""Weight passing in the runtime: layers' weights travel, activations stay on their rank.

A weight-passing program (``Program.weights`` set; ``compiler/lower_weights.py``
says what it means, ``compiler/checks/weights.py`` runs it symbolically) has one
pipeline per rank: rank r keeps its own microbatches and runs every layer on
them, stage ``s`` computing layer ``program.stages[s].position``. What moves
is a layer's weights, to the ranks that run it, and its weight gradient, back
to the layer's owner (``WeightPlan.owners``; under ``all_gather`` every rank
keeps a 1/P shard of every layer instead). This module is the interpreter's
part for that family, mirroring the symbolic executor op for op.

The parts (the weight context once per run, the step state, the handlers,
the end of a step) are ``WeightPassing``'s docstring, the family's hooks that
``runtime/family.py`` registers.

Everything a program that passed the checks never does (a copy missing at a
compute, an add to a partial in flight, a ring step whose giver holds another
layer) is a ``RuntimeFault`` naming the rank, the instruction and the value,
never a wrong number or a hang.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.func import functional_call

from pipec.compiler import ops
from pipec.compiler.ir import Action, Program, WeightPlan
from pipec.errors import ProgramError, RuntimeFault
from pipec.runtime import comm, payload
from pipec.runtime.checkpoint import load_optimizer_state, named_optimizer_state, parameter_names
from pipec.runtime.family import register, share_of
from pipec.runtime.interpreter import HANDLERS as HANDLERS_OF_STAGES, ActivationPassing, Trained
from pipec.runtime.exchange import Exchange, FaultMaker, PartHandler, check_all_waited, post_exchange, wait_exchange
from pipec.runtime.flat import bind_flat_grads

ACT, GRAD = ops.MESSAGE_KIND_CODE["act"], ops.MESSAGE_KIND_CODE["grad"]
FORWARD, BACKWARD = ops.FORWARD, ops.BACKWARD
_SHIFTS = (ops.SHIFT_F, ops.SHIFT_B, ops.SHIFT_G)
# A point-to-point tag per kind of value: gloo matches each on its own FIFO
# channel per pair, so a weight never meets a gradient's receive. NCCL ignores
# tags; there the program's order per pair (proven by the checks) matches them.
_TAGS = {ops.SEND_W: 1, ops.RECV_W: 1, ops.SEND_G: 2, ops.RECV_G: 2,
         ops.SHIFT_F: 3, ops.SHIFT_B: 4, ops.SHIFT_G: 5}


class LayerLayout(NamedTuple):
    """How a layer's trainable parameters lie in its flat weight vector.

    Attributes:
        names: the parameters' names in the module (``named_parameters()`` order).
        shapes: their shapes.
        size: the flat vector's length.
        shard: under ``all_gather``, one rank's piece: ``ceil(size / P)`` (at least 1).
        padded: the flat vector's length padded to whole shards, ``shard * P``.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    size: int
    shard: int
    padded: int


def trainable(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of the module's trainable parameters, in ``parameters()`` order."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def layer_layout(module: nn.Module, num_ranks: int) -> LayerLayout:
    """The flat layout of ``module``'s trainable parameters (one dtype)."""
    named = trainable(module)
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) > 1:
        raise ValueError(f"weight passing moves a layer as one flat vector, so its trainable parameters need "
                         f"one dtype; this one has {sorted(map(str, dtypes))}")
    size = sum(p.numel() for _, p in named)
    shard = max(1, -(-size // num_ranks))
    return LayerLayout(tuple(n for n, _ in named), tuple(p.shape for _, p in named), size, shard, shard * num_ranks)


def flat_weights(module: nn.Module) -> torch.Tensor:
    """A new flat vector of ``module``'s trainable parameters (detached)."""
    params = [p.detach().reshape(-1) for _, p in trainable(module)]
    return torch.cat(params) if params else torch.zeros(0)


def params_from_flat(layout: LayerLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Name -> a view of ``flat`` shaped like that parameter (for ``functional_call``)."""
    out, offset = {}, 0
    for name, shape in zip(layout.names, layout.shapes):
        count = shape.numel()
        out[name] = flat[offset:offset + count].view(shape)
        offset += count
    return out


@dataclass
class WeightContext:
    """What one rank keeps across steps for a weight-passing program.

    Attributes:
        plan: the program's ``WeightPlan``.
        rank, num_ranks: this rank, P.
        layer_of: stage id -> its layer (``StageInfo.position``).
        modules: layer -> this rank's module of it (masters of owned layers;
            the structure ``functional_call`` runs for the others).
        layouts: layer -> its ``LayerLayout``.
        owned: the layers whose masters and optimizer state this rank keeps
            (every layer under ``all_gather``: a shard of each).
        shards: under ``all_gather``, layer -> this rank's shard (a leaf the
            optimizer steps); empty otherwise.
        grads: layer -> the flat fp32 buffer the master's (or shard's) ``.grad`` views.
        groups: communicator id -> this rank's group (two or more members).
        successor, predecessor: under a ring, the ranks this rank passes to and takes from.
        successor_takes: (exchange, shift op, step) -> the layer the successor's
            ring step takes there, or -1 (a rank sends only what is taken).
        device: where masters, copies and partials live.
    """

    plan: WeightPlan
    rank: int
    num_ranks: int
    layer_of: list[int]
    modules: dict[int, nn.Module]
    layouts: dict[int, LayerLayout]
    owned: tuple[int, ...]
    shards: dict[int, torch.Tensor]
    grads: dict[int, torch.Tensor]
    groups: dict[int, comm.ReplicaGroup]
    successor: int
    predecessor: int
    successor_takes: dict[tuple[int, str, int], int]
    device: torch.device

    @property
    def sharded(self) -> bool:
        return self.plan.owners is None

    def owns(self, layer: int) -> bool:
        """Whether this rank keeps ``layer``'s whole master (never under ``all_gather``; on a mesh, its replica's)."""
        return self.plan.owns(self.rank, layer)

    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer steps: the owned layers' parameters, or the shards, in layer order."""
        if self.sharded:
            return [self.shards[layer] for layer in sorted(self.shards)]
        return [p for layer in self.owned for _, p in trainable(self.modules[layer])]


def make_weight_context(program: Program, rank: int, stages: dict[int, nn.Module], device: torch.device,
                        groups: dict[int, comm.ReplicaGroup] | None = None) -> WeightContext:
    """Prepare a rank for a weight-passing program; collective (it creates the communicators).

    Args:
        program: the program, ``weights`` set, the same on every rank.
        rank: this rank.
        stages: stage id -> module for this rank's stages (every layer: its pipeline).
        device: where the modules are.
        groups: the communicators already made (``comm.communicator_groups``); made here when None.
    Returns:
        the ``WeightContext``; the masters' ``.grad`` are zeroed views into ``grads``.
    Raises:
        ProgramError: a layer with no stage on this rank (every rank runs every
            layer in this family), or a ring that passes to its own rank.
    """
    plan, num_ranks = program.weights, program.num_ranks
    layer_of = [info.position for info in program.stages]
    modules: dict[int, nn.Module] = {}
    for stage in sorted(stages):
        modules.setdefault(layer_of[stage], stages[stage])
    missing = [layer for layer in range(program.num_chunks) if layer not in modules]
    if missing:
        raise ProgramError(f"weight passing runs every layer on every rank, but this rank has no stage of "
                           f"layer {missing[0]}", rank, 0, program.grid())
    try:
        layouts = {layer: layer_layout(module, num_ranks) for layer, module in modules.items()}
    except ValueError as error:
        raise ProgramError(str(error), rank, 0, program.grid()) from None
    if plan.owners is None:
        owned = tuple(sorted(modules))
        shards = {layer: _shard_of(modules[layer], layouts[layer], rank) for layer in owned}
        grads = {layer: bind_flat_grads([shard]) for layer, shard in shards.items()}
    else:
        owned = tuple(layer for layer in sorted(modules) if plan.owns(rank, layer))
        shards = {}
        grads = {layer: bind_flat_grads([p for _, p in trainable(modules[layer])]) for layer in owned}
    successor = predecessor = rank
    if plan.route == "ring" or plan.gradients == "ring":
        successor, predecessor = (rank + plan.ring_by) % num_ranks, (rank - plan.ring_by) % num_ranks
        if successor == rank and num_ranks > 1:
            raise ProgramError(f"the ring passes by {plan.ring_by}, a multiple of {num_ranks} ranks: every slot "
                               "would stay where it is", rank, 0, program.grid())
    return WeightContext(
        plan=plan, rank=rank, num_ranks=num_ranks, layer_of=layer_of, modules=modules, layouts=layouts,
        owned=owned, shards=shards, grads=grads,
        groups=groups if groups is not None else comm.communicator_groups(program, rank),
        successor=successor, predecessor=predecessor,
        successor_takes=_ring_takes(program, successor, layer_of), device=torch.device(device))


def _shard_of(module: nn.Module, layout: LayerLayout, rank: int) -> torch.Tensor:
    """This rank's shard of the module's flat weights (padded with zeros), a new leaf for the optimizer."""
    flat = flat_weights(module)
    padded = torch.zeros(layout.padded, dtype=flat.dtype, device=flat.device)
    padded[:layout.size] = flat
    return padded[rank * layout.shard:(rank + 1) * layout.shard].clone().requires_grad_(True)


def _ring_takes(program: Program, successor: int, layer_of: list[int]) -> dict[tuple[int, str, int], int]:
    """(exchange, shift op, step) -> the layer ``successor``'s ring step takes (or -1), from its list."""
    takes = {}
    for action in program.ranks[successor]:
        if action.op in ops.EXCHANGE_OPS:
            for part in action.parts:
                if part.op in _SHIFTS:
                    takes[(action.mb, part.op, part.mb)] = layer_of[part.stage] if part.stage >= 0 else -1
    return takes


# ------------------------------------------------------------------ one step


@dataclass
class WeightStep:
    """What a rank holds during one training step of a weight-passing program.

    Attributes:
        copies: key -> (layer, flat weights): ``("W", layer, step)`` delivered
            copies and ``(pass, step)`` ring slots, present (their exchange waited).
        arriving: keys of copies posted and not waited.
        masters: layer -> the owned master's flat weights this step (made on first use).
        accumulated: layer -> this rank's fp32 partial of its weight gradient.
        in_flight: layer -> the exchange sending or reducing that partial (no add meanwhile).
        partial: the ring gradient slot, (layer, fp32 partial), or None.
        partial_arriving: a ring step brings this rank's next gradient slot, not waited yet.
        open: exchange number -> the posted ``exchange.Exchange``.
        stash: stage * N + mb -> (layer, weight gradient) an I left for its W.
    """

    copies: dict = field(default_factory=dict)
    arriving: set = field(default_factory=set)
    masters: dict = field(default_factory=dict)
    accumulated: dict = field(default_factory=dict)
    in_flight: dict = field(default_factory=dict)
    partial: tuple[int, torch.Tensor] | None = None
    partial_arriving: bool = False
    open: dict = field(default_factory=dict)
    stash: dict = field(default_factory=dict)


def _fault(step, index: int, message: str, peer: int | None = None) -> RuntimeFault:
    ctx = step.ctx
    return RuntimeFault(message, ctx.rank, index, ctx.row[index].text() if index < len(ctx.row) else "the step's end",
                        peer)


def _faults(step) -> FaultMaker:
    """``_fault`` of this step, as the exchange machinery (``runtime/exchange.py``) raises it."""
    return lambda index, message: _fault(step, index, message)


def _master(step, layer: int) -> torch.Tensor:
    """The owned master's flat weights, made once per step (the masters change only at the optimizer step)."""
    masters = step.weights.masters
    if layer not in masters:
        masters[layer] = flat_weights(step.ctx.weights.modules[layer])
    return masters[layer]


def _held(step, layer: int, kinds: tuple) -> torch.Tensor | None:
    """A present copy of ``layer`` whose key starts with one of ``kinds`` ("W", a pass), or None."""
    for key, (held_layer, tensor) in step.weights.copies.items():
        if held_layer == layer and key[0] in kinds:
            return tensor
    return None


def _source(step, layer: int, index: int, what: str) -> torch.Tensor:
    """What this rank sends, broadcasts or fills from: the master it owns, else a copy it holds."""
    if step.ctx.weights.owns(layer):
        return _master(step, layer)
    held = _held(step, layer, ("W", FORWARD, BACKWARD))
    if held is None:
        raise _fault(step, index, f"{what} layer {layer}'s weights, but this rank neither owns layer {layer} nor "
                                  "holds a copy of it here (a program the checks did not pass?)")
    return held


def _new_weights(step, layer: int) -> torch.Tensor:
    wctx = step.ctx.weights
    master = next(iter(wctx.modules[layer].parameters()), None)
    dtype = master.dtype if master is not None else torch.float32
    return torch.empty(wctx.layouts[layer].size, dtype=dtype, device=wctx.device)


def _grad_size(wctx: WeightContext, layer: int) -> int:
    """A partial's length: the flat vector's, padded to whole shards under ``all_gather``."""
    layout = wctx.layouts[layer]
    return layout.padded if wctx.sharded else layout.size


def _deliver(step, key: tuple, layer: int, tensor: torch.Tensor, index: int) -> None:
    ws = step.weights
    ws.arriving.discard(key)
    if key in ws.copies:
        raise _fault(step, index, f"a copy of layer {layer} arrives for {key} while this rank still holds one "
                                  "there (a buffer overwritten before it was dropped)")
    ws.copies[key] = (layer, tensor)


def _expect(step, key: tuple, layer: int, index: int) -> None:
    ws = step.weights
    if key in ws.copies or key in ws.arriving:
        raise _fault(step, index, f"a copy of layer {layer} is posted for {key} while this rank still holds or "
                                  "awaits one there (a buffer overwritten before it was dropped)")
    ws.arriving.add(key)


# -- gradient partials --------------------------------------------------------


def _contribute(step, layer: int, grad: torch.Tensor, index: int) -> None:
    """Add one weight-gradient contribution (a B or W) into the ring slot or the layer's accumulator."""
    wctx, ws = step.ctx.weights, step.weights
    grad = grad.detach().float()
    if wctx.plan.gradients == "ring":
        if ws.partial_arriving:
            raise _fault(step, index, f"it adds layer {layer}'s weight gradient to a ring gradient slot that has not "
                                      "arrived (its exchange is not waited)")
        if ws.partial is None:
            ws.partial = (layer, grad)
        elif ws.partial[0] != layer:
            raise _fault(step, index, f"it adds layer {layer}'s weight gradient, but the ring gradient slot holds "
                                      f"layer {ws.partial[0]}'s")
        else:
            ws.partial[1].add_(grad)
        return
    _add_partial(step, layer, grad, index)


def _add_partial(step, layer: int, grad: torch.Tensor, index: int) -> None:
    """Add ``grad`` into this rank's accumulator of ``layer`` (made on first use, padded under all_gather)."""
    wctx, ws = step.ctx.weights, step.weights
    if layer in ws.in_flight:
        raise _fault(step, index, f"it adds to layer {layer}'s gradient partial while exchange "
                                  f"{ws.in_flight[layer]} is sending or reducing it (the add would race the transfer)")
    partial = ws.accumulated.get(layer)
    if partial is None:
        partial = ws.accumulated[layer] = torch.zeros(_grad_size(wctx, layer), dtype=torch.float32,
                                                      device=wctx.device)
    partial[:grad.numel()].add_(grad)


def _lend(step, layer: int, ex: Exchange, index: int) -> torch.Tensor:
    """This rank's accumulated partial of ``layer`` (zeros when it has none), now in flight with ``ex``."""
    wctx, ws = step.ctx.weights, step.weights
    if layer in ws.in_flight:
        raise _fault(step, index, f"layer {layer}'s gradient partial is taken while exchange {ws.in_flight[layer]} "
                                  "still has it in flight")
    ws.in_flight[layer] = ex.number
    partial = ws.accumulated.get(layer)
    if partial is None:
        partial = torch.zeros(_grad_size(wctx, layer), dtype=torch.float32, device=wctx.device)
    return partial


def _settle_lent(step, layer: int, number: int) -> None:
    """Once the exchange that took the partial is waited, the partial has left this rank."""
    ws = step.weights
    if ws.in_flight.get(layer) == number:
        del ws.in_flight[layer]
        ws.accumulated.pop(layer, None)


def _strand(step, partial: tuple[int, torch.Tensor], index: int) -> None:
    """A ring gradient slot no one takes stays with its holder, who must own the layer: fold it in."""
    layer, tensor = partial
    if not step.ctx.weights.owns(layer):
        raise _fault(step, index, f"the gradient partial of layer {layer} this rank holds goes nowhere: the next "
                                  f"rank takes none and this rank does not own layer {layer}")
    _add_partial(step, layer, tensor, index)


# -- computes -----------------------------------------------------------------


def _weights_for(step, action: Action, index: int, layer: int) -> torch.Tensor:
    """The weights a compute runs on: its pass's ring slot, or the master it owns, or a delivered copy."""
    wctx = step.ctx.weights
    pass_ = ops.WEIGHT_PASS[action[1]]
    if wctx.plan.route == "ring":
        held = _held(step, layer, (pass_,))
        if held is None:
            raise _fault(step, index, f"it runs layer {layer} {pass_}, but this rank's {pass_} ring slot does not "
                                      "hold it (a program the checks did not pass?)")
        return held
    if wctx.owns(layer):
        return _master(step, layer)
    held = _held(step, layer, ("W",))
    if held is None:
        arriving = any(key[0] == "W" and key[1] == layer for key in step.weights.arriving)
        why = "its copy is posted but not waited" if arriving else "no copy of it is here"
        raise _fault(step, index, f"it runs layer {layer}, but this rank does not own it and {why}")
    return held


def forward(step, action: Action, index: int) -> None:
    """F: run the layer on the microbatch without autograd; keep its input for the backward."""
    ctx = step.ctx
    wctx = ctx.weights
    stage, mb = action[0], action[2]
    layer = wctx.layer_of[stage]
    weights = _weights_for(step, action, index, layer)
    x = step.inputs[mb] if ctx.prev[stage] < 0 else step.take(ACT, ctx.prev[stage], mb, index)
    with torch.no_grad(), ctx.precision.autocast(ctx.device):
        out = functional_call(wctx.modules[layer], params_from_flat(wctx.layouts[layer], weights),
                              *payload.arguments(x))
        if ctx.next[stage] < 0:
            loss = ctx.loss_fn(out, step.targets[mb]) / (step.num_microbatches * _row_shares(ctx))
            step.loss = loss if step.loss is None else step.loss + loss
        else:
            step.produced[step.key(ACT, stage, mb)] = out
    step.saved[stage * step.num_microbatches + mb] = (x, None)


def _recompute(step, action: Action, index: int) -> tuple[int, torch.Tensor]:
    """Recompute the forward with the weights as a leaf; hand the input's gradient on; return (layer, weight grad)."""
    ctx = step.ctx
    wctx = ctx.weights
    stage, mb = action[0], action[2]
    layer = wctx.layer_of[stage]
    saved = step.saved.get(stage * step.num_microbatches + mb)
    if saved is None:
        raise _fault(step, index, f"the input of stage {stage}, microbatch {mb} is not kept here (no forward "
                                  "before it, or freed)")
    first, last = ctx.prev[stage] < 0, ctx.next[stage] < 0
    out_grad = None if last else step.take(GRAD, ctx.next[stage], mb, index)
    weights = _weights_for(step, action, index, layer).detach().requires_grad_(True)
    # the input's floating leaves carry gradients back, as the stage before hands them its (list of) gradients
    x, leaves = (saved[0], []) if first else payload.input_leaves(payload.floating_layout(saved[0]), saved[0])
    with torch.enable_grad():
        with ctx.precision.autocast(ctx.device):
            out = functional_call(wctx.modules[layer], params_from_flat(wctx.layouts[layer], weights),
                                  *payload.arguments(x))
            if last:
                out = ctx.loss_fn(out, step.targets[mb]) / (step.num_microbatches * _row_shares(ctx))
        roots, grads = ([out], None) if last else payload.backward_roots(payload.floating_layout(out), out, out_grad)
        found = torch.autograd.grad(roots, [weights, *leaves], grads, allow_unused=True)
    if not first:
        step.produced[step.key(GRAD, stage, mb)] = [g if g is not None else torch.zeros_like(x)
                                                    for g, x in zip(found[1:], leaves)]
    return layer, found[0] if found[0] is not None else torch.zeros_like(weights)


def _row_shares(ctx) -> int:
    """k: a replica of a mesh of k runs 1/k of each microbatch's rows, so its loss weighs 1/k (1 off a mesh)."""
    share = share_of(ctx.program, ctx.rank)
    return 1 if share is None else share[1]


def backward(step, action: Action, index: int) -> None:
    """B: the input's gradient for the stage before, and the weight gradient as a contribution."""
    layer, grad = _recompute(step, action, index)
    _contribute(step, layer, grad, index)


def input_grad(step, action: Action, index: int) -> None:
    """I: what B does, the weight gradient stashed for the W (added where the program says: at the W)."""
    step.weights.stash[action[0] * step.num_microbatches + action[2]] = _recompute(step, action, index)


def weight_grad(step, action: Action, index: int) -> None:
    """W: add what the I of the same (stage, microbatch) stashed."""
    stashed = step.weights.stash.pop(action[0] * step.num_microbatches + action[2], None)
    if stashed is None:
        raise _fault(step, index, "no I of this stage and microbatch ran before it")
    _contribute(step, stashed[0], stashed[1], index)


def free_copy(step, action: Action, index: int) -> None:
    """FREE_W: drop the copy of the layer delivered for step ``mb``."""
    ws = step.weights
    key = ("W", step.ctx.weights.layer_of[action[0]], action[2])
    if ws.copies.pop(key, None) is None:
        what = "still arriving (its exchange is not waited)" if key in ws.arriving else "not held"
        raise _fault(step, index, f"it drops a copy that is {what}")


# -- exchanges ----------------------------------------------------------------


def exchange(step, action: Action, index: int) -> None:
    """EXCHANGE: post every part in list order; point-to-point parts go out together at the end, per group."""
    post_exchange(step, action, index, step.weights.open, PART_POSTERS, fault=_faults(step),
                  refusal="an exchange cannot hold", groups=step.ctx.weights.groups)


def exchange_wait(step, action: Action, index: int) -> None:
    """EXCHANGE_WAIT: wait for every part of exchange ``mb`` on this rank, then apply what arrived."""
    wait_exchange(action, index, step.weights.open, step.ctx.row, fault=_faults(step), site=step.site,
                  wait=lambda ex, site: step.wait(ex.works, site))


def _layer(step, part: Action) -> int:
    return step.ctx.weights.layer_of[part[0]] if part[0] >= 0 else -1


def _send_w(step, part: Action, ex: Exchange) -> None:
    tensor = _source(step, _layer(step, part), ex.index, f"{part.text()} sends")
    ex.send(tensor, part[3], _TAGS[part[1]])


def _recv_w(step, part: Action, ex: Exchange) -> None:
    layer, key = _layer(step, part), ("W", _layer(step, part), part[2])
    buffer = _new_weights(step, layer)
    _expect(step, key, layer, ex.index)
    ex.receive(buffer, part[3], _TAGS[part[1]])
    ex.arrivals.append(lambda: _deliver(step, key, layer, buffer, ex.index))


def _send_g(step, part: Action, ex: Exchange) -> None:
    ws, layer = step.weights, _layer(step, part)
    if step.ctx.weights.plan.gradients == "ring" and ws.partial is not None and ws.partial[0] == layer:
        tensor, ws.partial = ws.partial[1], None  # the ring slot leaves for the owner
    else:
        tensor = _lend(step, layer, ex, ex.index)
        ex.arrivals.append(lambda: _settle_lent(step, layer, ex.number))
    ex.send(tensor, part[3], _TAGS[part[1]])


def _recv_g(step, part: Action, ex: Exchange) -> None:
    layer = _layer(step, part)
    wctx = step.ctx.weights
    buffer = torch.empty(_grad_size(wctx, layer), dtype=torch.float32, device=wctx.device)
    ex.receive(buffer, part[3], _TAGS[part[1]])
    ex.arrivals.append(lambda: _add_partial(step, layer, buffer, ex.index))


def _ring_group(step, part: Action, ex: Exchange) -> int:
    """The communicator id of the ring a SHIFT meets on."""
    communicator = step.ctx.program.communicator_on(part, step.ctx.rank)
    if communicator is None or communicator.id not in step.ctx.weights.groups:
        raise _fault(step, ex.index, f"{part.text()} meets on no ring of two or more ranks that has this rank")
    return communicator.id


def _successor_takes(step, part: Action, ex: Exchange) -> int:
    taken = step.ctx.weights.successor_takes.get((ex.number, part[1], part[2]))
    if taken is None:
        raise _fault(step, ex.index, f"{part.text()}: rank {step.ctx.weights.successor}'s exchange {ex.number} has "
                                     "no such ring step", step.ctx.weights.successor)
    return taken


def _shift_weights(step, part: Action, ex: Exchange) -> None:
    """SHIFT_F / SHIFT_B: pass this rank's slot of step t - 1 on (if the successor takes it), take the predecessor's."""
    wctx, ws = step.ctx.weights, step.weights
    op, t = part[1], part[2]
    pass_ = ops.PASS_OF_SLOT_OP[op]
    group, taken, layer = _ring_group(step, part, ex), _successor_takes(step, part, ex), _layer(step, part)
    given = (pass_, t - 1)
    if given in ws.arriving:
        raise _fault(step, ex.index, f"{part.text()} passes on the {pass_} slot of step {t - 1} before it arrived")
    held = ws.copies.get(given)
    if taken >= 0:
        if held is None or held[0] != taken:
            what = "nothing" if held is None else f"layer {held[0]}"
            raise _fault(step, ex.index, f"{part.text()}: rank {wctx.successor} takes layer {taken} from this rank's "
                                         f"{pass_} slot of step {t - 1}, which holds {what}", wctx.successor)
        ex.send(held[1], wctx.successor, _TAGS[op], group)
    if held is not None:  # the slot is passed on (or no longer needed): dropped once the step is waited
        ex.arrivals.append(lambda: ws.copies.pop(given, None))
    if layer >= 0:
        key, buffer = (pass_, t), _new_weights(step, layer)
        _expect(step, key, layer, ex.index)
        ex.receive(buffer, wctx.predecessor, _TAGS[op], group)
        ex.arrivals.append(lambda: _deliver(step, key, layer, buffer, ex.index))


def _shift_gradient(step, part: Action, ex: Exchange) -> None:
    """SHIFT_G: pass the ring gradient slot on (or fold it in, when no one takes it); take the predecessor's."""
    wctx, ws = step.ctx.weights, step.weights
    group, taken, layer = _ring_group(step, part, ex), _successor_takes(step, part, ex), _layer(step, part)
    if ws.partial_arriving:
        raise _fault(step, ex.index, f"{part.text()} passes on a gradient slot that has not arrived")
    held, ws.partial = ws.partial, None
    if taken >= 0:
        if held is None or held[0] != taken:
            what = "no partial" if held is None else f"layer {held[0]}'s partial"
            raise _fault(step, ex.index, f"{part.text()}: rank {wctx.successor} takes layer {taken}'s gradient "
                                         f"partial, but this rank holds {what}", wctx.successor)
        ex.send(held[1], wctx.successor, _TAGS[part[1]], group)
    elif held is not None:
        _strand(step, held, ex.index)
    if layer >= 0:
        buffer = torch.empty(_grad_size(wctx, layer), dtype=torch.float32, device=wctx.device)
        ws.partial_arriving = True
        ex.receive(buffer, wctx.predecessor, _TAGS[part[1]], group)

        def arrive() -> None:
            ws.partial, ws.partial_arriving = (layer, buffer), False

        ex.arrivals.append(arrive)


def _fill(step, part: Action, ex: Exchange) -> None:
    """FILL_F / FILL_B: a copy of the layer into this rank's slot of step ``mb``, from its master or its other slot."""
    pass_, layer = ops.PASS_OF_SLOT_OP[part[1]], _layer(step, part)
    source = _source(step, layer, ex.index, f"{part.text()} fills the {pass_} slot with")
    key = (pass_, part[2])
    _expect(step, key, layer, ex.index)
    _deliver(step, key, layer, source.clone(), ex.index)  # local: done when posted


def _group_of(step, part: Action, ex: Exchange) -> tuple[comm.ReplicaGroup | None, tuple[int, ...]]:
    """(this rank's process group for the collective, or None when it is the only member; the members)."""
    communicator = step.ctx.program.communicator_on(part, step.ctx.rank)
    if communicator is None or step.ctx.rank not in communicator.ranks:
        raise _fault(step, ex.index, f"{part.text()} meets on no communicator of the program that has this rank")
    ex.peers.update(r for r in communicator.ranks if r != step.ctx.rank)
    return step.ctx.weights.groups.get(communicator.id), communicator.ranks


def _bcast_w(step, part: Action, ex: Exchange) -> None:
    layer, root, t = _layer(step, part), part[3], part[2]
    group, members = _group_of(step, part, ex)
    if root not in members:
        raise _fault(step, ex.index, f"{part.text()} broadcasts from rank {root}, not a member of its group")
    if root == step.ctx.rank:
        source = _source(step, layer, ex.index, f"{part.text()} broadcasts")
        if group is not None:
            ex.works += comm.start_broadcast(source, root, group)
        return
    key, buffer = ("W", layer, t), _new_weights(step, layer)
    _expect(step, key, layer, ex.index)
    ex.works += comm.start_broadcast(buffer, root, group)
    ex.arrivals.append(lambda: _deliver(step, key, layer, buffer, ex.index))


def _reduce_g(step, part: Action, ex: Exchange) -> None:
    ws, layer, root = step.weights, _layer(step, part), part[3]
    group, members = _group_of(step, part, ex)
    if root not in members:
        raise _fault(step, ex.index, f"{part.text()} reduces to rank {root}, not a member of its group")
    partial = _lend(step, layer, ex, ex.index)
    if group is not None:
        ex.works += comm.start_reduce(partial, root, group)

    def arrive() -> None:
        _settle_lent(step, layer, ex.number)
        if root == step.ctx.rank:  # the root's accumulator is now the group's sum
            ws.accumulated[layer] = partial

    ex.arrivals.append(arrive)


def _allgather_w(step, part: Action, ex: Exchange) -> None:
    wctx, layer = step.ctx.weights, _layer(step, part)
    if not wctx.sharded:
        raise _fault(step, ex.index, f"{part.text()} gathers shards, but the program's layers have owners")
    group, _ = _group_of(step, part, ex)
    layout, key = wctx.layouts[layer], ("W", layer, part[2])
    shard = wctx.shards[layer].detach()
    if group is None:  # one rank: its shard is the layer
        gathered = shard
    else:
        gathered = torch.empty(layout.padded, dtype=shard.dtype, device=wctx.device)
        ex.works += comm.start_all_gather(gathered, shard, group)
    _expect(step, key, layer, ex.index)
    ex.arrivals.append(lambda: _deliver(step, key, layer, gathered[:layout.size], ex.index))


def _reducescatter_g(step, part: Action, ex: Exchange) -> None:
    wctx, layer = step.ctx.weights, _layer(step, part)
    if not wctx.sharded:
        raise _fault(step, ex.index, f"{part.text()} scatters into shards, but the program's layers have owners")
    group, members = _group_of(step, part, ex)
    partial = _lend(step, layer, ex, ex.index)
    if group is None:
        mine = partial
    else:
        works, mine = comm.start_reduce_scatter(partial, members.index(step.ctx.rank), group)
        ex.works += works

    def arrive() -> None:
        _settle_lent(step, layer, ex.number)
        wctx.grads[layer].add_(mine)  # this rank's shard of the sum: its shard's gradient

    ex.arrivals.append(arrive)


def _sync_grad(step, part: Action, ex: Exchange) -> None:
    """SYNC_GRAD on a mesh: the owner all-reduces (sums) its whole partial of the layer over its data group,
    after the last fold into it; the sum is the layer's gradient over every replica's rows."""
    ws, layer = step.weights, _layer(step, part)
    if not step.ctx.weights.owns(layer):
        raise _fault(step, ex.index, f"{part.text()} all-reduces layer {layer}'s gradient, which this rank does "
                                     "not own (a program the checks did not pass?)")
    group, _ = _group_of(step, part, ex)
    partial = _lend(step, layer, ex, ex.index)
    if group is not None:
        ex.works += comm.start_allreduce(partial, group)

    def arrive() -> None:
        ws.in_flight.pop(layer, None)
        ws.accumulated[layer] = partial

    ex.arrivals.append(arrive)


# part op -> its poster (step, part, exchange) -> None
PART_POSTERS: dict[str, PartHandler] = {
    ops.SEND_W: _send_w,
    ops.RECV_W: _recv_w,
    ops.SEND_G: _send_g,
    ops.RECV_G: _recv_g,
    ops.SHIFT_F: _shift_weights,
    ops.SHIFT_B: _shift_weights,
    ops.SHIFT_G: _shift_gradient,
    ops.FILL_F: _fill,
    ops.FILL_B: _fill,
    ops.BCAST_W: _bcast_w,
    ops.REDUCE_G: _reduce_g,
    ops.ALLGATHER_W: _allgather_w,
    ops.REDUCESCATTER_G: _reducescatter_g,
    ops.SYNC_GRAD: _sync_grad,
}
# The interpreter's handlers for a weight-passing program's instructions (``F``..``W`` replace activation passing's).
COMPUTE_HANDLERS: dict[str, Callable] = {ops.F: forward, ops.B: backward, ops.I: input_grad, ops.W: weight_grad}
HANDLERS: dict[str, Callable] = {ops.EXCHANGE: exchange, ops.EXCHANGE_WAIT: exchange_wait, ops.FREE_W: free_copy}


def finish_step(step, end: int) -> None:
    """After the list: every exchange waited, what is left folded into the owners', the masters' ``.grad`` set.

    Args:
        step: the interpreter's step state (``step.weights`` set).
        end: the index one past the rank's list, for messages.
    Raises:
        RuntimeFault: an exchange never waited, or a partial left on a rank
            that does not own its layer (a program the checks did not pass).
    """
    wctx, ws = step.ctx.weights, step.weights
    check_all_waited(ws.open, _faults(step))
    if ws.partial is not None:
        held, ws.partial = ws.partial, None
        _strand(step, held, end)
    for layer, partial in ws.accumulated.items():
        if wctx.sharded or not wctx.owns(layer):
            raise _fault(step, end, f"a partial of layer {layer}'s weight gradient is left on this rank, which does "
                                    "not own the layer: it never reached the owner")
        wctx.grads[layer].add_(partial[:wctx.layouts[layer].size])
    ws.accumulated.clear()


# -- saving ---------------------------------------------------------------------


def owned_state(wctx: WeightContext) -> dict:
    """What this rank contributes to the saved model: the owned layers' state_dicts, or its shards.

    Returns:
        {"state": name -> tensor (CPU) of the owned modules} or, under
        ``all_gather``, {"shards": layer -> this rank's shard (CPU)}.
    """
    if wctx.sharded:
        return {"shards": {layer: shard.detach().cpu() for layer, shard in wctx.shards.items()}}
    state = {}
    for layer in wctx.owned:
        for name, tensor in wctx.modules[layer].state_dict().items():
            state[name] = tensor.detach().cpu()
    return {"state": state}


def merged_state(wctx: WeightContext, gathered: list[dict]) -> dict:
    """The whole model's state_dict from every rank's ``owned_state`` (rank order), each layer from its owner.

    Under ``all_gather`` each layer's shards are joined in rank order, cut to
    the layer's length and copied into this rank's module (only structure
    there), whose state_dict then holds them; what is not trainable (buffers,
    frozen parameters) is this rank's, the same on every rank.
    """
    if not wctx.sharded:
        merged = {}
        for part in gathered:
            merged.update(part["state"])
        return merged
    merged = {}
    for layer, module in sorted(wctx.modules.items()):
        layout = wctx.layouts[layer]
        flat = torch.cat([part["shards"][layer] for part in gathered])[:layout.size]
        with torch.no_grad():  # the module is only structure under all_gather: its parameters may take the result
            for (_, parameter), trained in zip(trainable(module), params_from_flat(layout, flat).values()):
                parameter.copy_(trained)
        for name, tensor in module.state_dict().items():
            merged[name] = tensor.detach().cpu().clone()
    return merged


def owned_optimizer_state(wctx: WeightContext, optimizer) -> dict:
    """This rank's optimizer state for a checkpoint: named by parameter for the owned layers, or per layer
    for its shards (``{"shards": {layer: {key: value}}}``, joined by ``merged_optimizer_state``)."""
    if not wctx.sharded:
        return named_optimizer_state(optimizer, parameter_names(wctx.modules[layer] for layer in wctx.owned))
    shards = {}
    for layer, shard in wctx.shards.items():
        state = optimizer.state.get(shard) if optimizer is not None else None
        if state:
            shards[layer] = {key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
                             for key, value in state.items()}
    return {"shards": shards}


def merged_optimizer_state(wctx: WeightContext, gathered: list[dict]) -> dict:
    """The named optimizer state from every rank's ``owned_optimizer_state`` (rank order).

    Under ``all_gather`` a state tensor as long as a shard (a momentum) is
    joined from every rank's piece in rank order, cut to the layer's length and
    split by the layer's layout into its parameters; anything else (a step
    count) is the same on every rank and taken from the first.
    """
    if not wctx.sharded:
        merged = {}
        for part in gathered:
            merged.update(part)
        return merged
    merged = {}
    for layer, layout in sorted(wctx.layouts.items()):
        pieces = [part["shards"].get(layer) for part in gathered]
        if not all(pieces):
            continue  # not stepped yet: no state
        for key, first in pieces[0].items():
            if isinstance(first, torch.Tensor) and first.dim() > 0:  # one value per element of the shard
                flat = torch.cat([piece[key].reshape(-1) for piece in pieces])[:layout.size]
                for name, view in params_from_flat(layout, flat).items():
                    merged.setdefault(name, {})[key] = view.clone()
            else:
                for name in layout.names:
                    merged.setdefault(name, {})[key] = first
    return merged


def restore_optimizer_state(wctx: WeightContext, optimizer, saved: dict) -> None:
    """Give this rank's optimizer the checkpoint's named state: the owned layers' parameters, or this
    rank's shard of each layer's state (the inverse of ``merged_optimizer_state``)."""
    if optimizer is None:
        return
    if not wctx.sharded:
        load_optimizer_state(optimizer, parameter_names(wctx.modules[layer] for layer in wctx.owned), saved)
        return
    shard_names = {id(shard): f"layer {layer}'s shard" for layer, shard in wctx.shards.items()}
    by_shard = {}
    for layer, layout in wctx.layouts.items():
        entries = [saved.get(name) for name in layout.names]
        if not all(entries):
            continue
        state = {}
        for key, first in entries[0].items():
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                flat = torch.zeros(layout.padded, dtype=first.dtype)
                flat[:layout.size] = torch.cat([entry[key].reshape(-1) for entry in entries])
                state[key] = flat[wctx.rank * layout.shard:(wctx.rank + 1) * layout.shard].clone()
            else:
                state[key] = first
        by_shard[f"layer {layer}'s shard"] = state
    load_optimizer_state(optimizer, shard_names, by_shard)


# ------------------------------------------------------------------ the family


class WeightPassing(ActivationPassing):
    """Weight passing's runtime hooks: activation passing's loop and step with this module's computes,
    exchanges and frees, the weight context as the rank's extra state, the owners' masters trained,
    clipped and checkpointed.

    * ``make_weight_context`` (once per run): the modules of every layer (each
      rank builds every chunk; they are tiny here, and a production version would
      build the layers it only borrows on the meta device), each layer's *flat
      layout* (its trainable parameters concatenated in ``module.parameters()``
      order, the same on every rank), the masters this rank keeps (the owned
      layers' own parameters, or under ``all_gather`` its shard of each layer's
      flat vector padded to a multiple of P) with ``.grad`` bound to flat buffers,
      the communicators (``comm.communicator_groups``) and, for a ring, what the
      successor's ring steps take.
    * ``WeightStep`` (once per training step): the copies of layers this rank
      holds (``("W", layer, step)`` delivered by RECV_W, BCAST_W or ALLGATHER_W;
      ``(pass, step)`` ring slots), its gradient accumulators (one fp32 partial
      per layer), the ring gradient slot, and the exchanges posted and not waited.
    * Handlers: ``F`` runs the layer with ``torch.func.functional_call`` on the
      weights it finds (the owner's master, or the copy the program delivered)
      without autograd, keeping only its input; ``B`` (and ``I``) recompute that
      forward with the weights as a leaf and ask autograd for the input's and
      the flat weights' gradients; the weight gradient is a contribution added
      to the layer's partial (the ring gradient slot, or the accumulator). ``I``
      stashes it and ``W`` adds it. ``EXCHANGE`` posts every part (point-to-point
      parts in one batch per group, collectives asynchronously, local fills at
      once) and ``EXCHANGE_WAIT`` waits for them and applies what arrived, so
      communication overlaps the computes between the two. The posting and the
      waiting are ``runtime/exchange.py``'s, shared with sequence rings; this
      module gives it what each part means (``PART_POSTERS``).
    * ``finish_step``: folds what is left into the owners' accumulators and sets
      the masters' gradients; the interpreter then steps the optimizer, which
      holds only this rank's masters (or shards).
    """

    name = ops.WEIGHT_PASSING
    label = "weight-passing"
    handlers = {**HANDLERS_OF_STAGES, **COMPUTE_HANDLERS, **HANDLERS}
    part_posters = PART_POSTERS
    passes_activations = False
    takes_partition = False
    trains_on_groups = True  # TawPipe x DP: every replica's rank at a pp coordinate on that coordinate's group

    def refusal_outside(self, op: str) -> str | None:
        if op in ops.WEIGHT_OPS:
            return (f"'{op}' moves weights, but the program has no weight plan (owners, routes): it is not a "
                    "weight-passing program")
        return None

    def trained(self, program, rank, stages, device, groups) -> Trained:
        """Every layer is here but only the masters this rank keeps (the owned layers', or its shards)
        have gradients; collective (the communicators are made here when ``groups`` is None)."""
        context = make_weight_context(program, rank, stages, device, groups)
        return Trained(context.grads, context.parameters(), {}, context)

    def stash(self, program, stages):
        return None  # each layer's owner steps its optimizer after the list

    def start_step(self, step) -> None:
        step.weights = WeightStep()

    def finish_step(self, step, end: int) -> None:
        finish_step(step, end)

    def counted_gradients(self, context) -> list[torch.Tensor]:
        """A layer's gradient lives on its owner only (on a mesh, counted by the first replica's: every
        replica's holds the same sum); under ``all_gather`` the shards are disjoint."""
        share = share_of(context.program, context.rank)
        return list(context.weights.grads.values()) if share is None or share[0] == 0 else []

    def all_gradients(self, context) -> list[torch.Tensor]:
        return list(context.weights.grads.values())

    def checkpoint_part(self, context, stages: dict) -> dict:
        return {"model": owned_state(context.weights),
                "optimizer": owned_optimizer_state(context.weights, context.optimizer)}

    def merged_parts(self, context, parts: list[dict]) -> tuple[dict, dict]:
        model = merged_state(context.weights, [part["model"] for part in parts])
        return model, merged_optimizer_state(context.weights, [part["optimizer"] for part in parts])

    def restore_optimizer(self, context, stages: dict, saved: dict) -> None:
        restore_optimizer_state(context.weights, context.optimizer, saved)


FAMILY = register(WeightPassing(), WeightPlan)


__all__ = [
    "COMPUTE_HANDLERS", "FAMILY", "HANDLERS", "LayerLayout", "PART_POSTERS", "WeightContext", "WeightPassing",
    "WeightStep", "finish_step",
    "flat_weights", "layer_layout", "make_weight_context", "merged_optimizer_state", "merged_state",
    "owned_optimizer_state", "owned_state", "params_from_flat", "restore_optimizer_state",
]
