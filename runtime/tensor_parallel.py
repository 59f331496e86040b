"""Tensor-parallel training: the tensor-parallel family's runtime (docs/ir.md, "Adding a family").

A tensor-parallel program (``TensorPlan``) splits each of a stack of MLP
blocks, ``y = x + gelu(x W1^T + b1) W2^T``, across every rank as Megatron-LM
does: rank r holds rows r/P of W1 and b1 (column parallel) and columns r/P
of W2 (row parallel), cut from the whole model every rank builds from the
seed. Its list runs through the one interpreter loop
(``runtime/family.run_instructions``): TF makes the rank's partial sum of a
layer's output, TB its partial of the input's gradient (autograd of the
rank's slices, which also leaves their weight gradients); each ALLREDUCE
part sums the partials of every rank (``runtime/exchange.py``: posted at
EXCHANGE, waited at EXCHANGE_WAIT), and on arrival the residual is added.
Every rank holds the same whole tensors, computes the same loss and steps
only its slices, so the slices stay those of the one-process model trained
on the same data (``reference_parameters``).

The family trains its own model (``MlpConfig``): a model spec's layers have
no slices to cut, so ``--model`` is refused, and so are the options that
this runtime does not take yet (``--clip-grad-norm``, ``--config``, a dtype
other than fp32, NCCL, ...), by name, before any worker starts
(``refuse_run``) and again in each worker. ``TensorTrainer`` is what the one
training loop (``worker.train``) drives: ``--save``, ``--save-every``,
``--resume``, ``--trace`` and ``--inject`` as every family.
"""
from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipec.compiler import ops
from pipec.compiler.families.tensor_parallel import TensorPlan
from pipec.compiler.ir import Action
from pipec.errors import RuntimeFault, UsageError
from pipec.runtime import comm, phases
from pipec.runtime import model as builtin
from pipec.runtime.exchange import Exchange, check_all_waited, post_exchange, wait_exchange
from pipec.runtime.family import RuntimeFamily, StepOutcome, Trainer, register, run_instructions


@dataclass(frozen=True)
class MlpConfig:
    """The family's model: ``layers`` MLP blocks of width ``hidden`` and inner width ``inner``, trained on
    microbatches of ``rows`` random rows (inputs and targets drawn from the seed) with SGD at ``lr``."""

    hidden: int = 16
    inner: int = 64
    rows: int = 4
    lr: float = 0.05


def whole_model(layers: int, config: MlpConfig, seed: int) -> list[dict[str, torch.Tensor]]:
    """Every layer's whole weights (``w1``: inner x hidden, ``b1``: inner, ``w2``: hidden x inner), from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    scale1, scale2 = config.hidden ** -0.5, config.inner ** -0.5
    return [{"w1": torch.randn(config.inner, config.hidden, generator=generator) * scale1,
             "b1": torch.randn(config.inner, generator=generator) * 0.1,
             "w2": torch.randn(config.hidden, config.inner, generator=generator) * scale2}
            for _ in range(layers)]


def microbatch(config: MlpConfig, seed: int, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of microbatch ``mb`` of training step ``step`` (from 1), the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + mb)
    return (torch.randn(config.rows, config.hidden, generator=generator),
            torch.randn(config.rows, config.hidden, generator=generator))


def _block(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """What some columns of W1 (and rows of W2) add to a block's output: the whole block's, given all of them."""
    return F.gelu(x @ w1.T + b1) @ w2.T


def slices(layer: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of one layer: rows of W1 and b1, the same columns of W2."""
    size = layer["w1"].shape[0] // world
    part = slice(rank * size, (rank + 1) * size)
    return {"w1": layer["w1"][part].clone(), "b1": layer["b1"][part].clone(), "w2": layer["w2"][:, part].clone()}


