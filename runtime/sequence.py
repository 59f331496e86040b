"""Sequence-parallel training: the built-in model trained with a sequence-ring program.

A ring program (``Program.rings``: ring attention, zigzag, TASP) says which
chunks of the sequence each rank holds and how keys and values travel; here
it trains the built-in decoder (``runtime/model.py``) with the sequence cut
across the ranks:

* **Every rank builds the whole model** from the same seed (identical
  replicas) and draws the same global batch as the one-process reference
  with one microbatch (``data.BatchSource`` with N = 1: ``synthetic_batch(config,
  step, 1, seed)``, or the spec's other data source).
* **Each rank keeps the tokens of its own chunks** (``plan.chunks_of(rank)``,
  ascending; chunk c is tokens [c S/C, (c + 1) S/C)) and runs the embedding,
  every layer and the head on them only, with rotary embeddings at the
  tokens' global positions (``DecoderChunk.forward(x, positions, attend)``).
* **Attention runs through the ring.** Every layer's attention is one call
  of the program: its forward half in the forward
  (``rings.RingAttention.forward``), its backward half when autograd reaches
  it (``RingAttentionFunction``). All ranks call the layers in the same order,
  forward and backward, so the programs' messages line up; each half leaves
  nothing in flight, so one call never meets another's messages.
* **The loss** of a rank is the sum of its tokens' cross-entropies over the
  global token count, so the ranks' losses sum to the reference's mean.
* **After the backward**, one all-reduce (sum) of every parameter's gradient
  (flattened into one buffer, with the loss appended) over all ranks, within
  ``--timeout``; then every rank takes the same optimizer step
  (``spec.make_optimizer``), so the replicas stay equal. Rank 0 prints
  ``step k loss X`` (the sum over ranks) and, with ``--save``, writes the
  model's state_dict.

What a ring schedule needs of the model (``check_ring_model``, before any
worker joins the group): the built-in model (a user's model spec has no way
to run on a part of the sequence with an injected attention), a causal mask
(the built-in attention is causal: a full-mask ring would train another
model), and a ``seq_len`` the program's chunks and pieces cut evenly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipec.errors import UsageError
from pipec.runtime import comm
from pipec.runtime.config import RunConfig
from pipec.runtime.data import BatchSource, data_needs
from pipec.runtime.rings import RingAttention, chunk_length


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


def ring_attend(program, rank: int, *, timeout: float, iteration: int | None = None, scale: float | None = None):
    """An ``attend(q, k, v)`` for ``DecoderChunk.forward``: each call runs ``program`` once through autograd.

    q, k, v are this rank's chunks concatenated in ascending chunk order,
    (batch, heads, tokens of this rank, head dim). Fault messages name the
    call (``attention 3's forward``: the fourth call, layer 3 of the built-in
    model) and ``iteration``, the training step.
    """
    calls = 0

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        ring = RingAttention(program, rank, timeout=timeout, scale=scale, iteration=iteration,
                             label=f"attention {calls}")
        calls += 1
        return RingAttentionFunction.apply(q, k, v, ring)
    return attend


def token_positions(plan, rank: int, seq_len: int) -> torch.Tensor:
    """The global positions of ``rank``'s tokens, its chunks in ascending order (LongTensor)."""
    size = chunk_length(plan, seq_len)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in plan.chunks_of(rank)])


def check_ring_model(spec, config, program) -> None:
    """Check, before any worker starts, that ``program`` (a ring program) can train this model exactly.

    Raises:
        UsageError: a model spec other than the built-in one, a full-mask
            program (the built-in attention is causal), or a ``seq_len`` that
            the program's chunks and pieces do not cut evenly (naming both).
    """
    from pipec.runtime import model as builtin

    plan = program.rings
    name = program.name or "the program"
    if spec.build_model is not builtin.build_model or not isinstance(config, builtin.ModelConfig):
        raise UsageError(f"{name} is a sequence-ring schedule, which trains the built-in model only (--model "
                         f"{builtin.DEFAULT_MODEL}, any --config): a ring runs each rank's part of the sequence with "
                         "attention through the ring, and a model spec cannot say how to run its model that way")
    if not plan.causal:
        raise UsageError(f"{name} was compiled with a full attention mask, but the built-in model's attention is "
                         "causal: a full-mask ring cannot train it exactly; compile it with -D causal=true")
    cut = plan.chunks * plan.pieces
    if config.seq_len % cut:
        pieces = f" x {plan.pieces} pieces" if plan.pieces > 1 else ""
        raise UsageError(f"the model's seq_len {config.seq_len} cannot be cut into {name}'s {plan.chunks} chunks"
                         f"{pieces}: it must be a multiple of {cut} (--config seq_len=N sets it)")


