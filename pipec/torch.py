"""pipec's schedules inside a user's own torch.distributed.pipelining training loop (docs/torch.md).

``schedule_for(program, stages, ...)`` gives the user's ``PipelineStage`` objects a schedule with torch's
``step()`` interface: torch's own ``_PipelineScheduleRuntime``, loaded with the program's actions as
``pipec compile --format torch-csv-comms`` (or ``torch-csv``) writes them. The user keeps their model,
loss, optimizer and loop; only the order of the pipeline's work is pipec's.

What is checked here, before torch sees anything, is what torch would otherwise report as a hang or an
assertion deep in a step: the stages this rank was given against the ones the program places on it, the
process group's size against the program's ranks, the microbatch count. torch is imported when
``schedule_for`` is called, not when this module (or ``pipec``) is imported.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

from pipec.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from pipec.api import Program


def schedule_for(program: Program, stages: Sequence[Any], n_microbatches: int | None = None,
                 loss_fn: Callable | None = None, *, comms: bool = True, scale_grads: bool = True,
                 **schedule_options: Any) -> _PipelineScheduleRuntime:
    """A torch pipeline schedule that runs ``program`` on this rank's ``stages``.

    Args:
        program: a ``pipec.Program`` of one pipeline (``pipec.compile`` or ``pipec.load``).
        stages: this rank's ``torch.distributed.pipelining.PipelineStage`` objects, exactly the stages
            ``program.stages_on(rank)`` names (stage ``s`` built with ``stage_index=s``), in any order.
        n_microbatches: the microbatches a ``step()`` splits its batch into; the program's own count
            (``program.num_microbatches``) when None, and it must be that count.
        loss_fn: ``loss_fn(output, target)``, as for torch's schedules.
        comms: True: torch runs pipec's own sends and receives, in pipec's checked order
            (``format="compute_comms"``); False: torch places the messages itself (``format="compute_only"``,
            what torchtitan's ``pipeline_parallel_schedule_csv`` loads).
        scale_grads: divide gradients by the microbatch count (a mean loss), as torch's schedules do.
        schedule_options: passed on to ``_PipelineScheduleRuntime`` (``args_chunk_spec``, ...).
    Returns:
        the schedule: ``step(*inputs, target=..., losses=...)`` as torch's own schedules.
    Raises:
        UsageError: a program torch cannot run (several pipelines, weight passing, sequence rings; a torch
            without ``_PipelineScheduleRuntime``), stages that are not the ones the program places on this
            rank, a process group of another size, another microbatch count.
    """
    from pipec.compiler.emit.torch_csv import installed_torch_runtime

    _check_arguments(program, stages, n_microbatches, loss_fn, comms, scale_grads)
    runtime = installed_torch_runtime()
    if runtime is None or not runtime.loads_comms:
        version = runtime.version if runtime is not None else "no torch"
        raise UsageError(f"pipec.torch.schedule_for needs torch's _PipelineScheduleRuntime (torch 2.5 or later; "
                         f"found {version})")
    csv_text = program.to_torch_csv(comms=comms)  # first: a program torch cannot run is named as such
    count = _microbatches(program, n_microbatches)
    actions = _actions(csv_text)
    _check_stages(program, stages, actions)
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(list(stages), n_microbatches=count, loss_fn=loss_fn, scale_grads=scale_grads,
                                        **schedule_options)
    # What the runtime's _load_csv does once it has read its file, without a file: both are torch's private
    # API (torchtitan calls _load_csv), tested here on torch 2.13.
    if comms:
        schedule._prepare_schedule_with_comms(actions, format="compute_comms")
    else:  # as torch's own _load_csv: the compute order kept, then lowered with torch's messages
        schedule.pipeline_order = actions
        schedule._prepare_schedule_with_comms(actions, format="compute_only")
    for caveat in program.torch_caveats() if comms else ():
        warnings.warn(f"pipec.torch: {caveat}", stacklevel=2)
    return schedule


# What schedule_for reads of each stage: a PipelineStage has them all.
_STAGE_ATTRIBUTES = ("stage_index", "num_stages", "group_size", "group_rank")


def _check_arguments(program, stages, n_microbatches, loss_fn, comms, scale_grads) -> None:
    """Each argument of the type ``schedule_for`` takes, or a ``UsageError`` naming it and what it got (never a
    TypeError or AttributeError from inside, nor a truthy string taken for True)."""
    from pipec.api import Program

    if not isinstance(program, Program):
        raise UsageError(f"program: expected a pipec.Program (pipec.compile or pipec.load), got "
                         f"{type(program).__name__}")
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):
        raise UsageError(f"stages: expected a list of this rank's PipelineStage objects, got {type(stages).__name__}")
    for index, stage in enumerate(stages):
        missing = [name for name in _STAGE_ATTRIBUTES if not hasattr(stage, name)]
        if missing:
            raise UsageError(f"stages[{index}]: expected a torch.distributed.pipelining PipelineStage, got "
                             f"{type(stage).__name__} (it has no {missing[0]})")
    if n_microbatches is not None and (isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int)
                                       or n_microbatches < 1):
        shown = repr(n_microbatches) if isinstance(n_microbatches, (int, float, str)) else type(n_microbatches).__name__
        raise UsageError(f"n_microbatches: expected an int >= 1 (or None: the program's own count), got {shown}")
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"loss_fn: expected a function (output, target) -> loss, got {type(loss_fn).__name__}")
    for name, value in (("comms", comms), ("scale_grads", scale_grads)):
        if not isinstance(value, bool):
            raise UsageError(f"{name}: expected True or False, got {type(value).__name__}")


def _microbatches(program: Program, n_microbatches: int | None) -> int:
    if n_microbatches is None:
        return program.num_microbatches
    if n_microbatches != program.num_microbatches:
        raise UsageError(f"{program.name} orders {program.num_microbatches} microbatches a step; n_microbatches is "
                         f"{n_microbatches} (compile it with N={n_microbatches}, or leave n_microbatches out)")
    return n_microbatches


def _check_stages(program: Program, stages: Sequence[Any], actions: dict[int, list]) -> None:
    """``stages`` are this rank's (the ones its row of ``actions`` computes) in a process group of one rank per row.

    Stage ids are torch's stage indices only for a program whose one pipeline runs its stages in id order.
    A composed program (PP x FSDP, PP x DP) has one row per pp rank, the group being torch's pp group of one
    dp coordinate, and its stages must be FSDP2 modules: torch's runtime skips UNSHARD, RESHARD and the
    gradient reduction of any other module, and would train each dp member on its own rows alone.
    """
    ir = program.ir
    if len(ir.pipelines) == 1 and ir.pipelines[0] != list(range(len(ir.stages))):
        raise UsageError(f"{program.name}: its pipeline runs stages {ir.pipelines[0]}; pipec.torch needs stage s "
                         "to be the s-th (torch's stage_index)")
    if not stages:
        raise UsageError("schedule_for needs this rank's stages (torch.distributed.pipelining.PipelineStage)")
    composed = ir.mesh is not None and ir.placed_on_groups
    group_size, rank = stages[0].group_size, stages[0].group_rank
    if group_size != len(actions):
        where = f"{len(actions)} pp ranks (its pp process group)" if composed else f"{len(actions)} ranks"
        raise UsageError(f"{program.name} runs on {where}; the stages' process group has {group_size}")
    given = sorted(stage.stage_index for stage in stages)
    wanted = sorted({action.stage_index for action in actions[rank] if action.computation_type == _forward_type()})
    if given != wanted:
        raise UsageError(f"rank {rank}: {program.name} places stages {wanted} here; the stages given are {given}")
    totals = {stage.num_stages for stage in stages}
    if totals != {program.num_stages}:
        raise UsageError(f"{program.name} has {program.num_stages} stages; the stages given say "
                         f"{sorted(totals)} in all")
    if composed:
        _check_fully_sharded(program, stages)


def _check_fully_sharded(program: Program, stages: Sequence[Any]) -> None:
    from torch.distributed.fsdp import FSDPModule

    plain = sorted(stage.stage_index for stage in stages if not isinstance(stage.submod, FSDPModule))
    if plain:
        raise UsageError(f"{program.name} places its stages on data-parallel groups; stage(s) {plain} are not "
                         "FSDP2 modules (fully_shard on the dp sub-mesh with reshard_after_forward=False for a "
                         "sharded stage, replicate for a replicated one: docs/torch.md)")


def _forward_type():
    """torch's F action type (torch is imported only once a schedule is asked for)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    return _ComputationType.FORWARD


def _actions(csv_text: str) -> dict[int, list]:
    """torch's actions, rank by rank, from a CSV pipec wrote (one line per rank, even an empty one)."""
    from torch.distributed.pipelining.schedules import _Action

    return {rank: [_Action.from_str(cell) for cell in line.split(",") if cell]
            for rank, line in enumerate(csv_text.split("\n")[:-1])}
