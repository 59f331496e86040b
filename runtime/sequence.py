"""Sequence-parallel training: the sequence-ring family's runtime, a model trained with a ring program.

A ring program (``Program.rings``: ring attention, zigzag, TASP) cuts every
sequence into chunks held by the ranks. Every rank builds the whole model
from the same seed, draws the same whole batch (one microbatch a step), keeps
the tokens of its chunks and runs the model on them; every attention call of
the model runs the rank's ring list through the one interpreter loop
(``runtime/family.run_instructions``): its forward half in the forward, its
backward half when autograd reaches it (``RingAttentionFunction``). The ranks'
losses sum to the batch's mean, one all-reduce sums the gradients, and every
rank takes the same optimizer step, so the replicas stay equal and end with
the one-process parameters (``reference_run(config, K, 1, seed)``).

What a model spec must give to train here (``check_ring_model``, before any
worker joins): ``ring_model(config) -> RingModel(seq_len, causal)`` (its
sequence length and mask; the built-in model declares it), a model whose
forward takes ``positions=`` (the global positions of the tokens given) and
``attend=`` (calls ``attend(q, k, v)`` for every attention, q, k, v
(batch, heads, tokens, head dim)), inputs and targets whose dimension 1 is the
sequence, and a ``loss_fn`` that is a mean over tokens. docs/runtime.md,
"Training with a sequence ring", says why each is needed.

``SequenceRings`` registers the family's hooks: its table (``rings.HANDLERS``),
its model check and its trainer (``RingTrainer``), which the one training loop
(``worker.train``) drives: ``--trace``, ``--inject``, ``--save``, ``--resume``
and ``--clip-grad-norm`` as every family.
"""
from __future__ import annotations

from time import perf_counter

import torch
import torch.distributed as dist

from pipec.compiler import ops
from pipec.compiler.ir import RingPlan
from pipec.errors import UsageError
from pipec.runtime import checkpoint as checkpoints
from pipec.runtime import comm, phases, report
from pipec.runtime import model as builtin
from pipec.runtime.data import BatchSource, data_needs
from pipec.runtime.family import RuntimeFamily, StepOutcome, Trainer, register
from pipec.runtime.model import RingModel, call_spec_function, spec_label, spec_optimizer
from pipec.runtime.rings import HANDLERS, PART_POSTERS, RingAttention, RingContext, token_positions


