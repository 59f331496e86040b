"""Resolve a parsed schedule: names, types and its shape, before any parameter.

Contract: ``resolve(schedule, path, source, tasks)`` returns a ``ResolvedSchedule``
whose expressions and statements are compiled into closures
(``pipec.dsl.evaluate``), or raises every error it found at once: unknown
names, type mismatches, a missing ``stages``, a missing or second order,
parameters without the ``ranks``/``microbatches`` roles, tasks of the wrong
backward mode, keys or priorities given twice, the rules of each family
(asked of ``pipec.dsl.families``: weight passing's, ``pipec.dsl.weights``:
``weights`` without ``home``, a task outside every ``at step``, ``own`` with
``all_gather``, routes that do not pair, ...; sequence rings',
``pipec.dsl.rings``: ``sequence`` without ``hold``, ``mask`` or ``rings``, a
declaration of another family beside it, ...) and those of recomputation
(``recompute stage`` only in activation passing, ``R`` only where a stage is
recomputed, ``FC`` never written). A family whose declarations lay the
schedule out (a sequence ring) needs no stages, places, order or parameter
its family has no use for: the compiler derives its layout, and its order
unless ``order rank r`` writes it, each task compiled by the family.
This module tests no family: it asks the schedule's (``ResolvedSchedule.family``)
and every registered one.
"""
from __future__ import annotations

from typing import Callable

from pipec.dsl import ast
from pipec.dsl.composition import is_composition, resolve_composition
from pipec.dsl.evaluate import BOOL, INT, KEY, Resolver, Scope
from pipec.dsl.families import declared_families, family_of, first_word, owner_of
from pipec.dsl.order_body import assign_statement, branch_statement, loop_statement, OrderState
from pipec.dsl.schedule import DEFAULT_PREFER, ResolvedSchedule
from pipec.dsl.spec import TaskKinds
from pipec.errors import ResolveError, SourceErrors


def resolve(schedule: ast.Schedule, path: str, source: str, tasks: TaskKinds) -> ResolvedSchedule:
    """Resolve names and types of one schedule.

    Args:
        schedule: the parsed schedule.
        path, source: for messages.
        tasks: the task kinds a schedule may order (the compiler's rule table:
            ``pipec.compiler.driver.task_kinds()``).
    Returns:
        a ``ResolvedSchedule`` ready to ``evaluate``.
    Raises:
        SourceErrors: every resolution error found, at once.
    """
    if is_composition(schedule):  # a schedule built from another: its own declarations and rules
        return resolve_composition(schedule, path, source, tasks)
    resolver = Resolver(path, source)
    resolver.functions = {d.name: d for d in schedule.decls if isinstance(d, ast.FuncDef)}
    out = ResolvedSchedule(schedule, path, source, resolver, tasks=tasks)
    scope = Scope()
    # Read before anything: a family may need no microbatches parameter (a
    # sequence ring), refuse the other families' declarations instead of
    # resolving them, and say what an order body written before its
    # declarations may hold (tasks at steps).
    family = out.family = family_of(schedule)
    _resolve_params(out, schedule, scope)

    backward_nodes = [d for d in schedule.decls if isinstance(d, ast.Backward)]
    out.backward_mode = backward_nodes[-1].mode if backward_nodes else tasks.default_mode
    if out.backward_mode not in tasks.backward:
        resolver.error(f"there is no `backward {out.backward_mode}` (modes: {', '.join(tasks.backward)})",
                       backward_nodes[-1].span)
        out.backward_mode = tasks.default_mode
    out.split_backward = out.backward_mode != tasks.default_mode
    orders = [d for d in schedule.decls if isinstance(d, (ast.ExplicitOrder, ast.GreedyOrder, ast.SortedOrder))]
    # Read before the walk, like `backward`: an order body written before
    # `recompute` must already know that it may write the recompute.
    recomputes = [d for d in schedule.decls if isinstance(d, ast.Recompute)]
    out.recomputing = bool(recomputes)

    for decl in schedule.decls:
        if not isinstance(decl, family.foreign):
            _resolve_decl(out, decl, scope)

    if family.lays_out(out):  # its layout is derived, its order too unless written: only its own rules apply
        _check_laid_out_schedule(out, schedule, recomputes, orders)
    else:
        _check_pipeline_schedule(out, schedule, recomputes, orders, backward_nodes)
    if resolver.errors:
        _raise_all(resolver.errors)
    return out


