"""What evaluating a schedule with concrete parameters produces.

Plain data, handed from the front end to the compiler. Stage ids follow one
convention shared with the IR: stage ``s`` (position along its pipeline) of
pipeline ``p`` has id ``p * num_stages + s``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pipec.errors import Span

# A task: (kind, stage id, microbatch), kind in F B I W.
TaskTuple = tuple[str, int, int]


@dataclass(frozen=True)
class GreedyPolicy:
    """A list-scheduling policy: pipec's scheduler picks the order.

    Attributes:
        inflight: per rank, the most chunk activations alive at once (a forward
            done whose backward is not), or None for no limit.
        warmup: per rank, how many forwards it runs before it alternates
            strictly between a backward and a forward (1F1B's discipline), or
            None to run whatever is ready (work-conserving).
        prefer: task kinds from most to least preferred when several are ready.
        priority: ``(kind, stage id, mb) -> key``; among ready tasks of one
            kind the smallest key runs first, then the one ready earliest, then
            the lowest microbatch. A kind without a priority has key ``()``.
        deferred: per rank, the most weight gradients left waiting (split
            backward: an I started whose W has not), or None for no limit;
            None as a whole when the policy does not bound them.
    """

    inflight: list[int | None]
    warmup: list[int | None]
    prefer: tuple[str, ...]
    priority: Callable[[str, int, int], tuple]
    deferred: list[int | None] | None = None


@dataclass
class ScheduleSpec:
    """A schedule evaluated with concrete parameters.

    Attributes:
        name, path, source: where it came from.
        params: every parameter's value.
        num_ranks: P (the ``ranks``-typed parameter).
        num_microbatches: N (the ``microbatches``-typed parameter).
        num_stages: stages per pipeline (model chunks).
        num_pipelines: mirrored pipelines over the same ranks (1 unless replicated).
        mb_pipeline: the pipeline microbatch m rides.
        placement: ``placement[p][s]`` is the rank of stage s of pipeline p.
        devices: rank -> device, or None for the identity.
        split_backward: tasks are F, I, W (True) or F, B (False).
        order: explicit order: per rank its tasks; None under a policy.
        policy: the list-scheduling policy; None under an explicit order.
        order_span: where the order is written, for messages.
    """

    name: str
    path: str
    source: str
    params: dict[str, int | bool]
    num_ranks: int
    num_microbatches: int
    num_stages: int
    num_pipelines: int
    mb_pipeline: list[int]
    placement: list[list[int]]
    devices: list[int] | None
    split_backward: bool
    order: list[list[TaskTuple]] | None = None
    policy: GreedyPolicy | None = None
    order_span: Span | None = None
    notes: list[str] = field(default_factory=list)

    def stage_id(self, pipeline: int, position: int) -> int:
        return pipeline * self.num_stages + position

    @property
    def backward_kinds(self) -> tuple[str, ...]:
        return ("I", "W") if self.split_backward else ("B",)
