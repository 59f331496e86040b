"""Evaluate a resolved schedule with concrete parameters into a ``ScheduleSpec``.

Evaluation is the second of two steps (the first, ``pipec.dsl.resolve``, finds
every mistake a file can hold before any parameter is looked at):
``ResolvedSchedule.evaluate(defines)`` binds the parameters, runs the
``require``s (in text order, interleaved with ``let``s), places stages, routes
microbatches (or lays out one pipeline per rank under ``home``), finds the
recomputed stages (``recompute stage s when C``), maps devices,
evaluates the weight-passing declarations (``pipec.dsl.weights``), and produces
the order: an explicit order runs its loops once per rank
(``pipec.dsl.order_body``) and every task is checked where it is written, so a
mistake points at its line (a forward of a recomputed stage is handed over as
what it becomes there, ``TaskKinds.recompute``); a sorted order sorts each rank's tasks by key; a
policy is handed over for the list scheduler. A sequence ring
(``pipec.dsl.rings``) evaluates its ``RingSpec`` instead, one stage per chunk
on the chunk's holder; the compiler derives its order, unless the schedule
writes one (run like any explicit order, each block with its step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pipec.dsl import ast
from pipec.dsl.evaluate import BOOL, INT, KEY, Fn, Resolver, Scope
from pipec.dsl.limits import (
    BYTES_PER_TASK_TEXT, INT_LIMIT, INT_LIMIT_TEXT, MAX_OPERATIONS, MAX_RANKS, MAX_TASKS, PLAIN_INT, check_int,
)
from pipec.dsl.families import ACTIVATION_PASSING, Declared, declared_families
from pipec.dsl.rings import RingDecls
from pipec.dsl.spec import GreedyPolicy, ScheduleSpec, TaskKinds
from pipec.dsl.weights import WeightDecls, home_pipelines
from pipec.errors import EvalError, RequireError, ScheduleError, Span, UsageError

if TYPE_CHECKING:
    from pipec.dsl.order_body import OrderState

# The list scheduler's default preference among ready tasks (its policy's kinds).
DEFAULT_PREFER = ("B", "I", "F", "W")

# Bounds that keep a mistaken program from running for hours or exhausting
# memory (the loop iterations one evaluation may run, the size of the task grid,
# the ranks): ``pipec.dsl.limits``, where they are measured and explained.


class Budget:
    """Operations left to one evaluation: whatever runs many times pays up front."""

    def __init__(self):
        self.left = MAX_OPERATIONS

    def charge(self, count: int, cost: int, what: str, span: Span, source: str) -> None:
        """Pay ``count`` evaluations of ``cost`` operations each, or raise at ``span``.

        Args:
            what: what is evaluated ``count`` times, for the message.
        """
        self.left -= count * cost
        if self.left < 0:
            raise EvalError(
                f"evaluating this schedule takes more than {MAX_OPERATIONS:,} operations (pipec's limit): here "
                f"{what}, {count:,} times {cost:,} operations",
                span,
                source,
            )


# Parameter types: the smallest value each admits.
_PARAM_MINIMUM = {"ranks": 1, "microbatches": 1, "chunks": 1, "int": None, "bool": None}


@dataclass
class _Single:
    """A declaration that may appear at most once."""

    node: ast.Node | None = None
    fn: Fn | None = None


@dataclass
class ResolvedSchedule:
    """A schedule whose names and types are known; ``evaluate`` gives a spec."""

    node: ast.Schedule
    path: str
    source: str
    resolver: Resolver
    params: list[tuple[ast.Param, int, Fn | None]] = field(default_factory=list)
    scalar_steps: list[tuple[ast.Node, int | None, Fn]] = field(default_factory=list)
    stages: _Single = field(default_factory=_Single)
    pipelines: _Single = field(default_factory=_Single)
    # `stash weights [<= K]`: its node, and K's closure (None: no bound)
    stash: tuple[ast.Stash, Fn | None] | None = None
    route: tuple[ast.Route, int, Fn] | None = None
    places: list[tuple[ast.Place, int, int | None, Fn, Fn | None]] = field(default_factory=list)
    device_map: tuple[ast.DeviceMap, int, Fn] | None = None
    # home, own, group, weights, gradients, prefetch, buffers (weight passing)
    weight_decls: WeightDecls = field(default_factory=WeightDecls)
    # sequence, hold, mask, rings, pieces, kv, dkv, transfer (sequence rings)
    ring_decls: RingDecls = field(default_factory=RingDecls)
    # the family whose rules the schedule follows (``pipec.dsl.families.family_of``, read before the walk)
    family: Declared = ACTIVATION_PASSING
    # the resolved declarations of a family added as a module of its own (``Declared.field`` -> them)
    family_decls: dict = field(default_factory=dict)
    tasks: TaskKinds | None = None
    # `recompute stage s [when C]`: each declaration, its variable's slot and its condition's closure
    recomputes: list[tuple[ast.Recompute, int, Fn | None]] = field(default_factory=list)
    recomputing: bool = False  # the schedule declares `recompute` (read before the walk)
    backward_mode: str = ""
    split_backward: bool = False
    explicit: tuple[ast.ExplicitOrder, int, list[Callable]] | None = None
    greedy: ast.GreedyOrder | None = None
    sorted: ast.SortedOrder | None = None
    order_lets: list[tuple[int, Fn]] = field(default_factory=list)
    rank_rules: dict[str, tuple[ast.RankRule, int, Fn]] = field(default_factory=dict)
    priorities: dict[str, tuple[int, int, Fn]] = field(default_factory=dict)
    prefer: tuple[str, ...] = DEFAULT_PREFER
    in_order: tuple[str, ...] = ()  # kinds a greedy policy runs in priority order
    ranks_param: str = ""
    microbatches_param: str = ""  # "" for a sequence ring without one
    _state: "OrderState | None" = None
    budget: Budget = field(default_factory=Budget)
    # Operations of one run of the explicit order's body (its loops apart), and
    # of one task's keys (sorted) or priorities (greedy), all kinds together.
    explicit_cost: int = 0
    key_cost: int = 0
    # The name the user called it by, when that is not its name in the file
    # (a shipped schedule is named by its file: `1f1b`, whose schedule is
    # one_f_one_b); messages and programs use it.
    called: str = ""

    @property
    def name(self) -> str:
        return self.called or self.node.name

    def describe_params(self) -> list[dict]:
        """Parameters with their types and default expressions (as text)."""
        out = []
        for param, _slot, _fn in self.params:
            default = None
            if param.default is not None:
                default = _text_of(self.source, param.default.span)
            out.append({"name": param.name, "type": param.type, "default": default})
        return out

    # ------------------------------------------------------------ resolution

    def resolve_params(self, schedule: ast.Schedule, scope: Scope) -> None:
        """Bind ``schedule``'s parameters in ``scope`` (each default sees the parameters before it)."""
        for param in schedule.params:
            default = None
            want = BOOL if param.type == "bool" else INT
            if param.default is not None:
                default = self.resolver.expect(param.default, scope, want, f"the default of {param.name}")
            binding = self.resolver.bind(scope, param.name, want, param.span)
            self.params.append((param, binding.slot, default))

    def resolve_scalar(self, decl: ast.Let | ast.Require, scope: Scope) -> None:
        """Compile a ``let`` (bound in ``scope``) or a ``require`` into the steps run before the rest."""
        if isinstance(decl, ast.Let):
            fn, type_ = self.resolver.expr(decl.value, scope)
            if type_ == KEY:
                self.resolver.error("a `let` holds an integer or a boolean, not a priority key", decl.value.span)
            binding = self.resolver.bind(scope, decl.name, type_, decl.name_span)
            self.scalar_steps.append((decl, binding.slot, fn))
        else:
            fn = self.resolver.expect(decl.cond, scope, BOOL, "a requirement")
            self.scalar_steps.append((decl, None, fn))

    # ------------------------------------------------------------ evaluation

    def evaluate(self, defines: dict[str, str | int | bool] | None = None) -> ScheduleSpec:
        """Evaluate with parameter values.

        Args:
            defines: NAME -> value (int, bool, or their text as given by -D).
        Returns:
            the ``ScheduleSpec``.
        Raises:
            UsageError: an unknown or ill-typed parameter value.
            RequireError: a ``require`` is false.
            EvalError, ScheduleError: evaluation or consistency errors, located.
        """
        defines = dict(defines or {})
        env = self.resolver.new_env()
        self.budget.left = MAX_OPERATIONS
        values = self._bind_params(env, defines)
        self._run_scalar_steps(env, values)

        laying_out = next((family for family in declared_families() if family.lays_out(self)), None)
        if laying_out is not None:  # a sequence ring: its declarations lay it out
            return self._evaluate_laid_out(env, values, laying_out)
        P = values[self.ranks_param]
        N = values[self.microbatches_param]
        S = self._positive(self.stages.fn(env), "the number of stages", self.stages.node)
        home = self.weight_decls.home
        pipelines = P if home is not None else 1  # `home`: one pipeline per rank
        if self.pipelines.fn is not None:
            pipelines = self._positive(self.pipelines.fn(env), "the number of pipelines", self.pipelines.node)

        self._check_size(values, S, pipelines)
        recomputed = self._recomputed(env, S)
        if recomputed:
            self._check_size(values, S, pipelines, len(recomputed))
        if home is not None:
            mb_pipeline = home_pipelines(self.weight_decls, env, N, P, self.resolver, self.budget)
            placement = [[p] * S for p in range(P)]  # every stage (layer) of pipeline p on rank p
        else:
            mb_pipeline = self._route(env, N, pipelines)
            placement = self._place(env, P, S, pipelines)
        devices = self._devices(env, P)
        spec = ScheduleSpec(
            name=self.name,
            path=self.path,
            source=self.source,
            params=values,
            num_ranks=P,
            num_microbatches=N,
            num_stages=S,
            num_pipelines=pipelines,
            mb_pipeline=mb_pipeline,
            placement=placement,
            devices=devices,
            split_backward=self.split_backward,
            tasks=self.tasks,
            recomputed=recomputed,
            weight_versions=self._weight_versions(env),
        )
        for family in declared_families():  # before the order (weight passing's steps are recorded for it)
            family.evaluate(self, env, spec)
        if self.explicit is not None:
            spec.order_span = self.explicit[0].span
            spec.order = self._run_explicit(env, spec)
        elif self.sorted is not None:
            spec.order_span = self.sorted.span
            spec.order = self._run_sorted(env, spec)
        else:
            spec.order_span = self.greedy.span
            spec.policy = self._policy(env, spec)
        return spec

    def _run_scalar_steps(self, env: list, values: dict) -> None:
        """Run the ``require``s and ``let``s in text order (``values``: the parameters, for messages)."""
        for node, slot, fn in self.scalar_steps:
            if isinstance(node, ast.Require):
                if not fn(env):
                    raise RequireError(
                        f"requirement failed: {node.message} ({_text_of(self.source, node.cond.span)}"
                        f" is false for {format_values(values)})",
                        node.span,
                        self.source,
                    )
            else:
                env[slot] = fn(env)

    def _evaluate_laid_out(self, env: list, values: dict, family: Declared) -> ScheduleSpec:
        """A schedule its family's declarations lay out (a sequence ring: its ``RingSpec``, one stage per
        chunk, a query chunk, on the chunk's holder): one pipeline, one microbatch unless a ``microbatches``
        parameter says otherwise, and its written order with each block's step (``order``,
        ``task_steps``) or none (the compiler derives it)."""
        P = values[self.ranks_param]
        N = values[self.microbatches_param] if self.microbatches_param else 1
        layout = family.layout(self, env, P, f"{self.name} at {format_values(values)}")
        spec = ScheduleSpec(
            name=self.name,
            path=self.path,
            source=self.source,
            params=values,
            num_ranks=P,
            num_microbatches=N,
            num_stages=len(layout.placement),
            num_pipelines=1,
            mb_pipeline=[0] * N,
            placement=[list(layout.placement)],
            devices=self._devices(env, P),
            split_backward=False,
            tasks=self.tasks,
        )
        family.keep(spec, layout.declared)
        if self.explicit is not None:
            spec.order_span = self.explicit[0].span
            spec.order = self._run_explicit(env, spec)
        else:
            spec.order_span = layout.derived_order  # the order is derived from it
        return spec

    def _check_size(self, values: dict, S: int, pipelines: int, recomputed: int = 0) -> None:
        """Refuse, before anything is built, a task grid larger than pipec's limit.

        Each microbatch rides one pipeline and runs every required kind of
        task (F and B, or F, I and W) on each of its ``S`` stages, and a
        recompute on each of its ``recomputed`` recomputed stages.
        """
        N = values[self.microbatches_param]
        kinds = self.tasks.required(self.backward_mode)
        tasks = (len(kinds) * S + recomputed) * N
        if tasks > MAX_TASKS:
            again = (f", and {' '.join(self.tasks.recomputes)} on each of {recomputed:,} recomputed stages"
                     if recomputed else "")
            raise EvalError(
                f"{self.name} at {format_values(values)} has {tasks:,} tasks ({len(kinds)} per stage and "
                f"microbatch: {', '.join(kinds)}{again}; x {S:,} stages x {N:,} microbatches); pipec's limit is "
                f"{MAX_TASKS:,} tasks ({BYTES_PER_TASK_TEXT})",
                self.stages.node.span,
                self.source,
            )
        if pipelines * S > MAX_TASKS:
            # the pipelines are `pipelines E`, or one per rank under `home`
            where = self.pipelines.node or self.weight_decls.home[0]
            raise EvalError(
                f"{self.name} at {format_values(values)} has {pipelines * S:,} stages in all ({pipelines:,} "
                f"pipelines x {S:,} stages); pipec's limit is {MAX_TASKS:,}",
                where.span,
                self.source,
            )

    def _bind_params(self, env: list, defines: dict) -> dict[str, int | bool]:
        known = {param.name for param, _, _ in self.params}
        unknown = sorted(set(defines) - known)
        if unknown:
            listing = ", ".join(f"{p.name}: {p.type}" for p, _, _ in self.params)
            raise UsageError(f"schedule '{self.name}' has no parameter {', '.join(unknown)}; its parameters are {listing}")
        values: dict[str, int | bool] = {}
        for param, slot, default in self.params:
            if param.name in defines:
                value = _coerce(param, defines[param.name], self.name)
            elif default is not None:
                value = default(env)
            else:
                raise UsageError(
                    f"schedule '{self.name}' needs a value for {param.name} ({param.type}): pass -D {param.name}=VALUE"
                )
            message = _out_of_range(param, value)
            if message is not None:
                if param.name in defines:
                    raise UsageError(f"schedule '{self.name}': {message}")
                raise EvalError(message + self._default_words(param, values, defines), param.span, self.source)
            env[slot] = value
            values[param.name] = value
        return values

    def _default_words(self, param: ast.Param, values: dict, defines: dict) -> str:
        """Where a defaulted parameter's refused value came from: its default's text and the values given for
        the parameters before it (``-D P=0`` makes ``N = 2 * P`` zero: the fix is P's, not N's)."""
        if param.default is None:
            return ""
        read = _names_read(param.default)
        given = {name: value for name, value in values.items() if name in defines and name in read}
        if not given:
            return ""
        names = ", ".join(given)
        return (f" (its default, {_text_of(self.source, param.default.span)}, at {format_values(given)}: give "
                f"{names} {'another value' if len(given) == 1 else 'other values'}, or -D {param.name}=...)")

    def argument_refusal(self, name: str, value: int | bool) -> str | None:
        """Why ``evaluate`` would refuse ``name = value`` (a composition's arguments, checked where written).

        Returns:
            the message (no such parameter, a value of the wrong type or out of its type's range), or None.
        """
        param = next((param for param, _, _ in self.params if param.name == name), None)
        if param is None:
            listing = ", ".join(f"{p.name}: {p.type}" for p, _, _ in self.params) or "none"
            return f"schedule '{self.node.name}' has no parameter {name}; its parameters are {listing}"
        try:
            _coerce(param, value, self.node.name)
        except UsageError as error:
            return str(error)
        message = _out_of_range(param, value)
        return None if message is None else f"schedule '{self.node.name}': {message}"

    def missing_arguments(self, given) -> list[ast.Param]:
        """The parameters without a default that ``given`` (names) leaves without a value."""
        return [param for param, _, default in self.params if default is None and param.name not in given]

    def _positive(self, value: int, what: str, node: ast.Node) -> int:
        if value < 1:
            raise EvalError(f"{what} must be at least 1, got {value}", node.span, self.source)
        return value

    def _weight_versions(self, env: list) -> int | None:
        """The most versions of a stage's weights the schedule keeps: 1 without ``stash weights``, None for
        ``stash weights`` without a bound."""
        if self.stash is None:
            return 1
        node, bound = self.stash
        return None if bound is None else self._positive(bound(env), "the most weight versions", node)

    def _recomputed(self, env: list, S: int) -> frozenset[int]:
        """The stage positions some ``recompute stage s [when C]`` names (every one without ``when``)."""
        if not self.recomputes:
            return frozenset()
        cost = sum(self.resolver.cost(node.when) for node, _, _ in self.recomputes)
        first = self.recomputes[0][0]
        self.budget.charge(S, cost, "the recompute condition of each stage", first.span, self.source)
        out = set()
        for node, slot, when_fn in self.recomputes:
            if when_fn is None:
                return frozenset(range(S))
            for s in range(S):
                env[slot] = s
                if when_fn(env):
                    out.add(s)
        return frozenset(out)

    def _route(self, env: list, N: int, pipelines: int) -> list[int]:
        if self.route is None:
            if pipelines > 1:
                raise ScheduleError(
                    f"{pipelines} pipelines need a route: `route microbatch m to pipeline EXPR`",
                    self.pipelines.node.span,
                    self.source,
                )
            return [0] * N
        node, slot, fn = self.route
        self.budget.charge(N, self.resolver.cost(node.pipeline), "the route of each microbatch", node.span, self.source)
        out = []
        for m in range(N):
            env[slot] = m
            p = fn(env)
            if not 0 <= p < pipelines:
                raise EvalError(
                    f"microbatch {m} is routed to pipeline {p}, outside 0..{pipelines - 1}", node.pipeline.span, self.source
                )
            out.append(p)
        return out

    def _place(self, env: list, P: int, S: int, pipelines: int) -> list[list[int]]:
        cost = sum(self.resolver.cost(node.rank) + self.resolver.cost(node.when) for node, *_ in self.places)
        self.budget.charge(pipelines * S, cost, "the places of each stage", self.places[0][0].span, self.source)
        placement = []
        for p in range(pipelines):
            row = []
            for s in range(S):
                home = None
                home_node = None
                for node, s_slot, p_slot, rank_fn, when_fn in self.places:
                    env[s_slot] = s
                    if p_slot is not None:
                        env[p_slot] = p
                    if when_fn is not None and not when_fn(env):
                        continue
                    rank = rank_fn(env)
                    if not 0 <= rank < P:
                        raise EvalError(
                            f"stage {s}{of_pipeline(p, pipelines)} is placed on rank {rank}, outside 0..{P - 1}",
                            node.rank.span,
                            self.source,
                        )
                    if home is not None and home_node is not node:
                        raise ScheduleError(
                            f"stage {s}{of_pipeline(p, pipelines)} has two homes: rank {home} "
                            f"(line {home_node.span.line}) and rank {rank}",
                            node.span,
                            self.source,
                        )
                    home, home_node = rank, node
                if home is None:
                    last = self.places[-1][0]
                    raise ScheduleError(
                        f"stage {s}{of_pipeline(p, pipelines)} has no home: no `place` covers it", last.span, self.source
                    )
                row.append(home)
            placement.append(row)
        return placement

    def _devices(self, env: list, P: int) -> list[int] | None:
        if self.device_map is None:
            return None
        node, slot, fn = self.device_map
        self.budget.charge(P, self.resolver.cost(node.device), "the device of each rank", node.span, self.source)
        devices = []
        for r in range(P):
            env[slot] = r
            devices.append(fn(env))
        if sorted(devices) != list(range(P)):
            raise EvalError(
                f"the device map must be a permutation of 0..{P - 1}; it gives {devices}", node.device.span, self.source
            )
        return devices

    def _run_explicit(self, env: list, spec: ScheduleSpec) -> list[list[tuple[str, int, int]]]:
        node, rank_slot, body = self.explicit
        self.budget.charge(spec.num_ranks, self.explicit_cost, "the order's body for each rank", node.span, self.source)
        state = self._state
        state.start(spec, home=self.weight_decls.home is not None)
        for r in range(spec.num_ranks):
            env[rank_slot] = r
            state.begin_rank(r)
            for stmt in body:
                stmt(env)
        state.finish(node)
        spec.task_steps = state.steps
        return state.orders

    def _run_sorted(self, env: list, spec: ScheduleSpec) -> list[list[tuple[str, int, int]]]:
        """Each rank's tasks sorted by (key, kind in table order, microbatch, stage)."""
        priority = self._priority_function(env, spec)
        S = spec.num_stages
        kinds = spec.required_kinds
        by_pipeline: dict[int, list[int]] = {}
        for m, p in enumerate(spec.mb_pipeline):
            by_pipeline.setdefault(p, []).append(m)
        keyed: list[list] = [[] for _ in range(spec.num_ranks)]
        for p, row in enumerate(spec.placement):
            for s, rank in enumerate(row):
                sid = p * S + s
                # a recomputed stage's forward is sorted by the forward's key and runs as what it becomes
                ran = {kind: spec.tasks.recompute[kind][0] for kind in kinds if kind in spec.tasks.recompute} \
                    if s in spec.recomputed else {}
                for m in by_pipeline.get(p, ()):
                    for kind in kinds:
                        keyed[rank].append((priority(kind, sid, m), spec.tasks.index(kind), m, sid,
                                            ran.get(kind, kind)))
        orders = []
        for tasks in keyed:
            tasks.sort()
            orders.append([(kind, sid, m) for _, _, m, sid, kind in tasks])
        return orders

    def _policy(self, env: list, spec: ScheduleSpec) -> GreedyPolicy:
        priority = self._priority_function(env, spec)
        inflight = self._per_rank(env, spec, "inflight", 1, "no forward could run")
        deferred = self._per_rank(env, spec, "deferred", 1, "no I could run")
        warmup = self._per_rank(env, spec, "warmup", 0, "a count of forwards is never negative")
        return GreedyPolicy(inflight=inflight, warmup=warmup, prefer=self.prefer, priority=priority, deferred=deferred,
                            in_order=self.in_order)

    def _priority_function(self, env: list, spec: ScheduleSpec):
        """``(kind, stage id, mb) -> key tuple`` from the order's keys (after its lets).

        Charges every task's keys once (a policy's scheduler may ask again).
        """
        order = self.sorted or self.greedy
        self.budget.charge(spec.num_stages * spec.num_microbatches, self.key_cost, "the keys of each task",
                           order.span, self.source)
        for slot, fn in self.order_lets:
            env[slot] = fn(env)
        priorities = dict(self.priorities)
        S = spec.num_stages
        pipelines_of = spec.mb_pipeline
        base_env = list(env)

        def priority(kind: str, stage_id: int, mb: int) -> tuple:
            entry = priorities.get(kind)
            position = stage_id - pipelines_of[mb] * S
            if entry is None:
                return ()  # no key: the earliest ready runs first
            s_slot, m_slot, fn = entry
            base_env[s_slot] = position
            base_env[m_slot] = mb
            key = fn(base_env)
            return key if isinstance(key, tuple) else (key,)

        return priority

    def _per_rank(self, env: list, spec: ScheduleSpec, what: str, minimum: int, why: str) -> list[int | None]:
        """Evaluate a policy's per-rank rule for every rank (None where absent)."""
        values: list[int | None] = [None] * spec.num_ranks
        rule = self.rank_rules.get(what)
        if rule is None:
            return values
        node, slot, fn = rule
        self.budget.charge(spec.num_ranks, self.resolver.cost(node.value), f"the {what} of each rank", node.span,
                           self.source)
        for r in range(spec.num_ranks):
            env[slot] = r
            value = fn(env)
            if value < minimum:
                raise EvalError(f"the {what} of rank {r} is {value}; it must be at least {minimum} ({why})", node.value.span, self.source)
            values[r] = value
        return values