def reference_parameters(layers: int, num_microbatches: int, steps: int, seed: int,
                         config: MlpConfig = MlpConfig()) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """The whole model after ``steps`` steps of the same training in one process, and each step's loss."""
    model = [{name: t.clone().requires_grad_() for name, t in layer.items()} for layer in whole_model(layers, config, seed)]
    optimizer = torch.optim.SGD([t for layer in model for t in layer.values()], lr=config.lr)
    losses = []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        total = 0.0
        for mb in range(num_microbatches):
            x, target = microbatch(config, seed, step, mb)
            for layer in model:
                x = x + _block(x, layer["w1"], layer["b1"], layer["w2"])
            loss = F.mse_loss(x, target) / num_microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return [{name: t.detach() for name, t in layer.items()} for layer in model], losses


class TensorStep:
    """One rank's state while it runs its list for one training step (the handlers' ``state``).

    Attributes:
        row: the rank's list (a copy: ``--inject`` plants into it); handlers: the family's table (a copy, alike).
    """

    def __init__(self, program, rank: int, world: int, params: list[dict], timeout: float, backend: str):
        self.program, self.rank, self.world, self.params, self.timeout = program, rank, world, params, timeout
        self.row = list(program.ranks[rank])
        self.handlers = dict(HANDLERS)
        self.num_microbatches = program.num_microbatches
        self.layers = len(program.stages)
        self.wait_fn, _ = comm.wait_rule(backend)
        self.iteration = 1
        self.waited = 0.0
        self.open: dict[int, Exchange] = {}

    def reset(self, iteration: int, batch) -> None:
        """Start step ``iteration`` on ``batch``: (inputs, targets), one of each per microbatch."""
        self.iteration = iteration
        self.inputs = dict(enumerate(zip(*batch)))
        self.whole: dict[tuple, torch.Tensor] = {}     # (op, layer, mb) -> the all-reduced tensor, residual added
        self.saved: dict[tuple, tuple] = {}            # (layer, mb) -> (input leaf, partial output)
        self.partials: dict[tuple, tuple] = {}         # (op, layer, mb) -> (partial, what to add to its sum)
        self.loss = 0.0

    def fault(self, index: int, message: str, peer: int | None = None) -> RuntimeFault:
        return RuntimeFault(message, self.rank, index, self.row[index].text() if 0 <= index < len(self.row) else "",
                            peer)

    def site(self, index: int, text: str, peers: tuple[int, ...]) -> comm.Site:
        return comm.Site(self.rank, index, text, peers, self.iteration)

    def wait_works(self, ex: Exchange, site: comm.Site) -> None:
        self.wait_fn(ex.works, self.timeout, site)


def _forward(state: TensorStep, action: Action, index: int) -> None:
    """TF(l, m): this rank's partial sum of layer l's output, from the whole input."""
    layer, mb = action.stage, action.mb
    x = state.inputs[mb][0] if layer == 0 else state.whole[(ops.TF, layer - 1, mb)]
    leaf = x.detach().requires_grad_()
    weights = state.params[layer]
    partial = _block(leaf, weights["w1"], weights["b1"], weights["w2"])
    state.saved[(layer, mb)] = (leaf, partial)
    state.partials[(ops.TF, layer, mb)] = (partial.detach().clone(), x.detach())


def _backward(state: TensorStep, action: Action, index: int) -> None:
    """TB(l, m): this rank's partial of layer l's input gradient (and its slices' weight gradients), from the
    whole gradient of the layer's output: the layer after's, or the loss's at the last layer."""
    layer, mb = action.stage, action.mb
    if layer + 1 < state.layers:
        grad = state.whole[(ops.TB, layer + 1, mb)]
    else:
        out = state.whole[(ops.TF, layer, mb)].detach().requires_grad_()
        loss = F.mse_loss(out, state.inputs[mb][1]) / state.num_microbatches
        loss.backward()
        state.loss += loss.item()
        grad = out.grad
    leaf, partial = state.saved.pop((layer, mb))
    partial.backward(grad)
    state.partials[(ops.TB, layer, mb)] = (leaf.grad, grad)