def _check_laid_out_schedule(out: ResolvedSchedule, schedule: ast.Schedule, recomputes: list,
                             orders: list) -> None:
    """What a schedule its family lays out (a sequence ring) must (not) declare: its family's rules alone (the
    other families' declarations, orders among them, are refused there); errors go to ``out.resolver``."""
    out.family.check_schedule(out, schedule)
    _refuse_declarations(out, recomputes)
    _check_one_order(out, [d for d in orders if not isinstance(d, out.family.foreign)])


def _check_pipeline_schedule(out: ResolvedSchedule, schedule: ast.Schedule, recomputes: list, orders: list,
                             backward_nodes: list) -> None:
    """What a pipeline's (activation or weight passing) schedule must declare; errors go to ``out.resolver``."""
    resolver = out.resolver
    if out.stages.node is None:
        resolver.error("a schedule needs `stages EXPR` (how many stages each pipeline has)", schedule.span)
    for family in declared_families():  # a family's declarations without the one that makes it the schedule's too
        family.check_schedule(out, schedule)
    _refuse_declarations(out, recomputes)
    if not out.places and not any(family.places(out) for family in declared_families()):
        resolver.error("a schedule needs at least one `place stage s on rank EXPR`", schedule.span)
    if not orders:
        resolver.error(
            "a schedule needs an order: `order rank r { ... }`, `order greedy { ... }` or `order sorted { ... }`",
            schedule.span,
        )
    _check_one_order(out, orders)
    for extra in backward_nodes[1:]:
        resolver.error(f"`backward` is already declared at line {backward_nodes[0].span.line}", extra.span)


def _refuse_declarations(out: ResolvedSchedule, recomputes: list) -> None:
    """The ``recompute stage`` and ``stash weights`` of activation passing that the schedule's family refuses.

    Args:
        out: the schedule resolved (its family, its ``stash``; errors go to its resolver).
        recomputes: its ``recompute stage`` declarations, in text order.
    """
    stash = [] if out.stash is None else [out.stash[0]]
    for node in recomputes + stash:
        refusal = out.family.refusal(node)
        if refusal is not None:
            out.resolver.error(refusal, node.span)


def _check_one_order(out: ResolvedSchedule, orders: list) -> None:
    """A schedule has one order: each after the first is an error (at it, naming the first's line)."""
    for extra in orders[1:]:
        out.resolver.error(f"a schedule has one order; another is at line {orders[0].span.line}", extra.span)


def _resolve_params(out: ResolvedSchedule, schedule: ast.Schedule, scope: Scope) -> None:
    resolver = out.resolver
    out.resolve_params(schedule, scope)
    for role, attr in (("ranks", "ranks_param"), ("microbatches", "microbatches_param")):
        holders = [p for p in schedule.params if p.type == role]
        if len(holders) == 1:
            setattr(out, attr, holders[0].name)
        elif not holders:
            if role == "microbatches" and not out.family.microbatches:
                continue  # a sequence ring has no microbatches
            resolver.error(f"a schedule needs one parameter of type `{role}`", schedule.span)
        else:
            resolver.error(f"only one parameter may have type `{role}`", holders[1].span)


