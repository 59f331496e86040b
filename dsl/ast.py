"""The untyped AST of a ``.pipe`` file, every node with its source span.

Kept apart from what evaluation produces (``pipec.dsl.spec``): this is exactly
what the user wrote, nothing resolved, nothing computed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipec.errors import Span


@dataclass(frozen=True)
class Node:
    span: Span


# ---------------------------------------------------------------- expressions


@dataclass(frozen=True)
class IntLit(Node):
    value: int


@dataclass(frozen=True)
class BoolLit(Node):
    value: bool


@dataclass(frozen=True)
class Name(Node):
    id: str


@dataclass(frozen=True)
class Call(Node):
    func: str
    args: tuple["Expr", ...]


@dataclass(frozen=True)
class Negate(Node):
    operand: "Expr"


@dataclass(frozen=True)
class Binary(Node):
    """Arithmetic: + - * / % with floor semantics for / and %."""

    op: str
    left: "Expr"
    right: "Expr"


@dataclass(frozen=True)
class Compare(Node):
    op: str
    left: "Expr"
    right: "Expr"


@dataclass(frozen=True)
class Logic(Node):
    """``and`` / ``or``, short-circuit."""

    op: str
    left: "Expr"
    right: "Expr"


@dataclass(frozen=True)
class Not(Node):
    operand: "Expr"


@dataclass(frozen=True)
class Conditional(Node):
    cond: "Expr"
    then: "Expr"
    otherwise: "Expr"


@dataclass(frozen=True)
class Tuple(Node):
    """A lexicographic key; only a priority may be one."""

    items: tuple["Expr", ...]


Expr = IntLit | BoolLit | Name | Call | Negate | Binary | Compare | Logic | Not | Conditional | Tuple


# ---------------------------------------------------------------- statements


@dataclass(frozen=True)
class Let(Node):
    name: str
    name_span: Span
    value: Expr


@dataclass(frozen=True)
class FuncDef(Node):
    """``def name(a, b) = expr``: a named integer expression with parameters."""

    name: str
    name_span: Span
    params: tuple[str, ...]
    param_spans: tuple[Span, ...]
    body: Expr


@dataclass(frozen=True)
class Task(Node):
    """``F(stage, mb)``; the stage is the position along the microbatch's pipeline.

    In a sequence ring, ``AF(q, kv)`` / ``AF(q, kv, piece)``: ``stage`` is the
    query chunk, ``mb`` the KV chunk and ``piece`` the KV piece (None when
    not written: piece 0). Only a ring's tasks take a piece (the resolver says so).
    """

    kind: str
    stage: Expr
    mb: Expr
    piece: Expr | None = None


@dataclass(frozen=True)
class For(Node):
    var: str
    var_span: Span
    start: Expr
    stop: Expr
    step: Expr | None
    body: tuple["Stmt", ...]


@dataclass(frozen=True)
class If(Node):
    cond: Expr
    then: tuple["Stmt", ...]
    otherwise: tuple["Stmt", ...]


@dataclass(frozen=True)
class AtStep(Node):
    """``at step E { ... }``: the tasks inside belong to step E (weight passing)."""

    step: Expr
    body: tuple["Stmt", ...]


Stmt = Let | Task | For | If | AtStep


# -------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Param(Node):
    name: str
    type: str  # ranks | microbatches | chunks | int | bool
    default: Expr | None


@dataclass(frozen=True)
class Require(Node):
    cond: Expr
    message: str


@dataclass(frozen=True)
class Stages(Node):
    count: Expr


@dataclass(frozen=True)
class Pipelines(Node):
    count: Expr


@dataclass(frozen=True)
class Route(Node):
    """``route microbatch m to pipeline E``."""

    var: str
    var_span: Span
    pipeline: Expr


@dataclass(frozen=True)
class Place(Node):
    """``place stage s [of pipeline p] on rank E [when C]``."""

    stage_var: str
    pipeline_var: str | None
    rank: Expr
    when: Expr | None
    var_spans: tuple[Span, ...]


@dataclass(frozen=True)
class DeviceMap(Node):
    var: str
    var_span: Span
    device: Expr


@dataclass(frozen=True)
class Backward(Node):
    mode: str  # full | split


@dataclass(frozen=True)
class Recompute(Node):
    """``recompute stage s [when C]``: the stages (positions along a pipeline) whose forward keeps only
    its input and runs again before its backward (activation checkpointing); every stage without ``when``."""

    var: str
    var_span: Span
    when: Expr | None


@dataclass(frozen=True)
class Stash(Node):
    """``stash weights [<= K]``: each stage keeps the weight version its forwards ran on for their
    backwards, at most ``K`` versions at once (None: as many as the order needs)."""

    bound: Expr | None


@dataclass(frozen=True)
class Home(Node):
    """``home microbatch m on rank E``: one pipeline per rank, all local, microbatch m on E."""

    var: str
    var_span: Span
    rank: Expr


@dataclass(frozen=True)
class Own(Node):
    """``own layer l on rank E``: the rank that keeps layer l's master weights."""

    var: str
    var_span: Span
    rank: Expr