def _all_reduce(state: TensorStep, part: Action, ex: Exchange) -> None:
    """ALLREDUCE_TF / ALLREDUCE_TB: sum every rank's partial; on arrival the whole tensor is the sum plus
    the residual (the block's input forward, the output's gradient backward)."""
    task = ops.TF if part.op == ops.ALLREDUCE_TF else ops.TB
    key = (task, part.stage, part.mb)
    partial, residual = state.partials.pop(key)
    ex.works.append(dist.all_reduce(partial, op=dist.ReduceOp.SUM, async_op=True))
    ex.keep.append(partial)
    ex.peers.update(r for r in range(state.world) if r != state.rank)

    def arrive() -> None:
        state.whole[key] = residual + partial
    ex.arrivals.append(arrive)


def _exchange(state: TensorStep, action: Action, index: int) -> None:
    post_exchange(state, action, index, state.open, PART_POSTERS, fault=state.fault,
                  refusal="a tensor-parallel exchange cannot hold")


def _exchange_wait(state: TensorStep, action: Action, index: int) -> None:
    wait_exchange(action, index, state.open, state.row, fault=state.fault, site=state.site, wait=state.wait_works)


HANDLERS = {ops.TF: _forward, ops.TB: _backward, ops.EXCHANGE: _exchange, ops.EXCHANGE_WAIT: _exchange_wait}
PART_POSTERS = {ops.ALLREDUCE_TF: _all_reduce, ops.ALLREDUCE_TB: _all_reduce}


def options_refusal(run) -> str | None:
    """Why this runtime cannot take the run's options yet (module docstring), or None."""
    for given, words in ((run.clip_grad_norm, "--clip-grad-norm"), (run.partition, "--partition"),
                         (run.config_overrides, "--config"),
                         (run.dtype not in (None, "fp32"), f"--dtype {run.dtype}"),
                         (run.backend != "gloo", f"--backend {run.backend}")):
        if given:
            return (f"a tensor-parallel schedule does not take {words} yet (it trains on gloo ranks with --steps, "
                    "--seed, --timeout, --save, --save-every, --resume, --trace and --inject)")
    return None


