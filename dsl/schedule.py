"""Evaluate a parsed schedule with concrete parameters into a ``ScheduleSpec``.

Two steps, kept apart so that every mistake a file can hold is reported before
any parameter is looked at:

1. ``resolve(schedule, module)``: names, types and the shape of the schedule
   (exactly one ``stages``, one order, a ``ranks`` and a ``microbatches``
   parameter, ...). All errors are collected and raised once.
2. ``ResolvedSchedule.evaluate(defines)``: parameters, ``require``s (in text
   order, interleaved with ``let``s), placement, routing, devices, and the
   order: an explicit order runs its loops once per rank and every task is
   checked where it is written (range, home rank, duplicates), so a mistake
   points at its line; a policy is handed over for the list scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pipec.dsl import ast
from pipec.dsl.evaluate import BOOL, INT, KEY, Fn, Resolver, Scope
from pipec.dsl.spec import GreedyPolicy, ScheduleSpec
from pipec.errors import EvalError, RequireError, ResolveError, ScheduleError, SourceErrors, Span, UsageError

TASK_KINDS = ("F", "B", "I", "W")
_KIND_INDEX = {k: i for i, k in enumerate(TASK_KINDS)}
DEFAULT_PREFER = ("B", "I", "F", "W")

# Bounds that keep a mistaken program from running for hours: the loop
# iterations one evaluation may run, and the size of the task grid.
MAX_LOOP_ITERATIONS = 50_000_000
MAX_TASKS = 20_000_000


class _Budget:
    """Loop iterations left to one evaluation (a ``for`` pays its length up front)."""

    def __init__(self):
        self.left = MAX_LOOP_ITERATIONS


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
    route: tuple[ast.Route, int, Fn] | None = None
    places: list[tuple[ast.Place, int, int | None, Fn, Fn | None]] = field(default_factory=list)
    device_map: tuple[ast.DeviceMap, int, Fn] | None = None
    split_backward: bool = False
    explicit: tuple[ast.ExplicitOrder, int, list[Callable]] | None = None
    greedy: ast.GreedyOrder | None = None
    sorted: ast.SortedOrder | None = None
    order_lets: list[tuple[int, Fn]] = field(default_factory=list)
    rank_rules: dict[str, tuple[ast.RankRule, int, Fn]] = field(default_factory=dict)
    priorities: dict[str, tuple[int, int, Fn]] = field(default_factory=dict)
    prefer: tuple[str, ...] = DEFAULT_PREFER
    ranks_param: str = ""
    microbatches_param: str = ""
    _state: "_OrderState | None" = None
    budget: _Budget = field(default_factory=_Budget)

    @property
    def name(self) -> str:
        return self.node.name

    def describe_params(self) -> list[dict]:
        """Parameters with their types and default expressions (as text)."""
        out = []
        for param, _slot, _fn in self.params:
            default = None
            if param.default is not None:
                default = _text_of(self.source, param.default.span)
            out.append({"name": param.name, "type": param.type, "default": default})
        return out

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
        self.budget.left = MAX_LOOP_ITERATIONS
        values = self._bind_params(env, defines)
        for node, slot, fn in self.scalar_steps:
            if isinstance(node, ast.Require):
                if not fn(env):
                    raise RequireError(
                        f"requirement failed: {node.message} ({_text_of(self.source, node.cond.span)}"
                        f" is false for {_format_values(values)})",
                        node.span,
                        self.source,
                    )
            else:
                env[slot] = fn(env)

        P = values[self.ranks_param]
        N = values[self.microbatches_param]
        S = self._positive(self.stages.fn(env), "the number of stages", self.stages.node)
        pipelines = 1
        if self.pipelines.fn is not None:
            pipelines = self._positive(self.pipelines.fn(env), "the number of pipelines", self.pipelines.node)

        tasks = 3 * N * S * pipelines
        if tasks > MAX_TASKS or P > MAX_TASKS:
            raise EvalError(
                f"{P} ranks x {pipelines} pipeline(s) x {S} stages x {N} microbatches is beyond pipec's limit "
                f"of {MAX_TASKS} tasks",
                self.stages.node.span,
                self.source,
            )
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
        )
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
            minimum = _PARAM_MINIMUM[param.type]
            if minimum is not None and value < minimum:
                message = f"{param.name} ({param.type}) must be at least {minimum}, got {value}"
                if param.name in defines:
                    raise UsageError(f"schedule '{self.name}': {message}")
                raise EvalError(message, param.span, self.source)
            env[slot] = value
            values[param.name] = value
        return values

    def _positive(self, value: int, what: str, node: ast.Node) -> int:
        if value < 1:
            raise EvalError(f"{what} must be at least 1, got {value}", node.span, self.source)
        return value

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
                            f"stage {s}{_of_pipeline(p, pipelines)} is placed on rank {rank}, outside 0..{P - 1}",
                            node.rank.span,
                            self.source,
                        )
                    if home is not None and home_node is not node:
                        raise ScheduleError(
                            f"stage {s}{_of_pipeline(p, pipelines)} has two homes: rank {home} "
                            f"(line {home_node.span.line}) and rank {rank}",
                            node.span,
                            self.source,
                        )
                    home, home_node = rank, node
                if home is None:
                    last = self.places[-1][0]
                    raise ScheduleError(
                        f"stage {s}{_of_pipeline(p, pipelines)} has no home: no `place` covers it", last.span, self.source
                    )
                row.append(home)
            placement.append(row)
        return placement

    def _devices(self, env: list, P: int) -> list[int] | None:
        if self.device_map is None:
            return None
        node, slot, fn = self.device_map
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
        state = self._state
        state.start(spec)
        for r in range(spec.num_ranks):
            env[rank_slot] = r
            state.begin_rank(r)
            for stmt in body:
                stmt(env)
        state.finish(node)
        return state.orders

    def _run_sorted(self, env: list, spec: ScheduleSpec) -> list[list[tuple[str, int, int]]]:
        """Each rank's tasks sorted by (key, kind F B I W, microbatch, stage)."""
        priority = self._priority_function(env, spec)
        S = spec.num_stages
        kinds = ("F",) + spec.backward_kinds
        by_pipeline: dict[int, list[int]] = {}
        for m, p in enumerate(spec.mb_pipeline):
            by_pipeline.setdefault(p, []).append(m)
        keyed: list[list] = [[] for _ in range(spec.num_ranks)]
        for p, row in enumerate(spec.placement):
            for s, rank in enumerate(row):
                sid = p * S + s
                for m in by_pipeline.get(p, ()):
                    for kind in kinds:
                        keyed[rank].append((priority(kind, sid, m), _KIND_INDEX[kind], m, sid, kind))
        orders = []
        for tasks in keyed:
            tasks.sort()
            orders.append([(kind, sid, m) for _, _, m, sid, kind in tasks])
        return orders

    def _policy(self, env: list, spec: ScheduleSpec) -> GreedyPolicy:
        priority = self._priority_function(env, spec)
        inflight = self._per_rank(env, spec, "inflight", 1, "no forward could run")
        warmup = self._per_rank(env, spec, "warmup", 0, "a count of forwards is never negative")
        return GreedyPolicy(inflight=inflight, warmup=warmup, prefer=self.prefer, priority=priority)

    def _priority_function(self, env: list, spec: ScheduleSpec):
        """``(kind, stage id, mb) -> key tuple`` from the order's keys (after its lets)."""
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
        for r in range(spec.num_ranks):
            env[slot] = r
            value = fn(env)
            if value < minimum:
                raise EvalError(f"the {what} of rank {r} is {value}; it must be at least {minimum} ({why})", node.value.span, self.source)
            values[r] = value
        return values


