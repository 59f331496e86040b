"""A ``Program`` as torch.distributed.pipelining's schedule CSV.

``write_torch_csv(program, with_comms, for_torch)`` writes a single-pipeline
activation-passing program in either of torch's forms: compute only (torch
lowers it to communication itself) or with pipec's own sends and receives
(a ``BATCH`` as its parts). What each op becomes is its rule's ``torch``
field (``ops.py``), so no op is special-cased here. A composed program
(stages on the data-parallel or fully sharded groups of a mesh) is written
one row per pp rank with its own UNSHARD, RESHARD and REDUCE_GRAD steps by
``torch_csv_mesh`` (docs/torch.md, "Composed programs"). Programs torch's
single chain of stages cannot express (several pipelines, weight passing,
sequence rings, stages on groups without a mesh) raise ``UsageError``.

The comms form is for the torch that will load it (``TorchRuntime``, found
by ``installed_torch_runtime``): since 2.10 torch's runtime scales gradients
only at ``REDUCE_GRAD``, so a CSV without it trains with gradients N times too
large; the form written for such a torch carries ``REDUCE_GRAD`` and the
``UNSHARD`` / ``RESHARD`` tokens where torch's own lowering puts them
(``_add_reduce_grad``, ``_add_unshard_reshard``), and ``runtime_caveats``
says what is not exact on older ones. pipec's importer skips those tokens,
so the export reads back as the program it came from. Writing a BATCH as its
parts loses its atomicity: the result is safe under torch's "async"
semantics, which is how pipec checks a CSV with communication.

Both forms, what is dropped and why, and the token placement are described
in docs/formats.md, "torch's schedule CSV".
"""
from __future__ import annotations

from typing import NamedTuple

from pipec.compiler import ops
from pipec.compiler.family import first_refusal
from pipec.compiler.emit.torch_csv_mesh import UNSHARD, composed_rows
from pipec.compiler.ir import Action, Program, groups_refusal
from pipec.errors import UsageError

# What each op becomes in each form (its rule's ``torch``): KEEP writes its
# token, EXPAND writes its parts' tokens, DROP writes nothing.
_COMPUTE_ONLY = {op: rule.torch[0] for op, rule in ops.RULES.items()}
_WITH_COMMS = {op: rule.torch[1] for op, rule in ops.RULES.items()}
ops.declare_pass("torch csv", _COMPUTE_ONLY.keys() & _WITH_COMMS.keys())
# A kept op written as another token (FC as torch's F).
_TORCH_TOKEN = {op: rule.torch_token for op, rule in ops.RULES.items() if rule.torch_token}


class TorchRuntime(NamedTuple):
    """What the ``_PipelineScheduleRuntime`` that loads a comms CSV does, as read from torch's source.

    torch >= 2.4, < 2.14 (pyproject's range), by version:

    * 2.4: no ``_PipelineScheduleRuntime``; nothing loads the comms form.
    * 2.5, 2.6: loads it; never scales gradients (no ``scale_grads``): they
      are the sum over microbatches, N times a mean-loss step's, with torch's
      own schedules too.
    * 2.7 to 2.9: divides by N right after a stage's N-th full backward (B);
      a stage whose last backward is a weight backward (W, zero-bubble
      schedules) is never divided, with torch's own schedules too.
    * 2.10 to 2.13: divides by N only at ``REDUCE_GRAD``, which the CSV must
      carry: exact for every schedule (tested on 2.13, ``tests/test_torch_runtime_export.py``).

    Attributes:
        version: torch's version, for messages.
        loads_comms: ``_PipelineScheduleRuntime`` exists.
        reduce_grad: the ``REDUCE_GRAD`` action exists; the runtime scales there only.
        scales_full_backward: without ``REDUCE_GRAD``, the runtime scales after a
            stage's last full backward (``scale_grads`` exists).
        fsdp_tokens: ``UNSHARD`` and ``RESHARD`` exist.
        local_handoff: adjacent stages on one rank hand values over locally
            (torch's "V-schedule special case"), so the CSV has no message between them.
    """

    version: str
    loads_comms: bool = True
    reduce_grad: bool = True
    scales_full_backward: bool = True
    fsdp_tokens: bool = True
    local_handoff: bool = True


