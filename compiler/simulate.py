"""Discrete-event simulation of a Program: makespan, bubble, memory, timeline.

Contract: ``simulate(program, costs)`` runs every rank's list as the runtime
does, priced by a ``CostModel`` (unit costs by default), and returns a
``SimResult``: the makespan, the bubble ratio (1 - mean busy / makespan), each
rank's busy time and memory peaks, and the timeline ``render`` draws. A rank
waits only for data and collectives: a compute starts when its rank is free
and its inputs are there (the rule table's dataflow), messages are posted
asynchronously (isend/irecv) and matched FIFO per ordered pair, and a
collective is joined without stalling and waited for where its wait stands.
``simulate``'s docstring states these semantics in full; weight passing's and
sequence rings' exchanges, and a composed program's gathers and gradient
reductions, are priced on the network of ``compiler/network.py``
(docs/weights.md, section 5; docs/rings.md, section 4; docs/costs.md,
"Composed programs").

Instructions are dispatched by their rule's category, and every table the
simulator uses (what each compute waits for, where it publishes its end, what
a message carries, how memory counts change) is derived from ``ops.py`` when
this module is imported. The timing is a longest path, evaluated by a worklist
in time linear in the instructions (``_Simulation``); memory peaks
(activations, waiting weight gradients, kept inputs, bytes per size class)
come from ``memory_counts``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from operator import itemgetter
from typing import Callable, Mapping, NamedTuple

from pipec.compiler import ops
from pipec.compiler.costs import CostModel
from pipec.compiler.family import families_of, first_answer
from pipec.compiler.gc_pause import paused_gc
from pipec.compiler.guarded_read import checked_total
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import (
    ACTIVATION_DELTA, Number, check_sizes, peak_bytes, peak_kept_inputs, peak_waiting_w,
    recomputes,
)
from pipec.compiler.network import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, Network
from pipec.compiler.stage_ring import STAGE_BACKWARD_OPS, STAGE_FORWARD_OPS, ring_halves, sequence_groups
from pipec.compiler.placed_memory import with_shard_size
from pipec.compiler.traffic import member_share, node_map, traffic, whole_value_kind
from pipec.errors import DeadlockError, MatchError, WellFormedError

# A bubble fraction with a larger denominator is shown as a decimal only (float
# costs give exact but meaningless ones, like 7130774469997077/21935682705033476).
_EXACT_DENOMINATOR_LIMIT = 10_000


class Slot(NamedTuple):
    """One interval on a rank's timeline.

    Attributes:
        start, end: simulated times.
        action: the instruction (a compute action, or the RECV / ALLREDUCE_GRAD
            a communication slot belongs to).
        is_comm: True for a message in flight to this rank or an all-reduce it
            is part of; these overlap compute slots (they do not hold the rank).
    """

    start: Number
    end: Number
    action: Action
    is_comm: bool = False


@dataclass
class RankStats:
    """Per-rank totals: compute time, time without compute, peak live activations,
    (split backward) the most weight gradients waiting at once: an I done
    whose W is not, each holding what its W will read, and, when ``simulate``
    was given the bytes of each size class, the peak bytes of live values per
    size class (None otherwise)."""

    busy: Number
    idle: Number
    peak_activations: int
    peak_waiting_w: int = 0
    peak_bytes: dict[str, Number] | None = None
    peak_weight_buffers: int | None = None  # weight passing: borrowed weight copies alive at once
    peak_kept_inputs: int | None = None  # recomputed stages: inputs kept for a recompute at once (else None)


@dataclass
class SimResult:
    """The outcome of ``simulate``.

    Attributes:
        makespan: end of the last instruction (or all-reduce) on any rank.
        bubble_ratio: 1 - mean busy / makespan (0 for an empty program).
        ranks: per-rank totals.
        timeline: per rank, its slots sorted by start: one per compute action,
            plus communication slots (``is_comm``) where messages or all-reduces
            take time.
    """

    makespan: Number
    bubble_ratio: float
    ranks: list[RankStats]
    timeline: list[list[Slot]]
    traffic: dict[str, dict[str, Number]] | None = None
    links: dict[str, Number] | None = None

    def bubble_fraction(self) -> Fraction:
        """The bubble ratio as an exact fraction of the simulated totals.

        Exact (e.g. 3/11) when every cost is an integer; with float costs it is
        the exact ratio of the floating-point totals.
        """
        total = Fraction(self.makespan) * len(self.ranks)
        if total == 0:
            return Fraction(0)
        busy = sum((Fraction(rank.busy) for rank in self.ranks), Fraction(0))
        return 1 - busy / total

    def bubble_text(self) -> str:
        """The bubble ratio for people: ``3/11 = 0.2727`` when it is a small exact fraction, else ``0.2727``."""
        fraction = self.bubble_fraction()
        if fraction.denominator <= _EXACT_DENOMINATOR_LIMIT and fraction != int(fraction):
            return f"{fraction} = {float(fraction):.4f}"
        return f"{self.bubble_ratio:.4f}"

    def to_json(self) -> dict:
        """{"makespan", "bubble_ratio", "ranks": [{"busy", "idle", "peak_activations", "peak_waiting_w"}],
        "traffic"} as plain numbers; each rank also has "peak_bytes" (size class -> bytes) when the simulation
        was given sizes, "peak_weight_buffers" for weight passing and "peak_kept_inputs" for a program with
        recomputed stages; "traffic" is the bytes one step moves
        per value kind and link class (``compiler.traffic``); "links", when transfers took time, how long
        anything moved and the mean share of directed links busy meanwhile (``Network.usage``)."""
        out = {
            "makespan": plain_number(self.makespan),
            "bubble_ratio": float(self.bubble_ratio),
            "ranks": [_rank_json(rank) for rank in self.ranks],
        }
        if self.traffic is not None:
            out["traffic"] = self.traffic
        if self.links is not None:
            out["links"] = self.links
        return out


def _rank_json(rank: RankStats) -> dict:
    out = {"busy": plain_number(rank.busy), "idle": plain_number(rank.idle), "peak_activations": int(rank.peak_activations),
           "peak_waiting_w": int(rank.peak_waiting_w)}
    if rank.peak_bytes is not None:
        out["peak_bytes"] = {size_class: plain_number(size) for size_class, size in rank.peak_bytes.items()}
    if rank.peak_weight_buffers is not None:
        out["peak_weight_buffers"] = rank.peak_weight_buffers
    if rank.peak_kept_inputs is not None:
        out["peak_kept_inputs"] = rank.peak_kept_inputs
    return out


def plain_number(value: Number) -> Number:
    """A time for JSON: an int as it is, anything else (a Fraction) as a float."""
    return value if isinstance(value, int) else float(value)


def _exact(value: Number) -> Number:
    """A time as results report it: attention blocks are priced in exact Fractions (a diagonal block
    is half a unit), kept exact while simulating; a result is an int when whole, else a float."""
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else float(value)
    return value


# ----------------------------------------------------------------- key spaces
#
# The ``ready`` table holds the time each value is available, indexed by
# space * (stages * microbatches) + stage * microbatches + mb. Its spaces come
# from the rule table:
#
# * one space per value kind a compute waits for (``ops.DEPENDENCIES``) or a
#   message carries: every compute that makes a value of the kind at its own
#   stage publishes its end time there, so a reader waits on one key whichever
#   of the kind's producers runs (a gradient is made by B, or by I when the
#   backward is split; a saved activation by F, or by R on a recomputed
#   stage). A compute that makes several such kinds publishes in each (F: the
#   activation and the saved activation), so a value remade later (R) never
#   overwrites another one's time (FC's activation) (act: 0, saved: 1, grad: 2,
#   wstash: 3, kept: 4);
# * one space per message kind (``ops.MESSAGE_KINDS``): its arrival at the
#   reading stage, published by the receive that carries it (act: 5, grad: 6);
# * after them, one key per model chunk for the end of its gradient all-reduce.

_ACTIVATION_COMPUTE_OPS = tuple(op for op in ops.COMPUTE_OPS if op not in ops.IN_ORDER_COMPUTE_OPS)
_WAITED_KINDS = tuple(dict.fromkeys(
    [dep.kind for op in _ACTIVATION_COMPUTE_OPS for dep in ops.DEPENDENCIES[op]] + list(ops.MESSAGE_KINDS)))
# value kind -> the space its producers publish their end time in
_SPACE_OF_KIND = {kind: space for space, kind in enumerate(_WAITED_KINDS)}
_NUM_PRODUCED = len(_WAITED_KINDS)
# compute op -> the spaces it publishes its end time in: the waited-for kinds it makes at its own stage
_SPACES_OF_OP = {op: tuple(_SPACE_OF_KIND[use.kind] for use in ops.RULES[op].writes
                           if use.where == ops.SELF and use.kind in _SPACE_OF_KIND)
                 for op in _ACTIVATION_COMPUTE_OPS}
# message kind -> the space its arrival at the reading stage is published in
_ARRIVAL_SPACE = {kind: _NUM_PRODUCED + code for kind, code in ops.MESSAGE_KIND_CODE.items()}
_ALLREDUCE = _NUM_PRODUCED + len(ops.MESSAGE_KINDS)

# Compute op -> (spaces it publishes its end time in, change of the live
# activation count, the inputs it waits for as (value kind, whose: ops.SELF,
# PREV or NEXT of its stage)). A neighbour's value is missing at a pipeline's
# ends; then the input is not waited for.
_COMPUTE_RULES = {
    op: (_SPACES_OF_OP[op], ACTIVATION_DELTA.get(op, 0), tuple((dep.kind, dep.where) for dep in ops.DEPENDENCIES[op]))
    for op in _ACTIVATION_COMPUTE_OPS
}
# Marks an op that is not a SEND/RECV where only those may stand.
_NOT_A_MESSAGE = object()
# Communication op -> (is a send, space of the tensor it carries, whose tensor
# it is relative to the action's stage, space a receive publishes the arrival
# in, message kind code: the index in a channel's transfer times). A receive
# names its consumer stage (torch's convention), so the tensor it carries is
# its neighbour's.
_COMM_RULES = {
    op: (rule.is_send, _SPACE_OF_KIND[rule.kind], rule.where, None if rule.is_send else _ARRIVAL_SPACE[rule.kind],
         rule.code)
    for op, rule in ops.PART_RULES.items()
}
_BATCH_OPS = frozenset(ops.ops_of(ops.BATCH_OF))
_FREE_OPS = frozenset(ops.FREE_OPS)  # memory bookkeeping only: they take no time
# The rare ops drain does not handle inline, by (category, communicator) ->
# the ``_Simulation`` method that runs them.
_COLLECTIVE_HANDLERS = {
    (ops.COLLECTIVE, ops.REPLICAS_OF_CHUNK): "join_allreduce",
    (ops.COLLECTIVE_WAIT, ops.REPLICAS_OF_CHUNK): "wait_allreduce",
}
_HANDLERS = {op: _COLLECTIVE_HANDLERS[rule.category, rule.communicator] for op, rule in ops.RULES.items()
             if (rule.category, rule.communicator) in _COLLECTIVE_HANDLERS}
# Weight passing: an exchange posts its parts, its wait stalls until they
# completed, a drop takes no time (a part is never an instruction of its own).
_HANDLERS.update({op: "post_exchange" for op in ops.EXCHANGE_OPS})
_HANDLERS.update({op: "wait_exchange" for op in ops.EXCHANGE_WAIT_OPS})
_HANDLERS.update({op: "drop_copy" for op in ops.DROP_COPY_OPS})
_HANDLERS.update({op: "in_order_compute" for op in ops.IN_ORDER_COMPUTE_OPS})
_EXCHANGE_PARTS = frozenset(ops.EXCHANGE_PART_OPS)
# What a collective part is priced as (``Network.collective``; a ring step as its hops).
_COLLECTIVE_KIND = {ops.SHIFT_F: "shift", ops.SHIFT_B: "shift", ops.SHIFT_G: "shift", ops.BCAST_W: BROADCAST,
                    ops.REDUCE_G: REDUCE, ops.ALLGATHER_W: ALL_GATHER, ops.REDUCESCATTER_G: REDUCE_SCATTER,
                    ops.ALLTOALL_KV: "all_to_all", ops.ALLTOALL_DKV: "all_to_all", ops.GATHER: ALL_GATHER,
                    ops.ALLREDUCE_TF: ALL_REDUCE, ops.ALLREDUCE_TB: ALL_REDUCE,
                    ops.SYNC_GRAD: ALL_REDUCE, ops.REDUCE_GRAD: REDUCE_SCATTER, ops.SYNC_SHARD: ALL_REDUCE}
_ROOTED = frozenset({ops.BCAST_W, ops.REDUCE_G})  # their ``peer`` is the root
# An exchange's sends, receives and local copies are priced by their category; a collective part
# by its own kind of collective (``_COLLECTIVE_KIND``).
ops.declare_pass("simulate", [*_COMPUTE_RULES, *_COMM_RULES, *_BATCH_OPS, *_FREE_OPS, *_HANDLERS,
                              *(op for op in _EXCHANGE_PARTS
                                if ops.RULES[op].category != ops.PART_COLLECTIVE or op in _COLLECTIVE_KIND)])

# For messages: space -> the computes publishing in it; space -> the message
# kind its computes make (spaces of no message are absent).
_OPS_OF_SPACE = [ops.producers(kind) for kind in _WAITED_KINDS]
_MESSAGE_OF_SPACE = {_SPACE_OF_KIND[kind]: kind for kind in ops.MESSAGE_KINDS}


def simulate(program: Program, costs: CostModel | None = None, *,
             sizes: Mapping[str, Number] | None = None) -> SimResult:
    """Simulate ``program`` under ``costs`` (unit costs when None).

    Semantics (what the runtime does, priced by the ``CostModel``):

    * Each rank runs its list in order. A compute task (F, B, I, W) starts when
      the rank is free and its inputs are on the rank, and holds the rank for
      ``costs.compute(op, chunk)``.
    * Inputs follow the dataflow of the rule table (``ops.DEPENDENCIES``): each
      value a compute reads, at its own stage or a neighbour, is made by one of
      the value's producers. For activation passing: F(s, m) needs the activation
      of F(prev(s), m); B(s, m) or I(s, m) needs F(s, m) and the gradient of B or
      I of next(s) for m; W(s, m) needs I(s, m). A producer on the same rank hands
      off locally, at its end time.
    * Across ranks, a program without communication instructions gets the data at
      producer end + ``costs.transfer``. A program with them gets it from the
      receive that carries it (``ops.PART_RULES``): the k-th send from rank a to
      rank b matches the k-th receive on b from a (messages are untagged, FIFO per
      ordered pair), and the data is on b at the time the sender posted its send
      plus the transfer time. Sends and receives are posted asynchronously
      (isend/irecv): neither waits for its peer; the compute that uses the data
      waits for it. A batch posts all its parts at once. Posting holds the rank
      ``costs.post`` per message (0 by default), not counted as busy; a send leaves
      when its batch is posted.
    * A collective (ALLREDUCE_GRAD) joins the gradient all-reduce of its stage's
      model chunk without stalling; the all-reduce ends ``costs.allreduce`` after
      the last replica joined. A collective wait (ALLREDUCE_WAIT) stalls the rank
      until it ends. A free (FREE_F) takes no time.
    * A stage on a group of k ranks (a composed program, ``mesh_placement.place_on_mesh``): each member runs the
      stage's tasks on its share of the rows, taking 1/k of each task's time, and sends 1/k of each
      value to the member of the neighbouring group with the same share; each member's values are its
      own (keys per member stage). A compute's sub-steps (GATHER) are collectives of the group that
      block the member before the compute's body; SYNC_GRAD and REDUCE_GRAD are an exchange's
      collectives, priced as the all-reduce and reduce-scatter of the stage's weight gradient (docs/costs.md,
      "Composed programs"), and HSDP's SYNC_SHARD the all-reduce of one shard over the member's replica
      group; RESHARD takes no time.
    * A stage split by sequence (PP x CP, ``Program.stage_ring``): each of its computes is a meeting of the
      group: it starts when every member is there with its inputs; a forward (or recompute) on member i
      then lasts its share of the op's cost plus ring rank i's time in the stage ring's forward half, a
      backward its share plus the backward half's, each half simulated once per group on the group's
      ranks (``stage_ring.ring_halves``: the cost file's links, NICs and rails between the members). The
      halves' transfers count in the links' use at each meeting; they do not contend with the
      pipeline's messages.

    Args:
        program: a compute-only program, or one with communication instructions
            (SEND/RECV/BATCH, ALLREDUCE_GRAD/WAIT, FREE_F).
        costs: the cost model.
        sizes: size class (``ops.SIZE_*``) -> bytes of one value of it; when
            given, each rank's stats carry ``peak_bytes`` for those classes.
    Returns:
        makespan, bubble ratio, per-rank stats and the timeline.
    Raises:
        WellFormedError: an unknown op, or a stage/microbatch/peer out of range.
        MatchError: a RECV matched (FIFO) to a SEND of another tensor.
        DeadlockError: a rank waits for an input that never arrives.
        ValueError: an unknown size class or a negative size.
        UsageError: stages placed on groups of different sizes (``traffic.member_share``).
        NumberLimitError: a total (the makespan, a rank's busy or idle time, its peak bytes, the links'
            use) that overflowed: a float not finite, an integer past 2^63 (``guarded_read.checked_total``),
            naming the cost file. Costs within the reader's limits never overflow a float; an integer
            total can pass 2^63 on a long program.
    """
    if program.placed_on_groups:
        _check_members(program)
    if sizes is not None:
        check_sizes(sizes)  # before the run, not after it
    with paused_gc():
        return _Simulation(program, costs or CostModel.unit(), sizes).run()


class _Simulation:
    """State of one simulation; ``run`` drives the worklist.

    Because a rank never waits for anything but data and all-reduces, the timing is
    a longest-path computation over the program's dependency graph, evaluated with a
    worklist: a rank runs until an input is missing, parks on that input, and is woken
    by whoever produces it. Each instruction is executed once, so the cost is linear in
    the number of instructions. A rank parked on an input that is never produced is
    reported as a DeadlockError (a safety net; the deadlock check proves programs safe
    under stricter semantics).
    """

    def __init__(self, program: Program, costs: CostModel, sizes: Mapping[str, Number] | None = None):
        self.program = program
        self.families = families_of(program)  # asked for what differs by family: shares, ring steps, blocks
        self.costs = costs
        self.sizes = sizes
        self.num_ranks = len(program.ranks)
        self.num_stages = len(program.stages)
        self.num_mbs = program.num_microbatches
        # A stage on a group of k ranks: each member runs every task on its share of the rows (1/k of
        # its time and of its messages' bytes) and makes its own values, so the ``ready`` table's keys
        # name a member stage, (stage, member), where a plain program's name its stage.
        self.share = member_share(program)
        self.member_stages = _member_stages(program)
        self.placed = program.placed_on_groups
        # key arithmetic needs a non-zero stride even for an empty program
        self.stride = max(self.num_mbs, 1)
        self.space = len(self.member_stages) * self.stride
        self.devices = program.devices or list(range(self.num_ranks))
        self.has_comms = _has_comms(program)
        self.ready: list = [None] * (_ALLREDUCE * self.space + max(program.num_chunks, 1))
        self.waiters: dict[int, list[int]] = {}
        self.work: list[int] = list(reversed(range(self.num_ranks)))
        # per-rank progress, saved whenever a rank parks
        self.pc = [0] * self.num_ranks
        self.clock: list[Number] = [0] * self.num_ranks
        self.busy: list[Number] = [0] * self.num_ranks
        self.handled_busy: list[Number] = [0] * self.num_ranks  # compute run by handlers (attention blocks)
        self.live = [0] * self.num_ranks
        self.peak = [0] * self.num_ranks
        self.parked_on = [-1] * self.num_ranks
        self.slots: list[list[Slot]] = [[] for _ in range(self.num_ranks)]
        self.comm_slots: list[list[Slot]] = [[] for _ in range(self.num_ranks)]
        # channels[src][dst]: the FIFO channel from src to dst, opened on first use
        self.channels: list[list[tuple | None]] = [[None] * self.num_ranks for _ in range(self.num_ranks)]
        self.allreduce_joined: dict[int, list[tuple[Number, int, Action]]] = {}
        self.allreduce_stages: set[tuple[int, int]] = set()  # (rank, chunk) joined
        # what the first pass of posting needs: send op -> per member stage the key base
        # of the tensor it sends (None: no neighbour); receive op -> None
        self.comm_plan = self._plan_comms()
        sent_tensors = {
            op: [None if message is None else message[1] for message in row] if _COMM_RULES[op][0] else None
            for op, row in self.comm_plan.items()
        }
        # a context-parallel composition: its groups' stage-ring halves, the stages whose computes meet
        # their group, and each meeting's completion key and the members' ready times
        self.rings = {group: ring_halves(program, group, costs, sizes if sizes is not None else costs.sizes)
                      for group in (sequence_groups(program) if program.stage_ring is not None else ())}
        self.ring_stages = frozenset(info.id for info in program.stages if tuple(info.ranks) in self.rings)
        self.ring_meetings: dict[tuple[int, str, int], tuple[int, list[Number]]] = {}
        self.ring_pending: dict[int, int] = {}  # rank -> the step whose meeting it joined and waits on
        # per rank, the plans indexed by the stages it runs (``_per_rank``)
        self.compute_plans = self._per_rank(self._plan_compute())
        self.comm_plans = self._per_rank(self.comm_plan)
        self.sent_tensors = self._per_rank(sent_tensors)
        self.substep_pending: dict[int, tuple[int, int, int]] = {}  # rank -> (step, sub-step, key) parked on
        self.substeps_done = [-1] * self.num_ranks  # per rank, the step whose sub-steps have all ended
        # the rare ops drain does not handle inline:
        # op -> handler(rank, step, action, clock) -> new clock, or None when parked
        self.handlers = {op: getattr(self, method) for op, method in _HANDLERS.items()}
        # weight passing: point-to-point channels (src, dst) -> (unmatched sends, unmatched
        # receives), each (post time, completion key, rank, step, part); the k-th collective
        # of a communicator -> its members' (join time, completion key, rank, part); per
        # rank, its collectives joined per communicator; (rank, exchange) -> completion keys
        self.part_channels: dict[tuple[int, int], tuple[deque, deque]] = {}
        self.meetings: dict[tuple[int, int], list[tuple[Number, int, int, Action]]] = {}
        self.joined: list[dict[int, int]] = [{} for _ in range(self.num_ranks)]
        self.exchanges: dict[tuple[int, int], list[int]] = {}
        # what prices transfers when links or NICs are shared (else each message takes its link's time)
        self.network = Network(costs)
        self.kind_bytes = [_plain_share(costs.message_bytes_of(kind), self.share) for kind in ops.MESSAGE_KINDS]

    # -- plans -------------------------------------------------------------------

    def _plan_compute(self) -> dict[str, list[tuple]]:
        """op -> per member stage (duration, ((input key base, delay), ...), (output key base, ...),
        activation delta): a member's duration is its share of the task's.

        The key of an input or output for microbatch m is its base + m.
        """
        program, costs, n, space = self.program, self.costs, self.stride, self.space
        neighbours = self._neighbours()
        plan: dict[str, list[tuple]] = {op: [] for op in _COMPUTE_RULES}
        for m, (stage, rank) in enumerate(self.member_stages):
            chunk = program.stages[stage].chunk
            for op, (out_spaces, delta, needs) in _COMPUTE_RULES.items():
                waits = sum((self._input(m, neighbours[whose][m], kind) for kind, whose in needs), ())
                outs = tuple(out_space * space + m * n for out_space in out_spaces)
                duration = _plain_share(costs.compute(op, chunk), self.share) + self._ring_time(stage, rank, op)
                plan[op].append((duration, waits, outs, delta))
        return plan

    def _ring_time(self, stage: int, rank: int, op: str) -> Number:
        """The time member ``rank`` of a stage split by sequence spends in the stage ring's half that ``op``
        runs (0 for any other stage or op)."""
        group = tuple(self.program.stages[stage].ranks)
        halves = self.rings.get(group)
        if halves is None:
            return 0
        member = group.index(rank)
        if op in STAGE_FORWARD_OPS:
            return halves.forward[member]
        return halves.backward[member] if op in STAGE_BACKWARD_OPS else 0

    def ring_meeting(self, rank: int, step: int, action: Action, ready: Number) -> Number | None:
        """A compute of a stage split by sequence, its inputs on ``rank`` at ``ready``: when every member of the
        group is there (the ring's start), or None when the rank parked until the last one comes."""
        if self.ring_pending.get(rank) == step:  # woken: the meeting it joined has started
            del self.ring_pending[rank]
            return self.ready[self.ring_meetings[(action.stage, action.op, action.mb)][0]]
        found = self.ring_meetings.get((action.stage, action.op, action.mb))
        if found is None:
            found = self.ring_meetings[(action.stage, action.op, action.mb)] = (self._new_key(), [])
        key, arrived = found
        arrived.append(ready)
        group = tuple(self.program.stages[action.stage].ranks)
        if len(arrived) < len(group):
            self.ring_pending[rank] = step
            self.park(rank, key)
            return None
        start = max(arrived)
        halves = self.rings[group]
        moves = halves.forward_moves if action.op in STAGE_FORWARD_OPS else (
            halves.backward_moves if action.op in STAGE_BACKWARD_OPS else ())
        for src, dst, begin, arrival in moves:  # the links' use (the ring's transfers, priced on its own)
            self.network.record(src, dst, start + begin, start + arrival)
        self.publish(key, start)
        return start

    def _plan_comms(self) -> dict[str, list[tuple | None]]:
        """op -> per member stage (is send, tensor key base, arrival key base, kind), or None where
        the stage has no neighbour to exchange with. Keys for microbatch m are base + m."""
        n, space = self.stride, self.space
        neighbours = self._neighbours()
        plan: dict[str, list[tuple | None]] = {}
        for op, (is_send, tensor_space, whose, arrival_space, kind) in _COMM_RULES.items():
            row: list[tuple | None] = []
            for member in range(len(self.member_stages)):
                producer = neighbours[whose][member]
                arrival = -1 if arrival_space is None else arrival_space * space + member * n
                row.append(None if producer < 0 else (is_send, tensor_space * space + producer * n, arrival, kind))
            plan[op] = row
        return plan

    def _per_rank(self, plan: dict[str, list | None]) -> list[dict[str, list | None]]:
        """Per rank, ``plan`` (op -> per member stage) indexed by stage: the rank's own member stage of
        each stage it is a member of (None where it is none). Every rank of a plain program shares
        ``plan`` itself, indexed by stage as its member stages are."""
        if not self.placed:
            return [plan] * self.num_ranks
        index = [{rank: m for m, (stage, rank) in enumerate(self.member_stages) if stage == s}
                 for s in range(self.num_stages)]
        return [{op: None if row is None else [row[index[s][r]] if r in index[s] else None
                                               for s in range(self.num_stages)]
                 for op, row in plan.items()} for r in range(self.num_ranks)]

    def _neighbours(self) -> dict[str, list[int]]:
        """ops.SELF / PREV / NEXT -> per member stage, that member stage (-1: none): the stage the
        stages' own (pipeline, position) say (``Program.prev_stage`` / ``next_stage``), the member with
        the same share (groups of one size hand the holder of share i to the holder of share i, as the
        placements state the shares)."""
        program, members = self.program, self.member_stages
        holder = {}  # (stage, share) -> its member stage
        for m, (stage, rank) in enumerate(members):
            placement = program.stages[stage].placement
            holder[stage, 0 if placement is None else placement.share_of(rank)] = m

        def member_of(other: int, m: int) -> int:
            stage, rank = members[m]
            placement = program.stages[stage].placement
            share = 0 if placement is None else placement.share_of(rank)
            return -1 if other < 0 else holder.get((other, share), -1)  # -1: shares the prover refuses

        every = range(len(members))
        return {ops.SELF: list(every), ops.PREV: [member_of(program.prev_stage(members[m][0]), m) for m in every],
                ops.NEXT: [member_of(program.next_stage(members[m][0]), m) for m in every]}

    def _input(self, member: int, producer: int, kind: str) -> tuple:
        """The ((key base, delay),) a task of member stage ``member`` waits on for the ``kind`` value made
        by member stage ``producer``; () when there is no such stage."""
        n, space = self.stride, self.space
        if producer < 0:
            return ()
        made = _SPACE_OF_KIND[kind] * space + producer * n
        source, target = self.member_stages[producer][1], self.member_stages[member][1]
        if source == target:  # a local hand-off, at the producer's end
            return ((made, 0),)
        if self.has_comms:  # only the receive that carries it brings it
            return ((_ARRIVAL_SPACE[kind] * space + member * n, 0),)
        return ((made, self._message_time(source, target, kind)),)

    def _message_time(self, src: int, dst: int, kind: str) -> Number:
        """The time one message of ``kind`` from rank ``src`` to rank ``dst`` takes: its share of the bytes."""
        a, b = self.devices[src], self.devices[dst]
        if self.share == 1 or a == b:
            return self.costs.transfer(a, b, kind)
        return self.costs.link_between(a, b).time(self.kind_bytes[ops.MESSAGE_KIND_CODE[kind]])

    # -- driver ------------------------------------------------------------------

    def run(self) -> SimResult:
        self.drain()
        stuck = [r for r in range(self.num_ranks) if self.pc[r] < len(self.program.ranks[r])]
        if stuck:
            self._report_stuck(stuck)
        return self._result()

    def park(self, rank: int, key: int) -> None:
        """Make ``rank`` wait until ``key`` is published."""
        self.parked_on[rank] = key
        waiting = self.waiters.get(key)
        if waiting is None:
            self.waiters[key] = [rank]
        else:
            waiting.append(rank)

    def publish(self, key: int, time: Number) -> None:
        """Record that ``key`` is available at ``time`` and wake its waiters."""
        self.ready[key] = time
        waiting = self.waiters.pop(key, None)
        if waiting:
            self.work.extend(waiting)

    def drain(self) -> None:
        """Run ranks off the worklist, each from where it stopped until it parks or finishes, until no
        rank can move. One loop serves every rank: a rank parks and resumes every few instructions, so
        resuming must cost little. Compute tasks, messages and frees (nearly every instruction) are
        handled inline; the rare collectives and a compute's sub-steps go through handlers."""
        ready, waiters, work = self.ready, self.waiters, self.work
        comm_plan, handlers, substeps_done = self.comm_plan, self.handlers, self.substeps_done
        batch_ops, free_ops = _BATCH_OPS, _FREE_OPS
        channels, ranks, all_slots = self.channels, self.program.ranks, self.slots
        # per rank: what a resume needs that never changes, and its progress
        fixed = [(row, len(row), channels[r], all_slots[r].append, plans)
                 for r, (row, plans) in enumerate(zip(ranks, self.compute_plans))]
        progress = list(zip(self.pc, self.clock, self.busy, self.live, self.peak))
        parked_ons, new_tuple, num_stages, num_mbs = self.parked_on, tuple.__new__, self.num_stages, self.num_mbs
        ring_stages, ring_meeting = self.ring_stages, self.ring_meeting
        post_group = self._poster()
        while work:
            r = work.pop()
            row, end_of_row, outgoing, slots_append, compute_plan = fixed[r]
            pc, clock, busy, live, peak = progress[r]
            parked_on = -1
            while pc < end_of_row:
                action = row[pc]
                stage, op, mb, _, parts = action
                plan = compute_plan.get(op)
                if plan is not None:
                    if not (0 <= stage < num_stages and 0 <= mb < num_mbs):
                        raise self._error(WellFormedError, f"{action.text()}: stage or microbatch out of range", r, pc)
                    if parts and substeps_done[r] != pc:  # its sub-steps end before its body starts
                        ended = self.run_substeps(r, pc, action, clock)
                        if ended is None:  # parked on one of them
                            break
                        clock = ended
                    duration, inputs, outs, delta = plan[stage]
                    start = clock
                    for base, delay in inputs:
                        arrival = ready[base + mb]
                        if arrival is None:
                            parked_on = base + mb
                            break
                        arrival += delay
                        if arrival > start:
                            start = arrival
                    if parked_on >= 0:
                        break
                    if ring_stages and stage in ring_stages:  # the group's meeting: the ring starts when all came
                        start = ring_meeting(r, pc, action, start)
                        if start is None:  # parked until the last member comes
                            break
                    clock = start + duration
                    for out in outs:
                        key = out + mb
                        ready[key] = clock
                        if key in waiters:
                            work.extend(waiters.pop(key))
                    slots_append(new_tuple(Slot, (start, clock, action, False)))
                    busy += duration
                    live += delta
                    if live > peak:
                        peak = live
                    pc += 1
                    continue
                if op in free_ops:  # memory bookkeeping only; it takes no time
                    pc += 1
                    continue
                if op in batch_ops or op in comm_plan:
                    # A single SEND/RECV posts exactly like a one-part BATCH: all
                    # parts or none, each at ``clock``; the rank goes on.
                    group = parts if op in batch_ops else (action,)
                    clock, parked_on = post_group(r, pc, action, group, clock, outgoing)
                    if parked_on >= 0:
                        break
                else:  # the rare collectives and exchanges, through their handlers
                    next_clock = handlers.get(op, self._unknown)(r, pc, action, clock)
                    if next_clock is None:  # the handler parked the rank
                        break
                    clock = next_clock
                pc += 1
            if parked_on >= 0:  # wait until parked_on is published
                parked_ons[r] = parked_on
                waiters.setdefault(parked_on, []).append(r)
            progress[r] = (pc, clock, busy, live, peak)
        # hand the progress back to the per-rank lists that results and reports read
        for r, state in enumerate(progress):
            self.pc[r], self.clock[r], self.busy[r], self.live[r], self.peak[r] = state

    def _unknown(self, r: int, pc: int, action: Action, clock) -> None:
        raise self._error(WellFormedError, f"unknown instruction {action.text()}", r, pc)

    def _poster(self) -> Callable[..., tuple]:
        """The function that posts a message instruction's parts (``drain`` calls it for nearly every
        other instruction), with the simulation's tables bound once: a bound method would load them
        from ``self`` on every call, a measurable share of the simulation."""
        ready, waiters, work, comm_plans = self.ready, self.waiters, self.work, self.comm_plans
        channels, comm_slots, network = self.channels, self.comm_slots, self.network
        devices, kind_bytes, shared, new_tuple = self.devices, self.kind_bytes, network.shared, tuple.__new__
        num_stages, num_mbs, num_ranks = self.num_stages, self.num_mbs, self.num_ranks
        post, malformed, open_channel, mismatch = self.costs.post, self._malformed, self._channel, self._mismatch
        first_unproduced = self._unproduced_finder()

        def post_group(r: int, pc: int, action: Action, group: tuple, clock, outgoing: list) -> tuple:
            """Post the message parts ``group`` of ``r``'s instruction ``pc`` at ``clock``, all or none.

            Returns:
                (the rank's clock after posting, -1), or (``clock``, the key of a tensor to send that is
                not produced yet: the rank parks on it and posts nothing).
            """
            # Posting is all or none, in two passes (the order of checks decides which error a
            # program with several faults gets). First pass: every part is a message, and every
            # tensor sent is produced (by this rank, earlier in its list) or the rank parks.
            unproduced = first_unproduced(r, pc, action, group)
            if unproduced >= 0:
                return clock, unproduced
            if post:  # the rank posts every part; the sends leave when it is done
                clock += post * len(group)
            # Second pass: check each part in full, then post it; a part
            # that finds its counterpart waiting in the channel delivers.
            comm_plan = comm_plans[r]
            for part in group:
                p_stage, p_op, p_mb, p_peer, _ = part
                if not (0 <= p_stage < num_stages and 0 <= p_mb < num_mbs and 0 <= p_peer < num_ranks) or p_peer == r:
                    raise malformed(part, r, pc)
                message = comm_plan[p_op][p_stage]
                if message is None:
                    raise malformed(part, r, pc)
                is_send, tensor_base, arrival_base, kind = message
                if is_send:
                    sends, receives, transfer = outgoing[p_peer] or open_channel(r, p_peer)
                    produced = ready[tensor_base + p_mb]
                    sent = (tensor_base + p_mb, produced if produced > clock else clock, r, pc)
                    if not receives:
                        sends.append(sent)
                        continue
                    posted = receives.popleft()
                else:
                    sends, receives, transfer = channels[p_peer][r] or open_channel(p_peer, r)
                    posted = (tensor_base + p_mb, arrival_base + p_mb, r, pc, part)
                    if not sends:
                        receives.append(posted)
                        continue
                    sent = sends.popleft()
                # sent: (tensor, time, rank, step); posted: (tensor, arrival key, rank, step, part)
                if sent[0] != posted[0]:
                    raise mismatch(sent, posted)
                sent_at, delay = sent[1], transfer[kind]
                if shared:  # links and NICs shared: the network reserves its bandwidth
                    arrival = network.transfer(devices[sent[2]], devices[posted[2]], kind_bytes[kind], sent_at)
                    delay = arrival - sent_at
                else:
                    arrival = sent_at + delay
                    if delay:
                        network.record(devices[sent[2]], devices[posted[2]], sent_at, arrival)
                if delay:
                    comm_slots[posted[2]].append(new_tuple(Slot, (sent_at, arrival, posted[4], True)))
                key = posted[1]
                ready[key] = arrival
                if key in waiters:
                    work.extend(waiters.pop(key))
            return clock, -1

        return post_group

    def _unproduced_finder(self) -> Callable[[int, int, Action, tuple], int]:
        """The first pass of posting (``_poster``): ``first_unproduced(r, pc, action, group)`` raises for a
        part that is no message, and returns the key of the first tensor ``group`` sends that is not
        produced yet (the rank parks on it), or -1."""
        ready, sent_tensors, malformed, error = self.ready, self.sent_tensors, self._malformed, self._error
        num_stages, num_mbs, num_ranks = self.num_stages, self.num_mbs, self.num_ranks

        def first_unproduced(r: int, pc: int, action: Action, group: tuple) -> int:
            if not group:
                raise error(WellFormedError, f"{action.text()} posts nothing", r, pc)
            for part in group:
                bases = sent_tensors[r].get(part[1], _NOT_A_MESSAGE)
                if bases is None:  # a receive: it never waits
                    continue
                if bases is _NOT_A_MESSAGE:
                    raise malformed(part, r, pc)
                p_stage, _, p_mb, p_peer, _ = part
                if 0 <= p_stage < num_stages and 0 <= p_mb < num_mbs:
                    base = bases[p_stage]
                    if base is not None and ready[base + p_mb] is None:
                        if action[1] not in _BATCH_OPS and (not 0 <= p_peer < num_ranks or p_peer == r):
                            raise malformed(part, r, pc)  # a lone send is checked in full first
                        return base + p_mb
            return -1

        return first_unproduced

    def _malformed(self, part: Action, rank: int, step: int) -> WellFormedError:
        """The error for a message (or batch part) of ``rank`` that cannot be posted."""
        stage, op, mb, peer, _ = part
        if op not in self.comm_plan:
            problem = " cannot be part of a batch"
        elif not (0 <= stage < self.num_stages and 0 <= mb < self.num_mbs and 0 <= peer < self.num_ranks) or peer == rank:
            problem = ": stage, microbatch or peer out of range"
        else:
            problem = f": stage {stage} has no neighbour to exchange with"
        return self._error(WellFormedError, part.text() + problem, rank, step)

    def _channel(self, src: int, dst: int) -> tuple[deque, deque, tuple]:
        """Open the channel from ``src`` to ``dst``: (unmatched sends, unmatched receives,
        transfer time by kind). Channels live in ``self.channels[src][dst]``."""
        channel = (deque(), deque(), tuple(self._message_time(src, dst, kind) for kind in ops.MESSAGE_KINDS))
        self.channels[src][dst] = channel
        return channel

    def _mismatch(self, sent: tuple, posted: tuple) -> MatchError:
        """The error for a receive matched (FIFO) with a send of another tensor."""
        tensor, _, src, src_step = sent
        expected, _, dst, dst_step, part = posted
        return MatchError(
            f"{part.text()} expects {self._describe_tensor(expected)} but the matching send "
            f"(rank {src}, step {src_step}) carries {self._describe_tensor(tensor)}",
            rank=dst, step=dst_step, grid=self.program.grid(), marks=[(src, src_step)],
        )

    def join_allreduce(self, rank: int, step: int, action: Action, clock: Number) -> Number:
        """ALLREDUCE_GRAD: join the all-reduce of this stage's chunk; it ends once every member joined.

        The all-reduce meets on the chunk's communicator (``Program.communicators``),
        whose members are ranks, not stages: replicas of one chunk on one rank
        share one module, so that rank joins once, and a communicator of a
        single rank (every replica on it) has nothing to reduce and ends at once,
        as in the runtime.
        """
        stage = self._stage_of(rank, step, action)
        chunk = self.program.stages[stage].chunk
        if (rank, chunk) in self.allreduce_stages:
            raise self._error(WellFormedError, f"rank {rank} starts the gradient all-reduce of chunk {chunk} twice "
                                               f"(its replicas there share one module)", rank, step)
        self.allreduce_stages.add((rank, chunk))
        joined = self.allreduce_joined.setdefault(chunk, [])
        joined.append((clock, rank, action))
        members = self._allreduce_members(action)
        if len(joined) == members:
            start = max(time for time, _, _ in joined)
            end = start + self.costs.allreduce(members, chunk)
            if end > start:
                for _, member, member_action in joined:
                    self.comm_slots[member].append(Slot(start, end, member_action, True))
            self.publish(_ALLREDUCE * self.space + chunk, end)
        return clock

    def _allreduce_members(self, action: Action) -> int:
        """How many ranks meet in the all-reduce ``action`` joins: its communicator's
        members, or (a program without one) the distinct ranks of the chunk's replicas."""
        communicator = self.program.communicator_of(action)
        if communicator is not None:
            return len(communicator.ranks)
        return len({self.program.rank_of(replica) for replica in self.program.replicas(action.stage)})

    def wait_allreduce(self, rank: int, step: int, action: Action, clock: Number) -> Number | None:
        """ALLREDUCE_WAIT: stall until the all-reduce of this stage's chunk has ended."""
        stage = self._stage_of(rank, step, action)
        key = _ALLREDUCE * self.space + self.program.stages[stage].chunk
        end = self.ready[key]
        if end is None:
            self.park(rank, key)
            return None
        return max(clock, end)

    # -- weight passing ----------------------------------------------------------

    def _new_key(self) -> int:
        """A fresh key of the ``ready`` table, for one part's completion."""
        self.ready.append(None)
        return len(self.ready) - 1

    def _part_bytes(self, part: Action) -> Number:
        kind = whole_value_kind(part.op)
        if kind is None or not self.sizes and not self.costs.sizes:
            return 0
        sizes = self.sizes if self.sizes is not None else self.costs.sizes
        if ops.VALUE_KINDS[kind].size_class == ops.SIZE_SHARD:  # HSDP's SYNC_SHARD: a shard, given or derived
            sizes = with_shard_size(self.program, sizes)
        size = sizes.get(ops.VALUE_KINDS[kind].size_class, 0)
        share = first_answer(self.families, lambda family: family.value_share(self.program, part, kind))
        return size if share is None else plain_number(size * share)

    def post_exchange(self, rank: int, step: int, action: Action, clock: Number) -> Number:
        """EXCHANGE: post every part at ``clock`` and go on. A point-to-point part completes when
        both sides are posted and the bytes crossed; a collective when its last member joined and
        its ring steps ran (``CostModel.collective``); a fill at once."""
        keys = []
        for part in action.parts:
            rule = ops.RULES.get(part.op)
            if rule is None or part.op not in _EXCHANGE_PARTS:
                raise self._error(WellFormedError, f"{part.text()} cannot be part of an exchange", rank, step)
            if rule.category == ops.PART_LOCAL:
                continue
            key = self._new_key()
            keys.append(key)
            if rule.category == ops.PART_COLLECTIVE:
                self._join_meeting(rank, step, part, key, clock)
            else:
                self._post_part(rank, step, part, key, clock, rule.category == ops.PART_SEND)
        self.exchanges[(rank, action.mb)] = keys
        return clock + self.costs.post * len(action.parts)

    def _post_part(self, rank: int, step: int, part: Action, key: int, clock: Number, is_send: bool) -> None:
        peer = part.peer
        if not 0 <= peer < self.num_ranks or peer == rank:
            raise self._error(WellFormedError, f"{part.text()}: peer {peer} out of range", rank, step)
        pair = (rank, peer) if is_send else (peer, rank)
        sends, receives = self.part_channels.setdefault(pair, (deque(), deque()))
        mine, theirs = (sends, receives) if is_send else (receives, sends)
        posted = (clock, key, rank, part)
        if not theirs:
            mine.append(posted)
            return
        other = theirs.popleft()
        send, receive = (posted, other) if is_send else (other, posted)
        start = max(send[0], receive[0])
        end = self.network.transfer(self.devices[send[2]], self.devices[receive[2]], self._part_bytes(send[3]), start)
        if end > start:
            self.comm_slots[receive[2]].append(Slot(start, end, receive[3], True))
        self.publish(send[1], end)
        self.publish(receive[1], end)

    def _join_meeting(self, rank: int, step: int, part: Action, key: int, clock: Number) -> None:
        communicator = self.program.communicator_on(part, rank)
        if communicator is None or rank not in communicator.ranks:
            raise self._error(WellFormedError, f"{part.text()} meets on no communicator that has rank {rank}",
                              rank, step)
        k = self.joined[rank].get(communicator.id, 0)
        self.joined[rank][communicator.id] = k + 1
        members = self.meetings.setdefault((communicator.id, k), [])
        members.append((clock, key, rank, part))
        if len(members) < len(communicator.ranks):
            return
        start = max(time for time, _, _, _ in members)
        kind, nbytes = _COLLECTIVE_KIND[part.op], self._part_bytes(part)
        if kind == "all_to_all":  # every member's sends at once, each over its own link
            hops = [(self.devices[r], self.devices[inner.peer]) for _, _, r, p in members for inner in p.parts
                    if ops.RULES[inner.op].category == ops.PART_SEND]
            sizes = {self._part_bytes(inner) for _, _, _, p in members for inner in p.parts}
            end = self.network.hops(hops, max(sizes, default=0), start)
        elif kind == "shift":  # a ring step: each member that takes a slot takes it from its giver
            hops = [(self.devices[self._giver(r, step, part)], self.devices[r]) for _, _, r, p in members
                    if p.stage >= 0]
            end = self.network.hops(hops, nbytes, start)
        else:
            root = self.devices[part.peer] if part.op in _ROOTED else None
            end = self.network.collective(kind, tuple(self.devices[r] for r in communicator.ranks), nbytes, start, root)
        for _, member_key, member, member_part in members:
            if end > start:
                self.comm_slots[member].append(Slot(start, end, member_part, True))
            self.publish(member_key, end)

    def _giver(self, rank: int, step: int, part: Action) -> int:
        giver = first_answer(self.families, lambda family: family.ring_step_giver(self.program, rank))
        if giver is None:
            raise self._error(WellFormedError, f"{part.text()}: a ring step in a program with no ring of ranks",
                              rank, step)
        return giver

    def wait_exchange(self, rank: int, step: int, action: Action, clock: Number) -> Number | None:
        """EXCHANGE_WAIT: stall until every part of this rank's exchange ``mb`` has completed."""
        keys = self.exchanges.get((rank, action.mb))
        if keys is None:
            raise self._error(WellFormedError, f"{action.text()} waits for exchange {action.mb}, which this rank "
                              "has not posted", rank, step)
        for key in keys:
            if self.ready[key] is None:
                self.park(rank, key)
                return None
        return max([clock] + [self.ready[key] for key in keys])

    def run_substeps(self, rank: int, step: int, action: Action, clock: Number) -> Number | None:
        """The sub-steps of compute ``action`` (a stage on a group: ``(0GATHER0)0F0``), each a collective of
        the stage's group that blocks the rank: the first joined when the rank reaches the compute, each
        next one when the one before it has ended. Returns when the last has ended (the compute's body
        starts then, or when its inputs are there if later), or None when the rank parked on one."""
        pending = self.substep_pending.pop(rank, None)
        index, at = 0, clock
        if pending is not None and pending[0] == step:  # woken: the sub-step it parked on has ended
            index, at = pending[1] + 1, self.ready[pending[2]]
        for index in range(index, len(action.parts)):
            part = action.parts[index]
            if part.op not in ops.SUBSTEP_OPS or ops.RULES[part.op].category != ops.PART_COLLECTIVE:
                raise self._error(WellFormedError, f"{part.text()}: the simulator runs a compute's collective "
                                  "sub-steps only", rank, step)
            key = self._new_key()
            self._join_meeting(rank, step, part, key, at)
            if self.ready[key] is None:
                self.substep_pending[rank] = (step, index, key)
                self.park(rank, key)
                return None
            at = self.ready[key]
        self.substeps_done[rank] = step
        return at

    def in_order_compute(self, rank: int, step: int, action: Action, clock: Number) -> Number:
        """A compute whose family proves its dataflow (``ops.IN_ORDER_COMPUTE_OPS``: a ring's AF, AB, tensor
        parallelism's TF, TB), priced by the share of its op's cost its family gives it (a ring's block: the
        area the mask leaves of it, a whole chunk x chunk block the op's cost, a diagonal one half, a piece
        its share). Its inputs are on the rank: brought by the exchanges waited before it, or made by the
        computes before it."""
        area = first_answer(self.families, lambda family: family.block_area(self.program, action))
        if area is None:
            raise self._error(WellFormedError, f"{action.text()}: no task of a {' or '.join(f.name for f in self.families)}",
                              rank, step)
        cost = self.costs.compute(action.op, 0)
        duration = area * cost if isinstance(cost, int) else float(area) * cost  # exact under integer costs
        self.slots[rank].append(Slot(clock, clock + duration, action, False))
        self.handled_busy[rank] += duration
        return clock + duration

    def drop_copy(self, rank: int, step: int, action: Action, clock: Number) -> Number:
        """FREE_W: memory bookkeeping only; it takes no time."""
        return clock

    def _stage_of(self, rank: int, step: int, action: Action) -> int:
        if not 0 <= action.stage < self.num_stages:
            raise self._error(WellFormedError, f"{action.text()}: stage out of range", rank, step)
        return action.stage

    # -- results and reports -------------------------------------------------------

    def _result(self) -> SimResult:
        first = _ALLREDUCE * self.space  # the all-reduce ends, one key per chunk (weight passing's parts follow)
        allreduce_ends = [t for t in self.ready[first:first + max(self.program.num_chunks, 1)] if t is not None]
        exact_makespan = max(self.clock + allreduce_ends, default=0)
        makespan = _exact(exact_makespan)
        byte_peaks = peak_bytes(self.program, self.sizes) if self.sizes is not None else [None] * self.num_ranks
        families = self.families
        exact_times = any(family.exact_times for family in families)
        borrowed = next((peaks for peaks in (family.borrowed_buffers(self.program) for family in families)
                         if peaks is not None), [None] * self.num_ranks)
        exact_busy = [inline + handled for inline, handled in zip(self.busy, self.handled_busy)]
        recomputing = recomputes(self.program)
        ranks = [RankStats(_exact(busy), _exact(exact_makespan - busy), peak, peak_waiting_w(row), in_bytes, buffers,
                           peak_kept_inputs(row) if recomputing else None)
                 for busy, peak, row, in_bytes, buffers
                 in zip(exact_busy, self.peak, self.program.ranks, byte_peaks, borrowed)]
        bubble = 1 - sum(exact_busy) / (exact_makespan * self.num_ranks) if exact_makespan else 0.0
        timeline = []
        for compute, comms in zip(self.slots, self.comm_slots):
            # compute slots are already in start order; sorting is needed only to merge comms in
            lane = sorted(compute + comms, key=itemgetter(0)) if comms else compute
            if exact_times or self.share != 1:  # exact fractions (a ring's blocks, a member's share) as plain numbers
                lane = [slot._replace(start=_exact(slot.start), end=_exact(slot.end)) for slot in lane]
            timeline.append(lane)
        moved = traffic(self.program, self.sizes or self.costs.sizes, node_map(self.program, self.costs.node_size))
        result = SimResult(makespan, float(bubble), ranks, timeline, moved, self.network.usage(self.num_ranks))
        _check_totals(result, self.costs.source)
        return result

    def _error(self, kind: type, message: str, rank: int, step: int) -> Exception:
        return kind(message, rank=rank, step=step, grid=self.program.grid())

    def _describe_tensor(self, key: int) -> str:
        """Words for a sent tensor's key: ``the gradient of 2B0 (or 2I0)``."""
        space, rest = divmod(key, self.space)
        member, mb = divmod(rest, self.stride)
        stage = self.member_stages[member][0] if member < len(self.member_stages) else member
        kind = _MESSAGE_OF_SPACE.get(space)
        if kind is None:
            return f"value {key}"
        return f"the {ops.VALUE_KINDS[kind].words} of {_tasks_text(self._in_program(ops.producers(kind)), stage, mb)}"

    def _in_program(self, task_ops: tuple[str, ...]) -> tuple[str, ...]:
        """The ops of ``task_ops`` this program holds (all of them when it holds none), for messages:
        a program without recomputed stages is not told of FC and R."""
        present = {action.op for row in self.program.ranks for action in row}
        return tuple(op for op in task_ops if op in present) or task_ops

    def _describe_wait(self, key: int) -> str:
        """Words for what a rank parked on ``key`` waits for."""
        if key >= _ALLREDUCE * self.space + max(self.program.num_chunks, 1):  # a part's or a sub-step's key
            return "a collective that not every member of its communicator joins"
        if key >= _ALLREDUCE * self.space:
            return f"the gradient all-reduce of chunk {key - _ALLREDUCE * self.space}, which not every replica joins"
        space, rest = divmod(key, self.space)
        member, mb = divmod(rest, self.stride)
        stage = self.member_stages[member][0]
        if space < _NUM_PRODUCED:
            return (f"the output of {_tasks_text(self._in_program(_OPS_OF_SPACE[space]), stage, mb)}, which never "
                    "runs before it is needed")
        kind = ops.MESSAGE_KINDS[space - _NUM_PRODUCED]
        send, recv = ops.COMM_OP_OF_KIND[kind]
        reader = ops.MESSAGE_READERS[kind][0]  # the arrival key is the reading stage's
        return f"the {ops.VALUE_KINDS[kind].words} for {stage}{reader}{mb}, which no matched {recv}/{send} pair delivers"

    def _report_stuck(self, stuck: list[int]) -> None:
        first = stuck[0]
        waits = self._describe_wait(self.parked_on[first])
        others = [(r, self.pc[r]) for r in stuck[1:]]
        raise DeadlockError(
            f"simulation stuck: waits for {waits} ({len(stuck)} rank(s) stuck)",
            rank=first, step=self.pc[first], grid=self.program.grid(), marks=others,
            cycle=[(r, self.pc[r], self._describe_wait(self.parked_on[r])) for r in stuck],
        )


def _check_totals(result: SimResult, source: str) -> None:
    """Raise ``NumberLimitError`` (naming the cost file ``source``) at the first total of ``result`` that
    overflowed: every time the result reports and every peak in bytes (the timeline's slots lie within
    the makespan)."""
    checked_total(result.makespan, "the makespan", source)
    for rank, stats in enumerate(result.ranks):
        checked_total(stats.busy, f"rank {rank}'s busy time", source)
        checked_total(stats.idle, f"rank {rank}'s idle time", source)
        for size_class, size in (stats.peak_bytes or {}).items():
            checked_total(size, f"rank {rank}'s peak bytes of {size_class}-sized values", source)
    for kind, by_link in (result.traffic or {}).items():
        for link, size in by_link.items():
            checked_total(size, f"the {kind} bytes one step moves ({link})", source)
    if result.links is not None:
        checked_total(result.links["communication"], "the time anything moved on the links", source)
    checked_total(result.bubble_ratio, "the bubble ratio", source)


def _tasks_text(task_ops: tuple[str, ...], stage: int, mb: int) -> str:
    """``2B0 (or 2I0)``: the task of the first op, then its alternatives."""
    first, *others = task_ops
    return f"{stage}{first}{mb}" + "".join(f" (or {stage}{op}{mb})" for op in others)


def _has_comms(program: Program) -> bool:
    """Whether any rank's list holds a send, receive or batch (data then travels only by them)."""
    comm_ops = set(ops.POSTING_OPS)
    op_of = itemgetter(1)
    return any(not comm_ops.isdisjoint(map(op_of, row)) for row in program.ranks)



def _member_stages(program: Program) -> list[tuple[int, int]]:
    """(stage, rank) per member stage, by stage and then member: a stage on one rank is one member stage
    (its own id, so a plain program's keys are as they always were), a stage on a group of k, k of them."""
    return [(info.id, rank) for info in program.stages for rank in info.ranks]


def _plain_share(value: Number, share: Fraction | int) -> Number:
    """``share`` of a time or a size: exact (an int when whole, else a Fraction) for an int, a float for a float."""
    if share == 1:
        return value
    if isinstance(value, float):
        return value * float(share)
    exact = Fraction(value) * share
    return int(exact) if exact.denominator == 1 else exact


def _check_members(program: Program) -> None:
    """Raise ``WellFormedError`` at the first compute or message of a placed program on a rank that is not
    a member of its stage's group (the simulator keys each member's values apart)."""
    for rank, row in enumerate(program.ranks):
        for step, action in enumerate(row):
            for part in (action, *action.parts) if action.op in _BATCH_OPS else (action,):
                if part.op not in _COMPUTE_RULES and part.op not in _COMM_RULES:
                    continue
                if 0 <= part.stage < len(program.stages) and rank not in program.stages[part.stage].ranks:
                    raise WellFormedError(
                        f"{part.text()}: rank {rank} runs a task or a message of stage {part.stage}, which is "
                        f"placed on the ranks {', '.join(map(str, program.stages[part.stage].ranks))}",
                        rank=rank, step=step, grid=program.grid())
