"""The rule table: every instruction kind of the IR, written down once.

Every pass after evaluation (lowering, the checks, liveness, the simulator,
the task-graph renderer, the emitters, the trace and the runtime's
interpreter) reads what an instruction does from here, as JAX keeps one rule
per primitive. A pass may turn the rules into flat integer tables for speed;
those encodings are derived at the bottom of this module, in one place, from
the rules above them.

Values. A program names every tensor it moves or keeps. A value is of a
``ValueKind`` (an activation, a gradient, what a forward saves for its
backward, a weight, a KV piece, ...), identified by an index (for the
activation-passing family: the stage that made it and the microbatch), and
has a size class and a dtype class, so memory can be counted in bytes per
class. ``Value`` is one such tensor; ``describe`` names it for people.

Rules. An ``OpRule`` says, for one op: its category (compute, send, receive,
batch, free, collective), its family, the values it reads and writes (each
relative to the instruction's stage: its own, the previous or the next stage
of its pipeline), the values whose life ends there, the value a send or
receive carries, where it runs, the Action fields it uses, how torch's CSV
writes it and its trace category.

Adding a task kind is one entry in ``RULES`` plus its handler in the runtime's
interpreter; ``docs/ir.md`` walks through an example, and
``tests/test_ops_table.py`` fails when a pass has no rule for an op.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

# ------------------------------------------------------------------ families

ACTIVATION_PASSING = "activation passing"
WEIGHT_PASSING = "weight passing"
SEQUENCE_RING = "sequence ring"
TENSOR_PARALLEL = "tensor parallel"
FAMILIES = (ACTIVATION_PASSING, WEIGHT_PASSING, SEQUENCE_RING, TENSOR_PARALLEL)
# The family field of an op that no one family owns: the exchange and its wait, which post and wait the parts
# of every family (weight passing's weights, a ring's KV, a composition's gradient reductions, ...).
SHARED = "every family"

# --------------------------------------------------------------------- values

# Size classes: what a value's byte size scales with.
SIZE_ACTIVATION = "activation"  # what a stage's forward saves for its backward (and the messages between stages)
SIZE_WEIGHT = "weight"          # a chunk's (or layer's) parameters
SIZE_SHARD = "shard"            # a 1/n slice of a weight
SIZE_KV = "kv"                  # one key/value piece of a sequence chunk
SIZE_STATS = "stats"            # per-row softmax statistics (out's log-sum-exp)
SIZE_BOUNDARY = "boundary"      # one stage boundary's tensor for one microbatch: a recomputed stage's kept input
# Last, so that the classes of every earlier output keep their order.
SIZE_CLASSES = (SIZE_ACTIVATION, SIZE_WEIGHT, SIZE_SHARD, SIZE_KV, SIZE_STATS, SIZE_BOUNDARY)

# Dtype classes: the run's compute dtype (bf16 under mixed precision) or fp32
# (master weights, gradient reductions, softmax statistics).
DTYPE_COMPUTE = "compute"
DTYPE_FP32 = "fp32"


class ValueKind(NamedTuple):
    """A kind of tensor a program moves or keeps.

    Attributes:
        name: short id used in the rules (``"act"``).
        words: what people call it (``"activation"``).
        family: the workload family that uses it.
        index: what identifies one value of the kind, in order.
        size_class, dtype_class: see the constants above.
        counter: the memory count it is reported in (``"activations"`` is
            today's ``peak_activations``), or None when it is counted only in bytes.
        route: the default route policy that moves it (``routes.ROUTES``);
            a program may choose another.
    """

    name: str
    words: str
    family: str
    index: tuple[str, ...]
    size_class: str
    dtype_class: str
    counter: str | None = None
    route: str = "direct"


_STAGE_MB = ("stage", "mb")
# The memory counters of ``ValueKind.counter``: saved activations (today's
# ``peak_activations``), under split backward what an I leaves for its W, and
# the inputs recomputed stages keep for their recompute.
COUNT_ACTIVATIONS, COUNT_WAITING_W, COUNT_KEPT_INPUTS = "activations", "waiting_w", "kept_inputs"
# ... and borrowed weight buffers (weight passing: copies of other ranks' layers).
COUNT_WEIGHT_BUFFERS = "weight_buffers"

VALUE_KINDS: dict[str, ValueKind] = {kind.name: kind for kind in (
    # activation passing
    ValueKind("act", "activation", ACTIVATION_PASSING, _STAGE_MB, SIZE_ACTIVATION, DTYPE_COMPUTE),
    ValueKind("grad", "gradient", ACTIVATION_PASSING, _STAGE_MB, SIZE_ACTIVATION, DTYPE_COMPUTE),
    ValueKind("saved", "saved activation", ACTIVATION_PASSING, _STAGE_MB, SIZE_ACTIVATION, DTYPE_COMPUTE,
              COUNT_ACTIVATIONS),
    ValueKind("wstash", "weight-gradient inputs", ACTIVATION_PASSING, _STAGE_MB, SIZE_ACTIVATION, DTYPE_COMPUTE,
              COUNT_WAITING_W),
    # activation checkpointing: the stage input a checkpointed forward keeps for its recompute
    ValueKind("kept", "kept input", ACTIVATION_PASSING, _STAGE_MB, SIZE_BOUNDARY, DTYPE_COMPUTE, COUNT_KEPT_INPUTS),
    ValueKind("wgrad", "weight gradient", ACTIVATION_PASSING, ("chunk",), SIZE_WEIGHT, DTYPE_FP32, route="all_reduce"),
    # weight passing (docs/weights.md)
    # A copy of a layer's weights delivered to a rank for a step; a partial sum
    # of a layer's weight gradient on its way to the layer's owner.
    ValueKind("weight", "weight", WEIGHT_PASSING, ("layer", "step"), SIZE_WEIGHT, DTYPE_COMPUTE,
              COUNT_WEIGHT_BUFFERS),
    ValueKind("wgrad_partial", "weight-gradient partial", WEIGHT_PASSING, ("layer", "step"), SIZE_WEIGHT,
              DTYPE_FP32),
    ValueKind("shard", "weight shard", WEIGHT_PASSING, ("layer", "shard"), SIZE_SHARD, DTYPE_FP32),
    # sequence rings (the ring-attention issue adds its ops)
    ValueKind("kv", "KV piece", SEQUENCE_RING, ("holder", "piece", "pass"), SIZE_KV, DTYPE_COMPUTE),
    ValueKind("dkv", "dKV partial", SEQUENCE_RING, ("holder", "piece", "hop"), SIZE_KV, DTYPE_FP32),
    ValueKind("stats", "softmax statistics", SEQUENCE_RING, ("chunk",), SIZE_STATS, DTYPE_FP32),
    # tensor parallelism (docs/ir.md, "Adding a family"): one rank's partial sum of a layer's output
    # (forward) or of its input's gradient (backward), one layer boundary's tensor of one microbatch
    ValueKind("partial_sum", "partial sum", TENSOR_PARALLEL, ("layer", "mb"), SIZE_BOUNDARY, DTYPE_FP32),
)}


class Value(NamedTuple):
    """One tensor of a program: its kind and its index (for ``act``: producer stage, microbatch)."""

    kind: str
    index: tuple[int, ...]


# ---------------------------------------------------------------------- rules

# Categories: how an instruction takes part in a program.
COMPUTE = "compute"          # a task of the family's dataflow
SEND = "send"                # point-to-point, this rank to ``peer``
RECV = "recv"                # point-to-point, ``peer`` to this rank
BATCH_OF = "batch"           # several sends/receives posted and waited together
FREE = "free"                # drops a stored value
COLLECTIVE = "collective"    # starts a meeting of every member of a communicator
COLLECTIVE_WAIT = "collective wait"  # waits for this rank's collective to end
# Weight passing moves weights at step boundaries: an EXCHANGE posts its parts
# (sends, receives and collectives, in list order) and goes on; an
# EXCHANGE_WAIT waits for every part of one exchange to complete.
EXCHANGE_OF = "exchange"
EXCHANGE_WAIT_OF = "exchange wait"
PART_SEND = "exchange send"              # point-to-point inside an exchange, this rank to ``peer``
PART_RECV = "exchange receive"           # point-to-point inside an exchange, ``peer`` to this rank
PART_COLLECTIVE = "exchange collective"  # a meeting of a communicator's members inside an exchange
PART_LOCAL = "exchange local"            # a copy on this rank, done when posted
DROP_COPY = "drop copy"                  # drops a borrowed copy of a layer's weights
CATEGORIES = (COMPUTE, SEND, RECV, BATCH_OF, FREE, COLLECTIVE, COLLECTIVE_WAIT,
              EXCHANGE_OF, EXCHANGE_WAIT_OF, PART_SEND, PART_RECV, PART_COLLECTIVE, PART_LOCAL, DROP_COPY)
# The instruction categories of weight passing: the passes written for
# activation passing leave them to ``checks.weights`` and the simulator's handlers.
WEIGHT_CATEGORIES = (EXCHANGE_OF, EXCHANGE_WAIT_OF, PART_SEND, PART_RECV, PART_COLLECTIVE, PART_LOCAL, DROP_COPY)
EXCHANGE_PART_CATEGORIES = (PART_SEND, PART_RECV, PART_COLLECTIVE, PART_LOCAL)

# Where a value sits relative to an instruction's stage (its pipeline neighbours).
SELF, PREV, NEXT = "self", "prev", "next"

# Where an instruction runs.
ON_STAGE_HOME = "the home rank of its stage"
ON_ANY = "any rank"  # a batch: its parts say

# How torch.distributed.pipelining's CSV writes an op: as a token, not at all,
# or (a batch) as its parts.
KEEP, DROP, EXPAND = "keep", "drop", "expand"


class Use(NamedTuple):
    """A value an instruction touches: its kind, and whose (relative to the instruction's stage)."""

    kind: str
    where: str = SELF


class OpRule(NamedTuple):
    """What one op does.

    Attributes:
        op: the op name, as in the text form (``F``, ``SEND_F``).
        category: one of ``CATEGORIES``.
        family: the workload family (``FAMILIES``), or ``SHARED`` for an op of every family.
        reads: values it reads. For a compute, the dataflow: each read value is
            made by a compute that writes it (its producer).
        writes: values it makes.
        ends: value kinds (at its own stage) whose life ends here, for memory
            counts: the last reader of a stored value.
        carries: for a send or receive, the value it moves; a receive names its
            consumer stage (torch's convention), so its value is a neighbour's.
        runs_on: where it runs.
        fields: the Action fields it uses besides ``op`` (the JSON program's keys).
        torch: (compute-only CSV, CSV with communication): KEEP, DROP or EXPAND.
        torch_token: the token torch's CSV writes a kept op as, when it is not
            the op's own name (FC: torch's ``F``, which has no checkpointed forward).
        trace: its category in a run's trace (``compute``, ``comm``, ``memory``).
        communicator: for a collective, which communicator it meets on.
        unit_cost: for a compute, its time under unit costs (the simulator's
            default cost model: F = 1, B = 2, I = W = 1).
        priced_like: for a compute, the op whose time (on the same chunk) a
            cost file that does not price it gives it ("" for none): a
            recompute does a forward's work again (R: F), a checkpointed
            forward a forward's (FC: F).
        optional: for a compute, whether it may be left out (at most once per
            (stage, microbatch)) rather than being part of the family's task sets.
        updates: for a compute, whether it is an optimizer update of its
            stage's weights: it applies every weight gradient the stage's
            backwards made since its previous update, and starts a new weight
            version (``compiler/versions.py``); a program with one runs no
            optimizer step at the end of the list.
        doc: one line for people.
    """

    op: str
    category: str
    family: str
    reads: tuple[Use, ...] = ()
    writes: tuple[Use, ...] = ()
    ends: tuple[str, ...] = ()
    carries: Use | None = None
    runs_on: str = ON_STAGE_HOME
    fields: tuple[str, ...] = ("stage", "mb")
    torch: tuple[str, str] = (DROP, DROP)
    torch_token: str = ""
    trace: str = "comm"
    communicator: str | None = None
    unit_cost: int | None = None
    priced_like: str = ""
    optional: bool = False
    updates: bool = False
    doc: str = ""


# The communicator of the replica all-reduce: the ranks holding a replica of
# the instruction's stage's model chunk (BitPipe, Chimera).
REPLICAS_OF_CHUNK = "replicas of the stage's chunk"
# Weight passing's communicators: every rank, in ring order (SHIFT); the ranks
# of the acting rank's group (node); every rank (FSDP's gather and scatter).
RING = "the ring of every rank"
GROUP_OF_RANK = "the acting rank's group"
WORLD = "every rank"
# A sub-step's communicator: the group its stage is placed on (``ir.Placement``); under HSDP (a placement
# with ``shard_groups``), the acting member's shard group, the part of the group its weights are sharded over.
STAGE_GROUP = "the group the stage is placed on"
# HSDP's second communicator: the acting member's replica group, the members of the stage's group that
# hold the same shard (one per shard group; ``ir.Placement.replica_groups``).
SHARD_REPLICAS = "the replicas of a member's shard"

# Op names (the text form's tokens, torch's where torch has them).
F, B, I, W = "F", "B", "I", "W"
FC, R = "FC", "R"
U = "U"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
BATCH = "BATCH"
FREE_F = "FREE_F"
ALLREDUCE_GRAD, ALLREDUCE_WAIT = "ALLREDUCE_GRAD", "ALLREDUCE_WAIT"
EXCHANGE, EXCHANGE_WAIT = "EXCHANGE", "EXCHANGE_WAIT"
SEND_W, RECV_W, SEND_G, RECV_G = "SEND_W", "RECV_W", "SEND_G", "RECV_G"
SHIFT_F, SHIFT_B, SHIFT_G = "SHIFT_F", "SHIFT_B", "SHIFT_G"
FILL_F, FILL_B = "FILL_F", "FILL_B"
FREE_W = "FREE_W"
BCAST_W, ALLGATHER_W, REDUCE_G, REDUCESCATTER_G = "BCAST_W", "ALLGATHER_W", "REDUCE_G", "REDUCESCATTER_G"
AF, AB = "AF", "AB"
SEND_KV, RECV_KV, SEND_DKV, RECV_DKV = "SEND_KV", "RECV_KV", "SEND_DKV", "RECV_DKV"
ALLTOALL_KV, ALLTOALL_DKV = "ALLTOALL_KV", "ALLTOALL_DKV"
GATHER = "GATHER"
RESHARD, SYNC_GRAD, REDUCE_GRAD = "RESHARD", "SYNC_GRAD", "REDUCE_GRAD"
SYNC_SHARD = "SYNC_SHARD"
TF, TB, ALLREDUCE_TF, ALLREDUCE_TB = "TF", "TB", "ALLREDUCE_TF", "ALLREDUCE_TB"

_AP = ACTIVATION_PASSING
_WP = WEIGHT_PASSING
_SR = SEQUENCE_RING
_TP = TENSOR_PARALLEL
_COMPUTE_CSV = (KEEP, KEEP)
_COMM_CSV = (DROP, KEEP)
_PEER_FIELDS = ("stage", "mb", "peer")

RULES: dict[str, OpRule] = {rule.op: rule for rule in (
    # -- activation passing: compute. F(s, m) reads the activation prev(s) made
    # and makes its own, keeping what its backward needs; B reads that and the
    # gradient next(s) made; I is B's input-gradient half, W its weight half.
    OpRule(F, COMPUTE, _AP, reads=(Use("act", PREV), Use("weight")), writes=(Use("act"), Use("saved")),
           torch=_COMPUTE_CSV, trace="compute", unit_cost=1, doc="forward of (stage, mb)"),
    OpRule(B, COMPUTE, _AP, reads=(Use("saved"), Use("grad", NEXT), Use("weight")), writes=(Use("grad"), Use("wgrad")),
           ends=("saved",), torch=_COMPUTE_CSV, trace="compute", unit_cost=2, doc="backward of (stage, mb)"),
    OpRule(I, COMPUTE, _AP, reads=(Use("saved"), Use("grad", NEXT), Use("weight")), writes=(Use("grad"), Use("wstash")),
           ends=("saved",), torch=_COMPUTE_CSV, trace="compute", unit_cost=1,
           doc="backward for the input gradient; leaves what W needs"),
    OpRule(W, COMPUTE, _AP, reads=(Use("wstash"), Use("weight")), writes=(Use("wgrad"),), ends=("wstash",),
           torch=_COMPUTE_CSV, trace="compute", unit_cost=1, doc="backward for the weight gradient"),
    # -- activation checkpointing (``recompute stage s``): FC reads what F
    # reads and hands on the same activation, but keeps only its input; R
    # runs the forward again from that input, just before the backward, and
    # makes what F would have saved. torch's CSV has no checkpointed forward:
    # FC is written as its F, and R not at all.
    OpRule(FC, COMPUTE, _AP, reads=(Use("act", PREV), Use("weight")), writes=(Use("act"), Use("kept")),
           torch=_COMPUTE_CSV, torch_token=F, trace="compute", unit_cost=1, priced_like=F,
           doc="forward of (stage, mb) that keeps only its input (a recomputed stage)"),
    OpRule(R, COMPUTE, _AP, reads=(Use("kept"), Use("weight")), writes=(Use("saved"),), ends=("kept",),
           trace="compute", unit_cost=1, priced_like=F,
           doc="recompute the forward of (stage, mb) from its kept input: what F would have saved"),
    # -- asynchronous training (PipeDream): U(s, m) steps stage s's optimizer
    # after the backward of microbatch m, applying every weight gradient the
    # stage made since its previous update; the forwards after it run on the
    # new weight version, the backwards of microbatches already in flight on
    # the version their forward used (``stash weights``). It reads the weight
    # gradient the backward of (s, m) made, so it runs after it; torch's CSV
    # has no update action.
    OpRule(U, COMPUTE, _AP, reads=(Use("wgrad"),), trace="compute", unit_cost=0, optional=True, updates=True,
           doc="optimizer update of the stage's weights after the backward of (stage, mb)"),
    # -- point to point. On a send the stage is the producer's, on a receive the consumer's.
    OpRule(SEND_F, SEND, _AP, carries=Use("act"), fields=_PEER_FIELDS, torch=_COMM_CSV,
           doc="send the activation forward"),
    OpRule(RECV_F, RECV, _AP, carries=Use("act", PREV), fields=_PEER_FIELDS, torch=_COMM_CSV,
           doc="receive the previous stage's activation"),
    OpRule(SEND_B, SEND, _AP, carries=Use("grad"), fields=_PEER_FIELDS, torch=_COMM_CSV,
           doc="send the gradient backward"),
    OpRule(RECV_B, RECV, _AP, carries=Use("grad", NEXT), fields=_PEER_FIELDS, torch=_COMM_CSV,
           doc="receive the next stage's gradient"),
    OpRule(BATCH, BATCH_OF, _AP, runs_on=ON_ANY, fields=("parts",), torch=(DROP, EXPAND),
           doc="sends and receives posted together (batch_isend_irecv)"),
    # -- memory: drops what F saved (and I left for W) once the backward is done.
    OpRule(FREE_F, FREE, _AP, reads=(Use("saved"),), ends=("saved", "wstash"), trace="memory",
           doc="drop the saved activation of (stage, mb)"),
    # -- collectives: the replica all-reduce of a chunk's weight gradient.
    OpRule(ALLREDUCE_GRAD, COLLECTIVE, _AP, reads=(Use("wgrad"),), writes=(Use("wgrad"),), fields=("stage",),
           communicator=REPLICAS_OF_CHUNK, doc="start the all-reduce of the chunk's weight gradient"),
    OpRule(ALLREDUCE_WAIT, COLLECTIVE_WAIT, _AP, fields=("stage",), communicator=REPLICAS_OF_CHUNK,
           doc="wait for this rank's all-reduce of the chunk"),
    # -- every family's exchanges. An EXCHANGE posts its parts and goes on; an
    # EXCHANGE_WAIT waits for them. ``mb`` of both is the exchange's number
    # (weight passing: 2 * boundary + lane, the same on every rank).
    OpRule(EXCHANGE, EXCHANGE_OF, SHARED, runs_on=ON_ANY, fields=("mb", "parts"),
           doc="post the parts of one exchange (sends, receives, collectives) in list order"),
    OpRule(EXCHANGE_WAIT, EXCHANGE_WAIT_OF, SHARED, runs_on=ON_ANY, fields=("mb",),
           doc="wait until every part of this rank's exchange ``mb`` has completed"),
    # -- weight passing (docs/weights.md): the parts of its exchanges at step
    # boundaries. A part names its layer by the acting rank's own stage of it
    # (``stage``) and, in ``mb``, the step whose weights it brings (or whose
    # gradients it takes away).
    OpRule(SEND_W, PART_SEND, _WP, carries=Use("weight"), fields=_PEER_FIELDS,
           doc="send a copy of the layer's weights (the owner's master, or a copy held)"),
    OpRule(RECV_W, PART_RECV, _WP, carries=Use("weight"), fields=_PEER_FIELDS,
           doc="receive a copy of the layer's weights into a borrowed buffer"),
    OpRule(SEND_G, PART_SEND, _WP, carries=Use("wgrad_partial"), fields=_PEER_FIELDS,
           doc="send this rank's partial of the layer's weight gradient (it leaves this rank)"),
    OpRule(RECV_G, PART_RECV, _WP, carries=Use("wgrad_partial"), fields=_PEER_FIELDS,
           doc="receive a partial of the layer's weight gradient and add it to this rank's"),
    # A ring step of one slot, on every rank: each passes its slot of step
    # mb - 1 to rank r + ring_by and takes rank r - ring_by's as its slot of
    # step mb. ``stage`` is the acting rank's stage of the layer it takes, or
    # -1 when the slot it takes carries nothing still needed.
    OpRule(SHIFT_F, PART_COLLECTIVE, _WP, reads=(Use("weight"),), writes=(Use("weight"),), fields=("mb",),
           communicator=RING, doc="ring step of the forward weight slot"),
    OpRule(SHIFT_B, PART_COLLECTIVE, _WP, reads=(Use("weight"),), writes=(Use("weight"),), fields=("mb",),
           communicator=RING, doc="ring step of the backward weight slot"),
    OpRule(SHIFT_G, PART_COLLECTIVE, _WP, reads=(Use("wgrad_partial"),), writes=(Use("wgrad_partial"),),
           fields=("mb",), communicator=RING,
           doc="ring step of the gradient partial that rides the backward slot"),
    # A ring slot's first copy, made on its rank: from the owner's master, or
    # from the rank's other slot holding the layer (WeiPipe's backward slot
    # starts from the last forward's).
    OpRule(FILL_F, PART_LOCAL, _WP, writes=(Use("weight"),), fields=("stage", "mb"),
           doc="put a copy of the layer into this rank's forward slot of step mb"),
    OpRule(FILL_B, PART_LOCAL, _WP, writes=(Use("weight"),), fields=("stage", "mb"),
           doc="put a copy of the layer into this rank's backward slot of step mb"),
    # A copy delivered by RECV_W, BCAST_W or ALLGATHER_W for step mb, dropped
    # after its last use (ring slots are dropped by the shift that passes them on).
    OpRule(FREE_W, DROP_COPY, _WP, reads=(Use("weight"),), ends=("weight",), fields=("stage", "mb"), trace="memory",
           doc="drop this rank's copy of the layer delivered for step mb"),
    OpRule(BCAST_W, PART_COLLECTIVE, _WP, reads=(Use("weight"),), writes=(Use("weight"),), fields=_PEER_FIELDS,
           communicator=GROUP_OF_RANK, doc="broadcast the layer's weights inside the group from rank ``peer``"),
    OpRule(REDUCE_G, PART_COLLECTIVE, _WP, reads=(Use("wgrad_partial"),), writes=(Use("wgrad_partial"),),
           fields=_PEER_FIELDS, communicator=GROUP_OF_RANK,
           doc="sum the group's partials of the layer's weight gradient at rank ``peer``"),
    OpRule(ALLGATHER_W, PART_COLLECTIVE, _WP, reads=(Use("weight"),), writes=(Use("weight"),), fields=("stage", "mb"),
           communicator=WORLD, doc="gather the layer's weights from every rank's shard"),
    OpRule(REDUCESCATTER_G, PART_COLLECTIVE, _WP, reads=(Use("wgrad_partial"),), writes=(Use("wgrad_partial"),),
           fields=("stage", "mb"), communicator=WORLD,
           doc="sum every rank's partial of the layer's weight gradient, each rank keeping its shard"),
    # -- sequence rings (docs/rings.md). A block is a query chunk (``stage``)
    # against one KV piece: ``mb`` = kv chunk * pieces + piece. AF folds the
    # block's (out, lse) into its query chunk's running result; AB reads the
    # chunk's global (out, lse), adds the block's dQ to the chunk's and its
    # dK, dV to the rank's partial of the KV bundle (holder, piece).
    OpRule(AF, COMPUTE, _SR, reads=(Use("kv"),), writes=(Use("stats"),), torch=_COMPUTE_CSV, trace="compute",
           unit_cost=1, doc="attention forward of a query chunk against a KV piece (one block)"),
    OpRule(AB, COMPUTE, _SR, reads=(Use("stats"), Use("kv")), writes=(Use("dkv"),), torch=_COMPUTE_CSV,
           trace="compute", unit_cost=2, doc="attention backward of one block: dQ kept, dK and dV into the partial"),
    # A KV bundle (holder s, piece p) is piece p of every chunk rank s holds;
    # a part names it by ``stage`` = s and ``mb`` = p. Point-to-point parts of
    # one exchange are posted as one batch (batch_isend_irecv); an ALLTOALL
    # part carries its sends and receives as its own ``parts``, moved by one
    # all_to_all of every rank.
    OpRule(SEND_KV, PART_SEND, _SR, carries=Use("kv"), fields=_PEER_FIELDS,
           doc="send this rank's copy of a KV bundle along its ring"),
    OpRule(RECV_KV, PART_RECV, _SR, carries=Use("kv"), fields=_PEER_FIELDS,
           doc="receive a KV bundle (usable once its exchange is waited)"),
    OpRule(SEND_DKV, PART_SEND, _SR, carries=Use("dkv"), fields=_PEER_FIELDS,
           doc="send this rank's dK, dV partial of a bundle on (it leaves this rank)"),
    OpRule(RECV_DKV, PART_RECV, _SR, carries=Use("dkv"), fields=_PEER_FIELDS,
           doc="receive a dK, dV partial of a bundle and add it to this rank's (at the wait)"),
    OpRule(ALLTOALL_KV, PART_COLLECTIVE, _SR, reads=(Use("kv"),), writes=(Use("kv"),), fields=("mb", "parts"),
           communicator=WORLD, doc="one all_to_all of every rank moving the KV sends and receives it holds"),
    OpRule(ALLTOALL_DKV, PART_COLLECTIVE, _SR, reads=(Use("dkv"),), writes=(Use("dkv"),), fields=("mb", "parts"),
           communicator=WORLD, doc="one all_to_all of every rank moving the dK, dV partials it holds"),
    # -- placements on rank groups (docs/ir.md). A compute of a stage placed on
    # a group may hold sub-steps, its ``parts``: exchange parts that run inside
    # it, in order, on the group's communicator. GATHER(s, m) gathers stage
    # s's weights from its members' shards for the compute of (s, m) it sits in.
    OpRule(GATHER, PART_COLLECTIVE, _AP, reads=(Use("shard"),), writes=(Use("weight"),), fields=("stage", "mb"),
           communicator=STAGE_GROUP, doc="all-gather the stage's weights from its group's shards (a sub-step)"),
    # -- compositions on a mesh (docs/compose.md). A stage on a group whose weights are sharded
    # (``Placement.sharded``) holds them whole from a GATHER to the RESHARD after it; its weight
    # gradient is reduce-scattered over the group (REDUCE_GRAD, torch's token), each member keeping
    # its shard's sum; a replicated stage's gradient is all-reduced (SYNC_GRAD). Both are exchange
    # parts, posted by an EXCHANGE after the stage's last backward and waited before the optimizer.
    OpRule(RESHARD, DROP_COPY, _AP, reads=(Use("weight"),), ends=("weight",), fields=("stage",), trace="memory",
           doc="drop the stage's whole weights a GATHER made, keeping this member's shard"),
    OpRule(SYNC_GRAD, PART_COLLECTIVE, _AP, reads=(Use("wgrad"),), writes=(Use("wgrad"),), fields=("stage",),
           communicator=STAGE_GROUP, doc="all-reduce the stage's weight gradient over its group (data parallel)"),
    OpRule(REDUCE_GRAD, PART_COLLECTIVE, _AP, reads=(Use("wgrad"),), writes=(Use("shard"),), fields=("stage",),
           communicator=STAGE_GROUP,
           doc="reduce-scatter the stage's weight gradient over its group, each member keeping its shard's sum"),
    # HSDP (weights sharded over a shard group, replicated across shard groups): after its REDUCE_GRAD
    # was waited, a member all-reduces its shard's gradient with the members holding the same shard,
    # in an exchange of its own (torch's HSDP order: reduce-scatter, then all-reduce of the shard).
    OpRule(SYNC_SHARD, PART_COLLECTIVE, _AP, reads=(Use("shard"),), writes=(Use("shard"),), fields=("stage",),
           communicator=SHARD_REPLICAS,
           doc="all-reduce this member's shard of the stage's weight gradient over the members holding that shard"),
    # -- tensor parallelism (Megatron-LM's MLP; docs/ir.md, "Adding a family"). Every rank holds a
    # column slice of each layer's first matrix and a row slice of its second: TF(l, m) makes this
    # rank's partial sum of layer l's output for microbatch m, TB(l, m) its partial of the input's
    # gradient (and its slices' weight gradients); the all-reduce after each, on every rank, sums
    # the partials into the whole tensor the next task reads.
    OpRule(TF, COMPUTE, _TP, writes=(Use("partial_sum"),), trace="compute", unit_cost=1,
           doc="forward of this rank's slices of layer ``stage`` for microbatch ``mb``: a partial sum"),
    OpRule(TB, COMPUTE, _TP, writes=(Use("partial_sum"),), trace="compute", unit_cost=2,
           doc="backward of this rank's slices of layer ``stage`` for ``mb``: a partial input gradient"),
    OpRule(ALLREDUCE_TF, PART_COLLECTIVE, _TP, reads=(Use("partial_sum"),), writes=(Use("partial_sum"),),
           fields=("stage", "mb"), communicator=WORLD,
           doc="sum every rank's partial output of layer ``stage`` for ``mb`` (the row-parallel all-reduce)"),
    OpRule(ALLREDUCE_TB, PART_COLLECTIVE, _TP, reads=(Use("partial_sum"),), writes=(Use("partial_sum"),),
           fields=("stage", "mb"), communicator=WORLD,
           doc="sum every rank's partial input gradient of layer ``stage`` for ``mb`` (the column-parallel one)"),
)}

OPS: tuple[str, ...] = tuple(RULES)

class TaskSet(NamedTuple):
    """What "every task of the family appears exactly once" means, for one part of the work.

    For each (stage, microbatch riding it), exactly one of ``alternatives``
    appears, each of its ops once; an empty alternative makes the set
    optional (its ops may appear, at most once each).

    Attributes:
        name: for messages ("backward").
        alternatives: the ways of doing it, each a tuple of ops.
        modes: the language's name for each alternative (``backward full`` /
            ``backward split``); empty when a program does not choose.
        per_stage: the alternative is chosen per stage (``recompute stage s``:
            the second alternative on the stages it names, the first on the
            others) rather than for the whole program. Its later alternatives
            do more than the first (a recompute runs the forward twice), where
            a program-wide choice splits the first's work between its ops.
    """

    name: str
    alternatives: tuple[tuple[str, ...], ...]
    modes: tuple[str, ...] = ()
    per_stage: bool = False


# A forward that is F, or on a recomputed stage FC then R; a backward that is
# B (``backward full``) or split into I and W (``backward split``); then each
# optional compute of the family on its own.
FAMILY_TASKS: dict[str, tuple[TaskSet, ...]] = {
    ACTIVATION_PASSING: (TaskSet("forward", ((F,), (FC, R)), per_stage=True),
                         TaskSet("backward", ((B,), (I, W)), ("full", "split")))
    + tuple(TaskSet(op, ((), (op,))) for op, rule in RULES.items()
            if rule.category == COMPUTE and rule.optional and rule.family == ACTIVATION_PASSING),
}


# ----------------------------------------------------------- derived encodings
#
# Everything below is computed from RULES and VALUE_KINDS; passes import these
# instead of spelling the rules again.

def ops_of(*categories: str) -> tuple[str, ...]:
    """The ops of the given categories, in table order."""
    return tuple(op for op, rule in RULES.items() if rule.category in categories)


COMPUTE_OPS = ops_of(COMPUTE)
SEND_OPS = ops_of(SEND)
RECV_OPS = ops_of(RECV)
COMM_OPS = ops_of(SEND, RECV)          # what a BATCH may hold
POSTING_OPS = ops_of(SEND, RECV, BATCH_OF)
COLLECTIVE_OPS = ops_of(COLLECTIVE)
COLLECTIVE_WAIT_OPS = ops_of(COLLECTIVE_WAIT)
FREE_OPS = ops_of(FREE)
# Weight passing: exchanges, their waits, and what an exchange may hold.
EXCHANGE_OPS = ops_of(EXCHANGE_OF)
EXCHANGE_WAIT_OPS = ops_of(EXCHANGE_WAIT_OF)
EXCHANGE_PART_OPS = ops_of(*EXCHANGE_PART_CATEGORIES)
WEIGHT_OPS = ops_of(*WEIGHT_CATEGORIES)
DROP_COPY_OPS = ops_of(DROP_COPY)
# Sequence rings: the attention blocks, and the parts that move KV and dKV.
RING_COMPUTE_OPS: tuple[str, ...] = tuple(op for op in COMPUTE_OPS if RULES[op].family == SEQUENCE_RING)
RING_PART_OPS: tuple[str, ...] = tuple(op for op in EXCHANGE_PART_OPS if RULES[op].family == SEQUENCE_RING)
# The computes whose dataflow their family's semantics prove in the one symbolic run (a ring's attention
# blocks, tensor parallelism's slices), not the stage-to-stage rules of ``DEPENDENCIES``: their inputs are
# on the rank once the exchanges before them in its list were waited, so the simulator runs them in order.
IN_ORDER_COMPUTE_OPS: tuple[str, ...] = tuple(op for op in COMPUTE_OPS if RULES[op].family != ACTIVATION_PASSING)
# The compute ops that run on a layer's weights (a borrowed copy under weight
# passing), each with the pass whose copy it reads: the ops that make the
# activation run forward, the others backward (a ring keeps one slot per pass).
FORWARD, BACKWARD = "forward", "backward"
# The forwards: the computes that make a stage's activation (F, and FC on a recomputed stage).
FORWARD_COMPUTE_OPS: tuple[str, ...] = tuple(op for op in COMPUTE_OPS if Use("act") in RULES[op].writes)
WEIGHT_PASS: dict[str, str] = {
    op: FORWARD if op in FORWARD_COMPUTE_OPS else BACKWARD
    for op in COMPUTE_OPS if Use("weight") in RULES[op].reads}
# The compute ops whose weight gradient is a contribution to the layer's
# gradient (B, W): weight passing folds each into a partial bound for the owner.
GRADIENT_CONTRIBUTORS: tuple[str, ...] = tuple(op for op in COMPUTE_OPS if Use("wgrad") in RULES[op].writes)
# A ring's collective per slot: the forward and backward weight slots and the
# gradient partial that rides the backward slot.
SHIFT_OF_PASS: dict[str, str] = {FORWARD: SHIFT_F, BACKWARD: SHIFT_B}
FILL_OF_PASS: dict[str, str] = {FORWARD: FILL_F, BACKWARD: FILL_B}
PASS_OF_SLOT_OP: dict[str, str] = {op: p for table in (SHIFT_OF_PASS, FILL_OF_PASS) for p, op in table.items()}

# A whole compute op -> the ops that do its work between them (B -> (I, W)):
# cost files default a split op to its whole's share, and measured costs
# rebuild a whole from its parts. A per-stage alternative is no split: FC and
# R each do a forward's work.
SPLITS: dict[str, tuple[str, ...]] = {
    whole[0]: parts
    for task_set in FAMILY_TASKS[ACTIVATION_PASSING] if not task_set.per_stage
    for whole in task_set.alternatives if len(whole) == 1
    for parts in task_set.alternatives if len(parts) > 1
}

# Activation checkpointing, from the per-stage task set: the plain forward ->
# (the forward that keeps only its input, the recompute that remakes from that
# input what the plain forward saves) (F -> (FC, R)). A schedule writes the
# plain forward; on a recomputed stage it becomes the first, and the second
# runs before the first task that reads what it remakes (``RECOMPUTE_BEFORE``).
CHECKPOINTS: dict[str, tuple[str, str]] = {
    plain[0]: checkpointed
    for task_set in FAMILY_TASKS[ACTIVATION_PASSING] if task_set.per_stage
    for plain in task_set.alternatives[:1]
    for checkpointed in task_set.alternatives[1:]
}

# The optimizer updates (PipeDream's asynchronous training): U.
UPDATE_OPS: tuple[str, ...] = tuple(op for op in COMPUTE_OPS if RULES[op].updates)

# The simulator's unit costs (compute op -> time).
UNIT_COSTS: dict[str, int] = {op: RULES[op].unit_cost for op in COMPUTE_OPS}

# Task codes of compute ops: the low bits of the checks' integer task keys.
TASK_CODE: dict[str, int] = {op: code for code, op in enumerate(COMPUTE_OPS)}
OP_OF_CODE: tuple[str, ...] = COMPUTE_OPS
NUM_TASK_CODES = len(COMPUTE_OPS)


def producers(kind: str) -> tuple[str, ...]:
    """The compute ops that make values of ``kind`` at their own stage, in table order."""
    return tuple(op for op in COMPUTE_OPS if Use(kind) in RULES[op].writes)


class Dependency(NamedTuple):
    """A compute's input: the value, whose it is, and the compute ops that make it (the first present wins).

    A task that remakes a value (reads it and writes it again, as a
    recompute does) comes before the tasks that make it first, so a reader
    waits for the latest version; a task never depends on itself.
    """

    kind: str
    where: str
    made_by: tuple[str, ...]


def _dependencies(op: str) -> tuple[Dependency, ...]:
    out = []
    for use in RULES[op].reads:
        makers = [maker for maker in producers(use.kind) if maker != op or use.where != SELF]
        remakers = [maker for maker in makers if Use(use.kind) in RULES[maker].reads]
        if makers:
            out.append(Dependency(use.kind, use.where, tuple(remakers + [m for m in makers if m not in remakers])))
    return tuple(out)


# compute op -> its dataflow inputs, in rule order
DEPENDENCIES: dict[str, tuple[Dependency, ...]] = {op: _dependencies(op) for op in COMPUTE_OPS}

# Placements: the exchange parts that meet on the group a stage is placed on (``STAGE_GROUP``), in two
# kinds told apart by their dataflow. A *sub-step* reads only what no compute makes (the members' shards)
# and makes what its compute reads (GATHER: the whole weights), so it runs inside that compute, its
# ``parts``. A *group exchange part* reads what the stage's computes made (SYNC_GRAD, REDUCE_GRAD: the weight
# gradient), so it stands after them, in an EXCHANGE posted after the stage's last gradient contribution
# and waited before the list ends. Both meet on the one communicator of the group, counted together.
_STAGE_GROUP_PARTS = tuple(op for op in EXCHANGE_PART_OPS if RULES[op].communicator == STAGE_GROUP)
SUBSTEP_OPS: tuple[str, ...] = tuple(op for op in _STAGE_GROUP_PARTS
                                     if not any(producers(use.kind) for use in RULES[op].reads))
STAGE_EXCHANGE_OPS: tuple[str, ...] = tuple(op for op in _STAGE_GROUP_PARTS if op not in SUBSTEP_OPS)
# A sharded stage (``ir.Placement.sharded``): the sub-steps that make its weights whole from the shards
# (GATHER), the activation family's drops of that whole copy (RESHARD), and its gradient reductions that
# leave each member its shard's sum (REDUCE_GRAD); the other group exchange parts reduce a replicated
# stage's whole gradient (SYNC_GRAD).
GATHER_OPS: tuple[str, ...] = tuple(op for op in SUBSTEP_OPS
                                    if Use("shard") in RULES[op].reads and Use("weight") in RULES[op].writes)
RESHARD_OPS: tuple[str, ...] = tuple(op for op in DROP_COPY_OPS if RULES[op].family == ACTIVATION_PASSING
                                     and "weight" in RULES[op].ends)
SHARDED_REDUCTION_OPS: tuple[str, ...] = tuple(op for op in STAGE_EXCHANGE_OPS if Use("shard") in RULES[op].writes)
REPLICATED_REDUCTION_OPS: tuple[str, ...] = tuple(op for op in STAGE_EXCHANGE_OPS
                                                  if op not in SHARDED_REDUCTION_OPS)
# HSDP: the exchange parts that reduce a member's shard (what a sharded reduction wrote) over the members
# holding the same shard (SYNC_SHARD); each stands in an exchange posted after the sharded reduction's wait.
SHARD_REPLICA_OPS: tuple[str, ...] = tuple(op for op in EXCHANGE_PART_OPS if RULES[op].communicator == SHARD_REPLICAS)


def consumers(kind: str, where: str) -> tuple[str, ...]:
    """The compute ops that read ``kind`` made by the stage at ``where`` from them, in table order."""
    return tuple(op for op in COMPUTE_OPS if Use(kind, where) in RULES[op].reads)


# recompute op -> the ops that read, at their own stage, what it remakes (R ->
# B, I): the compiler runs a recompute right before the first of them.
RECOMPUTE_BEFORE: dict[str, tuple[str, ...]] = {
    remaking: tuple(dict.fromkeys(reader for use in RULES[remaking].writes if use.where == SELF
                                  for reader in consumers(use.kind, SELF)))
    for _keeping, remaking in CHECKPOINTS.values()
}


# The two directions a message travels between stages, derived from the
# compute rules: a value made at SELF and read at a neighbour. Each entry:
# (value kind, the neighbour that reads it, relative to the producer).
_OPPOSITE = {PREV: NEXT, NEXT: PREV}
HANDOFFS: tuple[tuple[str, str], ...] = tuple(dict.fromkeys(
    (use.kind, _OPPOSITE[use.where])
    for op in COMPUTE_OPS for use in RULES[op].reads
    if use.where in _OPPOSITE and producers(use.kind)))

# Message kinds: the values that cross stages, numbered (act 0, grad 1).
MESSAGE_KINDS: tuple[str, ...] = tuple(kind for kind, _ in HANDOFFS)
MESSAGE_KIND_CODE: dict[str, int] = {kind: code for code, kind in enumerate(MESSAGE_KINDS)}
# message kind -> the neighbour (relative to its producer) that reads it
READER_OF: dict[str, str] = dict(HANDOFFS)
# message kind -> the compute ops that read it at that neighbour, in table
# order (a gradient: B, or I when the backward is split)
MESSAGE_READERS: dict[str, tuple[str, ...]] = {
    kind: consumers(kind, _OPPOSITE[direction]) for kind, direction in HANDOFFS}


class PartRule(NamedTuple):
    """A send or receive as the integer passes use it."""

    is_send: bool
    kind: str       # the value kind it carries
    where: str      # whose value, relative to the action's stage
    code: int       # MESSAGE_KIND_CODE[kind]


PART_RULES: dict[str, PartRule] = {
    op: PartRule(RULES[op].category == SEND, RULES[op].carries.kind, RULES[op].carries.where,
                 MESSAGE_KIND_CODE[RULES[op].carries.kind])
    for op in COMM_OPS
}
# message kind -> (its send op, its receive op)
COMM_OP_OF_KIND: dict[str, tuple[str, str]] = {
    kind: (next(op for op in SEND_OPS if PART_RULES[op].kind == kind),
           next(op for op in RECV_OPS if PART_RULES[op].kind == kind))
    for kind in MESSAGE_KINDS
}


def _count_deltas(kinds: set[str]) -> dict[str, int]:
    """op -> change of the number of live values of ``kinds`` (+1 made at its stage, -1 ended).

    Only computes count: a FREE drops storage, it does not end a value's use.
    """
    deltas = {}
    for op in COMPUTE_OPS:
        rule = RULES[op]
        delta = sum(1 for use in rule.writes if use.where == SELF and use.kind in kinds) \
            - sum(1 for kind in rule.ends if kind in kinds)
        if delta:
            deltas[op] = delta
    return deltas


def memory_deltas(counter: str) -> dict[str, int]:
    """op -> change of the memory count ``counter`` (+1 where a counted value is made, -1 where it ends)."""
    return _count_deltas({name for name, kind in VALUE_KINDS.items() if kind.counter == counter})


def size_class_deltas(size_class: str) -> dict[str, int]:
    """op -> change of the number of live counted values (kinds with a counter) of ``size_class``."""
    return _count_deltas({name for name, kind in VALUE_KINDS.items()
                          if kind.counter is not None and kind.size_class == size_class})


def last_uses(free_op: str) -> tuple[str, ...]:
    """The compute ops after which ``free_op``'s storage is dead: they end a value it drops and make none."""
    dropped = set(RULES[free_op].ends)
    return tuple(op for op in COMPUTE_OPS
                 if dropped & set(RULES[op].ends) and not dropped & {use.kind for use in RULES[op].writes})


def stored_by(free_op: str) -> tuple[str, ...]:
    """The compute ops that make what ``free_op`` drops (the store it frees is theirs)."""
    dropped = set(RULES[free_op].ends)
    return tuple(op for op in COMPUTE_OPS if dropped & {use.kind for use in RULES[op].writes if use.where == SELF})


def describe(value: Value) -> str:
    """Words for a value: ``activation of 0F1``, ``gradient of 2B0`` (the producer's task when it has one)."""
    kind = VALUE_KINDS[value.kind]
    made_by = producers(value.kind)
    if made_by and kind.index == _STAGE_MB:
        stage, mb = value.index
        return f"{kind.words} of {stage}{made_by[0]}{mb}"
    return f"{kind.words} " + ", ".join(f"{name} {i}" for name, i in zip(kind.index, value.index))


# ------------------------------------------------------------ pass coverage

# An interpretation of the ops (the prover's semantics, a cost, an emitter, a
# runtime handler, a trace category, a drawing) declares the ops its per-op
# tables cover, and the categories it leaves alone by design, with why, where
# it declares itself. It never claims every op wholesale: an op added to the
# table is then missing from every interpretation until each is taught it.
# A family's lowering emits its own ops and interprets none, so it declares
# nothing; nor does a pass that reads only the rules' fields.
_PASS_RULES: dict[str, tuple[frozenset[str], frozenset[str]]] = {}


def declare_pass(name: str, handled: Iterable[str], *, leaves: Iterable[str] = ()) -> None:
    """Record which ops an interpretation has a rule for; ``tests/test_ops_table.py`` requires every op of ``OPS``.

    Args:
        name: the interpretation, for the test's message.
        handled: the ops it knows (its dispatch table's keys, or the ops its
            derived tables cover), never ``OPS`` itself.
        leaves: categories (``CATEGORIES``) whose ops it has nothing to do for
            (the trace draws no exchange wait apart; traffic counts a message at its send).
    Raises:
        ValueError: ``leaves`` names something that is not a category.
    """
    left = frozenset(leaves)
    if not left <= set(CATEGORIES):
        raise ValueError(f"{name} leaves unknown categories {sorted(left - set(CATEGORIES))}")
    _PASS_RULES[name] = (frozenset(handled), left)


def passes_missing_rules() -> dict[str, list[str]]:
    """interpretation -> the ops of ``OPS`` it has no rule for and does not leave (only those missing some)."""
    missing = {}
    for name, (handled, left) in sorted(_PASS_RULES.items()):
        lacking = [op for op in OPS if op not in handled and getattr(RULES.get(op), "category", None) not in left]
        if lacking:
            missing[name] = lacking
    return missing


def declared_passes() -> list[str]:
    return sorted(_PASS_RULES)


def _check_table() -> None:
    """The table's own consistency, checked once at import (a broken table is a programming error)."""
    for op, rule in RULES.items():
        assert rule.category in CATEGORIES, op
        assert rule.family in FAMILIES or (rule.family == SHARED
                                           and rule.category in (EXCHANGE_OF, EXCHANGE_WAIT_OF)), op
        for use in rule.reads + rule.writes + ((rule.carries,) if rule.carries else ()):
            assert use.kind in VALUE_KINDS and use.where in (SELF, PREV, NEXT), (op, use)
        assert all(kind in VALUE_KINDS for kind in rule.ends), op
        assert (rule.carries is not None) == (rule.category in (SEND, RECV, PART_SEND, PART_RECV)), op
        assert (rule.unit_cost is not None) == (rule.category == COMPUTE), op
        assert not rule.priced_like or RULES[rule.priced_like].category == COMPUTE == rule.category, op
        assert not rule.torch_token or rule.torch[0] == KEEP, op
        assert not rule.updates or (rule.category == COMPUTE and rule.optional), op
    for kind, direction in HANDOFFS:
        assert kind in COMM_OP_OF_KIND, kind


_check_table()
