"""The weight-passing declarations (WeiPipe, TawPipe, FSDP): resolved, checked, evaluated.

In this family every rank keeps its own microbatches and runs every layer on
them; layer weights travel. The front end models it as one pipeline per rank
(stage = layer, every stage of pipeline p on rank p, microbatch m riding
pipeline ``home(m)``), so every activation hand-off is local, plus a
``WeightSpec`` that says how weights and gradients move. The declarations:

* ``home microbatch m on rank E``: the sugar for that layout (instead of
  ``pipelines``, ``route`` and ``place``);
* ``own layer l on rank E``, ``group rank r in E``;
* ``weights ROUTE [by E]``, ``gradients ROUTE``, ``prefetch E``, ``buffers E``.

Contract: ``resolve_weight_decl`` compiles one declaration; ``check_weight_rules``
reports, before any parameter, every rule that ties them (``weights`` needs
``home`` and an explicit order, ``own`` unless ``all_gather``, ...);
``home_pipelines`` and ``weight_spec`` evaluate them with the parameters,
raising ``EvalError`` at the expression whose value is out of range. The
``at step E`` blocks of an order body are resolved with the body
(``pipec.dsl.resolve``) and run by ``pipec.dsl.order_body``. The family's
``Declared`` (``pipec.dsl.families``) answers resolution and evaluation with
these, and says why weight passing refuses recomputation, ``stash weights``
and updates in the order, and a task outside every ``at step``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipec.dsl import ast
from pipec.dsl.evaluate import INT, Fn, Resolver, Scope
from pipec.dsl.families import Declared, register
from pipec.dsl.limits import MAX_STEP_CELLS
from pipec.dsl.spec import WeightSpec
from pipec.errors import EvalError

if TYPE_CHECKING:
    from pipec.dsl.schedule import Budget

WEIGHT_DECLS = (ast.Home, ast.Own, ast.Group, ast.Weights, ast.Gradients, ast.WeightCount)

# The gradient route a weight route implies when `gradients` is not written:
# gradients go back the way weights came.
DEFAULT_GRADIENTS = {"ring": "ring", "direct": "direct", "staged": "reduce", "all_gather": "reduce_scatter"}

# How each declaration is named in messages.
_WORD = {ast.Home: "home", ast.Own: "own", ast.Group: "group", ast.Weights: "weights", ast.Gradients: "gradients"}


@dataclass
class WeightDecls:
    """A schedule's weight-passing declarations, each compiled (None when absent).

    Attributes:
        home, own, group: the declaration, its variable's slot and its value's closure.
        weights: ``weights ROUTE [by E]``; ``ring_by`` the closure of ``E``.
        gradients: ``gradients ROUTE``.
        counts: ``prefetch`` / ``buffers`` -> the declaration and its value's closure.
    """

    home: tuple[ast.Home, int, Fn] | None = None
    own: tuple[ast.Own, int, Fn] | None = None
    group: tuple[ast.Group, int, Fn] | None = None
    weights: ast.Weights | None = None
    ring_by: Fn | None = None
    gradients: ast.Gradients | None = None
    counts: dict[str, tuple[ast.WeightCount, Fn]] = field(default_factory=dict)

    def declared(self) -> list[ast.Node]:
        """Every declaration held, in text order (messages about them come in that order)."""
        nodes = [self.weights, self.gradients] + [entry[0] for entry in (self.home, self.own, self.group) if entry]
        nodes = [node for node in nodes if node is not None] + [node for node, _ in self.counts.values()]
        return sorted(nodes, key=lambda node: (node.span.line, node.span.col))


def resolve_weight_decl(resolver: Resolver, decls: WeightDecls, decl: ast.Node, scope: Scope) -> None:
    """Compile one weight-passing declaration into ``decls``; a second one of a kind is an error.

    Args:
        resolver: the schedule's resolver (errors are collected there).
        decls: where the compiled declaration goes.
        decl: one of ``WEIGHT_DECLS``.
        scope: the names visible at the declaration.
    """
    first = _same_kind(decls, decl)
    if first is not None:
        resolver.error(f"`{_word(decl)}` is already declared at line {first.span.line}", decl.span)
        return
    if isinstance(decl, (ast.Home, ast.Own, ast.Group)):
        inner = scope.child()
        slot = resolver.bind(inner, decl.var, INT, decl.var_span).slot
        value = decl.group if isinstance(decl, ast.Group) else decl.rank
        what = {ast.Home: "a home rank", ast.Own: "an owner rank", ast.Group: "a group"}[type(decl)]
        entry = (decl, slot, resolver.expect(value, inner, INT, what))
        setattr(decls, _word(decl), entry)
    elif isinstance(decl, ast.Weights):
        decls.weights = decl
        if decl.by is not None:
            decls.ring_by = resolver.expect(decl.by, scope, INT, "a ring offset")
    elif isinstance(decl, ast.Gradients):
        decls.gradients = decl
    else:
        decls.counts[decl.what] = (decl, resolver.expect(decl.value, scope, INT, f"a {decl.what} count"))


def _same_kind(decls: WeightDecls, decl: ast.Node) -> ast.Node | None:
    """The declaration of ``decl``'s kind already held, or None."""
    if isinstance(decl, ast.WeightCount):
        held = decls.counts.get(decl.what)
        return None if held is None else held[0]
    held = getattr(decls, _word(decl))
    return held[0] if isinstance(held, tuple) else held