# ------------------------------------------------------------- explicit order


class _OrderState:
    """Collects the tasks an explicit order emits and checks each where written."""

    def __init__(self, resolver: Resolver):
        self.source = resolver.source

    def start(self, spec: ScheduleSpec) -> None:
        self.spec = spec
        self.N = spec.num_microbatches
        self.S = spec.num_stages
        self.stage_rank = [r for row in spec.placement for r in row]
        self.mb_offset = [p * self.S for p in spec.mb_pipeline]
        self.seen = bytearray(len(TASK_KINDS) * len(self.stage_rank) * self.N)
        self.orders: list[list[tuple[str, int, int]]] = []
        self.rank = 0
        self.out: list = []

    def begin_rank(self, rank: int) -> None:
        self.rank = rank
        self.out = []
        self.orders.append(self.out)

    def emitter(self, node: ast.Task, stage_fn: Fn, mb_fn: Fn) -> Callable[[list], None]:
        kind = node.kind
        kind_base = _KIND_INDEX[kind]
        state = self

        def emit(env):
            s = stage_fn(env)
            m = mb_fn(env)
            if not 0 <= m < state.N:
                raise EvalError(
                    f"{kind}({s}, {m}): microbatch {m} is outside 0..{state.N - 1}", node.mb.span, state.source
                )
            if not 0 <= s < state.S:
                raise EvalError(
                    f"{kind}({s}, {m}): stage {s} is outside 0..{state.S - 1}", node.stage.span, state.source
                )
            sid = state.mb_offset[m] + s
            if state.stage_rank[sid] != state.rank:
                raise ScheduleError(
                    f"{kind}({s}, {m}) runs on rank {state.rank}, but stage {s}"
                    f"{_of_pipeline(sid // state.S, state.spec.num_pipelines)} is placed on rank {state.stage_rank[sid]}",
                    node.span,
                    state.source,
                )
            key = (kind_base * len(state.stage_rank) + sid) * state.N + m
            if state.seen[key]:
                raise ScheduleError(
                    f"{kind}({s}, {m}) is scheduled twice (first at {state._where(kind, sid, m)})",
                    node.span,
                    state.source,
                )
            state.seen[key] = 1
            state.out.append((kind, sid, m))

        return emit

    def _where(self, kind: str, sid: int, m: int) -> str:
        for rank, row in enumerate(self.orders):
            for step, task in enumerate(row):
                if task == (kind, sid, m):
                    return f"rank {rank}, step {step}"
        return "an earlier step"

    def finish(self, node: ast.ExplicitOrder) -> None:
        """Every task of the family must appear: report the first one missing."""
        spec = self.spec
        kinds = ("F",) + spec.backward_kinds
        expected = len(kinds) * len(spec.mb_pipeline) * self.S
        emitted = sum(len(row) for row in self.orders)
        if emitted == expected:
            return
        stages_total = len(self.stage_rank)
        for kind in kinds:
            base = _KIND_INDEX[kind] * stages_total
            for m, p in enumerate(spec.mb_pipeline):
                for s in range(self.S):
                    sid = p * self.S + s
                    if not self.seen[(base + sid) * self.N + m]:
                        raise ScheduleError(
                            f"{kind}({s}, {m}) is never scheduled: rank {self.stage_rank[sid]} runs stage {s}"
                            f"{_of_pipeline(p, spec.num_pipelines)} and must run it",
                            node.span,
                            self.source,
                        )


