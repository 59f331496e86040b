"""The run-time side of explicit order bodies (``order rank r { ... }``).

Resolution (``pipec.dsl.resolve``) turns each statement into a closure over the
schedule's flat ``env``; these are the closures for loops, branches, lets,
``at step`` blocks and tasks. ``OrderState`` collects the tasks a body emits
and checks each one where it is written (range, home rank, duplicates, and in
a weight-passing schedule a step that never goes back) and, at the end, that
none is missing, so every mistake is reported at the statement responsible.

A sequence ring's written order is collected the same way, each block checked
where it is written for what the front end knows: its chunks and piece in
range, its queries held by the rank, its step in 0..2P-1, a forward block at a
forward step (0..P-1) and a backward one at a backward step (P..2P-1), steps
that never go back. Whether the rank holds the block's KV then, whether every
visible block is computed once forward and once backward and nothing else, is
the compiler's ring check to prove (``compiler/checks/rings.py``): it knows the
rings.
"""
from __future__ import annotations

from typing import Callable

from pipec.dsl import ast
from pipec.dsl.evaluate import Fn, Resolver
from pipec.dsl.limits import MAX_OPERATIONS, MAX_PASSING_STEP_CELLS, MAX_TASKS, PASSING_LIMIT_TEXT
from pipec.dsl.families import declared_in
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
        self.orders: list[list[tuple[str, int, int]]] = []
        self.rank = 0
        self.out: list = []
        # The families the schedule declares (``dsl/families.py``). Those whose orders put tasks at
        # steps (weight passing, a ring's written order): per rank the step of each task (None
        # otherwise), the step of the `at step` block running, and the steps of the rank running.
        self.declared = declared_in(spec)
        self.steps: list[list[int]] | None = [] if any(family.at_steps for family, _ in self.declared) else None
        self.step: int | None = None
        self.step_out: list[int] = []
        self.last_text = ""  # the rank's task emitted last, as written (for the steps' message)
        # An order of blocks (a sequence ring's: its blocks' numbering, how many were written in all); no task grid.
        self.blocks = next((blocks for blocks in (family.written_blocks(declared) for family, declared in self.declared)
                            if blocks is not None), None)
        if self.blocks is not None:
            return
        self.N = spec.num_microbatches
        self.S = spec.num_stages
        self.stage_rank = [r for row in spec.placement for r in row]
        self.mb_offset = [p * self.S for p in spec.mb_pipeline]
        # One flag per (kind, stage position, microbatch): a microbatch rides one
        # pipeline, so the position names the stage (kinds x S x N, bounded by
        # the task limit, whatever the number of pipelines).
        self.seen = bytearray(len(spec.tasks.kinds) * self.S * self.N)
        self.kind_index = {kind: index for index, kind in enumerate(spec.tasks.kinds)}
        # Recomputed stages: a written forward runs as what it becomes there
        # (F as FC), and a recompute (R) may be written only there.
        self.recomputed = spec.recomputed
        self.ran_as = {written: keeping for written, (keeping, _) in spec.tasks.recompute.items()}
        self.remakers = frozenset(spec.tasks.recomputes)

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
            for family, declared in state.declared:
                refusal = family.step_refusal(declared, step, ranks)
                if refusal is not None:
                    raise EvalError(refusal, node.step.span, state.source)
            if (step + 1) * ranks > MAX_PASSING_STEP_CELLS:
                raise EvalError(
                    f"step {step} on {ranks} rank(s) makes {step + 1:,} x {ranks} step cells, more than pipec's "
                    f"limit of {MAX_PASSING_STEP_CELLS:,}: weight passing walks every step of every rank "
                    f"({PASSING_LIMIT_TEXT})", node.step.span, state.source)
            outer, state.step = state.step, step
            for stmt in body:
                stmt(env)
            state.step = outer

        return run

    def check_step(self, node: ast.Task, text: str) -> None:
        """Record the step of the task being emitted (``text``); a rank's steps never go back."""
        out = self.step_out
        if out and self.step < out[-1]:
            raise ScheduleError(
                f"{text} is at step {self.step} on rank {self.rank}, after {self.last_text} at step "
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
            ran = kind
            if s in state.recomputed:
                ran = state.ran_as.get(kind, kind)
            elif kind in state.remakers:
                raise ScheduleError(
                    f"{kind}({s}, {m}) recomputes stage {s}'s forward, but stage {s} is not recomputed: add a "
                    f"`recompute stage s when COND` whose condition holds for s = {s}, or drop {kind}({s}, {m})",
                    node.span,
                    state.source,
                )
            key = (state.kind_index[kind] * state.S + s) * state.N + m
            if state.seen[key]:
                raise ScheduleError(
                    f"{kind}({s}, {m}) is scheduled twice (first at {state._where(ran, sid, m)})",
                    node.span,
                    state.source,
                )
            if state.steps is not None:
                state.check_step(node, f"{kind}({s}, {m})")
                state.last_text = f"{kind}({s}, {m})"
            state.seen[key] = 1
            state.out.append((ran, sid, m))

        return emit

    def ring_emitter(self, node: ast.Task, q_fn: Fn, kv_fn: Fn, piece_fn: Fn | None,
                     forward: bool) -> Callable[[list], None]:
        """A block of a sequence ring's written order, ``KIND(q, kv[, piece])``, emitted as
        ``(KIND, q, kv * pieces + piece)`` at the step of its ``at step``; ``forward``: KIND is a
        forward block (written at steps 0..P-1), else a backward one (P..2P-1)."""
        kind = node.kind
        state = self

        def emit(env):
            blocks, ranks = state.blocks, state.spec.num_ranks
            rings = blocks.spec
            q, kv = q_fn(env), kv_fn(env)
            piece = 0 if piece_fn is None else piece_fn(env)
            text = f"{kind}({q}, {kv})" if piece_fn is None else f"{kind}({q}, {kv}, {piece})"
            for value, expr, what in ((q, node.stage, "query chunk"), (kv, node.mb, "KV chunk")):
                if not 0 <= value < rings.chunks:
                    raise EvalError(f"{text}: {what} {value} is outside 0..{rings.chunks - 1}", expr.span,
                                    state.source)
            if not 0 <= piece < blocks.pieces:
                why = "" if rings.pieces is not None else " (one ring: one piece per chunk unless `pieces` says more)"
                raise EvalError(f"{text}: piece {piece} is outside 0..{blocks.pieces - 1}{why}", node.piece.span,
                                state.source)
            holder = rings.holders[q]
            if holder != state.rank:
                raise ScheduleError(f"{text} runs on rank {state.rank}, but chunk {q} is held by rank {holder}: a "
                                    "block runs on the rank that holds its queries", node.span, state.source)
            if forward and state.step >= ranks:
                raise ScheduleError(f"{text} is at step {state.step}, a backward step ({ranks}..{2 * ranks - 1} on "
                                    f"{ranks} rank(s)): {kind} is a forward block, written at steps 0..{ranks - 1}",
                                    node.span, state.source)
            if not forward and state.step < ranks:
                raise ScheduleError(f"{text} is at step {state.step}, a forward step (0..{ranks - 1} on {ranks} "
                                    f"rank(s)): {kind} is a backward block, written at steps {ranks}..{2 * ranks - 1}"
                                    ", after every forward block", node.span, state.source)
            blocks.written += 1
            if blocks.written > MAX_TASKS:
                raise EvalError(f"the order writes more than {MAX_TASKS:,} blocks in all (pipec's limit on tasks; "
                                "a ring computes each visible block once forward and once backward)", node.span,
                                state.source)
            state.check_step(node, text)
            state.last_text = text
            state.out.append((kind, q, kv * blocks.pieces + piece))

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
        """Every task of the family must appear (optional ones may): report the first one missing.

        A sequence ring's blocks are the ring check's to count (which are visible is the mask's and the
        pieces', where each KV is when is the rings')."""
        if self.blocks is not None:
            return
        spec = self.spec
        kinds = spec.required_kinds
        expected = len(kinds) * len(spec.mb_pipeline) * self.S
        counted = set(kinds) | {self.ran_as[kind] for kind in kinds if kind in self.ran_as}  # F, and FC for it
        emitted = sum(1 for row in self.orders for task in row if task[0] in counted)
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
