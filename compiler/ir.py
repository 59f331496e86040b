"""The per-rank instruction IR shared by every phase after evaluation.

A ``Program`` is what the compiler emits and what the checks, the simulator,
the emitters and the runtime read. It is deliberately plain data:

* ``Action``: one instruction, a frozen hashable tuple whose text form is
  torch.distributed.pipelining's token (``2F0``, ``2SEND_F0``, ``2RECV_B1``), so
  programs round-trip through torch's CSV. A batch of communications
  (``batch_isend_irecv``) is an ``Action`` with op ``BATCH`` and ``parts``; its
  text is torch's sub-action form ``(0SEND_F1;0RECV_B0)BATCH``.
* ``StageInfo``: where each stage lives. A stage is one (pipeline, position)
  pair with exactly one home rank; stages at the same position of different
  pipelines are replicas holding the same model chunk (BitPipe, Chimera), and
  their weight gradients are all-reduced.
* ``Program``: stages, pipelines, the pipeline each microbatch rides, and one
  instruction list per rank.

Messages are untagged: a message is identified by the tensor it carries,
``tensor_of(action)``, and matched FIFO per ordered pair of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

# Compute ops of the activation-passing family. F: forward; B: full backward;
# I: backward for the input gradient; W: backward for the weight gradient.
F, B, I, W = "F", "B", "I", "W"
COMPUTE_OPS = (F, B, I, W)

# Point-to-point communication. SEND_F/RECV_F carry an activation forward,
# SEND_B/RECV_B a gradient backward. On a SEND the stage is the producer's; on a
# RECV it is the consumer's (torch's convention).
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
SEND_OPS = (SEND_F, SEND_B)
RECV_OPS = (RECV_F, RECV_B)
COMM_OPS = SEND_OPS + RECV_OPS

# A group of communications posted together and waited together.
BATCH = "BATCH"
# Drop a stored tensor: FREE_F drops the saved activation of (stage, mb) once no
# backward needs it; emitted by liveness, ignored by torch's CSV.
FREE_F = "FREE_F"
# All-reduce of a replicated stage's weight gradients between its replicas
# (stage = this rank's replica, mb = -1); ALLREDUCE_WAIT waits for it before the
# optimizer step.
ALLREDUCE_GRAD = "ALLREDUCE_GRAD"
ALLREDUCE_WAIT = "ALLREDUCE_WAIT"

NO_PEER = -1


class Action(NamedTuple):
    """One instruction of a rank.

    Attributes:
        stage: global stage id (``Program.stages`` index); -1 for a batch.
        op: one of the op names above.
        mb: microbatch index; -1 where none applies.
        peer: the other rank of a send/recv; -1 otherwise.
        parts: the communications of a ``BATCH``; empty otherwise.
    """

    stage: int
    op: str
    mb: int = -1
    peer: int = NO_PEER
    parts: tuple["Action", ...] = ()

    def __str__(self) -> str:
        return self.text()

    def text(self) -> str:
        """torch.distributed.pipelining's token for this action."""
        if self.parts:
            return "(" + ";".join(p.text() for p in self.parts) + ")" + self.op
        if self.mb < 0:
            return f"{self.stage}{self.op}"
        return f"{self.stage}{self.op}{self.mb}"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS or self.op == BATCH

    def comms(self) -> tuple["Action", ...]:
        """The point-to-point operations this instruction posts (itself, or a batch's parts)."""
        if self.op == BATCH:
            return self.parts
        if self.op in COMM_OPS:
            return (self,)
        return ()


def batch(parts: Iterable[Action]) -> Action:
    """A ``BATCH`` instruction over the given communications (two or more)."""
    parts = tuple(parts)
    return Action(-1, BATCH, -1, NO_PEER, parts)