# -------------------------------------------------------------- resolution


def resolve(schedule: ast.Schedule, path: str, source: str) -> ResolvedSchedule:
    """Resolve names and types of one schedule.

    Args:
        schedule: the parsed schedule.
        path, source: for messages.
    Returns:
        a ``ResolvedSchedule`` ready to ``evaluate``.
    Raises:
        SourceErrors: every resolution error found, at once.
    """
    resolver = Resolver(path, source)
    out = ResolvedSchedule(schedule, path, source, resolver)
    scope = Scope()
    _resolve_params(out, schedule, scope)

    backward_nodes = [d for d in schedule.decls if isinstance(d, ast.Backward)]
    out.split_backward = bool(backward_nodes) and backward_nodes[-1].mode == "split"
    orders = [d for d in schedule.decls if isinstance(d, (ast.ExplicitOrder, ast.GreedyOrder, ast.SortedOrder))]

    for decl in schedule.decls:
        _resolve_decl(out, decl, scope)

    if out.stages.node is None:
        resolver.error("a schedule needs `stages EXPR` (how many stages each pipeline has)", schedule.span)
    if not out.places:
        resolver.error("a schedule needs at least one `place stage s on rank EXPR`", schedule.span)
    if not orders:
        resolver.error(
            "a schedule needs an order: `order rank r { ... }`, `order greedy { ... }` or `order sorted { ... }`",
            schedule.span,
        )
    for extra in orders[1:]:
        resolver.error(f"a schedule has one order; another is at line {orders[0].span.line}", extra.span)
    for extra in backward_nodes[1:]:
        resolver.error(f"`backward` is already declared at line {backward_nodes[0].span.line}", extra.span)
    if resolver.errors:
        _raise_all(resolver.errors)
    return out