# The newest torch pyproject accepts; what is written when no torch is at hand.
NEWEST_TORCH = TorchRuntime("2.13")
REDUCE_GRAD, RESHARD = "REDUCE_GRAD", "RESHARD"


def installed_torch_runtime() -> TorchRuntime | None:
    """The installed torch's runtime, found by looking for its features (not its version number); None without torch."""
    try:
        import inspect

        import torch
        from torch.distributed.pipelining import schedules
    except (ImportError, OSError):  # no torch, or one whose libraries do not load
        return None
    kinds = getattr(schedules, "_ComputationType", None)
    multi = getattr(schedules, "PipelineScheduleMulti", None)
    return TorchRuntime(
        version=str(torch.__version__).split("+")[0],
        loads_comms=hasattr(schedules, "_PipelineScheduleRuntime"),
        reduce_grad=hasattr(kinds, REDUCE_GRAD),
        scales_full_backward=multi is not None and "scale_grads" in inspect.signature(multi.__init__).parameters,
        fsdp_tokens=hasattr(kinds, UNSHARD) and hasattr(kinds, RESHARD),
        # the zero-bubble V schedule came with the runtime's local hand-off it relies on
        local_handoff=hasattr(schedules, "ScheduleZBVZeroBubble"),
    )


def write_torch_csv(program: Program, with_comms: bool, for_torch: TorchRuntime | None = None) -> str:
    """torch's schedule CSV for a single-pipeline program.

    Args:
        program: a program with exactly one pipeline (its stages on one rank each, or on the groups of a
            mesh's data axis: one row per pp rank then).
        with_comms: write sends and receives too (torch's "compute_comms"
            format); otherwise only compute (its "compute_only" format).
        for_torch: the torch runtime the comms form is for: it decides
            whether ``REDUCE_GRAD``, ``UNSHARD`` and ``RESHARD`` are written
            (``installed_torch_runtime()``, or ``NEWEST_TORCH``). None writes
            compute and messages only, the plain form pipec itself reads,
            on which torch >= 2.10's runtime leaves gradients N times too
            large. Unused for compute only.
    Returns:
        the CSV text, one line per rank, ``\\n``-terminated.
    Raises:
        UsageError: the program passes weights, is a sequence ring, has several pipelines (replicated stages),
            a composition torch's runtime cannot run (``torch_csv_mesh``), or an op torch cannot express.
    """
    refusal = first_refusal(program, lambda family: family.refuse_torch_csv(program.name or "this program"))
    composed = program.mesh is not None and program.placed_on_groups
    if refusal is None and not composed:
        refusal = groups_refusal(program, "torch's schedule CSV (one rank per stage)")
    if refusal is not None:
        raise UsageError(refusal)
    if len(program.pipelines) != 1:
        raise UsageError(
            f"{program.name or 'this program'} has {len(program.pipelines)} pipelines (replicated stages); "
            "torch's schedule CSV has a single chain of stages (stage s+1 follows s), so it cannot be written as one"
        )
    cells_of = _cell_writer(program, _WITH_COMMS if with_comms else _COMPUTE_ONLY)
    if composed:
        return _write_composed(program, with_comms, for_torch, cells_of)
    position = _positions(program)
    rules = _WITH_COMMS if with_comms else _COMPUTE_ONLY
    lines = []
    for rank, row in enumerate(program.ranks):
        cells: list[str] = []
        for action in row:
            written = cells_of(action)
            if written is None:
                raise UsageError(f"rank {rank}: {action.text()} has no torch.distributed.pipelining token")
            cells.extend(written)
        if with_comms and for_torch is not None:
            if for_torch.reduce_grad:
                cells = _add_reduce_grad(cells, row, rules, position, program.num_microbatches)
            if for_torch.fsdp_tokens:
                cells = _add_unshard_reshard(cells, row, rules, position)
        lines.append(",".join(cells) + "\n")
    return "".join(lines)


