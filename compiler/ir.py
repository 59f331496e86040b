"""The per-rank instruction IR shared by every phase after evaluation.

A ``Program`` is what the compiler emits and what the checks, the simulator,
the emitters and the runtime read. It is deliberately plain data:

* ``Action``: one instruction, a frozen hashable tuple whose text form is
  torch.distributed.pipelining's token (``2F0``, ``2SEND_F0``, ``2RECV_B1``), so
  programs round-trip through torch's CSV. A batch of communications
  (``batch_isend_irecv``) is an ``Action`` with op ``BATCH`` and ``parts``; its
  text is torch's sub-action form ``(0SEND_F1;0RECV_B0)BATCH``.
* ``StageInfo``: where each stage lives. A stage is one (pipeline, position)
  pair on one home rank, or on a group of ranks (``Placement``: each member
  runs the stage's computes on its share); stages at the same position of
  different pipelines are replicas holding the same model chunk (BitPipe,
  Chimera), and their weight gradients are all-reduced. A compute of a stage
  on a group may hold *sub-steps* (its ``parts``): collectives on the group's
  communicator that run inside it, in order (docs/ir.md, placements).
* ``Program``: stages, pipelines, the pipeline each microbatch rides, and one
  instruction list per rank.
* ``Communicator``: a group of ranks that meets in collectives. Groups are
  explicit in the program (``Program.communicators``), created once on every
  rank in list order; a collective instruction meets on the communicator its
  rule names (``ops.OpRule.communicator``).

Messages are untagged: a message is identified by the value it carries,
``tensor_of(action)`` (from the op's rule), and matched FIFO per ordered pair
of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction
import weakref
from typing import Iterable, NamedTuple

# The op names and what each op does live in the rule table (``ops.py``);
# they are re-exported here because every pass speaks of them.
from pipec.compiler.ops import (  # noqa: F401  (re-exported)
    GROUP_OF_RANK,
    RING,
    SHARD_REPLICAS,
    WORLD,
    ALLREDUCE_GRAD,
    ALLREDUCE_WAIT,
    B,
    BATCH,
    COLLECTIVE_OPS,
    COMM_OPS,
    COMPUTE_OPS,
    F,
    FREE_F,
    I,
    NEXT,
    PART_RULES,
    PREV,
    RECV_B,
    RECV_F,
    RECV_OPS,
    REPLICAS_OF_CHUNK,
    RULES,
    STAGE_GROUP,
    SEND_B,
    SEND_F,
    SEND_OPS,
    W,
)

NO_PEER = -1


# How every drawing and listing labels a task: its text form (``Action.text``), stage, op, microbatch,
# as torch.distributed.pipelining's CSV writes it. Every legend (SVG, HTML, text timeline, Chrome traces
# of the simulator and of runs) explains it with this sentence.
LABEL_SCHEME = "task labels: 2F3 = stage 2, op F, microbatch 3 (as in torch's schedule CSV)"


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
        if self.parts:  # a batch; an exchange also shows its number; a compute with sub-steps its own token
            number = str(self.mb) if self.mb >= 0 else ""
            own = f"{self.stage}{self.op}{number}" if self.stage >= 0 else self.op + number
            return "(" + ";".join(p.text() for p in self.parts) + ")" + own
        if self.stage < 0:  # an exchange's wait, a ring step: no stage
            return f"{self.op}{self.mb}" if self.mb >= 0 else self.op
        if self.mb < 0:
            return f"{self.stage}{self.op}"
        return f"{self.stage}{self.op}{self.mb}"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS or self.op == BATCH

    @property
    def rule(self):
        """This op's ``ops.OpRule`` (KeyError for an op the table does not know)."""
        return RULES[self.op]

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
class Placement:
    """A stage placed on a group of ranks (a data-, fully sharded or context-parallel group).

    Every member runs each of the stage's computes on its share: member i of
    k holds share i of k of each value the stage makes or reads (rows of a
    microbatch, pieces of a sequence, 1/k of its weights), and the group meets
    in collectives, its computes' sub-steps, on one communicator.

    Attributes:
        ranks: the members, ascending, two or more (a stage on one rank has no placement).
        communicator: the id of its communicator in ``Program.communicators``, whose
            members are exactly ``ranks`` (purpose ``STAGE_GROUP``).
        sharded: whether its weights are sharded over the members (FSDP, ZeRO): member i keeps share i
            of k of them (and of their optimizer state), a GATHER makes them whole until a RESHARD, and
            its weight gradient is reduce-scattered (REDUCE_GRAD); otherwise every member holds them
            whole and its gradient is all-reduced (SYNC_GRAD).
        shard_groups: HSDP (``sharded``, weights sharded inside a node and replicated across nodes): the
            ids of the communicators (purpose ``STAGE_GROUP``) its weights are sharded over, which split
            ``ranks`` into equal groups; a member's GATHER, RESHARD and REDUCE_GRAD meet on its own one
            and ``communicator`` is -1 (nothing meets on the whole group). Empty otherwise: sharded over
            the whole group.
        replica_groups: HSDP: the ids of the communicators (purpose ``SHARD_REPLICAS``) of the members
            holding the same shard, one member of each shard group each; a member's SYNC_SHARD meets on
            its own one. Empty otherwise.
        split: what a member's share of a value is: ``ROW_SHARE``, rows [i/k, (i+1)/k) of each
            microbatch (data parallel), or ``SEQUENCE_SHARE``, ring rank i's chunks of every sequence
            of each microbatch (context parallel): the stage runs every attention of its forward and
            backward through ``Program.stage_ring`` over the group, member i as ring rank i.
        shares: each member's role in the data, in ``ranks`` order: the share (of k) of every microbatch's
            rows or tokens it takes; the runtime reads a member's rows (or tokens) and loss targets by it,
            and the prover routes each hand-off by it. Not given: member i takes share i.
        shards: a sharded stage's: the shard (of the members its weights are cut over) each member holds,
            in ``ranks`` order; empty for whole weights. Not given: its index in the communicator its
            weights are gathered on (the whole group, or under HSDP its shard group: given by
            ``mesh_placement`` and the program file's reader, which know the groups).
        saver: the member that writes the stage's parameters to a checkpoint and counts its replicated
            gradient once in the global norm. Not given: the first member.

    A member's roles are facts of the program: the runtime acts on them and ``checks/placement.py``
    proves them (docs/ir.md, "Roles").
    """

    ranks: tuple[int, ...]
    communicator: int
    sharded: bool = False
    split: str = "rows"
    shard_groups: tuple[int, ...] = ()
    replica_groups: tuple[int, ...] = ()
    shares: tuple[int, ...] = ()
    shards: tuple[int, ...] = ()
    saver: int | None = None

    def __post_init__(self) -> None:
        # what a placement states when its maker states nothing: the plain roles (never left to the runtime)
        if not self.shares:
            object.__setattr__(self, "shares", tuple(range(len(self.ranks))))
        if not self.shards and self.sharded and not self.shard_groups:
            object.__setattr__(self, "shards", tuple(range(len(self.ranks))))
        if self.saver is None and self.ranks:
            object.__setattr__(self, "saver", self.ranks[0])

    @property
    def hybrid(self) -> bool:
        """Whether the weights are sharded over parts of the group and replicated across them (HSDP)."""
        return bool(self.shard_groups)

    def share_of(self, rank: int) -> int:
        """The share of each microbatch ``rank`` (a member) takes, as the program states it."""
        return self.shares[self.ranks.index(rank)]

    def shard_of(self, rank: int) -> int:
        """The shard of the stage's weights ``rank`` (a member of a sharded stage) holds, as stated."""
        return self.shards[self.ranks.index(rank)]