def _resolve_params(out: ResolvedSchedule, schedule: ast.Schedule, scope: Scope) -> None:
    resolver = out.resolver
    for param in schedule.params:
        default = None
        want = BOOL if param.type == "bool" else INT
        if param.default is not None:
            default = resolver.expect(param.default, scope, want, f"the default of {param.name}")
        binding = resolver.bind(scope, param.name, want, param.span)
        out.params.append((param, binding.slot, default))
    for role, attr in (("ranks", "ranks_param"), ("microbatches", "microbatches_param")):
        holders = [p for p in schedule.params if p.type == role]
        if len(holders) == 1:
            setattr(out, attr, holders[0].name)
        elif not holders:
            resolver.error(f"a schedule needs one parameter of type `{role}`", schedule.span)
        else:
            resolver.error(f"only one parameter may have type `{role}`", holders[1].span)


def _resolve_decl(out: ResolvedSchedule, decl: ast.Node, scope: Scope) -> None:
    resolver = out.resolver
    if isinstance(decl, ast.FuncDef):
        resolver.define_function(scope, decl)
    elif isinstance(decl, ast.Let):
        fn, type_ = resolver.expr(decl.value, scope)
        if type_ == KEY:
            resolver.error("a `let` holds an integer or a boolean, not a priority key", decl.value.span)
        binding = resolver.bind(scope, decl.name, type_, decl.name_span)
        out.scalar_steps.append((decl, binding.slot, fn))
    elif isinstance(decl, ast.Require):
        fn = resolver.expect(decl.cond, scope, BOOL, "a requirement")
        out.scalar_steps.append((decl, None, fn))
    elif isinstance(decl, (ast.Stages, ast.Pipelines)):
        single = out.stages if isinstance(decl, ast.Stages) else out.pipelines
        word = "stages" if isinstance(decl, ast.Stages) else "pipelines"
        if single.node is not None:
            resolver.error(f"`{word}` is already declared at line {single.node.span.line}", decl.span)
        single.node = decl
        single.fn = resolver.expect(decl.count, scope, INT, f"the number of {word}")
    elif isinstance(decl, ast.Route):
        if out.route is not None:
            resolver.error(f"`route` is already declared at line {out.route[0].span.line}", decl.span)
        inner = scope.child()
        binding = resolver.bind(inner, decl.var, INT, decl.var_span)
        out.route = (decl, binding.slot, resolver.expect(decl.pipeline, inner, INT, "a pipeline"))
    elif isinstance(decl, ast.Place):
        inner = scope.child()
        s_slot = resolver.bind(inner, decl.stage_var, INT, decl.var_spans[0]).slot
        p_slot = None
        if decl.pipeline_var is not None:
            p_slot = resolver.bind(inner, decl.pipeline_var, INT, decl.var_spans[1]).slot
        rank_fn = resolver.expect(decl.rank, inner, INT, "a rank")
        when_fn = None if decl.when is None else resolver.expect(decl.when, inner, BOOL, "a `when` condition")
        out.places.append((decl, s_slot, p_slot, rank_fn, when_fn))
    elif isinstance(decl, ast.DeviceMap):
        if out.device_map is not None:
            resolver.error(f"a device map is already declared at line {out.device_map[0].span.line}", decl.span)
        inner = scope.child()
        slot = resolver.bind(inner, decl.var, INT, decl.var_span).slot
        out.device_map = (decl, slot, resolver.expect(decl.device, inner, INT, "a device"))
    elif isinstance(decl, ast.Backward):
        pass  # read before the walk: tasks need to know it
    elif isinstance(decl, ast.ExplicitOrder):
        if out.explicit is None and out.greedy is None and out.sorted is None:
            inner = scope.child()
            slot = resolver.bind(inner, decl.rank_var, INT, decl.rank_span).slot
            out._state = _OrderState(resolver)
            body = _resolve_body(out, decl.body, inner)
            out.explicit = (decl, slot, body)
    elif isinstance(decl, ast.GreedyOrder):
        if out.explicit is None and out.greedy is None and out.sorted is None:
            out.greedy = decl
            _resolve_greedy(out, decl, scope)
    elif isinstance(decl, ast.SortedOrder):
        if out.explicit is None and out.greedy is None and out.sorted is None:
            out.sorted = decl
            inner = _resolve_order_lets(out, decl.lets, scope)
            _resolve_keys(out, decl.keys, inner, "key")
            family = ("F", "I", "W") if out.split_backward else ("F", "B")
            missing = [k for k in family if k not in out.priorities]
            if missing:
                resolver.error(f"`order sorted` needs a key for every kind of task; add `key {missing[0]}(s, m) = ...`", decl.span)