@dataclass(frozen=True)
class Group(Node):
    """``group rank r in E``: the group (node) of rank r."""

    var: str
    var_span: Span
    group: Expr


@dataclass(frozen=True)
class Weights(Node):
    """``weights ROUTE [by E]``: how weights reach the ranks that run a layer."""

    route: str  # ring | direct | staged | all_gather
    by: Expr | None


@dataclass(frozen=True)
class Gradients(Node):
    """``gradients ROUTE``: how weight gradients reach a layer's owner."""

    route: str  # ring | direct | reduce | reduce_scatter


@dataclass(frozen=True)
class WeightCount(Node):
    """``prefetch E`` (steps ahead a weight fetch is posted) or ``buffers E`` (the most
    borrowed weight buffers alive on a rank)."""

    what: str  # prefetch | buffers
    value: Expr


@dataclass(frozen=True)
class Sequence(Node):
    """``sequence chunks E``: the sequence is cut into E equal chunks; makes the schedule a sequence ring."""

    count: Expr


@dataclass(frozen=True)
class Hold(Node):
    """``hold chunk c on rank E``: the rank that holds chunk c's queries, keys and values."""

    var: str
    var_span: Span
    rank: Expr


@dataclass(frozen=True)
class Mask(Node):
    """``mask full``, ``mask causal`` or ``mask causal when E`` (causal where E holds, else full)."""

    mode: str  # full | causal
    when: Expr | None


@dataclass(frozen=True)
class Rings(Node):
    """``rings shift E, ...``, ``rings hamilton``, ``rings rails E, E`` or ``rings cycle (E, ...), ...``: the
    rings KV travels on.

    ``values`` holds every value written (how many each kind takes is the resolver's to check).
    """

    kind: str  # shift | hamilton | rails | cycle
    values: tuple[Expr, ...]


@dataclass(frozen=True)
class Pieces(Node):
    """``pieces E``: the KV pieces each chunk is cut into."""

    value: Expr


@dataclass(frozen=True)
class TensorParallel(Node):
    """``tensor parallel layers E``: E MLP blocks, each split across every rank (Megatron-LM)."""

    layers: Expr


@dataclass(frozen=True)
class RingMode(Node):
    """``kv again|kept``, ``dkv behind|direct`` or ``transfer p2p|all_to_all``."""

    what: str  # kv | dkv | transfer
    mode: str


@dataclass(frozen=True)
class MeshAxis(Node):
    """``NAME = E`` in a ``mesh``: a rank axis and its size."""

    name: str
    name_span: Span
    size: Expr


@dataclass(frozen=True)
class Mesh(Node):
    """``mesh pp = P, dp = D``: the composition's rank axes, outermost first (the last is contiguous)."""

    axes: tuple[MeshAxis, ...]