def _resolve_decl(out: ResolvedSchedule, decl: ast.Node, scope: Scope) -> None:
    resolver = out.resolver
    if isinstance(decl, ast.FuncDef):
        resolver.define_function(scope, decl)
    elif isinstance(decl, (ast.Let, ast.Require)):
        out.resolve_scalar(decl, scope)
    elif isinstance(decl, (ast.Stages, ast.Pipelines)):
        single = out.stages if isinstance(decl, ast.Stages) else out.pipelines
        word = "stages" if isinstance(decl, ast.Stages) else "pipelines"
        if single.node is not None:
            resolver.error(f"`{word}` is already declared at line {single.node.span.line}", decl.span)
        single.node = decl
        single.fn = resolver.expect(decl.count, scope, INT, f"the number of {word}")
    elif isinstance(decl, ast.Stash):
        if out.stash is not None:
            resolver.error(f"`stash weights` is already declared at line {out.stash[0].span.line}", decl.span)
        bound = None if decl.bound is None else resolver.expect(decl.bound, scope, INT, "the most weight versions")
        out.stash = (decl, bound)
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
    elif isinstance(decl, ast.Recompute):
        inner = scope.child()
        slot = resolver.bind(inner, decl.var, INT, decl.var_span).slot
        when_fn = None if decl.when is None else resolver.expect(decl.when, inner, BOOL, "a `when` condition")
        out.recomputes.append((decl, slot, when_fn))
    elif (owner := owner_of(decl)) is not None:  # a family's own declaration (`weights`, `sequence`, ...)
        owner.resolve_decl(out, decl, scope)
    elif isinstance(decl, ast.ExplicitOrder):
        if out.explicit is None and out.greedy is None and out.sorted is None:
            inner = scope.child()
            slot = resolver.bind(inner, decl.rank_var, INT, decl.rank_span).slot
            out._state = OrderState(resolver)
            body = _resolve_body(out, decl.body, inner)
            out.explicit = (decl, slot, body)
            out.explicit_cost = _body_cost(resolver, decl.body)
    elif isinstance(decl, ast.GreedyOrder):
        if out.explicit is None and out.greedy is None and out.sorted is None:
            out.greedy = decl
            _resolve_greedy(out, decl, scope)
    elif isinstance(decl, ast.SortedOrder):
        if out.explicit is None and out.greedy is None and out.sorted is None:
            out.sorted = decl
            inner = _resolve_order_lets(out, decl.lets, scope)
            _resolve_keys(out, decl.keys, inner, "key")
            family = out.tasks.required(out.backward_mode)
            missing = [k for k in family if k not in out.priorities]
            if missing:
                resolver.error(f"`order sorted` needs a key for every kind of task; add `key {missing[0]}(s, m) = ...`", decl.span)


def _resolve_body(out: ResolvedSchedule, body: tuple, scope: Scope, inside: ast.AtStep | None = None) -> list[Callable]:
    """Compile the statements of an explicit order's block.

    Args:
        out: the schedule being resolved (its order state, task kinds, budget).
        body: the block's statements.
        scope: the names visible to the block.
        inside: the ``at step`` block this one is in, or None.
    Returns:
        one closure per statement.
    """
    resolver = out.resolver
    compiled: list[Callable] = []
    for stmt in body:
        if isinstance(stmt, ast.Let):
            fn, type_ = resolver.expr(stmt.value, scope)
            slot = resolver.bind(scope, stmt.name, type_, stmt.name_span).slot
            compiled.append(assign_statement(slot, fn))
        elif isinstance(stmt, ast.Task):
            own = out.family.resolve_task(out, stmt, scope, inside)  # a family's own tasks (a ring's blocks)
            compiled.append(own if own is not None else _resolve_task(out, stmt, scope, inside))
        elif isinstance(stmt, ast.For):
            start = resolver.expect(stmt.start, scope, INT, "a range start")
            stop = resolver.expect(stmt.stop, scope, INT, "a range end")
            step = None if stmt.step is None else resolver.expect(stmt.step, scope, INT, "a range step")
            inner = scope.child()
            slot = resolver.bind(inner, stmt.var, INT, stmt.var_span).slot
            body_fns = _resolve_body(out, stmt.body, inner, inside)
            compiled.append(loop_statement(stmt, slot, start, stop, step, body_fns, out.source, out.budget,
                                           _body_cost(resolver, stmt.body)))
        elif isinstance(stmt, ast.If):
            cond = resolver.expect(stmt.cond, scope, BOOL, "an `if` condition")
            then = _resolve_body(out, stmt.then, scope.child(), inside)
            otherwise = _resolve_body(out, stmt.otherwise, scope.child(), inside)
            compiled.append(branch_statement(cond, then, otherwise))
        elif isinstance(stmt, ast.AtStep):
            compiled.append(_resolve_at_step(out, stmt, scope, inside))
    return compiled


