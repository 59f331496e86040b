"""The per-rank interpreter: one loop over a rank's instructions, one handler per op.

``make_context`` prepares what a rank keeps across training steps (its stages'
modules, flat gradient buffers, the optimizer, the replica subgroups);
``run_step`` walks the rank's instruction list once, through its family's table, and
ends with the optimizer step.

Activation passing's runtime: the handlers of its ops (``HANDLERS``) and its
family hooks (``ActivationPassing``, the default ``runtime/family.py`` family);
the loop itself is ``family.run_instructions``, shared with every family.
Weight passing (``runtime/weights.py``) keeps this loop, this context and this
step state, with its own computes, exchanges and frees in its table and its
hooks before and after the list. How values flow inside a step and how
autograd is split per stage: ``_Step``'s docstring.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable, NamedTuple, Sequence

import torch
from torch import nn

from pipec.compiler import ops
from pipec.compiler.ir import (
    ALLREDUCE_GRAD,
    ALLREDUCE_WAIT,
    B,
    BATCH,
    F,
    FREE_F,
    I,
    PART_RULES,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    W,
    Action,
    Program,
    stage_tables,
)
from pipec.errors import ProgramError, RuntimeFault
from pipec.compiler.versions import version_plan
from pipec.runtime import clipping, comm, payload, placed, split_backward
from pipec.runtime.checkpoint import load_optimizer_state, named_optimizer_state, parameter_names
from pipec.runtime.family import (RuntimeFamily, families, load_families, refusal_outside, register,
                                  run_instructions, runtime_family)
from pipec.runtime.stash import WeightStash
from pipec.runtime.flat import bind_flat_grads
from pipec.runtime.model import spec_optimizer
from pipec.runtime.precision import FP32, Precision

# Kinds of a hand-off tensor (``ops.MESSAGE_KIND_CODE``): the low bits of its key.
ACT, GRAD = ops.MESSAGE_KIND_CODE["act"], ops.MESSAGE_KIND_CODE["grad"]
_NUM_KINDS = len(ops.MESSAGE_KINDS)

# A trace event: (instruction index, start, end, waited), perf_counter
# seconds; waited is the time the instruction spent waiting for messages, at
# its start (a compute waits for its inputs before it computes). The optimizer
# step is recorded with index len(row).
Event = tuple[int, float, float, float]


@dataclass
class RankContext:
    """What one rank keeps across training steps (built by ``make_context``).

    Attributes:
        program: the compiled program.
        rank: this rank.
        row: this rank's instruction list (a copy; a test may insert into it).
        stages: stage id -> module, for this rank's stages; replicas of one
            chunk on this rank share the module.
        loss_fn: (last chunk's output, targets) -> scalar.
        optimizer: steps every parameter of this rank's chunks (None when it holds none).
        flat_grads: chunk -> the flat buffer its parameters' ``.grad`` views.
        stage_params: stage id -> its module's trainable parameters (for W).
        replicas: the replica subgroups this rank is in (``comm.replica_groups``),
            keyed by their communicator's key (the chunk); see ``_group_of``.
        wires: chunk position c -> the ``payload.Wire`` of what chunk c hands
            chunk c + 1 (and of its gradients); empty under weight passing.
        device: where the modules, messages and batches live.
        precision: the run's compute precision (autocast for the forwards).
        timeout: longest wait of one instruction, in seconds.
        wait: the backend's wait function (``comm.wait_rule``).
        blocking: whether ``wait`` blocks the CPU (else the step settles at its end).
        handlers: op -> handler: the family's table (``HANDLERS`` for activation passing) plus
            anything a test or ``--inject`` adds.
        synchronize: called after every instruction when the trace must show
            device time (CUDA), else None.
        prev, next: per stage id, its neighbour along its pipeline or -1.
        producer: per communication op, stage id -> the producer stage of the
            tensor it carries (the stage its rule's ``where`` names).
        iteration: the current training step, counted from 1 (for messages).
        family: the program's runtime family (``runtime/family.py``): what its hooks say of
            training, clipping and checkpoints.
        weights: the extra per-rank state the family keeps (weight passing's
            ``weights.WeightContext``); None when it keeps none.
        clip_grad_norm: clip the gradients by their global norm over every
            rank to this before each optimizer step (``runtime/clipping.py``); None: no clipping.
        grad_norm: under clipping, the global gradient norm of the last step (before clipping).
        stash: for a program with optimizer updates in its order (asynchronous
            training), its weight versions and updates (``runtime/stash.py``);
            None otherwise, when the optimizer steps once after the list.
        placed: for a program whose stages sit on rank groups (PP x DP, PP x FSDP, PP x CP), this rank's share,
            groups and shards (``runtime/placed.py``); None otherwise.
    """

    program: Program
    rank: int
    row: list[Action]
    stages: dict[int, nn.Module]
    loss_fn: Callable
    optimizer: torch.optim.Optimizer | None
    flat_grads: dict[int, torch.Tensor]
    stage_params: dict[int, list[torch.Tensor]]
    replicas: dict[int, comm.ReplicaGroup]
    wires: dict[int, payload.Wire]
    device: torch.device
    precision: Precision
    timeout: float
    wait: Callable
    blocking: bool
    handlers: dict[str, Callable]
    synchronize: Callable[[], None] | None
    prev: list[int]
    next: list[int]
    producer: dict[str, list[int]]
    family: RuntimeFamily
    iteration: int = 0
    weights: object = None
    clip_grad_norm: float | None = None
    grad_norm: float | None = None
    stash: WeightStash | None = None
    placed: placed.PlacedContext | None = None

    def wire_of(self, kind: int, producer: int) -> payload.Wire | None:
        """The wire of the value (kind, producer stage, ·): an activation leaves its producer's chunk, a
        gradient goes back across the boundary before its producer's chunk. None when the boundary has no
        wire (weight passing: no activation leaves its rank)."""
        position = self.program.stages[producer].position
        return self.wires.get(position if kind == ACT else position - 1)


def make_context(
    program: Program,
    rank: int,
    stages: dict[int, nn.Module],
    *,
    loss_fn: Callable,
    make_optimizer: Callable,
    activation_shape: Sequence[int] = (),
    layouts: Sequence[payload.Layout] | payload.Layout | None = None,
    precision: Precision = FP32,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "gloo",
    timeout: float = 60.0,
    synchronize: Callable[[], None] | None = None,
    groups: dict[int, comm.ReplicaGroup] | None = None,
    clip_grad_norm: float | None = None,
    seq_len: int | None = None,
) -> RankContext:
    """Prepare a rank to run steps; collective (it creates the replica subgroups).

    Args:
        program: the compiled program, the same on every rank.
        rank: this rank.
        stages: stage id -> module for every stage this rank holds (see
            ``stage_modules``); modules already on ``device``.
        loss_fn, make_optimizer: the model spec's.
        activation_shape: the shape of what one stage hands the next for one
            microbatch when it is one tensor of ``dtype`` (its gradient has
            the same shape); used when ``layouts`` is None.
        layouts: what each chunk hands the next (``payload.Layout``): one per
            chunk boundary (index c: chunk c's output), or one for all of them.
            Both unused under weight passing, where activations never leave
            their rank.
        precision: the run's compute precision.
        device, dtype: where modules and messages live; the dtype of ``activation_shape``'s tensor.
        backend: "gloo" or "nccl"; chooses how waits meet their deadline.
        timeout: longest wait of one instruction, seconds.
        synchronize: see ``RankContext``.
        groups: replica subgroups already made (``comm.replica_groups``); made here when None.
            For a weight-passing program: its communicators (``comm.communicator_groups``).
        clip_grad_norm: see ``RankContext``; every rank of the run must pass the same.
        seq_len: the model's sequence length, for a context-parallel program (PP x CP: each member's
            tokens, ``placed.start_ring``); unused otherwise.
    Returns:
        the ``RankContext``. Every parameter's ``.grad`` is now a zeroed view
        into its chunk's flat buffer: never set it to None (``run_step`` zeroes it).
        Under weight passing only the masters this rank keeps (the owned layers',
        or its shards) have one, and only they are in the optimizer.
    Raises:
        ProgramError: an instruction with no handler, or one of the other family.
    """
    row = list(program.ranks[rank])
    family = runtime_family(program)
    _check_handlers(program, rank, row, family)
    device = torch.device(device)
    trained = family.trained(program, rank, stages, device, groups)
    tables = stage_tables(program)
    wait, blocking = comm.wait_rule(backend)
    wires = _rank_wires(program, family, activation_shape, layouts, dtype, device, precision)
    handlers = dict(family.handlers)
    if trained.placed is not None:  # a compute of a stage on a group runs its sub-steps (GATHER) first
        handlers.update({op: placed.with_substeps(handlers[op]) for op in ops.COMPUTE_OPS if op in handlers})
        placed.start_ring(trained.placed, program, rank, seq_len, device, timeout, synchronize)
    return RankContext(
        program=program, rank=rank, row=row, stages=stages, loss_fn=loss_fn,
        optimizer=spec_optimizer("", make_optimizer, trained.parameters) if trained.parameters else None,
        flat_grads=trained.flat_grads,
        stage_params={stage: _trainable(module) for stage, module in stages.items()},
        replicas=trained.replicas, wires=wires, device=device, precision=precision, timeout=timeout,
        wait=wait, blocking=blocking, handlers=handlers, synchronize=synchronize,
        prev=tables.prev, next=tables.next,
        producer={op: tables.neighbour(rule.where) for op, rule in PART_RULES.items()}, family=family,
        weights=trained.weights, clip_grad_norm=clip_grad_norm, stash=family.stash(program, stages),
        placed=trained.placed,
    )


class Trained(NamedTuple):
    """What a rank trains and how its gradients meet (a family's ``trained`` hook).

    Attributes:
        flat_grads: chunk (or layer) -> the flat gradient buffer its parameters' ``.grad`` view.
        parameters: the parameters this rank's optimizer steps.
        replicas: the replica subgroups this rank is in (empty under weight passing).
        weights: the extra per-rank state the family keeps (``RankContext.weights``), or None.
        placed: the rank's stages on groups (``RankContext.placed``), or None.
    """

    flat_grads: dict[int, torch.Tensor]
    parameters: list[torch.Tensor]
    replicas: dict[int, comm.ReplicaGroup]
    weights: object = None
    placed: placed.PlacedContext | None = None


def _stage_trained(program: Program, rank: int, stages: dict[int, nn.Module],
                   groups: dict[int, comm.ReplicaGroup] | None) -> Trained:
    """Activation passing's ``Trained``: each chunk's module (replicas share one) gets its flat buffer;
    collective (the replica subgroups are made here when ``groups`` is None; a composed program's groups
    and shards by ``placed.make_placed``)."""
    chunk_modules: dict[int, nn.Module] = {}
    for stage, module in stages.items():
        chunk_modules.setdefault(program.stages[stage].position, module)
    if program.placed_on_groups:
        context, flat_grads, parameters = placed.make_placed(program, rank, chunk_modules, _trainable)
        return Trained(flat_grads, parameters, {}, None, context)
    flat_grads = {chunk: bind_flat_grads(_trainable(module)) for chunk, module in chunk_modules.items()}
    parameters = [p for module in chunk_modules.values() for p in _trainable(module)]
    replicas = groups if groups is not None else comm.replica_groups(program, rank)
    return Trained(flat_grads, parameters, replicas)


def _rank_wires(program: Program, family: RuntimeFamily, activation_shape: Sequence[int], layouts,
                dtype: torch.dtype, device: torch.device, precision: Precision) -> dict[int, payload.Wire]:
    """Chunk position -> the wire of what it hands the next chunk (``_wires``): from ``layouts``, or one tensor
    of ``activation_shape`` and ``dtype`` when it is None; none in a family whose activations stay home."""
    if not family.passes_activations:
        return {}
    return _wires(program, payload.tensor_layout(activation_shape, dtype) if layouts is None else layouts,
                  device, precision)


def _wires(program: Program, layouts, device: torch.device, precision: Precision) -> dict[int, payload.Wire]:
    """Chunk position -> the wire of its output, for every boundary between two chunks."""
    boundaries = range(program.num_chunks - 1)
    if isinstance(layouts, payload.Layout):
        layouts = [layouts] * len(boundaries)
    if len(layouts) != len(boundaries):
        raise ValueError(f"{len(layouts)} layouts for the {len(boundaries)} boundaries of {program.num_chunks} chunks")
    return {c: payload.Wire(layouts[c], device, precision.wire_dtype) for c in boundaries}


def _check_handlers(program: Program, rank: int, row: list[Action], family: RuntimeFamily) -> None:
    """Every instruction has a handler in the family's table, and every part of an exchange or a compute a
    poster; an op of another family's says why not (``family.refusal_outside``), any other that the runtime
    has none. The ops of stages on rank groups run only in a program that places some."""
    for index, action in enumerate(row):
        why = None
        if action.op not in family.handlers:
            why = refusal_outside(action.op, family) or f"the runtime has no handler for '{action.op}'"
        elif action.parts and action.op != BATCH:
            part = next((part for part in action.parts if part.op not in family.part_posters), None)
            if part is not None:  # another family's part (SEND_W in an EXCHANGE) says whose it is
                why = (refusal_outside(part.op, family) or _refusal_of_part(part.op, family)
                       or f"the runtime cannot run '{part.op}' inside '{action.op}'")
        if why is None and not program.placed_on_groups:
            used = _GROUP_OPS.intersection((action.op, *(part.op for part in action.parts)))
            if used:
                why = f"'{min(used)}' belongs to stages placed on rank groups, and this program places none"
        if why is not None:
            raise ProgramError(why, rank, index, program.grid())


def _refusal_of_part(op: str, family: RuntimeFamily) -> str | None:
    """Why ``op``, a part another family posts, cannot run in ``family``'s program (that family's
    ``refusal_outside``), or None."""
    return next((why for other in families() if other is not family and op in other.part_posters
                 for why in [other.refusal_outside(op)] if why is not None), None)


def stage_modules(program: Program, rank: int, build: Callable[[int], nn.Module]) -> dict[int, nn.Module]:
    """Stage id -> module for the stages on ``rank``, building each chunk once.

    Args:
        program: the compiled program.
        rank: this rank.
        build: chunk index -> a new module for that chunk.
    Returns:
        a dict over this rank's stages; replicas of a chunk on this rank share one module.
    """
    built: dict[int, nn.Module] = {}
    out = {}
    for info in program.stages:
        if rank in info.ranks:  # every member of a stage's group builds it (a sharded one then cuts its shard)
            if info.position not in built:
                built[info.position] = build(info.position)
            out[info.id] = built[info.position]
    return out


def _trainable(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


# ------------------------------------------------------------------ one step


@dataclass
class _Step:
    """The state of one training step on one rank.

    Dataflow inside a step. Every tensor that crosses a stage boundary is named by
    ``(kind, producer stage, microbatch)`` (``compiler.ir.tensor_of``), coded as one
    int; a send or receive finds its kind and producer in its op's rule
    (``ops.PART_RULES``). A producer puts its output in ``produced`` under that
    key; the consumer takes it from there when producer and consumer share the
    rank (a local hand-off, no message), or a SEND takes it and ships it. A RECV
    posts its receive into a fresh buffer of the activation's shape and files it
    in ``pending`` under the same key; the compute that reads it waits for it then
    (receives are posted early, waited at first use). What crosses a boundary is a
    payload (``runtime/payload.py``: a tensor, or a tuple or dict of tensors, of
    the boundary's ``Layout``); each boundary's ``Wire`` packs it into the one
    tensor a message carries, and its gradients likewise.

    Autograd. Each stage is its own graph: a stage's input leaves that carry a
    gradient are autograd leaves (the received or handed-off tensors, detached),
    so B or I yields the gradients to send back as those leaves' gradients. The
    last stage of a pipeline turns logits into ``loss_fn / N`` right after its
    forward, so microbatch gradients sum to the one-process gradient of the mean
    loss. Forwards run in the run's precision
    (``runtime/precision.py``: autocast under ``--dtype bf16``; parameters,
    gradients and their reductions stay fp32). I computes the input gradient and
    records the gradients where the paths to the parameters branch off; W later
    computes the parameters' gradients from those alone (``split_backward``), so
    I + W does the work of one B. Weight gradients accumulate into ``.grad``,
    which for every parameter is a view into its chunk's flat buffer, so a
    replicated chunk's all-reduce is one call on one tensor, and zeroing is one fill.

    Attributes:
        ctx: the rank's context.
        inputs, targets: per microbatch, the first stage's input and the loss targets.
        num_microbatches: N.
        saved: stage * N + mb -> (its input leaves that carry a gradient (none
            for a first stage), its output payload or scaled loss).
        produced: tensor key -> what was made here, not yet consumed or sent:
            an output payload (detached), or the list of its input's gradients.
        pending: tensor key -> (receive buffer, works, index of its RECV, peer).
        weight_grads: stage * N + mb -> what its I left for its W (``split_backward``).
        sends: (works, tensor, index of its SEND, peer): waited when the step ends.
        reduces: communicator id -> (works, index of its ALLREDUCE_GRAD, its ReplicaGroup).
        streamed: (works, site) of every wait that only ordered the stream
            (NCCL): their deadline is checked when the step ends.
        waited: seconds spent waiting for messages so far in this step.
        loss: sum of this rank's scaled microbatch losses, or None.
        weights: the family's state of this step (weight passing's ``weights.WeightStep``,
            set by its ``start_step``); else None.
        exchanges: exchange number -> posted and not waited (a composed program's gradient reductions).
    """

    ctx: RankContext
    inputs: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]
    num_microbatches: int
    saved: dict = field(default_factory=dict)
    produced: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)
    weight_grads: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)
    reduces: dict = field(default_factory=dict)
    streamed: list = field(default_factory=list)
    waited: float = 0.0
    loss: torch.Tensor | None = None
    weights: object = None
    exchanges: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    def key(self, kind: int, producer: int, mb: int) -> int:
        return (producer * self.num_microbatches + mb) * _NUM_KINDS + kind

    def site(self, index: int, text: str, peers: tuple[int, ...]) -> comm.Site:
        return comm.Site(self.ctx.rank, index, text, peers, self.ctx.iteration)

    def wait(self, works, site: comm.Site) -> None:
        """Wait for ``works`` the backend's way (see ``comm``); a stream wait is settled at the end."""
        start = perf_counter()
        self.ctx.wait(works, self.ctx.timeout, site)
        self.waited += perf_counter() - start
        if not self.ctx.blocking:
            self.streamed.append((works, site))

    def take(self, kind: int, producer: int, mb: int, index: int):
        """The value (kind, producer, mb): handed off here, or received (waited now). An activation is
        its payload, a gradient the list of the gradients of its payload's leaves that carry one."""
        key = self.key(kind, producer, mb)
        value = self.produced.pop(key, None)
        wire = self.ctx.wire_of(kind, producer)
        if value is not None:
            if wire is None:  # weight passing: a stage of this rank's own pipeline made it
                return value
            return wire.hand_off(value) if kind == ACT else wire.hand_off_grads(value)
        entry = self.pending.pop(key, None)
        ctx = self.ctx
        if entry is None:
            raise RuntimeFault(
                f"its input ({ops.VALUE_KINDS[ops.MESSAGE_KINDS[kind]].words} of stage {producer}, microbatch {mb}) "
                f"was neither made on this rank nor received (a program the checks did not pass?)",
                ctx.rank, index, ctx.row[index].text())
        buffer, works, posted, peer = entry
        text = f"{ctx.row[index].text()}, reading {ctx.row[posted].text()} of step {posted}"
        self.wait(works, self.site(index, text, (peer,)))
        return wire.unpack(buffer) if kind == ACT else wire.unpack_grads(buffer)

    def new_buffer(self, kind: int, producer: int) -> torch.Tensor:
        """A receive buffer for the value (kind, producer, ·)."""
        wire = self.ctx.wire_of(kind, producer)
        return wire.buffer() if kind == ACT else wire.grad_buffer()


def _stage_input(step: _Step, stage: int, mb: int, index: int):
    """What a stage's forward reads: the microbatch's inputs on a first stage, else the payload the stage
    before handed over (taken now: received, or handed off on this rank)."""
    prev = step.ctx.prev[stage]
    return step.inputs[mb] if prev < 0 else step.take(ACT, prev, mb, index)


def _run_forward(step: _Step, stage: int, mb: int, index: int, value) -> tuple[list[torch.Tensor], object]:
    """Run a stage's forward on ``value``, microbatch ``mb``'s input (in the run's precision; autograd as
    the caller has it).

    Returns:
        (its input leaves that carry a gradient: empty for a first stage; its
        output payload, or on a pipeline's last stage its loss / N).
    """
    ctx = step.ctx
    prev = ctx.prev[stage]
    leaves = []
    if prev >= 0:
        value, leaves = payload.input_leaves(ctx.wire_of(ACT, prev).layout, value)
    module = ctx.stages[stage] if ctx.stash is None else ctx.stash.module_for(stage, mb)
    with ctx.precision.autocast(ctx.device):
        out = payload.call(module, value, **placed.sequence_arguments(step, stage, mb))
        if ctx.next[stage] < 0:
            loss = ctx.loss_fn(out, step.targets[mb])
            if ctx.stash is not None:
                return leaves, loss * ctx.stash.loss_scales[mb]
            # a member of a group of k ran 1/k of the rows (or of each sequence's tokens, as many as every
            # other member): its loss weighs 1/k of the microbatch's
            shares = 1 if ctx.placed is None else ctx.placed.share[1]
            return leaves, loss / (step.num_microbatches * shares)
    wire = ctx.wire_of(ACT, stage)
    problem = payload.mismatch(wire.layout, out)
    if problem is not None:
        raise RuntimeFault(f"stage {stage}'s output for microbatch {mb} does not fit its boundary: {problem} "
                           "(the model spec's activation_shape, or chunks whose outputs change from one "
                           "microbatch to the next?)", ctx.rank, index, ctx.row[index].text())
    return leaves, out


def _keep_output(step: _Step, stage: int, mb: int, out) -> None:
    """File a forward's result: a loss adds to the step's, an output waits for its consumer or its SEND."""
    if step.ctx.next[stage] < 0:
        if step.ctx.stash is not None:  # report the mean loss, as every program does
            out = out / (step.ctx.stash.loss_scales[mb] * step.num_microbatches)
        step.loss = out.detach() if step.loss is None else step.loss + out.detach()
    else:
        step.produced[step.key(ACT, stage, mb)] = out


def _forward(step: _Step, action: Action, index: int) -> None:
    stage, mb = action[0], action[2]
    leaves, out = _run_forward(step, stage, mb, index, _stage_input(step, stage, mb, index))
    _keep_output(step, stage, mb, out)
    step.saved[stage * step.num_microbatches + mb] = (leaves, out)


def _backward_roots(step: _Step, stage: int, mb: int, out, index: int) -> tuple[list, list | None]:
    """What a stage's backward starts from: (its loss, None) on a last stage, else (the output leaves the
    next stage sent gradients for, those gradients)."""
    after = step.ctx.next[stage]
    if after < 0:
        return [out], None
    grads = step.take(GRAD, after, mb, index)
    return payload.backward_roots(step.ctx.wire_of(ACT, stage).layout, out, grads)


def _backward(step: _Step, action: Action, index: int) -> None:
    stage, mb = action[0], action[2]
    leaves, out = step.saved[stage * step.num_microbatches + mb]
    roots, grads = _backward_roots(step, stage, mb, out, index)
    if roots:
        torch.autograd.backward(roots, grads)
    if step.ctx.stash is not None:
        step.ctx.stash.backward_done(stage, mb)
    if step.ctx.prev[stage] >= 0:
        step.produced[step.key(GRAD, stage, mb)] = payload.leaf_grads(leaves)


def _input_grad(step: _Step, action: Action, index: int) -> None:
    stage, mb = action[0], action[2]
    slot = stage * step.num_microbatches + mb
    leaves, out = step.saved[slot]
    roots, grads = _backward_roots(step, stage, mb, out, index)
    ctx = step.ctx
    params = ctx.stage_params[stage] if ctx.stash is None else ctx.stash.params_for(stage, mb)
    grad, step.weight_grads[slot] = split_backward.input_grad(roots, grads, leaves, params)
    if step.ctx.prev[stage] >= 0:  # a first stage has no input gradient: its W does all its backward
        step.produced[step.key(GRAD, stage, mb)] = grad


def _weight_grad(step: _Step, action: Action, index: int) -> None:
    split_backward.weight_grad(step.weight_grads.pop(action[0] * step.num_microbatches + action[2]))
    if step.ctx.stash is not None:
        step.ctx.stash.backward_done(action[0], action[2])


def _update(step: _Step, action: Action, index: int) -> None:
    """U: the optimizer update of the stage's weights (asynchronous training, ``runtime/stash.py``)."""
    ctx = step.ctx
    ctx.stash.update(action[0], ctx.optimizer, ctx.flat_grads[ctx.program.stages[action[0]].position])


def _free(step: _Step, action: Action, index: int) -> None:
    step.saved.pop(action[0] * step.num_microbatches + action[2], None)


# ---- activation checkpointing (``recompute stage s``): FC, then R just before the backward.
# Between the two, ``step.saved[slot]`` holds a ``_Kept``; R replaces it with the
# (input leaves, output) F would have saved, so B, I, W and FREE_F run unchanged.


class _Kept(NamedTuple):
    """What FC keeps for its R: the stage's input payload (a first stage's microbatch inputs) and the
    random-number state the forward ran with (CPU, and the device's on CUDA), so that R replays it."""

    input: object
    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None


def _checkpointed_forward(step: _Step, action: Action, index: int) -> None:
    """FC: the forward without autograd, handing its output on (a last stage: adding its scaled loss to the
    step's); it keeps only its input and the RNG state, for R."""
    ctx = step.ctx
    stage, mb = action[0], action[2]
    value = _stage_input(step, stage, mb, index)
    on_cuda = ctx.device.type == "cuda"
    kept = _Kept(value, torch.get_rng_state(), torch.cuda.get_rng_state(ctx.device) if on_cuda else None)
    with torch.no_grad():
        _, out = _run_forward(step, stage, mb, index, value)
    _keep_output(step, stage, mb, out)
    step.saved[stage * step.num_microbatches + mb] = kept


def _recompute(step: _Step, action: Action, index: int) -> None:
    """R: the forward again, with autograd and in the run's precision, from the input FC kept and under the
    RNG state FC ran with (restored afterwards, as ``torch.utils.checkpoint`` does); saves what F would."""
    ctx = step.ctx
    stage, mb = action[0], action[2]
    slot = stage * step.num_microbatches + mb
    kept = step.saved[slot]
    devices = [ctx.device] if kept.device_rng is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(kept.cpu_rng)
        if kept.device_rng is not None:
            torch.cuda.set_rng_state(kept.device_rng, ctx.device)
        step.saved[slot] = _run_forward(step, stage, mb, index, kept.input)  # FC counted the loss


def _outgoing(step: _Step, part: Action, index: int) -> torch.Tensor:
    """The one dense tensor a SEND carries: the payload (or its gradients) packed by its boundary's wire."""
    op = part[1]
    rule, producer = PART_RULES[op], step.ctx.producer[op][part[0]]
    value = step.produced.pop(step.key(rule.code, producer, part[2]), None)
    if value is None:
        raise RuntimeFault("it sends a tensor this rank has not made (a program the checks did not pass?)",
                           step.ctx.rank, index, step.ctx.row[index].text())
    wire = step.ctx.wire_of(rule.code, producer)
    return wire.pack(value) if rule.code == ACT else wire.pack_grads(value)


def _incoming(step: _Step, part: Action) -> tuple[int, torch.Tensor]:
    """(the key, a fresh receive buffer) of what a RECV brings."""
    op = part[1]
    rule, producer = PART_RULES[op], step.ctx.producer[op][part[0]]
    return step.key(rule.code, producer, part[2]), step.new_buffer(rule.code, producer)


def _send(step: _Step, action: Action, index: int) -> None:
    tensor = _outgoing(step, action, index)
    step.sends.append((comm.post_send(tensor, action[3]), tensor, index, action[3]))


def _recv(step: _Step, action: Action, index: int) -> None:
    key, buffer = _incoming(step, action)
    step.pending[key] = (buffer, comm.post_recv(buffer, action[3]), index, action[3])


def _batch(step: _Step, action: Action, index: int) -> None:
    parts = action[4]
    sending = [PART_RULES[part[1]].is_send for part in parts]
    incoming = {i: _incoming(step, part) for i, (part, is_send) in enumerate(zip(parts, sending)) if not is_send}
    tensors = [_outgoing(step, part, index) if is_send else incoming[i][1]
               for i, (part, is_send) in enumerate(zip(parts, sending))]
    works = comm.post_batch([(is_send, tensor, part[3]) for part, is_send, tensor in zip(parts, sending, tensors)])
    for i, (part, is_send, tensor, handles) in enumerate(zip(parts, sending, tensors, works)):
        if is_send:
            step.sends.append((handles, tensor, index, part[3]))
        else:
            step.pending[incoming[i][0]] = (tensor, handles, index, part[3])


def _group_of(ctx: RankContext, action: Action) -> tuple[int, comm.ReplicaGroup | None]:
    """(communicator id, this rank's group of it) of a collective: ``Program.communicator_of``.

    The group is None when the program names no communicator for it, or when
    ``comm.replica_groups`` made none on this rank (replicas all on this rank
    share one module: nothing to reduce). ``replica_groups`` keys its groups by
    the communicator's key (the chunk).
    """
    communicator = ctx.program.communicator_of(action)
    if communicator is None:
        return -1, None
    return communicator.id, ctx.replicas.get(communicator.key)


def _allreduce_start(step: _Step, action: Action, index: int) -> None:
    ctx = step.ctx
    communicator, replicas = _group_of(ctx, action)
    if replicas is not None:
        chunk = ctx.program.stages[action[0]].position
        step.reduces[communicator] = (comm.start_allreduce(ctx.flat_grads[chunk], replicas), index, replicas)


def _allreduce_wait(step: _Step, action: Action, index: int) -> None:
    ctx = step.ctx
    communicator, _ = _group_of(ctx, action)
    entry = step.reduces.pop(communicator, None)
    if entry is not None:
        works, started, replicas = entry
        text = f"{ctx.row[index].text()}, for {ctx.row[started].text()} of step {started}"
        step.wait(works, step.site(index, text, replicas.peers))


# The dispatch table of activation passing: one handler per op, each (step, action, index) -> None.
# Weight passing's table (``runtime/weights.py``) is this one with its own computes and exchanges.
HANDLERS: dict[str, Callable[[_Step, Action, int], None]] = {
    F: _forward,
    B: _backward,
    I: _input_grad,
    W: _weight_grad,
    FREE_F: _free,
    SEND_F: _send,
    SEND_B: _send,
    RECV_F: _recv,
    RECV_B: _recv,
    BATCH: _batch,
    ALLREDUCE_GRAD: _allreduce_start,
    ALLREDUCE_WAIT: _allreduce_wait,
    ops.FC: _checkpointed_forward,
    ops.R: _recompute,
    ops.U: _update,
    **placed.HANDLERS,  # a composed program's: its gradient reductions' exchanges, RESHARD
}
# The ops only a program with stages on rank groups holds (``runtime/placed.py``).
_GROUP_OPS = frozenset((*placed.HANDLERS, *placed.PART_POSTERS)) - {ops.EXCHANGE, ops.EXCHANGE_WAIT}


def run_step(
    program: Program,
    rank: int,
    stages: dict[int, nn.Module],
    batch: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
    context: RankContext,
) -> tuple[torch.Tensor | None, list[Event]]:
    """Run one training step of ``rank``: its instruction list, then the optimizer step.

    Args:
        program: the compiled program (``context.program``).
        rank: this rank (``context.rank``).
        stages: this rank's stage modules (``context.stages``).
        batch: (inputs, targets), each a sequence of N microbatches on the
            device; a rank reads the inputs of the microbatches its first stages
            run and the targets of those its last stages run.
        context: from ``make_context``; ``context.iteration`` names the step in messages.
    Returns:
        (loss, events): the sum of this rank's scaled microbatch losses (a 0-d
        tensor; None when it holds no last stage); and one ``Event``
        (index, start, end, waited) per instruction, ``perf_counter`` seconds,
        the optimizer step (with the clipping before it) last with index ``len(context.row)``.
    Raises:
        RuntimeFault: a wait ran past ``context.timeout`` or a peer failed.
    """
    if program is not context.program or rank != context.rank or stages is not context.stages:
        raise ValueError("run_step: program, rank and stages must be the context's")
    inputs, targets = batch
    step = _Step(context, inputs, targets, program.num_microbatches)
    context.family.start_step(step)
    if context.stash is not None:
        context.stash.start_step()
    for flat in context.flat_grads.values():
        flat.zero_()
    synchronize = context.synchronize
    events: list[Event] = []
    end = len(context.row)
    run_instructions(step, context.row, context.handlers, 0, end, events.append, synchronize)
    _finish(step, end)
    context.family.finish_step(step, end)
    start = perf_counter()
    if context.clip_grad_norm is not None:  # every rank's gradients are complete now
        everyone = tuple(r for r in range(program.num_ranks) if r != rank)
        context.grad_norm = clipping.clip_gradients(
            context, context.clip_grad_norm, step.site(end, "the step's gradient-norm all-reduce", everyone))
    if context.optimizer is not None and context.stash is None:  # with updates in the list, U stepped it
        context.optimizer.step()
    if synchronize is not None:
        synchronize()
    events.append((end, start, perf_counter(), 0.0))
    return step.loss, events


def _finish(step: _Step, end: int) -> None:
    """Wait for this step's sends and any unwaited all-reduce; check that nothing is left over."""
    ctx = step.ctx
    settle = comm.await_blocking if ctx.blocking else comm.settle
    for works, _tensor, index, peer in step.sends:
        settle(works, ctx.timeout, step.site(index, f"{ctx.row[index].text()}, at the end of the list", (peer,)))
    for works, index, replicas in step.reduces.values():
        settle(works, ctx.timeout, step.site(index, f"{ctx.row[index].text()}, at the end of the list",
                                             replicas.peers))
    for works, site in step.streamed:  # NCCL: the waits that only ordered the stream
        settle(works, ctx.timeout, site)
    if ctx.placed is not None:
        placed.finish(step, end)
    if step.pending:
        _, _, index, _ = next(iter(step.pending.values()))
        raise RuntimeFault("a message was received that no instruction read (a program the checks did not pass?)",
                           ctx.rank, index, ctx.row[index].text())


# ------------------------------------------------------------------ the family


class ActivationPassing(RuntimeFamily):
    """Activation passing's runtime hooks: stages' modules with flat gradients, replicas all-reduced,
    activations on the wires; the default family (of programs that hold no plan)."""

    name = ops.ACTIVATION_PASSING
    handlers = HANDLERS  # the table itself: a handler added to HANDLERS is the family's (docs/ir.md)
    part_posters = placed.PART_POSTERS  # a composed program's group collectives, in exchanges or as sub-steps

    def trained(self, program: Program, rank: int, stages: dict[int, nn.Module], device: torch.device,
                groups: dict[int, comm.ReplicaGroup] | None) -> Trained:
        """Bind this rank's gradients to flat buffers, find the parameters it steps; collective."""
        return _stage_trained(program, rank, stages, groups)

    def check_model(self, spec, config, program: Program, name: str) -> None:
        """A context-parallel program's stage ring must train the model exactly (``placed.stage_ring_model``)."""
        if program.stage_ring is not None:
            placed.stage_ring_model(spec, config, program, name)

    def stash(self, program: Program, stages: dict[int, nn.Module]) -> WeightStash | None:
        """The weight versions of a program with updates in its order (``runtime/stash.py``), else None."""
        plan = version_plan(program)
        return None if plan is None else WeightStash(program, plan, stages)

    def start_step(self, step: _Step) -> None:
        """Before a step's list: the family's step state (``step.weights``); activation passing has none."""

    def finish_step(self, step: _Step, end: int) -> None:
        """After a step's list, before clipping and the optimizer step: what the family still owes."""

    def counted_gradients(self, context: RankContext) -> list[torch.Tensor]:
        """The flat gradient buffers this rank counts in the global norm: a replicated chunk's by its
        lowest holder only (``runtime/clipping.py``); on rank groups, ``placed.counted_gradients``."""
        if context.program.placed_on_groups:
            return placed.counted_gradients(context)
        first_holder: dict[int, int] = {}
        for info in context.program.stages:
            first_holder[info.position] = min(first_holder.get(info.position, info.rank), info.rank)
        return [flat for chunk, flat in context.flat_grads.items() if first_holder[chunk] == context.rank]

    def all_gradients(self, context: RankContext) -> list[torch.Tensor]:
        """Every flat gradient buffer of this rank (clipping scales every one), and its shards' gradients."""
        shards = [s.shard.grad for s in context.placed.sharded.values()] if context.program.placed_on_groups else []
        return list(context.flat_grads.values()) + shards

    def checkpoint_part(self, context: RankContext, stages: dict) -> dict:
        """This rank's part of a checkpoint: its chunks' state_dicts, its optimizer's named state (CPU); on rank
        groups ``placed.checkpoint_part`` (collective over each group)."""
        if context.placed is not None:
            return placed.checkpoint_part(context, stages)
        model = {}
        for module in {id(m): m for m in stages.values()}.values():
            for name, tensor in module.state_dict().items():
                model[name] = tensor.detach().cpu()
        return {"model": model,
                "optimizer": named_optimizer_state(context.optimizer, parameter_names(stages.values()))}

    def merged_parts(self, context: RankContext, parts: list[dict]) -> tuple[dict, dict]:
        """The whole model and optimizer state from every rank's part; a replicated chunk's first copy."""
        model, optimizer = {}, {}
        for part in parts:
            for name, tensor in part["model"].items():
                model.setdefault(name, tensor)
            for name, state in part["optimizer"].items():
                optimizer.setdefault(name, state)
        return model, optimizer

    def restore_optimizer(self, context: RankContext, stages: dict, saved: dict) -> None:
        """Give this rank's optimizer the checkpoint's state of the parameters (or shards) it steps."""
        if context.placed is not None:
            names, saved = placed.optimizer_names(context, stages, saved)
            load_optimizer_state(context.optimizer, names, saved)
            return
        load_optimizer_state(context.optimizer, parameter_names(stages.values()), saved)


FAMILY = register(ActivationPassing(), None)
load_families()  # the other families extend this table; importing the interpreter registers them all


__all__ = ["ACT", "FAMILY", "GRAD", "HANDLERS", "ActivationPassing", "Event", "RankContext", "Trained",
           "make_context", "run_step", "stage_modules"]