def _cell_writer(program: Program, rules: dict[str, str]):
    """A function Action -> the cells torch's CSV writes for it under ``rules`` (None: the op has no token)."""
    token = _token_writer(program)

    def cells_of(action: Action) -> list[str] | None:
        rule = rules.get(action.op)
        if rule == ops.KEEP:
            return [token(action._replace(op=_TORCH_TOKEN.get(action.op, action.op)))]
        if rule == ops.EXPAND:
            return [token(part) for part in action.parts]
        return None if rule is None else []

    return cells_of


def _write_composed(program: Program, with_comms: bool, for_torch: TorchRuntime | None, cells_of) -> str:
    """A PP x FSDP or PP x DP program's CSV (``torch_csv_mesh``): one row per pp rank, the program's own
    UNSHARD, RESHARD and REDUCE_GRAD in it, which a torch without those tokens cannot run."""
    if with_comms and for_torch is not None and not (for_torch.reduce_grad and for_torch.fsdp_tokens):
        raise UsageError(f"torch {for_torch.version}'s runtime has no {REDUCE_GRAD} action; "
                         f"{program.name or 'this composed program'} reduces its stages' gradients over their data "
                         f"groups there (torch {_EXACT} runs it)")
    return "".join(",".join(cells) + "\n" for cells in composed_rows(program, with_comms, cells_of))


def _positions(program: Program) -> dict[int, int]:
    """stage id -> torch's stage index (its position along the one pipeline)."""
    return {stage: pos for pos, stage in enumerate(program.pipelines[0])}


def _cell_sources(row, rules) -> list[Action]:
    """The action each written cell came from, cell by cell (a batch's parts one by one)."""
    sources: list[Action] = []
    for action in row:
        rule = rules.get(action.op)
        if rule == ops.KEEP:
            sources.append(action)
        elif rule == ops.EXPAND:
            sources.extend(action.parts)
    return sources


def _add_reduce_grad(cells: list[str], row, rules, position: dict[int, int], num_microbatches: int) -> list[str]:
    """``cells`` with ``<stage>REDUCE_GRAD`` after each stage's N-th backward (B or W) and that backward's sends.

    torch's ``_add_reduce_grad`` counts B and W (an I leaves the weight
    gradient to its W); its ``_add_send_recv`` then puts a backward's own send
    right after it, before the REDUCE_GRAD, so the neighbour is not kept waiting.
    """
    counts: dict[int, int] = {}
    pending: list[tuple[int, int]] = []  # (stage, mb) of last backwards whose sends may still follow
    out: list[str] = []
    for cell, action in zip(cells, _cell_sources(row, rules)):
        while pending and not (action.op == ops.SEND_B and (action.stage, action.mb) == pending[0]):
            out.append(f"{position[pending.pop(0)[0]]}{REDUCE_GRAD}")
        out.append(cell)
        if action.op in _GRAD_DONE:
            counts[action.stage] = count = counts.get(action.stage, 0) + 1
            if count == num_microbatches:
                pending.append((action.stage, action.mb))
    out.extend(f"{position[stage]}{REDUCE_GRAD}" for stage, _ in pending)
    return out


def _add_unshard_reshard(cells: list[str], row, rules, position: dict[int, int]) -> list[str]:
    """``cells`` with torch's ``UNSHARD``/``RESHARD`` tokens, placed by torch's ``_add_unshard_reshard`` rule.

    Before each compute, the next ``_ACTIVE_STAGES`` distinct stages the rank
    computes (this one first) are unsharded, and active stages not among them
    resharded; every stage still active is resharded at the end. Only the
    compute order matters, so messages stay where they are and the tokens go
    just before the compute. ``REDUCE_GRAD`` cells (from ``_add_reduce_grad``)
    are kept in place.
    """
    sources = _cell_sources(row, rules)
    upcoming = _next_distinct([a.stage for a in sources if a.op in ops.COMPUTE_OPS], _ACTIVE_STAGES)
    sources = iter(sources)
    active: list[int] = []
    out: list[str] = []
    compute_index = 0
    for cell in cells:
        if cell.endswith(REDUCE_GRAD):
            out.append(cell)
            continue
        action = next(sources)
        if action.op in ops.COMPUTE_OPS:
            wanted = upcoming[compute_index]
            compute_index += 1
            for stage in [s for s in active if s not in wanted]:
                active.remove(stage)
                out.append(f"{position[stage]}{RESHARD}")
            for stage in wanted:
                if stage not in active:
                    active.append(stage)
                    out.append(f"{position[stage]}{UNSHARD}")
        out.append(cell)
    out.extend(f"{position[stage]}{RESHARD}" for stage in active)
    return out


