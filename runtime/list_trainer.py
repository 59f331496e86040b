"""A rank's training of an instruction-list program: its chunks, its context, its data, one interpreter step.

The ``Trainer`` (``runtime/family.py``) of activation passing and weight passing,
alone and composed on a mesh: the rank builds the chunks its stages run
(``interpreter.stage_modules``; under weight passing every chunk), loads a
resumed checkpoint into them before its context is made (weight passing cuts
its shards from the modules), and each step runs its list through the
interpreter (``interpreter.run_step``). Its data are the microbatches its first
and last stages read, of the share of rows or tokens its placement states.
"""
from __future__ import annotations

from pipec.runtime import checkpoint, phases
from pipec.runtime.data import BatchSource, data_needs
from pipec.runtime.family import StepOutcome, Trainer, share_of
from pipec.runtime.interpreter import make_context, run_step, stage_modules
from pipec.runtime.model import call_spec_function
from pipec.runtime.report import batch_size


class ListTrainer(Trainer):
    """One rank of an instruction-list program (module docstring); collective (its context's groups)."""

    def __init__(self, plan, rank: int, world: int, device):
        import torch

        program, spec, config, run = plan.program, plan.spec, plan.config, plan.run
        phases.announce(phases.MODEL_BUILD)
        self.modules = stage_modules(program, rank, lambda chunk: call_spec_function(
            run.model, f"build_chunk(config, {chunk}, {program.num_chunks}, seed)", spec.build_chunk, config, chunk,
            program.num_chunks, run.seed).to(device))
        resumed = plan.checkpoint
        if resumed is not None:  # before the context: weight passing cuts its shards from the modules
            phases.announce(phases.CHECKPOINT_LOAD)
            checkpoint.load_modules(self.modules.values(), resumed.model, run.resume)
        synchronize = torch.cuda.synchronize if (run.trace and device.type == "cuda") else None
        seq_len, tokens = None, None
        if program.stage_ring is not None:  # context parallel: each member runs its tokens of every sequence
            from pipec.runtime.placed import stage_ring_model, token_share

            seq_len = stage_ring_model(spec, config, program, run.model).seq_len
            tokens = token_share(program, rank, seq_len)
        self.context = make_context(
            program, rank, self.modules,
            loss_fn=spec.loss_fn, make_optimizer=spec.make_optimizer, layouts=plan.layouts or [],
            precision=plan.precision, device=device, backend=run.backend, timeout=run.timeout,
            synchronize=synchronize, clip_grad_norm=run.clip_grad_norm, seq_len=seq_len,
        )
        if resumed is not None:
            checkpoint.restore_optimizer(self.context, self.modules, resumed.optimizer)
        # this rank reads only the inputs and targets its first and last stages use
        self.data = BatchSource(spec, config, run.seed, program.num_microbatches, data_needs(program, rank),
                                device=device, name=run.model,
                                share=share_of(program, rank) if tokens is None else None, tokens=tokens)
        self.batch_size = batch_size(config, program.num_microbatches, self.data.rows_per_microbatch)

    def step(self, batch, iteration: int) -> StepOutcome:
        context = self.context
        context.iteration = iteration
        loss, events = run_step(context.program, context.rank, self.modules, batch, context)
        return StepOutcome(loss, context.grad_norm, events)

    def checkpoint_part(self) -> dict:
        return checkpoint.rank_part(self.context, self.modules)

    def merged_parts(self, parts: list[dict]) -> tuple[dict, dict]:
        return checkpoint.merged_parts(self.context, parts)


__all__ = ["ListTrainer"]