# The shares a placed stage's members may split a value into (``Placement.split``).
ROW_SHARE = "rows"
SEQUENCE_SHARE = "sequence"
SHARE_SPLITS = (ROW_SHARE, SEQUENCE_SHARE)


@dataclass(frozen=True)
class Mesh:
    """A program's rank axes (``mesh pp = P, dp = D``): ranks are the product of their sizes.

    The axes are listed outermost first and a rank's coordinates are its digits in that mixed radix, so
    the last axis is contiguous (ranks r and r + 1 differ along it) and node boundaries fall on the outer
    axes: ``mesh pp = 2, dp = 2`` puts ranks 0, 1 at pp 0 and ranks 2, 3 at pp 1.

    Attributes:
        axes: (name, size) per axis, outermost first; names distinct, sizes at least 1.
    """

    axes: tuple[tuple[str, int], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def size(self) -> int:
        """The number of ranks: the product of the axes' sizes."""
        total = 1
        for _, size in self.axes:
            total *= size
        return total

    def axis_size(self, axis: str) -> int:
        return dict(self.axes)[axis]

    def coords(self, rank: int) -> dict[str, int]:
        """Axis name -> the coordinate of ``rank`` along it."""
        out = {}
        for name, size in reversed(self.axes):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.names}

    def rank_at(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (every axis named)."""
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    def members(self, rank: int, axes: Iterable[str]) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only along ``axes`` (``rank`` included), ascending."""
        base, varying = self.coords(rank), tuple(axes)
        found = [dict(base)]
        for axis in varying:
            found = [dict(c, **{axis: i}) for c in found for i in range(self.axis_size(axis))]
        return tuple(sorted(self.rank_at(c) for c in found))

    def label(self, rank: int) -> str:
        """``pp 1, dp 0``: where ``rank`` sits on the mesh, for timelines and messages."""
        return ", ".join(f"{name} {i}" for name, i in self.coords(rank).items())


@dataclass(frozen=True)
class StageInfo:
    """One stage: a model chunk placed on one rank, or on a group of ranks, as part of one pipeline.

    Attributes:
        id: global stage id, index into ``Program.stages``.
        rank: the rank that runs it; on a group, its first member.
        pipeline: which pipeline it belongs to (0 when there is only one).
        position: its place along that pipeline, 0 = first.
        placement: the group it is placed on, or None for the one rank ``rank`` (the default).
        chunk: the model chunk (block of layers) it computes; replicas share it.
            Equal to ``position``: every pipeline runs the whole model.
    """

    id: int
    rank: int
    pipeline: int
    position: int
    placement: Placement | None = None

    @property
    def chunk(self) -> int:
        return self.position

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that runs the stage: its group's members, or its one rank."""
        return self.placement.ranks if self.placement is not None else (self.rank,)


@dataclass(frozen=True)
class Communicator:
    """A group of ranks that meets in collectives.

    Attributes:
        id: index into ``Program.communicators``; every rank creates the
            groups in this order (torch.distributed requires one order).
        ranks: its members, ascending.
        purpose: which collectives meet on it (an ``ops`` communicator name,
            e.g. ``REPLICAS_OF_CHUNK``).
        key: what the purpose is about (for the replicas: the model chunk).
    """

    id: int
    ranks: tuple[int, ...]
    purpose: str
    key: int


def replica_communicators(stages: list[StageInfo], pipelines: list[list[int]]) -> list[Communicator]:
    """One communicator per replicated model chunk, in chunk order: the ranks holding its replicas.

    A chunk whose replicas all sit on one rank gets one too (a single
    member; the runtime has nothing to reduce there), so that every
    collective instruction names a communicator.
    """
    out: list[Communicator] = []
    if len(pipelines) < 2:
        return out
    for position in range(len(pipelines[0])):
        ranks = tuple(sorted({stages[line[position]].rank for line in pipelines if position < len(line)}))
        out.append(Communicator(len(out), ranks, REPLICAS_OF_CHUNK, position))
    return out


# Weight routes and gradient routes a weight-passing program may take (docs/weights.md).
WEIGHT_ROUTES = ("ring", "direct", "staged", "all_gather")
GRADIENT_ROUTES = ("ring", "direct", "reduce", "reduce_scatter")


@dataclass(frozen=True)
class WeightPlan:
    """Where a weight-passing program's layers live and how their weights and gradients move.

    Attributes:
        owners: layer -> the rank that keeps its master weights and optimizer
            state; None under ``all_gather`` (every rank keeps a shard of every layer).
        groups: rank -> its group (node) id.
        route: how weights reach a rank (``WEIGHT_ROUTES``).
        ring_by: under ``ring``, each step a rank's slot goes to rank
            ``(r + ring_by) mod P``.
        gradients: how weight gradients reach the owner (``GRADIENT_ROUTES``).
        prefetch: how many steps before its use a weight's last leg is posted.
        buffers: the most borrowed weight buffers alive at once on a rank, or None.
        num_steps: the steps of the order (every rank runs each, idle or not).
        pipeline_ranks: on a mesh (``compiler/weight_placement.py``), rank -> the rank of the plan's pipeline
            it runs (its pp coordinate): ``owners`` name those, and every replica's rank at an owner's
            coordinate owns the layer; ``groups`` are per replica already. None: the identity.
    """

    owners: tuple[int, ...] | None
    groups: tuple[int, ...]
    route: str
    ring_by: int
    gradients: str
    prefetch: int
    buffers: int | None
    num_steps: int
    pipeline_ranks: tuple[int, ...] | None = None

    def pipeline_rank(self, rank: int) -> int:
        """The rank of the plan's pipeline that ``rank`` runs (the names ``owners`` use)."""
        return rank if self.pipeline_ranks is None else self.pipeline_ranks[rank]

    def owns(self, rank: int, layer: int) -> bool:
        """Whether ``rank`` keeps ``layer``'s master (never under ``all_gather``); False for a layer out of range."""
        owners = self.owners
        return owners is not None and 0 <= layer < len(owners) and owners[layer] == self.pipeline_rank(rank)

    def communicators(self, num_ranks: int) -> list[Communicator]:
        """The groups the program's collectives meet on (``weight_communicators``)."""
        return weight_communicators(self, num_ranks)

    def group_of(self, rank: int) -> int | None:
        """The group (node) ``rank`` belongs to, or None for a rank the plan does not have."""
        return self.groups[rank] if 0 <= rank < len(self.groups) else None

    def group_ranks(self, group: int) -> tuple[int, ...]:
        """The ranks of ``group``, ascending."""
        return tuple(r for r, g in enumerate(self.groups) if g == group)

    def staging_rank(self, owner: int, group: int) -> int:
        """The rank of ``group`` that takes a layer from ``owner`` for the group: the member with
        the owner's index inside its own group (rail-aligned), wrapped when the group is smaller."""
        members = self.group_ranks(group)
        index = self.group_ranks(self.groups[owner]).index(owner)
        return members[index % len(members)]


def weight_communicators(plan: WeightPlan, num_ranks: int) -> list[Communicator]:
    """The communicators a weight-passing program's collectives meet on, in creation order:
    the ring (every rank) under a ring route, one per group under the staged weights or
    reduced gradients, and every rank under all_gather."""
    out: list[Communicator] = []
    everyone = tuple(range(num_ranks))
    if plan.route == "ring":
        out.append(Communicator(len(out), everyone, RING, 0))
    if plan.route == "staged" or plan.gradients == "reduce":
        for group in sorted(set(plan.groups)):
            out.append(Communicator(len(out), plan.group_ranks(group), GROUP_OF_RANK, group))
    if plan.route == "all_gather" or plan.gradients == "reduce_scatter":
        out.append(Communicator(len(out), everyone, WORLD, 0))
    return out


# How a sequence ring's KV and dKV move (docs/rings.md).
KV_ROUTES = ("again", "kept")        # KV goes round again in backward, or every rank keeps what it saw
DKV_ROUTES = ("behind", "direct")    # dK, dV partials ride the ring behind KV, or go straight home
TRANSFERS = ("p2p", "all_to_all")    # an exchange's moves: one batch of point-to-point, or one all_to_all



# Per ring plan (by identity, dropped with it): rank -> the chunks it holds, and per ring each rank's place on
# it. ``chunks_of``, ``next_on`` and ``prev_on`` are called per instruction by the lowering, the prover and the
# runtime; a scan of the plan each time made a ring's proof quadratic in its ranks. Kept outside the plan, so
# its fields, identity and JSON are what they were.
_RING_INDEXES: dict[int, tuple[dict[int, tuple[int, ...]], list[dict[int, int]]]] = {}


def _ring_indexes(plan: "RingPlan") -> tuple[dict[int, tuple[int, ...]], list[dict[int, int]]]:
    found = _RING_INDEXES.get(id(plan))
    if found is None:
        held: dict[int, list[int]] = {}
        for chunk, rank in enumerate(plan.holders):
            held.setdefault(rank, []).append(chunk)
        found = ({rank: tuple(chunks) for rank, chunks in held.items()},
                 [{rank: place for place, rank in enumerate(ring)} for ring in plan.rings])
        _RING_INDEXES[id(plan)] = found
        weakref.finalize(plan, _RING_INDEXES.pop, id(plan), None)
    return found

@dataclass(frozen=True)
class RingPlan:
    """How a sequence-ring program cuts the sequence and moves KV (ring, zigzag, TASP attention).

    The sequence of S tokens is cut into ``chunks`` equal chunks (chunk c is
    tokens [c S/C, (c+1) S/C)); the queries, keys and values of chunk c live on
    rank ``holders[c]``. Each chunk's KV is cut into ``pieces`` equal pieces
    along the sequence. A rank's **bundle** (s, p) is piece p of every chunk
    rank s holds, in ascending chunk order: the unit that travels. Piece p
    travels ring ``rings[p % len(rings)]``, a cycle over every rank: its i-th
    rank sends to its (i+1)-th.

    A **block** is a query chunk against one KV piece; an instruction names it
    by ``stage`` = query chunk and ``mb`` = ``block(kv_chunk, piece)``.

    Attributes:
        chunks: C.
        holders: chunk -> rank.
        pieces: KV pieces per chunk.
        rings: the rings, each a tuple of every rank once.
        causal: the causal mask (key j visible to query i iff j <= i), else full attention.
        kv: ``again`` (KV goes round again in backward) or ``kept`` (each rank
            keeps every bundle it received in forward).
        dkv: ``behind`` (each bundle's dK, dV partial rides its ring one
            exchange behind, every rank adding its blocks, until it is home) or
            ``direct`` (every rank sends its partial of each bundle straight home).
        transfer: ``p2p`` or ``all_to_all`` (see ``TRANSFERS``).
        note: what the compiler wants a user to know about the rings (n = 4, 6).
        steps: per rank, the ring step (0..2n-1: ``at step``) each instruction
            belongs to, as lowered; None for a plan read or built by hand.
            Errors name it beside the instruction's index; not part of the
            plan's identity or its JSON.
    """

    chunks: int
    holders: tuple[int, ...]
    pieces: int
    rings: tuple[tuple[int, ...], ...]
    causal: bool
    kv: str = "again"
    dkv: str = "behind"
    transfer: str = "p2p"
    note: str = ""
    steps: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False, repr=False)

    @property
    def num_ranks(self) -> int:
        return len(self.rings[0])

    def step_of(self, rank: int, index: int, row_length: int) -> int | None:
        """The ring step of instruction ``index`` of ``rank``'s list, when known for a list of that length."""
        steps = self.steps
        if steps is None or not 0 <= rank < len(steps) or len(steps[rank]) != row_length \
                or not 0 <= index < row_length:
            return None
        return steps[rank][index]

    def communicators(self, num_ranks: int) -> list[Communicator]:
        """One communicator of every rank: an all_to_all exchange meets on it."""
        return [Communicator(0, tuple(range(num_ranks)), WORLD, 0)]

    def group_of(self, rank: int) -> None:
        """A sequence ring groups no ranks."""
        return None

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks ``rank`` holds, ascending (its bundles' order)."""
        return _ring_indexes(self)[0].get(rank, ())

    def ring_of(self, piece: int) -> tuple[int, ...]:
        return self.rings[piece % len(self.rings)]

    def next_on(self, piece: int, rank: int) -> int:
        """The rank ``rank`` sends piece ``piece``'s bundles to."""
        ring = self.ring_of(piece)
        return ring[(_ring_indexes(self)[1][piece % len(self.rings)][rank] + 1) % len(ring)]

    def prev_on(self, piece: int, rank: int) -> int:
        """The rank ``rank`` receives piece ``piece``'s bundles from."""
        ring = self.ring_of(piece)
        return ring[(_ring_indexes(self)[1][piece % len(self.rings)][rank] - 1) % len(ring)]

    def block(self, kv_chunk: int, piece: int) -> int:
        return kv_chunk * self.pieces + piece

    def unblock(self, block: int) -> tuple[int, int]:
        """(kv chunk, piece) of a block number."""
        return divmod(block, self.pieces)

    def bundle_share(self, holder: int) -> Fraction:
        """A bundle of ``holder``'s in units of one chunk's keys and values (the cost file's ``kv`` size):
        one piece of each chunk it holds."""
        return Fraction(len(self.chunks_of(holder)), self.pieces)

    def visible(self, q_chunk: int, kv_chunk: int, piece: int) -> bool:
        """Whether some query of ``q_chunk`` sees some key of the piece: the block is not fully masked."""
        if not self.causal:
            return True
        first_key = kv_chunk * self.pieces + piece          # in units of a piece
        last_query = (q_chunk + 1) * self.pieces - 1        # the piece holding the chunk's last query
        return first_key <= last_query

    def block_area(self, q_chunk: int, kv_chunk: int, piece: int) -> Fraction:
        """The block's share of a whole chunk x chunk block that the mask leaves (1 unmasked, 1/2 a
        diagonal), exact: counted in piece x piece squares, a square on the diagonal as half."""
        n = self.pieces
        if not self.causal:
            return Fraction(1, n)
        key = kv_chunk * n + piece  # in pieces: the chunk's queries are [q n, (q + 1) n)
        halves = sum(2 if key < query else 1 if key == query else 0 for query in range(q_chunk * n, (q_chunk + 1) * n))
        return Fraction(halves, 2 * n * n)


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
        communicators: the groups its collectives meet on; derived from the
            pipelines (``replica_communicators``) or, for weight passing, the
            weight plan (``weight_communicators``) when not given.
        weights: for a weight-passing program, where its weights live and how
            they move; None for activation passing.
        rings: for a sequence-ring program, how the sequence is cut and KV
            moves; None otherwise.
        family_plans: the plans of the families whose plan type ``Program`` has no field for (a
            family added as a module of its own, docs/ir.md "Adding a family"), in registration order.
        weight_versions: with optimizer updates in the order (asynchronous
            training, ``compiler/versions.py``), the most versions of a
            stage's weights it may keep at once: 1 keeps only the newest (no
            stashing), None as many as the order needs (``stash weights``).
        mesh: the rank axes of a composed program (``compiler/mesh_placement.py``), or None for a program of
            plain ranks; its stages are placed on groups of the mesh.
        stage_ring: in a context-parallel composition (stages placed with ``SEQUENCE_SHARE``), the
            sequence-ring program (``rings`` set, one rank per group member) that every such stage runs
            for each attention of its forward and backward over its group, member i as ring rank i,
            its peers read as group members; None otherwise.
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
    communicators: list[Communicator] = field(default_factory=list)
    weights: WeightPlan | None = None
    rings: RingPlan | None = None
    weight_versions: int | None = 1
    family_plans: tuple = ()
    mesh: Mesh | None = None
    stage_ring: "Program | None" = None

    def __post_init__(self) -> None:
        if not self.communicators:  # each plan's groups, in plan order; a program without one: the replicas'
            plans = self.plans
            self.communicators = ([c for plan in plans for c in plan.communicators(self.num_ranks)] if plans
                                  else replica_communicators(self.stages, self.pipelines))
            self.communicators = [replace(c, id=i) for i, c in enumerate(self.communicators)]

    @property
    def plans(self) -> tuple:
        """The family plans the program holds (``compiler/family.py`` maps each to its family), in a fixed order."""
        return tuple(plan for plan in (self.weights, self.rings) if plan is not None) + self.family_plans

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

    @property
    def placed_on_groups(self) -> bool:
        """Whether some stage is placed on a group of ranks (``Placement``)."""
        return any(info.placement is not None for info in self.stages)

    def share_peers(self, stage: int, rank: int, other: int) -> tuple[int, ...]:
        """The ranks of stage ``other`` that hold some of ``rank``'s share of a value ``stage`` hands to
        ``other`` (or takes from it): share i of k covers [i/k, (i+1)/k) of the value, and a member of
        ``other``'s group of k' the same with k', so two shares meet where their intervals overlap (shares as
        the placements state them, ``Placement.shares``). A group of k hands to a group of k the holder of
        share i to the holder of share i; to one rank, every member to it."""
        mine, theirs = self.stages[stage], self.stages[other]
        i, k, n = _share(mine, rank), len(mine.ranks), len(theirs.ranks)
        return tuple(peer for peer in theirs.ranks
                     if i * n < ((j := _share(theirs, peer)) + 1) * k and j * k < (i + 1) * n)

    def replicas(self, stage: int) -> list[int]:
        """Every stage (this one included) that holds the same model chunk."""
        position = self.stages[stage].position
        return [line[position] for line in self.pipelines]

    def microbatches_of(self, stage: int) -> list[int]:
        """The microbatches that pass through ``stage``."""
        pipeline = self.stages[stage].pipeline
        return [m for m, p in enumerate(self.mb_pipeline) if p == pipeline]

    def communicator_of(self, action: Action) -> Communicator | None:
        """The communicator a collective instruction meets on, or None when it names none that exists."""
        purpose = RULES[action.op].communicator
        if purpose == REPLICAS_OF_CHUNK and 0 <= action.stage < len(self.stages):
            key = self.stages[action.stage].position
            return next((c for c in self.communicators if c.purpose == purpose and c.key == key), None)
        if purpose in (RING, WORLD):
            return next((c for c in self.communicators if c.purpose == purpose), None)
        if purpose == STAGE_GROUP and 0 <= action.stage < len(self.stages):  # a sub-step: its stage's group
            placement = self.stages[action.stage].placement
            if placement is not None and 0 <= placement.communicator < len(self.communicators):
                return self.communicators[placement.communicator]
        return None

    def communicator_on(self, action: Action, rank: int) -> Communicator | None:
        """The communicator a collective (or an exchange's collective part) of ``rank`` meets on, or None.

        A group's collective meets on the acting rank's group (weight passing); under HSDP a stage's
        collective on its group meets on the acting member's shard group (``Placement.shard_groups``),
        and one over the members holding its shard on its replica group (``Placement.replica_groups``);
        the others as ``communicator_of`` says.
        """
        purpose = RULES[action.op].communicator
        if purpose in (STAGE_GROUP, SHARD_REPLICAS) and 0 <= action.stage < len(self.stages):
            placement = self.stages[action.stage].placement
            ids = () if placement is None else (placement.shard_groups if purpose == STAGE_GROUP
                                                else placement.replica_groups)
            if ids:
                return next((self.communicators[i] for i in ids
                             if 0 <= i < len(self.communicators) and rank in self.communicators[i].ranks), None)
        if RULES[action.op].communicator == GROUP_OF_RANK:
            key = next((plan.group_of(rank) for plan in self.plans if plan.group_of(rank) is not None), None)
            return next((c for c in self.communicators if c.purpose == GROUP_OF_RANK and c.key == key), None)
        return self.communicator_of(action)

    def grid(self) -> list[list[str]]:
        """The program as text tokens, one list per rank (for error windows)."""
        return [[a.text() for a in row] for row in self.ranks]

    def instruction_count(self) -> int:
        return sum(len(row) for row in self.ranks)