@dataclass(frozen=True)
class StageInfo:
    """One stage: a model chunk placed on one rank as part of one pipeline.

    Attributes:
        id: global stage id, index into ``Program.stages``.
        rank: the rank that runs it.
        pipeline: which pipeline it belongs to (0 when there is only one).
        position: its place along that pipeline, 0 = first.
        chunk: the model chunk (block of layers) it computes; replicas share it.
            Equal to ``position``: every pipeline runs the whole model.
    """

    id: int
    rank: int
    pipeline: int
    position: int

    @property
    def chunk(self) -> int:
        return self.position


@dataclass
class Program:
    """A compiled (or imported) schedule: one instruction list per rank.

    Attributes:
        name: schedule name, for messages and emitters.
        params: the parameter values it was compiled with.
        num_ranks: number of ranks; ``len(ranks)``.
        num_microbatches: N.
        stages: every stage, indexed by id.
        pipelines: for each pipeline the stage ids in order, first to last.
        mb_pipeline: for each microbatch, the pipeline it rides.
        ranks: for each rank its instruction list.
        devices: optional rank -> device mapping (BitPipe keeps replicas on
            adjacent devices); the identity when None.
        source: where it came from (a path, "torch-csv", ...), for messages.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    stages: list[StageInfo]
    pipelines: list[list[int]]
    mb_pipeline: list[int]
    ranks: list[list[Action]]
    params: dict[str, int] = field(default_factory=dict)
    devices: list[int] | None = None
    source: str = ""

    # -- stage graph -------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        """Model chunks: the length of a pipeline (every pipeline runs the whole model)."""
        return len(self.pipelines[0]) if self.pipelines else 0

    def next_stage(self, stage: int) -> int:
        """The stage after ``stage`` in its pipeline, or -1 for the last."""
        info = self.stages[stage]
        line = self.pipelines[info.pipeline]
        return line[info.position + 1] if info.position + 1 < len(line) else -1

    def prev_stage(self, stage: int) -> int:
        """The stage before ``stage`` in its pipeline, or -1 for the first."""
        info = self.stages[stage]
        line = self.pipelines[info.pipeline]
        return line[info.position - 1] if info.position > 0 else -1

    def rank_of(self, stage: int) -> int:
        return self.stages[stage].rank

    def replicas(self, stage: int) -> list[int]:
        """Every stage (this one included) that holds the same model chunk."""
        position = self.stages[stage].position
        return [line[position] for line in self.pipelines]

    def microbatches_of(self, stage: int) -> list[int]:
        """The microbatches that pass through ``stage``."""
        pipeline = self.stages[stage].pipeline
        return [m for m, p in enumerate(self.mb_pipeline) if p == pipeline]

    def grid(self) -> list[list[str]]:
        """The program as text tokens, one list per rank (for error windows)."""
        return [[a.text() for a in row] for row in self.ranks]

    def instruction_count(self) -> int:
        return sum(len(row) for row in self.ranks)


def tensor_of(action: Action, program: Program) -> tuple[str, int, int]:
    """The tensor a send or receive carries, as (kind, producer stage, mb).

    An activation is named by the stage that produced it; a gradient by the
    stage whose backward produced it. A RECV names its consumer stage (torch's
    convention), so its producer is the neighbour along the pipeline.
    """
    op = action.op
    if op == SEND_F:
        return ("act", action.stage, action.mb)
    if op == SEND_B:
        return ("grad", action.stage, action.mb)
    if op == RECV_F:
        return ("act", program.prev_stage(action.stage), action.mb)
    if op == RECV_B:
        return ("grad", program.next_stage(action.stage), action.mb)
    raise ValueError(f"{action.text()} carries no tensor")


def single_pipeline(stage_ranks: list[int], num_microbatches: int) -> tuple[list[StageInfo], list[list[int]], list[int]]:
    """Stages, pipelines and microbatch routing for one straight pipeline.

    Args:
        stage_ranks: the home rank of stage s, for s = 0..S-1.
        num_microbatches: N.
    Returns:
        (stages, pipelines, mb_pipeline) for ``Program``.
    """
    stages = [StageInfo(s, r, 0, s) for s, r in enumerate(stage_ranks)]
    return stages, [list(range(len(stage_ranks)))], [0] * num_microbatches