def check_ring_options(config: RunConfig, program) -> None:
    """The worker options a sequence-ring run does not support: ``--trace`` and fault injection.

    Args:
        config: the run's configuration.
        program: the sequence-ring program it trains.

    Raises:
        UsageError: either was given (``--inject late:R:S``, a late start, is allowed).
    """
    name = program.name or "the program"
    if config.trace:
        raise UsageError(f"--trace is not supported for sequence-ring schedules ({name}): a ring's instructions "
                         "run inside every layer's attention, forward and backward, not as one list per step")
    inject = config.inject
    if inject and not inject.startswith("late:"):
        raise UsageError(f"--inject {inject}: faults cannot be planted in a sequence-ring schedule's list ({name})")


def train_ring(plan, rank: int, world: int, device) -> list[float]:
    """Run ``plan.run.steps`` sequence-parallel training steps of a ring program on this rank; the group is joined.

    Collective: every rank calls it with the same arguments. Rank 0 prints the
    loss per step (the sum of the ranks' losses: the batch's mean loss) and,
    with ``--save``, writes the whole model's state_dict.

    Returns:
        on rank 0 the loss of each step; elsewhere an empty list.
    """
    from pipec.runtime import checkpoint as checkpoints
    from pipec.runtime.worker import saves_after, step_line

    program, spec, config, run = plan.program, plan.spec, plan.config, plan.run
    ring = program.rings
    check_ring_model(spec, config, program)
    positions = token_positions(ring, rank, config.seq_len).to(device)
    # one whole batch a step (N = 1), the same on every rank: each keeps its tokens of it
    data = BatchSource(spec, config, run.seed, 1, data_needs(program, rank), name=run.model)
    model = spec.build_model(config, run.seed).to(device)
    first, resumed = 1, plan.checkpoint
    if resumed is not None:
        checkpoints.load_modules([model], resumed.model, run.resume)
    optimizer = spec.make_optimizer(model.parameters())
    names = checkpoints.parameter_names([model])
    if resumed is not None:
        checkpoints.load_optimizer_state(optimizer, names, resumed.optimizer)
        data.restore(resumed.data)
        first, plan.checkpoint = resumed.step + 1, None
    parameters = [p for p in model.parameters() if p.requires_grad]
    others = tuple(r for r in range(world) if r != rank)
    dist.barrier()
    losses: list[float] = []
    for iteration in range(first, run.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        (inputs,), (targets,) = data.batch(iteration - 1)
        tokens = targets.numel()  # the global batch's: every rank's losses sum to its mean
        inputs, targets = inputs.to(device)[:, positions], targets.to(device)[:, positions]
        attend = ring_attend(program, rank, timeout=run.timeout, iteration=iteration)
        with plan.precision.autocast(device):
            logits = model(inputs, positions=positions, attend=attend)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   reduction="sum") / tokens
        loss.backward()
        total = _all_reduce_gradients(parameters, loss.detach(), run.timeout,
                                      comm.Site(rank, len(program.ranks[rank]), "the step's gradient all-reduce",
                                                others, iteration))
        norm = None
        if run.clip_grad_norm is not None:  # every replica holds the whole summed gradient: no message
            norm = torch.nn.utils.clip_grad_norm_(parameters, run.clip_grad_norm).item()
        optimizer.step()
        if rank == 0:
            losses.append(total)
            print(step_line(iteration, total, norm), flush=True)
        if saves_after(run, iteration) and rank == 0:  # every rank holds the same replica: rank 0's is the model
            _save(plan, model, optimizer, names, data.state_after(iteration), world, iteration)
    return losses


def _all_reduce_gradients(parameters, loss: torch.Tensor, timeout: float, site: comm.Site) -> float:
    """Sum every parameter's gradient, and the loss, over all ranks (one flat all-reduce, waited within
    ``timeout``); the gradients are replaced by the sums. Returns the summed loss."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    dtype = grads[0].dtype if grads else loss.dtype
    if any(g.dtype != dtype for g in grads):
        raise UsageError("sequence-ring training needs every parameter in one dtype (they are all-reduced as one "
                         "buffer)")
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1).to(dtype)])
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
    return flat[-1].item()


def _save(plan, model, optimizer, names: dict, data_state: dict, world: int, iteration: int) -> None:
    """Write the checkpoint after step ``iteration`` from this rank's replica (``checkpoint.write_checkpoint``),
    with the data position ``data_state``."""
    from pipec.runtime import checkpoint
    from pipec.runtime.worker import checkpoint_meta

    path = checkpoint.checkpoint_path(plan.run.save, iteration)
    checkpoint.write_checkpoint(
        path, {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()},
        checkpoint.named_optimizer_state(optimizer, names), step=iteration, seed=plan.run.seed,
        data=data_state, meta=checkpoint_meta(plan.program, world, plan.precision))
    print(f"saved: {path}", flush=True)


__all__ = ["RingAttentionFunction", "check_ring_model", "check_ring_options", "ring_attend", "token_positions",
           "train_ring"]
