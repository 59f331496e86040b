"""The run-time side of explicit order bodies (``order rank r { ... }``).

Resolution (``pipec.dsl.resolve``) turns each statement into a closure over the
schedule's flat ``env``; these are the closures for loops, branches, lets,
``at step`` blocks and tasks. ``OrderState`` collects the tasks a body emits
and checks each one where it is written (range, home rank, duplicates, and in
a weight-passing schedule a step that never goes back) and, at the end, that
none is missing, so every mistake is reported at the statement responsible.
"""
from __future__ import annotations

from typing import Callable

from pipec.dsl import ast
from pipec.dsl.evaluate import Fn, Resolver
from pipec.dsl.limits import MAX_OPERATIONS, MAX_STEP_CELLS
from pipec.dsl.schedule import Budget, of_pipeline
from pipec.dsl.spec import ScheduleSpec
from pipec.errors import EvalError, ScheduleError


class OrderState:
    """Collects the tasks an explicit order emits and checks each where written."""

    def __init__(self, resolver: Resolver):
        self.source = resolver.source

    def start(self, spec: ScheduleSpec, home: bool = False) -> None:
        """Begin an evaluation of the order for ``spec``.

        Args:
            spec: the schedule evaluated so far (layout, and weights if any).
            home: the layout is ``home``'s (one pipeline per rank): a task on
                the wrong rank is named by its microbatch's home.
        """
        self.spec = spec
        self.home = home
        self.N = spec.num_microbatches
        self.S = spec.num_stages
        self.stage_rank = [r for row in spec.placement for r in row]
        self.mb_offset = [p * self.S for p in spec.mb_pipeline]
        # One flag per (kind, stage position, microbatch): a microbatch rides one
        # pipeline, so the position names the stage (kinds x S x N, bounded by
        # the task limit, whatever the number of pipelines).
        self.seen = bytearray(len(spec.tasks.kinds) * self.S * self.N)
        self.kind_index = {kind: index for index, kind in enumerate(spec.tasks.kinds)}
        self.orders: list[list[tuple[str, int, int]]] = []
        self.rank = 0
        self.out: list = []
        # Weight passing: per rank the step of each task (None otherwise), the
        # step of the `at step` block running, and the steps of the rank running.
        self.steps: list[list[int]] | None = [] if spec.weights is not None else None
        self.step: int | None = None
        self.step_out: list[int] = []

    def begin_rank(self, rank: int) -> None:
        self.rank = rank
        self.out = []
        self.orders.append(self.out)
        if self.steps is not None:
            self.step_out = []
            self.steps.append(self.step_out)

    def at_step(self, node: ast.AtStep, step_fn: Fn, body: list[Callable]) -> Callable[[list], None]:
        """``at step E { ... }``: the tasks the body emits belong to step E (an integer >= 0)."""
        state = self

        def run(env):
            step = step_fn(env)
            if step < 0:
                raise EvalError(f"a step is 0 or more; this one is {step}", node.step.span, state.source)
            ranks = state.spec.num_ranks
            if (step + 1) * ranks > MAX_STEP_CELLS:
                raise EvalError(
                    f"step {step} on {ranks} rank(s) makes {step + 1:,} x {ranks} step cells, more than pipec's "
                    f"limit of {MAX_STEP_CELLS:,}: weight passing walks every step of every rank",
                    node.step.span, state.source)
            outer, state.step = state.step, step
            for stmt in body:
                stmt(env)
            state.step = outer

        return run

    def check_step(self, node: ast.Task, text: str) -> None:
        """Record the step of the task being emitted (``text``); a rank's steps never go back."""
        out = self.step_out
        if out and self.step < out[-1]:
            kind, sid, m = self.out[-1]
            raise ScheduleError(
                f"{text} is at step {self.step} on rank {self.rank}, after {kind}({sid % self.S}, {m}) at step "
                f"{out[-1]}: the steps of a rank never go back",
                node.span,
                self.source,
            )
        out.append(self.step)

    def emitter(self, node: ast.Task, stage_fn: Fn, mb_fn: Fn) -> Callable[[list], None]:
        kind = node.kind
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
                if state.home:
                    raise ScheduleError(
                        f"{kind}({s}, {m}) runs on rank {state.rank}, but microbatch {m}'s home is rank "
                        f"{state.stage_rank[sid]}: a microbatch's tasks all run on its home",
                        node.span,
                        state.source,
                    )
                raise ScheduleError(
                    f"{kind}({s}, {m}) runs on rank {state.rank}, but stage {s}"
                    f"{of_pipeline(sid // state.S, state.spec.num_pipelines)} is placed on rank {state.stage_rank[sid]}",
                    node.span,
                    state.source,
                )
            key = (state.kind_index[kind] * state.S + s) * state.N + m
            if state.seen[key]:
                raise ScheduleError(
                    f"{kind}({s}, {m}) is scheduled twice (first at {state._where(kind, sid, m)})",
                    node.span,
                    state.source,
                )
            if state.steps is not None:
                state.check_step(node, f"{kind}({s}, {m})")
            state.seen[key] = 1
            state.out.append((kind, sid, m))

        return emit

    def _where(self, kind: str, sid: int, m: int) -> str:
        for rank, row in enumerate(self.orders):
            for step, task in enumerate(row):
                if task == (kind, sid, m):
                    if self.steps is not None:  # a weight-passing order's steps are its `at step`s
                        return f"rank {rank}, at step {self.steps[rank][step]}"
                    return f"rank {rank}, step {step}"
        return "an earlier step"

    def finish(self, node: ast.ExplicitOrder) -> None:
        """Every task of the family must appear (optional ones may): report the first one missing."""
        spec = self.spec
        kinds = spec.required_kinds
        expected = len(kinds) * len(spec.mb_pipeline) * self.S
        emitted = sum(1 for row in self.orders for task in row if task[0] in kinds)
        if emitted == expected:
            return
        for kind in kinds:
            base = spec.tasks.index(kind) * self.S
            for m, p in enumerate(spec.mb_pipeline):
                for s in range(self.S):
                    if self.seen[(base + s) * self.N + m]:
                        continue
                    sid = p * self.S + s
                    who = (f"rank {p}, microbatch {m}'s home, must run it" if self.home else
                           f"rank {self.stage_rank[sid]} runs stage {s}{of_pipeline(p, spec.num_pipelines)} "
                           "and must run it")
                    raise ScheduleError(f"{kind}({s}, {m}) is never scheduled: {who}", node.span, self.source)


