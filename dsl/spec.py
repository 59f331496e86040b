"""What evaluating a schedule with concrete parameters produces.

Plain data, handed from the front end to the compiler. Stage ids follow one
convention shared with the IR: stage ``s`` (position along its pipeline) of
pipeline ``p`` has id ``p * num_stages + s``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pipec.errors import Span

# A task: (kind, stage id, microbatch), kind one of ``TaskKinds.kinds``.
TaskTuple = tuple[str, int, int]


@dataclass(frozen=True)
class TaskKinds:
    """The compute tasks a schedule may order, as the compiler's rule table defines them.

    The front end knows no task by name: the compiler hands it this
    vocabulary (``pipec.compiler.driver.task_kinds``), so a task kind added
    to the rule table is at once a task a ``.pipe`` file can order.

    Attributes:
        kinds: every kind, in the table's order (a kind's index is its code).
        always: the kinds every (stage, microbatch) runs exactly once (F).
        backward: ``backward`` mode -> the kinds its backward is made of
            (``full``: B; ``split``: I then W); the first mode is the default.
        optional: kinds that may run at most once per (stage, microbatch).
        recompute: on a recomputed stage (``recompute stage s``), a kind
            written -> what it becomes: (the kind run in its place, then the
            kind that recomputes) (``F`` -> ``FC`` then ``R``). A schedule
            writes the first as the plain kind (``F``); it may write the
            recompute itself, else the compiler places it.
        ring_forward, ring_backward: the tasks of a sequence ring's order
            (``AF``; ``AB`` today), its forward pass's and its backward's:
            each is one block, ``KIND(q, kv[, piece])``, and a ring's order
            writes only these, forward ones at its forward steps, backward
            ones at its backward steps.
        updates: the optional kinds that update a stage's weights inside the
            order (``U``): activation passing only.
    """

    kinds: tuple[str, ...]
    always: tuple[str, ...]
    backward: dict[str, tuple[str, ...]]
    optional: tuple[str, ...] = ()
    ring_forward: tuple[str, ...] = ()
    ring_backward: tuple[str, ...] = ()
    recompute: dict[str, tuple[str, str]] = field(default_factory=dict)
    updates: tuple[str, ...] = ()

    @property
    def ring(self) -> tuple[str, ...]:
        """Every task a sequence ring's order may write, forward ones first."""
        return self.ring_forward + self.ring_backward

    @property
    def default_mode(self) -> str:
        return next(iter(self.backward))

    def required(self, mode: str) -> tuple[str, ...]:
        """The kinds every (stage, microbatch) runs once under ``mode``, in table order."""
        wanted = set(self.always) | set(self.backward[mode])
        return tuple(kind for kind in self.kinds if kind in wanted)

    def allowed(self, mode: str) -> tuple[str, ...]:
        """The kinds a schedule in ``mode`` may order, in table order (a recompute only on a recomputed stage)."""
        wanted = set(self.required(mode)) | set(self.optional) | set(self.recomputes)
        return tuple(kind for kind in self.kinds if kind in wanted)

    @property
    def recomputes(self) -> tuple[str, ...]:
        """The kinds that recompute a forward (``R``)."""
        return tuple(remaking for _, remaking in self.recompute.values())

    @property
    def checkpointed(self) -> dict[str, str]:
        """Kind run on a recomputed stage in a written kind's place -> that written kind (``FC`` -> ``F``)."""
        return {keeping: written for written, (keeping, _) in self.recompute.items()}

    def index(self, kind: str) -> int:
        return self.kinds.index(kind)


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
        in_order: kinds whose tasks each rank runs in priority order (then
            microbatch, then stage), waiting for the next one rather than
            taking another of the kind that is ready (``in order F, B``).
    """

    inflight: list[int | None]
    warmup: list[int | None]
    prefer: tuple[str, ...]
    priority: Callable[[str, int, int], tuple]
    deferred: list[int | None] | None = None
    in_order: tuple[str, ...] = ()


@dataclass(frozen=True)
class WeightSpec:
    """How a weight-passing schedule moves weights (``weights ROUTE`` and its companions).

    In this family every rank keeps its own microbatches and runs every layer
    (stage) on them; the weights of a layer travel to the ranks that run it and
    its weight gradients travel back to its owner.

    Attributes:
        route: how a layer's weights reach a rank that runs it: ``ring`` (every
            step each rank passes its ring slot to rank ``r + ring_by``),
            ``direct`` (owner -> user), ``staged`` (owner -> the staging rank
            of the user's group, then a broadcast in the group) or
            ``all_gather`` (every layer sharded over every rank, gathered
            before use).
        ring_by: the ring offset as written (``by E``; 1 when not given), not
            reduced mod P: -1 stays -1. Used only under ``ring``.
        gradients: how weight gradients reach a layer's owner: ``ring``,
            ``direct``, ``reduce`` (in the group, then to the owner) or
            ``reduce_scatter``.
        owners: layer -> the rank that keeps its master weights and optimizer
            state (``own layer l on rank E``); None under ``all_gather``.
        groups: rank -> its group (node) id (``group rank r in E``; every rank
            in group 0 when not given).
        prefetch: how many steps ahead a weight fetch is posted (``prefetch E``; 0).
        buffers: the most borrowed weight buffers alive at once on a rank
            (``buffers E``), or None for no bound.
    """

    route: str
    ring_by: int
    gradients: str
    owners: tuple[int, ...] | None
    groups: tuple[int, ...]
    prefetch: int
    buffers: int | None


@dataclass(frozen=True)
class RingSpec:
    """How a sequence-ring schedule cuts the sequence and moves KV (``sequence chunks E`` and its companions).

    Attributes:
        chunks: how many equal chunks the sequence is cut into (``sequence chunks E``).
        holders: chunk -> the rank holding it (``hold chunk c on rank E``).
        causal: the causal mask (``mask causal [when E]``), else full (``mask full``).
        rings: which rings carry KV: ``shift`` (a ring r -> r + by per offset),
            ``hamilton`` (the arc-disjoint Hamiltonian rings of every rank) or
            ``rails`` (rail rings of ``nodes`` x ``per_node`` ranks) or ``cycle`` (rings written
            rank by rank).
        ring_args: ``shift``: the offsets (by, ...); ``hamilton``: (); ``rails``: (nodes, per_node);
            ``cycle``: the rings, each a tuple of every rank in ring order from rank 0.
        pieces: KV pieces per chunk (``pieces E``), or None for one per ring.
        kv: ``again`` or ``kept`` (``kv ROUTE``; again when absent).
        dkv: ``behind`` or ``direct`` (``dkv ROUTE``; behind when absent).
        transfer: ``p2p`` or ``all_to_all`` (``transfer KIND``; p2p when absent).
        rings_span: where ``rings``' values are written (None when built
            by hand): the compiler's ring search, which may refuse a shape
            the front end cannot judge (rails of 3 nodes x 2), reports there.
    """

    chunks: int
    holders: tuple[int, ...]
    causal: bool
    rings: str
    ring_args: tuple
    pieces: int | None = None
    kv: str = "again"
    dkv: str = "behind"
    transfer: str = "p2p"
    rings_span: Span | None = field(default=None, compare=False)


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
        split_backward: the backward is split (``backward split``: I and W) or
            whole (B).
        tasks: the task vocabulary it was written against.
        order: explicit order: per rank its tasks; None under a policy. In a
            sequence ring, None when the compiler derives it, else per rank
            its blocks ``(kind, query chunk, kv chunk * pieces + piece)`` as
            written (``order rank r { at step E { AF(q, kv, p) } }``).
        policy: the list-scheduling policy; None under an explicit order.
        order_span: where the order is written, for messages.
        weights: how weights move, for a weight-passing schedule (``weights
            ROUTE``); None otherwise.
        task_steps: for a weight-passing schedule, or a sequence ring whose
            order is written, per rank the step (``at step E``) of each task of
            ``order[r]`` (same length); None otherwise. A ring's steps 0..P-1
            are its forward pass's, P..2P-1 its backward's.
        rings: for a sequence-ring schedule (``sequence chunks E``), how the
            sequence is cut and KV moves; None otherwise. Its order is derived
            by the compiler (``compiler/lower_rings.py``) unless the schedule
            writes one (``order``, ``task_steps``); ``policy`` is None.
        recomputed: the stage positions (along a pipeline, as in ``F(s, m)``)
            that ``recompute stage s`` names: their forward keeps only its
            input (``order`` holds what it becomes, ``tasks.recompute``) and
            runs again before their backward.
        weight_versions: the most versions of a stage's weights the schedule
            keeps for its backwards (``stash weights <= K``: K; ``stash
            weights``: None, as many as the order needs; without: 1).
        family_declarations: the evaluated declarations of each family added as a module of its own
            (``dsl/families.py``'s ``Declared.field`` -> them), which has no field here.
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
    tasks: TaskKinds | None = None
    order: list[list[TaskTuple]] | None = None
    policy: GreedyPolicy | None = None
    order_span: Span | None = None
    notes: list[str] = field(default_factory=list)
    weights: WeightSpec | None = None
    task_steps: list[list[int]] | None = None
    rings: RingSpec | None = None
    recomputed: frozenset[int] = frozenset()
    weight_versions: int | None = 1
    family_declarations: dict[str, object] = field(default_factory=dict)

    def stage_id(self, pipeline: int, position: int) -> int:
        return pipeline * self.num_stages + position

    @property
    def backward_mode(self) -> str:
        modes = list(self.tasks.backward)
        return modes[1] if self.split_backward else modes[0]

    @property
    def backward_kinds(self) -> tuple[str, ...]:
        return self.tasks.backward[self.backward_mode]

    @property
    def required_kinds(self) -> tuple[str, ...]:
        """The kinds every (stage, riding microbatch) runs once, in table order (F, B or F, I, W)."""
        return self.tasks.required(self.backward_mode)