def _share(info: StageInfo, rank: int) -> int:
    """The share ``rank`` takes of the values of stage ``info`` (0 on a stage of one rank)."""
    return 0 if info.placement is None else info.placement.share_of(rank)


def resize_hint(program: Program) -> str:
    """How a user changes ``program``'s number of ranks, for messages: its mesh's axes, or ``-D P=...``."""
    if program.mesh is None:
        return "-D P=..."
    return "the sizes of its mesh (" + " x ".join(f"{name} {size}" for name, size in program.mesh.axes) + ")"


def groups_refusal(program: Program, interpretation: str) -> str | None:
    """Why ``interpretation`` (the simulator, ``pipec run``, torch's CSV) cannot take ``program`` yet: a stage
    placed on a group of ranks, which the prover proves and those do not run (docs/ir.md); None otherwise."""
    placed = next((info for info in program.stages if info.placement is not None), None)
    if placed is None:
        return None
    return (f"{program.name or 'this program'} places stage {placed.id} on the group of ranks "
            f"{', '.join(map(str, placed.placement.ranks))}; pipec proves a program with stages on rank groups, "
            f"but {interpretation} does not run one yet")


# The field of ``Program`` each family plan lives in (``Program.plans`` reads them back).
_PLAN_FIELDS = {WeightPlan: "weights", RingPlan: "rings"}