def assign_statement(slot: int, fn: Fn) -> Callable:
    def run(env):
        env[slot] = fn(env)

    return run


def loop_statement(
    node: ast.For,
    slot: int,
    start: Fn,
    stop: Fn,
    step: Fn | None,
    body: list[Callable],
    source: str,
    budget: Budget,
    body_cost: int = 0,
) -> Callable:
    """A ``for``: pays its iterations times (1 + ``body_cost``, its body's operations) before it runs."""
    per_iteration = 1 + body_cost

    def values(env) -> range:
        stride = 1 if step is None else step(env)
        if stride == 0:
            raise EvalError("a range step cannot be 0", node.step.span, source)
        span = range(start(env), stop(env), stride)
        try:
            budget.left -= len(span) * per_iteration
        except OverflowError:  # more than sys.maxsize values: past any budget
            budget.left = -1
        if budget.left < 0:
            raise EvalError(
                f"the loops run more than {MAX_OPERATIONS:,} operations in all (pipec's limit: iterations times "
                f"the operations of their bodies); is a bound wrong?",
                node.span,
                source,
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


def branch_statement(cond: Fn, then: list[Callable], otherwise: list[Callable]) -> Callable:
    def run(env):
        for stmt in then if cond(env) else otherwise:
            stmt(env)

    return run