class MlpBatches:
    """The family's data (``Trainer.data``): step ``step``'s microbatches, drawn from the seed, the same on every
    rank; its position is only the steps done, so a resumed run draws what the uninterrupted one would."""

    SOURCE = "tensor_parallel_mlp"

    def __init__(self, config: MlpConfig, seed: int, num_microbatches: int):
        self.config, self.seed, self.num_microbatches = config, seed, num_microbatches
        self.rows_per_microbatch = config.rows

    def batch(self, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Step ``step``'s (from 0) inputs and targets, one of each per microbatch."""
        pairs = [microbatch(self.config, self.seed, step + 1, mb) for mb in range(self.num_microbatches)]
        return [x for x, _ in pairs], [target for _, target in pairs]

    def state_after(self, steps_done: int) -> dict:
        return {"source": self.SOURCE, "steps": steps_done}

    def restore(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("source") != self.SOURCE or set(state) != {"source", "steps"}:
            raise UsageError(f"--resume: the checkpoint's data position {state!r} is not a tensor-parallel run's")


class TensorTrainer(Trainer):
    """One rank of a tensor-parallel program (``RuntimeFamily.trainer``): its slices of every layer, cut from the
    whole model every rank builds from the seed (or a resumed checkpoint's), stepped by SGD; a checkpoint joins
    every rank's slices into the whole model (``layers.L.w1`` and so on)."""

    def __init__(self, plan, rank: int, world: int, device):
        program, run = plan.program, plan.run
        refusal = options_refusal(run)
        if refusal is not None:
            raise UsageError(refusal)
        phases.announce(phases.MODEL_BUILD)
        config = MlpConfig()
        whole = whole_model(len(program.stages), config, run.seed)
        if plan.checkpoint is not None:
            phases.announce(phases.CHECKPOINT_LOAD)
            whole = _checkpoint_layers(plan.checkpoint.model, whole, run.resume)
        self.params = [{name: t.requires_grad_() for name, t in slices(layer, rank, world).items()} for layer in whole]
        self.optimizer = torch.optim.SGD([t for layer in self.params for t in layer.values()], lr=config.lr)
        self.rank, self.record = rank, run.trace
        self.context = TensorStep(program, rank, world, self.params, run.timeout, run.backend)
        self.data = MlpBatches(config, run.seed, program.num_microbatches)
        self.batch_size = (program.num_microbatches * config.rows, None)
        self.modules = {}

    def step(self, batch, iteration: int) -> StepOutcome:
        """Every rank computes the whole loss; rank 0's is the batch's (the others add nothing)."""
        state = self.context
        events: list = []
        self.optimizer.zero_grad()
        state.reset(iteration, batch)
        run_instructions(state, state.row, state.handlers, 0, len(state.row), events.append if self.record else None)
        check_all_waited(state.open, state.fault)
        start = perf_counter()
        self.optimizer.step()
        if self.record:
            events.append((len(state.row), start, perf_counter(), 0.0))
        return StepOutcome(torch.tensor(state.loss) if self.rank == 0 else None, None, events)

    def checkpoint_part(self) -> dict:
        return {"model": [{name: t.detach().clone() for name, t in layer.items()} for layer in self.params]}

    def merged_parts(self, parts: list[dict]) -> tuple[dict, dict]:
        """The whole layers, every rank's slices joined in rank order (W1, b1 by rows, W2 by columns); SGD keeps
        no state."""
        model = {}
        for layer, pieces in enumerate(zip(*(part["model"] for part in parts))):
            for name in pieces[0]:
                model[f"layers.{layer}.{name}"] = torch.cat([piece[name] for piece in pieces],
                                                            dim=1 if name == "w2" else 0)
        return model, {}


def _checkpoint_layers(model: dict, built: list[dict], source: str) -> list[dict]:
    """The whole layers a checkpoint holds, each the shape of the one built (else a ``UsageError``)."""
    layers = []
    for index, layer in enumerate(built):
        found = {}
        for name, tensor in layer.items():
            key = f"layers.{index}.{name}"
            saved = model.get(key)
            if saved is None or tuple(saved.shape) != tuple(tensor.shape):
                raise UsageError(f"--resume: the checkpoint's '{key}' is "
                                 f"{'missing' if saved is None else tuple(saved.shape)}, this model's is "
                                 f"{tuple(tensor.shape)}: it was saved from another model ({source})")
            found[name] = saved.clone()
        layers.append(found)
    return layers


class TensorParallel(RuntimeFamily):
    """The tensor-parallel family's runtime hooks: its table, its model check, its trainer."""

    name = ops.TENSOR_PARALLEL
    label = "tensor-parallel"
    handlers = HANDLERS
    part_posters = PART_POSTERS
    passes_activations = False
    runs_chunks = False
    takes_partition = False
    reads_whole_batch = True
    trainer = TensorTrainer

    def check_model(self, spec, config, program, name: str) -> None:
        schedule = program.name or "the program"
        if spec.build_model is not builtin.build_model:
            raise UsageError(f"{schedule} is tensor-parallel: it trains its own stack of MLP blocks, cut into slices "
                             "per rank (docs/ir.md, \"Adding a family\"); --model is not taken yet")
        inner = MlpConfig().inner
        if inner % program.num_ranks:
            raise UsageError(f"{schedule} splits each MLP block's inner width, {inner}, across {program.num_ranks} "
                             f"ranks: it must divide by them (2, 4, 8, 16, 32 or 64 ranks)")

    def refuse_run(self, run) -> str | None:
        return options_refusal(run)


FAMILY = register(TensorParallel(), TensorPlan)


__all__ = ["FAMILY", "HANDLERS", "MlpBatches", "MlpConfig", "PART_POSTERS", "TensorParallel", "TensorTrainer",
           "microbatch", "reference_parameters", "slices", "whole_model"]