def _resolve_body(out: ResolvedSchedule, body: tuple, scope: Scope) -> list[Callable]:
    resolver = out.resolver
    compiled: list[Callable] = []
    for stmt in body:
        if isinstance(stmt, ast.Let):
            fn, type_ = resolver.expr(stmt.value, scope)
            slot = resolver.bind(scope, stmt.name, type_, stmt.name_span).slot
            compiled.append(_assign(slot, fn))
        elif isinstance(stmt, ast.Task):
            _check_kind(out, stmt)
            stage_fn = resolver.expect(stmt.stage, scope, INT, "a task's stage")
            mb_fn = resolver.expect(stmt.mb, scope, INT, "a task's microbatch")
            compiled.append(out._state.emitter(stmt, stage_fn, mb_fn))
        elif isinstance(stmt, ast.For):
            start = resolver.expect(stmt.start, scope, INT, "a range start")
            stop = resolver.expect(stmt.stop, scope, INT, "a range end")
            step = None if stmt.step is None else resolver.expect(stmt.step, scope, INT, "a range step")
            inner = scope.child()
            slot = resolver.bind(inner, stmt.var, INT, stmt.var_span).slot
            body_fns = _resolve_body(out, stmt.body, inner)
            compiled.append(_loop(stmt, slot, start, stop, step, body_fns, out.source, out.budget))
        elif isinstance(stmt, ast.If):
            cond = resolver.expect(stmt.cond, scope, BOOL, "an `if` condition")
            then = _resolve_body(out, stmt.then, scope.child())
            otherwise = _resolve_body(out, stmt.otherwise, scope.child())
            compiled.append(_branch(cond, then, otherwise))
    return compiled


def _check_kind(out: ResolvedSchedule, stmt: ast.Task) -> None:
    if out.split_backward and stmt.kind == "B":
        out.resolver.error("this schedule declares `backward split`: write I(...) then W(...) instead of B(...)", stmt.span)
    if not out.split_backward and stmt.kind in ("I", "W"):
        out.resolver.error(f"{stmt.kind}(...) needs `backward split` in the schedule (the default is `backward full`, task B)", stmt.span)


def _assign(slot: int, fn: Fn) -> Callable:
    def run(env):
        env[slot] = fn(env)

    return run