def build_program(name: str, num_ranks: int, num_microbatches: int, stages: list[StageInfo],
                  pipelines: list[list[int]], mb_pipeline: list[int], ranks: list[list[Action]], *,
                  plans: Iterable = (), **fields) -> Program:
    """The one place a ``Program`` is made from its parts (a program derived from another is
    ``dataclasses.replace``'s): each of ``plans`` (a family's plan) goes to its field by its type;
    ``fields`` are the optional ones (``params``, ``devices``, ``source``, ``communicators``,
    ``weight_versions``); a plan of a type with no field of its own goes to ``family_plans``."""
    plans = tuple(plans)
    return Program(name, num_ranks, num_microbatches, stages, pipelines, mb_pipeline, ranks, **fields,
                   **{_PLAN_FIELDS[type(plan)]: plan for plan in plans if type(plan) in _PLAN_FIELDS},
                   family_plans=tuple(plan for plan in plans if type(plan) not in _PLAN_FIELDS))


def tensor_of(action: Action, program: Program) -> tuple[str, int, int]:
    """The value a send or receive carries, as (value kind, producer stage, mb).

    From the op's rule: a send carries its own stage's value, a receive (which
    names its consumer stage, torch's convention) its neighbour's.
    """
    rule = PART_RULES.get(action.op)
    if rule is None:
        raise ValueError(f"{action.text()} carries no tensor")
    if rule.where == PREV:
        return (rule.kind, program.prev_stage(action.stage), action.mb)
    if rule.where == NEXT:
        return (rule.kind, program.next_stage(action.stage), action.mb)
    return (rule.kind, action.stage, action.mb)