def _word(decl: ast.Node) -> str:
    return decl.what if isinstance(decl, ast.WeightCount) else _WORD[type(decl)]


# ------------------------------------------------------------ resolve-time rules


def check_weight_rules(resolver: Resolver, decls: WeightDecls, schedule: ast.Schedule) -> None:
    """Report every broken rule between the declarations that needs no parameter value.

    Args:
        resolver: collects the errors.
        decls: the schedule's weight-passing declarations, resolved.
        schedule: the whole schedule (its layout declarations and its order).
    """
    _check_home_alone(resolver, decls, schedule)
    if decls.weights is None:
        for node in decls.declared():
            if not isinstance(node, ast.Home):
                resolver.error(f"`{_word(node)}` belongs to weight passing: it needs `weights ROUTE` "
                               "(ring, direct, staged or all_gather)", node.span)
        return
    weights = decls.weights
    if decls.home is None:
        resolver.error("weight passing needs `home microbatch m on rank EXPR`: every rank keeps its own "
                       "microbatches and runs every layer on them", weights.span)
    orders = [d for d in schedule.decls if isinstance(d, (ast.ExplicitOrder, ast.GreedyOrder, ast.SortedOrder))]
    if orders and not isinstance(orders[0], ast.ExplicitOrder):
        resolver.error("weight passing needs an explicit order, `order rank r { at step EXPR { ... } }`: "
                       "weights move between the steps it names", orders[0].span)
    _check_owners(resolver, decls, weights)
    if weights.by is not None and weights.route != "ring":
        resolver.error(f"`by` is the ring's offset; `weights {weights.route}` takes none", weights.by.span)
    if decls.gradients is not None:
        _check_gradients(resolver, weights.route, decls.gradients)


def _check_home_alone(resolver: Resolver, decls: WeightDecls, schedule: ast.Schedule) -> None:
    """``home`` lays the pipelines out itself: ``pipelines``, ``route`` and ``place`` would contradict it."""
    if decls.home is None:
        return
    home = decls.home[0]
    words = {ast.Pipelines: "pipelines", ast.Route: "route microbatch", ast.Place: "place"}
    for decl in schedule.decls:
        word = words.get(type(decl))
        if word is not None:
            resolver.error(f"`{word}` cannot be combined with `home` (line {home.span.line}), which already makes "
                           "one pipeline per rank, places stage s of pipeline p on rank p and routes each "
                           "microbatch to its home", decl.span)