def _loop(
    node: ast.For, slot: int, start: Fn, stop: Fn, step: Fn | None, body: list[Callable], source: str, budget: _Budget
) -> Callable:
    def values(env) -> range:
        stride = 1 if step is None else step(env)
        if stride == 0:
            raise EvalError("a range step cannot be 0", node.step.span, source)
        span = range(start(env), stop(env), stride)
        budget.left -= len(span)
        if budget.left < 0:
            raise EvalError(
                f"the loops run more than {MAX_LOOP_ITERATIONS} iterations in all; is a bound wrong?", node.span, source
            )
        return span

    if len(body) == 1:
        (only,) = body

        def run_one(env):
            for value in values(env):
                env[slot] = value
                only(env)

        return run_one

    def run(env):
        for value in values(env):
            env[slot] = value
            for stmt in body:
                stmt(env)

    return run


def _branch(cond: Fn, then: list[Callable], otherwise: list[Callable]) -> Callable:
    def run(env):
        for stmt in then if cond(env) else otherwise:
            stmt(env)

    return run


def _resolve_order_lets(out: ResolvedSchedule, lets: tuple, scope: Scope) -> Scope:
    inner = scope.child()
    for let in lets:
        fn, type_ = out.resolver.expr(let.value, inner)
        out.order_lets.append((out.resolver.bind(inner, let.name, type_, let.name_span).slot, fn))
    return inner


def _resolve_keys(out: ResolvedSchedule, nodes: tuple, scope: Scope, word: str) -> None:
    """``priority``/``key`` KIND(s, m) = KEY, at most one per kind."""
    resolver = out.resolver
    for node in nodes:
        if node.kind in out.priorities:
            resolver.error(f"the {word} of {node.kind} is already given", node.span)
        if node.kind not in (("F", "I", "W") if out.split_backward else ("F", "B")):
            resolver.error(f"this schedule has no {node.kind} tasks (backward {'split' if out.split_backward else 'full'})", node.span)
        key_scope = scope.child()
        s_slot = resolver.bind(key_scope, node.stage_var, INT, node.var_spans[0]).slot
        m_slot = resolver.bind(key_scope, node.mb_var, INT, node.var_spans[1]).slot
        out.priorities[node.kind] = (s_slot, m_slot, resolver.expect(node.key, key_scope, KEY, f"a {word}"))


def _resolve_greedy(out: ResolvedSchedule, decl: ast.GreedyOrder, scope: Scope) -> None:
    resolver = out.resolver
    inner = _resolve_order_lets(out, decl.lets, scope)
    for node in decl.rules:
        if node.what in out.rank_rules:
            first = out.rank_rules[node.what][0]
            resolver.error(f"`{node.what}` is already given at line {first.span.line}", node.span)
            continue
        rule_scope = inner.child()
        slot = resolver.bind(rule_scope, node.rank_var, INT, node.rank_span).slot
        out.rank_rules[node.what] = (node, slot, resolver.expect(node.value, rule_scope, INT, f"a {node.what} count"))
    _resolve_keys(out, decl.priorities, inner, "priority")
    for extra in decl.prefer[1:]:
        resolver.error(f"`prefer` is already given at line {decl.prefer[0].span.line}", extra.span)
    if decl.prefer:
        kinds = decl.prefer[0].kinds
        if len(set(kinds)) != len(kinds):
            resolver.error("`prefer` lists a kind twice", decl.prefer[0].span)
        out.prefer = tuple(kinds) + tuple(k for k in DEFAULT_PREFER if k not in kinds)


# ----------------------------------------------------------------- helpers


def _raise_all(errors: list[ResolveError]):
    if len(errors) == 1:
        raise errors[0]
    raise SourceErrors(errors)


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
    if isinstance(raw, int):
        return raw
    try:
        return int(str(raw).strip(), 10)
    except ValueError:
        raise UsageError(f"schedule '{schedule}': {param.name} ({param.type}) must be an integer, not {raw!r}") from None


def _of_pipeline(p: int, pipelines: int) -> str:
    return f" of pipeline {p}" if pipelines > 1 else ""


def _text_of(source: str, span: Span) -> str:
    lines = source.splitlines()
    if span.end_line == span.line and 0 < span.line <= len(lines):
        return lines[span.line - 1][span.col - 1 : span.end_col - 1]
    if 0 < span.line <= len(lines):
        return lines[span.line - 1][span.col - 1 :].strip()
    return "?"


def _format_values(values: dict) -> str:
    return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())