@dataclass(frozen=True)
class PipelineArg(Node):
    """``NAME = E`` in a composed pipeline's arguments: a parameter of the schedule it names."""

    name: str
    name_span: Span
    value: Expr


@dataclass(frozen=True)
class ComposedPipeline(Node):
    """``pipeline NAME(ARG = E, ...) from "TARGET"``: the pipeline schedule a composition places on its mesh."""

    name: str
    name_span: Span
    args: tuple[PipelineArg, ...]
    target: str
    target_span: Span


@dataclass(frozen=True)
class DataPolicy(Node):
    """``replicate over AXIS`` or ``shard over AXIS [reshard after forward]``: how each stage's group holds
    its weights (whole on every member, or a shard each) along the data axis."""

    sharded: bool
    axis: str
    axis_span: Span
    reshard_after_forward: bool


@dataclass(frozen=True)
class ContextPolicy(Node):
    """``context over AXIS ring "TARGET"`` (or ``ring NAME(ARG = E, ...) from "TARGET"``): each stage's group
    along AXIS splits every sequence by the ring schedule's chunks and runs the stage's attention through it.

    ``ring`` is the schedule's name in TARGET (None: the file's first schedule), ``ring_span`` where it is
    written (the target's span when it is not), ``args`` its arguments beside the ranks the axis gives."""

    axis: str
    axis_span: Span
    ring: str | None
    ring_span: Span
    args: tuple[PipelineArg, ...]
    target: str
    target_span: Span


@dataclass(frozen=True)
class ExplicitOrder(Node):
    rank_var: str
    rank_span: Span
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class RankRule(Node):
    """A per-rank number of a policy: ``inflight on rank r <= E`` (the most chunk
    activations alive), ``deferred on rank r <= E`` (the most weight gradients
    waiting: I done, W not started) or ``warmup on rank r = E`` (forwards before
    the rank starts alternating backward and forward)."""

    what: str  # inflight | deferred | warmup
    rank_var: str
    rank_span: Span
    value: Expr


@dataclass(frozen=True)
class Priority(Node):
    kind: str
    stage_var: str
    mb_var: str
    key: Expr
    var_spans: tuple[Span, ...]


@dataclass(frozen=True)
class Prefer(Node):
    kinds: tuple[str, ...]


@dataclass(frozen=True)
class InOrder(Node):
    """``in order F, B``: kinds each rank runs in priority order, waiting for the next."""

    kinds: tuple[str, ...]


@dataclass(frozen=True)
class GreedyOrder(Node):
    lets: tuple[Let, ...]
    rules: tuple[RankRule, ...]
    priorities: tuple[Priority, ...]
    prefer: tuple[Prefer, ...]
    in_order: tuple[InOrder, ...] = ()


@dataclass(frozen=True)
class SortedOrder(Node):
    """``order sorted { key F(s, m) = K ... }``: each rank runs its tasks in key order."""

    lets: tuple[Let, ...]
    keys: tuple[Priority, ...]


Decl = (
    Require | Let | FuncDef | Stages | Pipelines | Route | Place | DeviceMap | Backward | Recompute | Stash | ExplicitOrder
    | GreedyOrder
    | SortedOrder | Home | Own | Group | Weights | Gradients | WeightCount | Sequence | Hold | Mask | Rings | Pieces
    | RingMode | TensorParallel | Mesh | ComposedPipeline | DataPolicy
)


@dataclass(frozen=True)
class Schedule(Node):
    name: str
    params: tuple[Param, ...]
    decls: tuple[Decl, ...]
    name_span: Span | None = None


@dataclass
class Module:
    """A parsed ``.pipe`` file."""

    path: str
    source: str
    schedules: list[Schedule] = field(default_factory=list)

    def schedule(self, name: str | None) -> Schedule | None:
        if name is None:
            return self.schedules[0] if self.schedules else None
        for schedule in self.schedules:
            if schedule.name == name:
                return schedule
        return None