class StageTables(NamedTuple):
    """Per-stage facts as flat lists indexed by stage id (cheap inner loops).

    Attributes:
        home: the rank that runs the stage.
        prev: the stage before it in its pipeline, or -1.
        next: the stage after it in its pipeline, or -1.
        pipeline: the pipeline it belongs to.
        chunk: the model chunk it computes (its position; replicas share it).
    """

    home: list[int]
    prev: list[int]
    next: list[int]
    pipeline: list[int]
    chunk: list[int]

    def neighbour(self, where: str) -> list[int]:
        """The stage at ``where`` (ops.SELF, PREV or NEXT) of each stage, -1 where there is none."""
        if where == PREV:
            return self.prev
        if where == NEXT:
            return self.next
        return list(range(len(self.home)))


def stage_tables(program: Program) -> StageTables:
    """The stage graph of ``program`` as flat lists (every pass that walks stages uses these).

    Args:
        program: any program.
    Returns:
        ``StageTables`` with one entry per stage id.
    """
    count = len(program.stages)
    prev, nxt = [-1] * count, [-1] * count
    for line in program.pipelines:
        for before, after in zip(line, line[1:]):
            nxt[before] = after
            prev[after] = before
    return StageTables(
        [s.rank for s in program.stages],
        prev,
        nxt,
        [s.pipeline for s in program.stages],
        [s.position for s in program.stages],
    )


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