class RingAttentionFunction(torch.autograd.Function):
    """Attention through a sequence ring inside autograd: forward runs the program's forward half,
    backward its backward half (``rings.RingAttention``), one ``RingAttention`` per call."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingAttention) -> torch.Tensor:
        out = ring.forward(q, k, v)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        ring, ctx.ring = ctx.ring, None  # one backward per call; free its buffers after it
        dq, dk, dv = ring.backward(grad_out)
        return dq, dk, dv, None


def ring_attend(context: RingContext, iteration: int | None = None, where: str = ""):
    """An ``attend(q, k, v)`` for a model's forward: each call runs ``context``'s list once through autograd.

    q, k, v are this rank's chunks concatenated in ascending chunk order,
    (batch, heads, tokens of this rank, head dim). Fault messages and the
    trace name the call (``attention 3's forward``: the fourth call, layer 3
    of the built-in model; after ``where``, ``stage 1, microbatch 2: `` in a
    context-parallel stage) and ``iteration``, the training step.
    """
    calls = 0

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        ring = RingAttention.in_context(context, iteration=iteration, label=f"{where}attention {calls}")
        calls += 1
        return RingAttentionFunction.apply(q, k, v, ring)
    return attend


def ring_model(spec, config, program, name: str = "", why: str | None = None) -> RingModel:
    """What the spec declares of its model for a ring (``spec.ring_model(config)``), checked.

    ``why`` says what runs the ring (default: ``program`` is a sequence-ring schedule).

    Raises:
        UsageError: the spec declares nothing (naming what a ring needs), or its
            declaration is not a positive int ``seq_len`` and a bool ``causal``.
    """
    schedule = program.name or "the program"
    if spec.ring_model is None:
        why = why or f"{schedule} is a sequence-ring schedule"
        raise UsageError(
            f"{why}, and {spec_label(name)} does not declare ring_model(config): "
            "a ring runs each rank's part of the sequence with attention through the ring, so the spec must "
            "give ring_model(config) -> RingModel(seq_len, causal) and a model whose forward takes positions= "
            "and attend= (see docs/runtime.md, \"Training with a sequence ring\"; the built-in model, --model "
            f"{builtin.DEFAULT_MODEL}, has them)")
    declared = call_spec_function(name, "ring_model(config)", spec.ring_model, config)
    seq_len, causal = getattr(declared, "seq_len", None), getattr(declared, "causal", None)
    if type(seq_len) is not int or seq_len < 1 or type(causal) is not bool:
        raise UsageError(f"{spec_label(name)}: ring_model(config) must return a RingModel(seq_len, causal): a "
                         f"positive int and a bool; got {declared!r}")
    return RingModel(seq_len, causal)


def check_ring_model(spec, config, program, name: str = "", why: str | None = None,
                     mask_fix: str | None = None) -> RingModel:
    """Check, before any worker starts, that ``program`` (a ring program) can train this model exactly
    (``why``: ``ring_model``'s; ``mask_fix``: how to give the ring the model's mask, "{causal}" standing for
    the value; by default the define that compiles it so).

    Returns:
        the model's ``RingModel`` (``ring_model``).
    Raises:
        UsageError: ``ring_model``'s; a mask other than the model's (naming the
            define to use); a ``seq_len`` that the program's chunks and pieces
            do not cut evenly (naming both).
    """
    plan = program.rings
    schedule = program.name or "the program"
    declared = ring_model(spec, config, program, name, why)
    who = "the built-in model" if spec.build_model is builtin.build_model else spec_label(name)
    if plan.causal != declared.causal:
        program_mask, model_mask = ("a full attention mask", "causal") if declared.causal else ("a causal mask", "full")
        verb = "a full-mask ring" if declared.causal else "a causal ring"
        fix = (mask_fix or "compile it with -D causal={causal}").format(causal=str(declared.causal).lower())
        raise UsageError(f"{schedule} was compiled with {program_mask}, but {who}'s attention is {model_mask}: "
                         f"{verb} cannot train it exactly; {fix}")
    cut = plan.chunks * plan.pieces
    if declared.seq_len % cut:
        pieces = f" x {plan.pieces} pieces" if plan.pieces > 1 else ""
        raise UsageError(f"the model's seq_len {declared.seq_len} cannot be cut into {schedule}'s {plan.chunks} "
                         f"chunks{pieces}: it must be a multiple of {cut} (--config seq_len=N sets it)")
    return declared


class RingTrainer(Trainer):
    """One rank of a sequence-ring program (``RuntimeFamily.trainer``): the whole model, built from the seed,
    run on the rank's tokens of one whole batch a step, every attention through the ring.

    Every rank holds the same replica (their gradients are summed, and every rank takes the same step), so
    rank 0's is the checkpoint's. With ``--trace``, every rank's ring instructions (each attention call's
    halves, ``args.call``) and each step's all-reduce and optimizer step are the step's events.
    """

    def __init__(self, plan, rank: int, world: int, device):
        program, spec, config, run = plan.program, plan.spec, plan.config, plan.run
        phases.announce(phases.MODEL_BUILD)
        declared = check_ring_model(spec, config, program, run.model)
        self.plan, self.device, self.rank = plan, device, rank
        self.context = RingContext(program, rank, timeout=run.timeout)
        if run.trace and device.type == "cuda":
            self.context.synchronize = torch.cuda.synchronize
        self.positions = token_positions(program.rings, rank, declared.seq_len).to(device)
        # one whole batch a step (N = 1), the same on every rank: each keeps its tokens of it
        self.data = BatchSource(spec, config, run.seed, 1, data_needs(program, rank), name=run.model)
        self.batch_size = report.batch_size(config, 1, self.data.rows_per_microbatch)
        self.model = spec.build_model(config, run.seed).to(device)
        self.modules = {0: self.model}
        resumed = plan.checkpoint
        if resumed is not None:
            phases.announce(phases.CHECKPOINT_LOAD)
            checkpoints.load_modules([self.model], resumed.model, run.resume)
        self.optimizer = spec_optimizer(run.model, spec.make_optimizer, list(self.model.parameters()))
        self.names = checkpoints.parameter_names([self.model])
        if resumed is not None:
            checkpoints.load_optimizer_state(self.optimizer, self.names, resumed.optimizer)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.others = tuple(r for r in range(world) if r != rank)

    def step(self, batch, iteration: int) -> StepOutcome:
        """Train on ``batch`` (one whole microbatch). The loss this rank adds is its tokens' mean scaled to
        their share of the batch, so the ranks' sum is the batch's mean. The step's end (all-reduce,
        clipping, optimizer) is the trace's instruction ``len(row)``, as every family's optimizer step."""
        spec, run, context, positions = self.plan.spec, self.plan.run, self.context, self.positions
        context.events = [] if run.trace else None
        self.optimizer.zero_grad(set_to_none=True)
        (inputs,), (targets,) = batch
        share = positions.numel() / targets.shape[1]  # a mean over this rank's tokens, scaled to the batch's
        inputs, targets = inputs.to(self.device)[:, positions], targets.to(self.device)[:, positions]
        attend = ring_attend(context, iteration)
        with self.plan.precision.autocast(self.device):
            out = self.model(inputs, positions=positions, attend=attend)
            loss = spec.loss_fn(out, targets) * share
        loss.backward()
        start = perf_counter()
        end = len(context.row)
        _all_reduce_gradients(self.parameters, run.timeout,
                              comm.Site(context.rank, end, "the step's gradient all-reduce", self.others, iteration))
        norm = None
        if run.clip_grad_norm is not None:  # every replica holds the whole summed gradient: no message
            norm = torch.nn.utils.clip_grad_norm_(self.parameters, run.clip_grad_norm).item()
        self.optimizer.step()
        if context.synchronize is not None:
            context.synchronize()
        if context.events is not None:
            context.events.append((end, start, perf_counter(), 0.0))
        return StepOutcome(loss.detach(), norm, context.events or [])

    def checkpoint_part(self) -> dict:
        if self.rank != 0:  # rank 0's replica is the checkpoint's (class docstring)
            return {}
        return {"model": {name: tensor.detach().cpu() for name, tensor in self.model.state_dict().items()},
                "optimizer": checkpoints.named_optimizer_state(self.optimizer, self.names)}

    def merged_parts(self, parts: list[dict]) -> tuple[dict, dict]:
        return parts[0]["model"], parts[0]["optimizer"]


def _all_reduce_gradients(parameters, timeout: float, site: comm.Site) -> None:
    """Sum every parameter's gradient over all ranks (one flat all-reduce, waited within ``timeout``); the
    gradients are replaced by the sums."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    if not grads:
        return
    dtype = grads[0].dtype
    if any(g.dtype != dtype for g in grads):
        raise UsageError("sequence-ring training needs every parameter in one dtype (they are all-reduced as one "
                         "buffer)")
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
    comm.settle([work], timeout, site)
    offset = 0
    for parameter, grad in zip(parameters, grads):
        summed = flat[offset:offset + grad.numel()].view_as(grad)
        offset += grad.numel()
        if parameter.grad is None:
            parameter.grad = summed.clone()
        else:
            parameter.grad.copy_(summed)


class SequenceRings(RuntimeFamily):
    """The sequence-ring family's runtime hooks: its table, its model check, its trainer."""

    name = ops.SEQUENCE_RING
    label = "sequence-ring"
    handlers = HANDLERS
    part_posters = PART_POSTERS
    passes_activations = False
    runs_chunks = False
    takes_partition = False
    reads_whole_batch = True
    trainer = RingTrainer

    def check_model(self, spec, config, program, name: str) -> None:
        check_ring_model(spec, config, program, name)


FAMILY = register(SequenceRings(), RingPlan)


__all__ = ["FAMILY", "RingAttentionFunction", "RingTrainer", "SequenceRings", "check_ring_model", "ring_attend",
           "ring_model", "token_positions"]