def _next_distinct(stages: list[int], count: int) -> list[tuple[int, ...]]:
    """For each index i, the first ``count`` distinct stages of ``stages[i:]``, in order of first appearance.

    One pass from the end (a move-to-front list) instead of torch's scan of the
    whole remainder at each step, which is quadratic when a rank has fewer
    than ``count`` stages.
    """
    order: list[int] = []
    result: list[tuple[int, ...]] = [()] * len(stages)
    for i in range(len(stages) - 1, -1, -1):
        stage = stages[i]
        if stage in order:
            order.remove(stage)
        order.insert(0, stage)
        result[i] = tuple(order[:count])
    return result


# torch's lowering keeps this many stages unsharded at once (_add_unshard_reshard's max_active_stages).
_ACTIVE_STAGES = 3
# The backwards that finish a microbatch's weight gradient (torch's _requires_reduce_grad).
_GRAD_DONE = {ops.B, ops.W}


def runtime_caveats(program: Program, runtime: TorchRuntime | None) -> list[str]:
    """Why torch's runtime would not run a comms export of ``program`` exactly: one sentence each; [] when it would.

    Args:
        program: a single-pipeline program.
        runtime: the installed torch's (``installed_torch_runtime``), or None when there is no torch.
    """
    if runtime is None:
        return [f"torch is not installed here: wrote the form torch {_EXACT} runs exactly "
                f"(with {REDUCE_GRAD}); torch 2.5 to 2.9 cannot read {REDUCE_GRAD}"]
    if not runtime.loads_comms:
        return [f"torch {runtime.version} has no _PipelineScheduleRuntime to load this CSV; "
                f"wrote the form torch {_EXACT} runs exactly"]
    notes = []
    if not runtime.local_handoff and _has_local_handoff(program):
        notes.append(f"torch {runtime.version}'s runtime expects a message between adjacent stages on one rank, "
                     f"which this program hands over locally; it will stop at the first one (torch {_EXACT} runs it)")
    if runtime.reduce_grad:
        return notes
    if not runtime.scales_full_backward:
        notes.append(f"torch {runtime.version}'s runtime never divides gradients by the {program.num_microbatches} "
                     f"microbatches: they come out {program.num_microbatches} times a mean-loss step's "
                     f"(as with torch's own schedules there; torch {_EXACT} runs the export exactly)")
    else:
        ending_in_w = _stages_ending_in_weight_backward(program)
        if ending_in_w:
            notes.append(f"torch {runtime.version}'s runtime divides gradients by N only after a full backward (B); "
                         f"stage(s) {', '.join(map(str, ending_in_w))} end with a weight backward (W), so their "
                         f"gradients come out {program.num_microbatches} times too large "
                         f"(as with torch's own zero-bubble schedules there; torch {_EXACT} runs the export exactly)")
    return notes


# The torch versions whose runtime runs the comms export exactly, whatever the schedule.
_EXACT = "2.10 to 2.13"


def _has_local_handoff(program: Program) -> bool:
    """Whether two consecutive stages of the pipeline share a rank."""
    line = program.pipelines[0]
    return any(program.stages[a].rank == program.stages[b].rank for a, b in zip(line, line[1:]))


def _stages_ending_in_weight_backward(program: Program) -> list[int]:
    """torch's indices of the stages whose last B or W (in their rank's order) is a W."""
    position = _positions(program)
    last: dict[int, str] = {}
    for row in program.ranks:
        for action in row:
            if action.op in _GRAD_DONE:
                last[action.stage] = action.op
    return sorted(position[stage] for stage, op in last.items() if op == ops.W)


def _token_writer(program: Program):
    """A function Action -> torch token, numbering stages by pipeline position."""
    line = program.pipelines[0]
    if line == list(range(len(line))):
        # the common case: stage ids already are torch's stage indices
        return Action.text
    position = {stage: pos for pos, stage in enumerate(line)}

    def token(action: Action) -> str:
        return action._replace(stage=position[action.stage]).text()

    return token