def _resolve_task(out: ResolvedSchedule, stmt: ast.Task, scope: Scope, inside: ast.AtStep | None) -> Callable:
    """Compile a pipeline's task, ``KIND(stage, mb)``, of a kind the schedule orders.

    Args:
        out: the schedule being resolved (its family, task kinds and order state).
        stmt: the task statement.
        scope: the names visible to it.
        inside: the ``at step`` block it is in, or None (its family may need one).
    Returns:
        the closure that emits the task.
    """
    resolver = out.resolver
    _check_kind(out, stmt)
    if stmt.piece is not None:
        piece = first_word(lambda family: family.piece_elsewhere(out.tasks, stmt.kind))
        resolver.error(piece or f"{stmt.kind}(...) takes two arguments, a stage and a microbatch", stmt.piece.span)
    outside = None if inside is not None else out.family.outside_steps(stmt.kind)
    if outside is not None:
        resolver.error(outside, stmt.span)
    stage_fn = resolver.expect(stmt.stage, scope, INT, "a task's stage")
    mb_fn = resolver.expect(stmt.mb, scope, INT, "a task's microbatch")
    return out._state.emitter(stmt, stage_fn, mb_fn)


def _resolve_at_step(out: ResolvedSchedule, stmt: ast.AtStep, scope: Scope, outer: ast.AtStep | None) -> Callable:
    """``at step E { ... }``: only where the schedule's family puts tasks at steps, never inside another."""
    resolver = out.resolver
    if not out.family.at_steps:
        elsewhere = first_word(lambda family: family.at_step_elsewhere())
        resolver.error(elsewhere or "`at step` belongs to a family whose order has steps", stmt.span)
    if outer is not None:
        resolver.error(f"`at step` inside `at step` (line {outer.span.line}): a task belongs to one step", stmt.span)
    step = resolver.expect(stmt.step, scope, INT, "a step")
    body = _resolve_body(out, stmt.body, scope.child(), stmt)
    return out._state.at_step(stmt, step, body)


def _body_cost(resolver: Resolver, body: tuple) -> int:
    """The operations one run of a block takes, its loops' bodies apart (a loop pays for its own)."""
    cost = 0
    for stmt in body:
        if isinstance(stmt, ast.Let):
            cost += 1 + resolver.cost(stmt.value)
        elif isinstance(stmt, ast.Task):
            cost += 1 + resolver.cost(stmt.stage) + resolver.cost(stmt.mb) + resolver.cost(stmt.piece)
        elif isinstance(stmt, ast.For):
            cost += 1 + resolver.cost(stmt.start) + resolver.cost(stmt.stop) + resolver.cost(stmt.step)
        elif isinstance(stmt, ast.If):
            cost += 1 + resolver.cost(stmt.cond) + _body_cost(resolver, stmt.then) + _body_cost(resolver, stmt.otherwise)
        elif isinstance(stmt, ast.AtStep):
            cost += 1 + resolver.cost(stmt.step) + _body_cost(resolver, stmt.body)
    return cost