def _check_owners(resolver: Resolver, decls: WeightDecls, weights: ast.Weights) -> None:
    """Every route but ``all_gather`` needs the layers' owners; ``all_gather`` has none."""
    if weights.route == "all_gather":
        if decls.own is not None:
            resolver.error("all_gather shards every layer over every rank: no rank owns a layer; drop `own`",
                           decls.own[0].span)
    elif decls.own is None:
        resolver.error(f"`weights {weights.route}` needs `own layer l on rank EXPR` (the rank that keeps each "
                       "layer's master weights)", weights.span)


def _check_gradients(resolver: Resolver, route: str, gradients: ast.Gradients) -> None:
    """The gradient routes each weight route can pair with."""
    if gradients.route == "ring" and route != "ring":
        resolver.error(f"`gradients ring` travels with the weights' ring: it needs `weights ring`, "
                       f"not `weights {route}`", gradients.span)
    elif gradients.route == "reduce_scatter" and route != "all_gather":
        resolver.error(f"`gradients reduce_scatter` scatters to the shards of `weights all_gather`; "
                       f"this schedule has `weights {route}`", gradients.span)
    elif route == "all_gather" and gradients.route != "reduce_scatter":
        resolver.error(f"`weights all_gather` keeps no owners: its gradients are `reduce_scatter`, "
                       f"not `{gradients.route}`", gradients.span)


# ------------------------------------------------------------------ evaluation


def home_pipelines(decls: WeightDecls, env: list, N: int, P: int, resolver: Resolver, budget: "Budget") -> list[int]:
    """Evaluate ``home microbatch m on rank E`` for every microbatch.

    Args:
        decls: holds the ``home`` declaration.
        env: the schedule's slots, parameters and lets set.
        N, P: microbatches and ranks.
        resolver, budget: for the expression's cost and the evaluation budget.
    Returns:
        microbatch -> its home rank (= the pipeline it rides).
    Raises:
        EvalError: a home outside 0..P-1, at the expression.
    """
    node, slot, fn = decls.home
    budget.charge(N, resolver.cost(node.rank), "the home of each microbatch", node.span, resolver.source)
    return _per_index(env, slot, fn, N, P, node.rank, resolver.source, "microbatch {i} has home rank {v}")


def weight_spec(decls: WeightDecls, env: list, P: int, S: int, resolver: Resolver, budget: "Budget") -> WeightSpec:
    """Evaluate the weight-passing declarations into a ``WeightSpec``.

    Args:
        decls: the declarations (``weights`` among them).
        env: the schedule's slots, parameters and lets set.
        P, S: ranks and layers (stages).
        resolver, budget: for the expressions' costs and the evaluation budget.
    Returns:
        the ``WeightSpec``, defaults filled in.
    Raises:
        EvalError: an owner or a group outside 0..P-1, a ring offset that is
            0 mod P, a negative prefetch, fewer than one buffer.
    """
    source = resolver.source
    weights = decls.weights
    ring_by = 1 if decls.ring_by is None else decls.ring_by(env)
    if weights.route == "ring" and P > 1 and ring_by % P == 0:
        raise EvalError(f"the ring offset is {ring_by}, a multiple of the {P} ranks: every rank would pass its "
                        "slot to itself", weights.by.span, source)
    owners = None
    if decls.own is not None:
        node, slot, fn = decls.own
        budget.charge(S, resolver.cost(node.rank), "the owner of each layer", node.span, source)
        owners = tuple(_per_index(env, slot, fn, S, P, node.rank, source, "layer {i} is owned by rank {v}"))
    groups = (0,) * P
    if decls.group is not None:
        node, slot, fn = decls.group
        budget.charge(P, resolver.cost(node.group), "the group of each rank", node.span, source)
        groups = tuple(_per_index(env, slot, fn, P, P, node.group, source, "rank {i} is in group {v}"))
    gradients = DEFAULT_GRADIENTS[weights.route] if decls.gradients is None else decls.gradients.route
    return WeightSpec(route=weights.route, ring_by=ring_by, gradients=gradients, owners=owners, groups=groups,
                      prefetch=_count(decls, env, "prefetch", 0, source),
                      buffers=_count(decls, env, "buffers", 1, source))


