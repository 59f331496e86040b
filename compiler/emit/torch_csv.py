"""A ``Program`` as torch.distributed.pipelining's schedule CSV.

torch reads a schedule as a CSV with one row per rank and one action token per
cell (``PipelineScheduleMulti._load_csv`` for the compute-only form,
``_PipelineScheduleRuntime._load_csv(format="compute_comms")`` for the form with
communication). Two forms are written:

* compute only: the F, B, I and W tokens of each rank, in order. torch lowers
  it to communication itself.
* with communication: pipec's own sends and receives as well. A ``BATCH`` is
  written as its parts, in order, because torch has no batch token. torch's
  runtime posts each send/recv as it meets it (isend/irecv) and waits for a
  receive at first use, so the result is safe under those ("async")
  semantics, which is how pipec checks a CSV with communication; the batch's
  atomicity is lost, though, so under strict rendezvous sends (a blocking
  NCCL send that waits for its receive) a written pair like ``0SEND_F2,
  0RECV_B0`` / ``1SEND_B0, 1RECV_F2`` can wait on itself where the batch
  could not. ``FREE_F``, ``ALLREDUCE_GRAD`` and ``ALLREDUCE_WAIT`` are
  dropped: torch has no such tokens; it frees saved activations itself after
  a backward and reduces gradients outside the pipeline schedule.

torch's stages form a single chain (stage s+1 follows stage s), so only
programs with one pipeline can be written; a stage is written as its position
along that pipeline. Programs with replicated stages (several pipelines, e.g.
BitPipe, Chimera) raise ``UsageError``.
"""
from __future__ import annotations

from pipec.compiler import ops
from pipec.compiler.ir import Action, Program
from pipec.errors import UsageError

# What each op becomes in each form (its rule's ``torch``): KEEP writes its
# token, EXPAND writes its parts' tokens, DROP writes nothing.
_COMPUTE_ONLY = {op: rule.torch[0] for op, rule in ops.RULES.items()}
_WITH_COMMS = {op: rule.torch[1] for op, rule in ops.RULES.items()}
ops.declare_pass("torch csv", _COMPUTE_ONLY.keys() & _WITH_COMMS.keys())


def write_torch_csv(program: Program, with_comms: bool) -> str:
    """torch's schedule CSV for a single-pipeline program.

    Args:
        program: a program with exactly one pipeline.
        with_comms: write sends and receives too (torch's "compute_comms"
            format); otherwise only compute (its "compute_only" format).
    Returns:
        the CSV text, one line per rank, ``\\n``-terminated.
    Raises:
        UsageError: the program has several pipelines (replicated stages), or
            an op torch cannot express.
    """
    if len(program.pipelines) != 1:
        raise UsageError(
            f"{program.name or 'this program'} has {len(program.pipelines)} pipelines (replicated stages); "
            "torch's schedule CSV has a single chain of stages (stage s+1 follows s), so it cannot be written as one"
        )
    rules = _WITH_COMMS if with_comms else _COMPUTE_ONLY
    token = _token_writer(program)
    lines = []
    for rank, row in enumerate(program.ranks):
        cells: list[str] = []
        for action in row:
            rule = rules.get(action.op)
            if rule == ops.KEEP:
                cells.append(token(action))
            elif rule == ops.EXPAND:
                cells.extend(token(part) for part in action.parts)
            elif rule is None:
                raise UsageError(f"rank {rank}: {action.text()} has no torch.distributed.pipelining token")
        lines.append(",".join(cells) + "\n")
    return "".join(lines)


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