# ----------------------------------------------------------------- helpers


def _coerce(param: ast.Param, raw, schedule: str) -> int | bool:
    if param.type == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise UsageError(f"schedule '{schedule}': {param.name} is a bool; give true or false, not {raw!r}")
    if isinstance(raw, bool):
        raise UsageError(f"schedule '{schedule}': {param.name} is an integer ({param.type}), not a bool")
    text = str(raw).strip() if not isinstance(raw, int) else None
    if text is not None and len(text.lstrip("+-").lstrip("0")) > len(str(INT_LIMIT)):
        value = None  # more digits than any value in range (and than int() accepts, past 4300)
    else:
        try:
            if text is not None and not PLAIN_INT.fullmatch(text):  # the one reading of an integer, as -D's
                raise ValueError(text)
            value = raw if text is None else int(text, 10)
        except ValueError:
            shown = raw if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
            raise UsageError(f"schedule '{schedule}': {param.name} ({param.type}) must be an integer, "
                             f"not {shown!r}") from None
    if value is None or not check_int(value):
        raise UsageError(f"schedule '{schedule}': {param.name} exceeds pipec's integer limit {INT_LIMIT_TEXT}")
    return value


def _names_read(expr) -> set[str]:
    """The names an expression reads (its ``Name`` nodes, at any depth)."""
    found, todo = set(), [expr]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Node):
            todo.extend(getattr(node, name) for name in node.__dataclass_fields__)
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
    return found


def _out_of_range(param: ast.Param, value: int | bool) -> str | None:
    """Why ``value`` is outside the range of ``param``'s type, or None."""
    minimum = _PARAM_MINIMUM[param.type]
    if minimum is not None and value < minimum:
        return f"{param.name} ({param.type}) must be at least {minimum}, got {value}"
    if param.type == "ranks" and value > MAX_RANKS:
        return (f"{param.name} (ranks) is {value:,}; pipec's limit is {MAX_RANKS:,} ranks (a program "
                f"keeps per-rank lists and per-pair tables: P^2 entries)")
    return None


def of_pipeline(p: int, pipelines: int) -> str:
    return f" of pipeline {p}" if pipelines > 1 else ""


def _text_of(source: str, span: Span) -> str:
    lines = source.splitlines()
    if span.end_line == span.line and 0 < span.line <= len(lines):
        return lines[span.line - 1][span.col - 1 : span.end_col - 1]
    if 0 < span.line <= len(lines):
        return lines[span.line - 1][span.col - 1 :].strip()
    return "?"


def format_values(values: dict) -> str:
    """``values`` as messages show them: ``P=4, N=8, remat=false``."""
    return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())