def _per_index(env: list, slot: int, fn: Fn, count: int, P: int, expr: ast.Node, source: str,
               what: str) -> list[int]:
    """``fn`` for each index 0..count-1 bound in ``slot``; each value must be a rank (0..P-1).

    Args:
        what: the message's start, with ``{i}`` the index and ``{v}`` the value.
    """
    out = []
    for i in range(count):
        env[slot] = i
        value = fn(env)
        if not 0 <= value < P:
            raise EvalError(what.format(i=i, v=value) + f", outside 0..{P - 1}", expr.span, source)
        out.append(value)
    return out


def _count(decls: WeightDecls, env: list, what: str, minimum: int, source: str) -> int | None:
    """``prefetch`` / ``buffers``: its value, at least ``minimum``, or its default when not
    declared (``_DEFAULT_COUNT``)."""
    entry = decls.counts.get(what)
    if entry is None:
        return _DEFAULT_COUNT[what]
    node, fn = entry
    value = fn(env)
    if value < minimum:
        raise EvalError(f"`{what}` must be at least {minimum}, got {value}", node.value.span, source)
    if value > MAX_STEP_CELLS:  # more steps ahead, or buffers, than any order has steps: a mistake
        raise EvalError(f"`{what}` must be at most {MAX_STEP_CELLS:,} (pipec's limit on steps), got {value:,}",
                        node.value.span, source)
    return value


# A count not declared: no prefetch; no bound on the buffers.
_DEFAULT_COUNT = {"prefetch": 0, "buffers": None}


# Activation passing's declarations a weight-passing schedule cannot hold, and why.
_REFUSALS = {
    ast.Recompute: "`recompute stage` belongs to activation passing: weight passing already recomputes every layer "
                   "(its F keeps only the layer's input, its B runs the forward again)",
    ast.Stash: "`stash weights` belongs to activation passing: under weight passing each layer's owner steps its "
               "optimizer after the list",
}


class _WeightPassing(Declared):
    """Weight passing's declarations: a ``WeightSpec`` beside the layout, its order's tasks at steps,
    no recomputation nor update of activation passing's."""

    field = "weights"
    at_steps = True
    decls = WEIGHT_DECLS

    def declares(self, schedule):
        return any(isinstance(decl, ast.Weights) for decl in schedule.decls)

    def resolve_decl(self, schedule, decl, scope):
        resolve_weight_decl(schedule.resolver, schedule.weight_decls, decl, scope)

    def check_schedule(self, schedule, node):
        check_weight_rules(schedule.resolver, schedule.weight_decls, node)

    def refusal(self, decl):
        return _REFUSALS.get(type(decl))

    def places(self, schedule):
        return schedule.weight_decls.home is not None  # `home` lays out one pipeline per rank

    def outside_steps(self, kind):
        return (f"{kind}(...) is outside every `at step`: in a weight-passing schedule every task belongs to a "
                "step, `at step EXPR { ... }`")

    def kind_refusal(self, tasks, kind):
        if kind in tasks.recomputes:
            return (f"{kind}(...) recomputes a stage's forward, and weight passing needs none: its B already "
                    "runs the layer's forward again from the input its F kept")
        if kind in tasks.updates:
            return (f"{kind}(...) updates a stage's weights inside the order, and under weight passing each "
                    "layer's owner steps its optimizer after the list: asynchronous updates belong to "
                    "activation passing")
        return None

    def at_step_elsewhere(self):
        return "`at step` belongs to weight passing: it needs `weights ROUTE` (ring, direct, staged or all_gather)"

    def evaluate(self, schedule, env, spec):
        decls = schedule.weight_decls
        if decls.weights is not None:  # before the order: its steps are recorded for it
            spec.weights = weight_spec(decls, env, spec.num_ranks, spec.num_stages, schedule.resolver,
                                       schedule.budget)


register(_WeightPassing())