def _check_kind(out: ResolvedSchedule, stmt: ast.Task) -> None:
    """A task's kind must be one the schedule's backward mode orders (the rule table's kinds); a
    recompute needs a recomputed stage, and what a forward becomes there is written as the forward."""
    tasks, mode = out.tasks, out.backward_mode
    refusal = out.family.kind_refusal(tasks, stmt.kind)  # weight passing: no recompute, no update
    if refusal is not None:
        out.resolver.error(refusal, stmt.span)
        return
    if stmt.kind in tasks.recomputes and not out.recomputing:
        out.resolver.error(f"{stmt.kind}(...) runs a recomputed stage's forward again, and this schedule "
                           f"recomputes no stage: add `recompute stage s` (or `recompute stage s when COND`)",
                           stmt.span)
        return
    if stmt.kind in tasks.allowed(mode):
        return
    if stmt.kind in tasks.checkpointed:
        written = tasks.checkpointed[stmt.kind]
        out.resolver.error(f"{stmt.kind}(...) is what {written}(...) becomes on a recomputed stage (`recompute "
                           f"stage`); write {written}(s, m)", stmt.span)
        return
    elsewhere = first_word(lambda family: family.kind_elsewhere(tasks, stmt.kind))  # a ring's attention block
    if elsewhere is not None:
        out.resolver.error(elsewhere, stmt.span)
    elif stmt.kind not in tasks.kinds:
        out.resolver.error(f"there is no task {stmt.kind}(...) (tasks: {', '.join(tasks.kinds)})", stmt.span)
    elif mode != tasks.default_mode:
        mine = " then ".join(f"{kind}(...)" for kind in tasks.backward[mode])
        out.resolver.error(f"this schedule declares `backward {mode}`: write {mine} instead of {stmt.kind}(...)",
                           stmt.span)
    else:
        other = next(name for name, kinds in tasks.backward.items() if stmt.kind in kinds)
        default = " ".join(tasks.backward[mode])
        out.resolver.error(f"{stmt.kind}(...) needs `backward {other}` in the schedule (the default is "
                           f"`backward {mode}`, task {default})", stmt.span)


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
        if node.kind in out.tasks.optional:
            resolver.error(f"{node.kind} tasks are ordered only by an explicit order (`order rank r {{ ... }}`)",
                           node.span)
        elif node.kind in out.tasks.recomputes:
            resolver.error(f"{node.kind} tasks take no {word}: the compiler runs each right before its "
                           "backward (an explicit order, `order rank r { ... }`, may place them itself)", node.span)
        elif node.kind in out.tasks.checkpointed:
            resolver.error(f"the {word} of {out.tasks.checkpointed[node.kind]} orders the forwards of recomputed "
                           f"stages too; write {out.tasks.checkpointed[node.kind]}(s, m)", node.span)
        elif node.kind not in out.tasks.required(out.backward_mode):
            resolver.error(f"this schedule has no {node.kind} tasks (backward {out.backward_mode})", node.span)
        key_scope = scope.child()
        s_slot = resolver.bind(key_scope, node.stage_var, INT, node.var_spans[0]).slot
        m_slot = resolver.bind(key_scope, node.mb_var, INT, node.var_spans[1]).slot
        out.priorities[node.kind] = (s_slot, m_slot, resolver.expect(node.key, key_scope, KEY, f"a {word}"))
        out.key_cost += resolver.cost(node.key)


def _resolve_greedy(out: ResolvedSchedule, decl: ast.GreedyOrder, scope: Scope) -> None:
    resolver = out.resolver
    inner = _resolve_order_lets(out, decl.lets, scope)
    for node in decl.rules:
        if node.what in out.rank_rules:
            first = out.rank_rules[node.what][0]
            resolver.error(f"`{node.what}` is already given at line {first.span.line}", node.span)
            continue
        if node.what == "deferred" and not out.split_backward:
            resolver.error("`deferred` bounds the W tasks that wait, and this schedule has none (backward full; "
                           "write `backward split`)", node.span)
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
    _resolve_in_order(out, decl.in_order)


def _resolve_in_order(out: ResolvedSchedule, nodes: tuple) -> None:
    """``in order KIND, ...``: at most once, each kind once, a kind the schedule runs."""
    resolver = out.resolver
    for extra in nodes[1:]:
        resolver.error(f"`in order` is already given at line {nodes[0].span.line}", extra.span)
    if not nodes:
        return
    kinds = nodes[0].kinds
    if len(set(kinds)) != len(kinds):
        resolver.error("`in order` lists a kind twice", nodes[0].span)
    for kind in kinds:
        if kind not in out.tasks.required(out.backward_mode):
            resolver.error(f"this schedule has no {kind} tasks (backward {out.backward_mode})", nodes[0].span)
    out.in_order = tuple(kinds)


def _raise_all(errors: list[ResolveError]):
    if len(errors) == 1:
        raise errors[0]
    raise SourceErrors(errors)
