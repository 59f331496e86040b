"""The sequence-ring declarations (ring attention, zigzag ring attention, TASP): resolved, checked, evaluated.

In this family the sequence is cut into equal chunks and every rank holds some
of them (their queries, keys and values); KV travels on rings so that each
rank's queries meet every KV chunk they may see. By default the compiler
derives each rank's order of attention blocks (at each step, every visible
block of the rank's queries with the KV it holds then); a schedule may write
it instead, ``order rank r { at step E { AF(q, kv[, piece]) ... } }`` (steps
0..P-1 forward, P..2P-1 backward; resolved with the order body,
``pipec.dsl.resolve``, each block by ``resolve_ring_task``, run by
``pipec.dsl.order_body``). The front end hands
the compiler a ``RingSpec``; the ``ScheduleSpec`` around it has one stage per
chunk (a query chunk), placed on the chunk's holder, one pipeline, no policy,
and the written order if any. The declarations:

* ``sequence chunks E``: makes the schedule a sequence ring;
* ``hold chunk c on rank E``, ``mask full`` / ``mask causal [when E]``;
* ``rings shift E, ...`` (one ring per offset), ``rings hamilton``, ``rings rails E, E``,
  ``rings cycle (E, ...), ...`` (one ring per cycle, its ranks in ring order);
* ``pieces E``, ``kv again|kept``, ``dkv behind|direct``, ``transfer p2p|all_to_all``.

Contract: ``resolve_ring_decl`` compiles one declaration; ``check_ring_rules``
reports, before any parameter, every rule that ties them (``sequence`` needs
``hold``, ``mask`` and ``rings``; the others need ``sequence``; a ring
schedule has no declaration of the other families, and its written order
needs its pieces known); ``resolve_ring_task`` compiles one block of a
written order; ``ring_spec`` evaluates them with the parameters, raising
``EvalError`` at the expression whose value is out of range. The family's
``Declared`` (``pipec.dsl.families``) answers resolution and evaluation with
these, and says why a ring refuses ``recompute stage`` and ``stash weights``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd
from typing import TYPE_CHECKING, Callable

from pipec.dsl import ast
from pipec.dsl.evaluate import BOOL, INT, Fn, Resolver, Scope
from pipec.dsl.families import Declared, Layout, register
from pipec.dsl.limits import BYTES_PER_TASK_TEXT, MAX_CHUNKS, MAX_RING_BLOCKS, MAX_TASKS, RING_LIMIT_TEXT
from pipec.dsl.spec import RingSpec
from pipec.errors import EvalError, Span

if TYPE_CHECKING:
    from pipec.dsl.schedule import Budget, ResolvedSchedule

RING_DECLS = (ast.Sequence, ast.Hold, ast.Mask, ast.Rings, ast.Pieces, ast.RingMode)

# The declarations of the other families (activation and weight passing),
# which a ring schedule cannot hold, and how each is named in messages. An
# explicit order (`order rank r`) is not among them: a ring may write its own.
OTHER_FAMILIES = {
    ast.Stages: "stages", ast.Pipelines: "pipelines", ast.Route: "route microbatch", ast.Place: "place",
    ast.Backward: "backward", ast.GreedyOrder: "order greedy",
    ast.SortedOrder: "order sorted", ast.Home: "home", ast.Own: "own", ast.Group: "group",
    ast.Weights: "weights", ast.Gradients: "gradients", ast.WeightCount: None,  # prefetch | buffers
}
OTHER_DECLS = tuple(OTHER_FAMILIES)

# What each kind of ring takes after its name, and how to say so.
_RING_VALUES = {
    "shift": ("a ring offset",), "hamilton": (), "rails": ("a number of nodes", "a number of ranks per node"),
    "cycle": ("a cycle of ranks",),
}
_RING_ARITY = {
    "shift": "`rings shift` takes one or more values, one ring's offset each: `rings shift EXPR, ...`",
    "hamilton": "`rings hamilton` takes no value: its rings are the arc-disjoint Hamiltonian rings of the ranks",
    "rails": "`rings rails` takes two values, the nodes and the ranks per node: `rings rails EXPR, EXPR`",
    "cycle": "`rings cycle` takes one or more cycles, each every rank once in ring order: `rings cycle (0, 2, 1, "
             "3), ...`",
}
# The kinds that make one ring per written value (and so one KV piece per value by default).
_ONE_RING_EACH = ("shift", "cycle")

# A mode not declared: KV goes round again in backward, dK and dV ride behind it, point to point.
DEFAULT_MODES = {"kv": "again", "dkv": "behind", "transfer": "p2p"}

# How each declaration is named in messages.
_WORD = {ast.Sequence: "sequence", ast.Hold: "hold", ast.Mask: "mask", ast.Rings: "rings", ast.Pieces: "pieces"}


@dataclass
class RingDecls:
    """A schedule's sequence-ring declarations, each compiled (None when absent).

    Attributes:
        sequence: ``sequence chunks E`` and the closure of ``E``.
        hold: the declaration, its variable's slot and its value's closure.
        mask: the declaration and the closure of its ``when`` (None without one).
        rings: the declaration and the closures of its values.
        pieces: ``pieces E`` and the closure of ``E``.
        modes: ``kv`` / ``dkv`` / ``transfer`` -> its declaration.
    """

    sequence: tuple[ast.Sequence, Fn] | None = None
    hold: tuple[ast.Hold, int, Fn] | None = None
    mask: tuple[ast.Mask, Fn | None] | None = None
    rings: tuple[ast.Rings, tuple[Fn, ...]] | None = None
    pieces: tuple[ast.Pieces, Fn] | None = None
    modes: dict[str, ast.RingMode] = field(default_factory=dict)

    def declared(self) -> list[ast.Node]:
        """Every declaration held, in text order (messages about them come in that order)."""
        nodes = [entry[0] for entry in (self.sequence, self.hold, self.mask, self.rings, self.pieces) if entry]
        nodes += list(self.modes.values())
        return sorted(nodes, key=lambda node: (node.span.line, node.span.col))


def resolve_ring_decl(resolver: Resolver, decls: RingDecls, decl: ast.Node, scope: Scope) -> None:
    """Compile one sequence-ring declaration into ``decls``; a second one of a kind is an error.

    Args:
        resolver: the schedule's resolver (errors are collected there).
        decls: where the compiled declaration goes.
        decl: one of ``RING_DECLS``.
        scope: the names visible at the declaration.
    """
    first = _same_kind(decls, decl)
    if first is not None:
        resolver.error(f"`{_word(decl)}` is already declared at line {first.span.line}", decl.span)
        return
    if isinstance(decl, ast.Sequence):
        decls.sequence = (decl, resolver.expect(decl.count, scope, INT, "a number of chunks"))
    elif isinstance(decl, ast.Hold):
        inner = scope.child()
        slot = resolver.bind(inner, decl.var, INT, decl.var_span).slot
        decls.hold = (decl, slot, resolver.expect(decl.rank, inner, INT, "a holder rank"))
    elif isinstance(decl, ast.Mask):
        when = None
        if decl.when is not None and decl.mode == "full":
            resolver.error("`when` says where the mask is causal: write `mask causal when EXPR`; `mask full` "
                           "takes no condition", decl.when.span)
        elif decl.when is not None:
            when = resolver.expect(decl.when, scope, BOOL, "a `when` condition")
        decls.mask = (decl, when)
    elif isinstance(decl, ast.Rings):
        wanted = _RING_VALUES[decl.kind]
        if decl.kind in _ONE_RING_EACH and decl.values:  # any number of values, a ring each
            wanted = wanted * len(decl.values)
        if len(decl.values) != len(wanted):
            extra = decl.values[len(wanted)] if len(decl.values) > len(wanted) else decl
            resolver.error(_RING_ARITY[decl.kind], extra.span)
        compile_value = _compile_cycle if decl.kind == "cycle" else _compile_int
        decls.rings = (decl, tuple(compile_value(resolver, value, scope, what)
                                   for value, what in zip(decl.values, wanted)))
    elif isinstance(decl, ast.Pieces):
        decls.pieces = (decl, resolver.expect(decl.value, scope, INT, "a number of pieces"))
    else:
        decls.modes[decl.what] = decl


def _compile_int(resolver: Resolver, value: ast.Node, scope: Scope, what: str) -> Fn:
    return resolver.expect(value, scope, INT, what)


def _compile_cycle(resolver: Resolver, value: ast.Node, scope: Scope, what: str) -> Fn:
    """A cycle of ``rings cycle``: a tuple written in place, ``(E, E, ...)``, each item a rank.

    Written in place (not a name bound to a tuple) so that a wrong rank is
    reported at the item that gives it.
    """
    if not isinstance(value, ast.Tuple):
        resolver.error(f"{what} is written in place as a tuple of ranks in ring order, `(0, 2, 1, 3)`: KV goes "
                       "from each rank to the next, and from the last back to the first", value.span)
        return lambda env: ()
    items = [resolver.expect(item, scope, INT, "a rank of a cycle") for item in value.items]
    return lambda env: tuple(item(env) for item in items)


def _same_kind(decls: RingDecls, decl: ast.Node) -> ast.Node | None:
    """The declaration of ``decl``'s kind already held, or None."""
    if isinstance(decl, ast.RingMode):
        return decls.modes.get(decl.what)
    held = getattr(decls, _word(decl))
    return None if held is None else held[0]


def _word(decl: ast.Node) -> str:
    return decl.what if isinstance(decl, ast.RingMode) else _WORD[type(decl)]


# ------------------------------------------------------------ resolve-time rules


def check_ring_rules(resolver: Resolver, decls: RingDecls, schedule: ast.Schedule) -> None:
    """Report every broken rule between the declarations that needs no parameter value.

    Args:
        resolver: collects the errors.
        decls: the schedule's sequence-ring declarations, resolved.
        schedule: the whole schedule (the other families' declarations too).
    """
    if decls.sequence is None:
        for node in decls.declared():
            resolver.error(f"`{_word(node)}` belongs to sequence rings: it needs `sequence chunks EXPR` (the "
                           "chunks the sequence is cut into)", node.span)
        return
    sequence = decls.sequence[0]
    other = next((decl for decl in schedule.decls if isinstance(decl, OTHER_DECLS)), None)
    if isinstance(other, (ast.GreedyOrder, ast.SortedOrder)):
        resolver.error(f"`{OTHER_FAMILIES[type(other)]}` cannot be written in a sequence ring (`sequence` at line "
                       f"{sequence.span.line}): the compiler derives its order (each rank's attention blocks: at "
                       "each step, every visible block of the rank's queries with the KV it holds then), or "
                       "`order rank r { at step EXPR { AF(q, kv) ... } }` writes it block by block", other.span)
    elif other is not None:
        word = OTHER_FAMILIES[type(other)] or other.what
        resolver.error(f"`{word}` cannot be written in a sequence ring (`sequence` at line {sequence.span.line}): "
                       "the sequence ring family derives its order (the compiler computes each rank's order of "
                       "attention blocks: at each step, every visible block of the rank's queries with the KV it "
                       "holds then) and its layout (`hold`)", other.span)
    _check_written_order(resolver, decls, schedule)
    if decls.hold is None:
        resolver.error("a sequence ring needs `hold chunk c on rank EXPR` (the rank that holds each chunk's "
                       "queries, keys and values)", sequence.span)
    if decls.mask is None:
        resolver.error("a sequence ring needs its mask written, `mask full`, `mask causal` or `mask causal when "
                       "EXPR`: none is assumed, so that no schedule gets full attention by accident", sequence.span)
    if decls.rings is None:
        resolver.error("a sequence ring needs `rings shift EXPR`, `rings hamilton`, `rings rails EXPR, EXPR` or "
                       "`rings cycle (EXPR, ...)` (the rings KV travels on)", sequence.span)


def _check_written_order(resolver: Resolver, decls: RingDecls, schedule: ast.Schedule) -> None:
    """A written order names blocks by piece: their number is needed before the compiler finds the rings.

    ``rings shift`` and ``rings cycle`` make one ring per written offset or
    cycle, so one piece per ring unless ``pieces`` says otherwise; under
    ``hamilton`` and ``rails`` the default is one piece per ring, a count the
    compiler's ring search decides (hamilton finds fewer than P - 1 rings on
    4 and 6 ranks), so ``pieces`` must be written.
    """
    order = next((decl for decl in schedule.decls if isinstance(decl, ast.ExplicitOrder)), None)
    if order is None or decls.pieces is not None or decls.rings is None or decls.rings[0].kind in _ONE_RING_EACH:
        return
    resolver.error(f"an order written block by block needs `pieces EXPR` under `rings {decls.rings[0].kind}` "
                   f"(line {decls.rings[0].span.line}): its default, one piece per ring, depends on the rings the "
                   "compiler finds, and a block names its piece", order.span)


def resolve_ring_task(schedule: "ResolvedSchedule", stmt: ast.Task, scope: Scope,
                      inside: ast.AtStep | None) -> Callable:
    """Compile a block of a sequence ring's written order, ``KIND(q, kv)`` or ``KIND(q, kv, piece)``.

    Args:
        schedule: the schedule being resolved (its resolver, task kinds and order state).
        stmt: the block's task statement.
        scope: the names visible to it.
        inside: the ``at step`` block it is in (None: an error, every block belongs to a step).
    Returns:
        the closure that emits the block at its step.
    """
    resolver, tasks = schedule.resolver, schedule.tasks
    if stmt.kind not in tasks.ring:
        forward = " or ".join(f"{kind}(q, kv[, piece])" for kind in tasks.ring_forward)
        backward = " or ".join(f"{kind}(q, kv[, piece])" for kind in tasks.ring_backward)
        resolver.error(f"there is no task {stmt.kind}(...) in a sequence ring: its order writes attention blocks, "
                       f"{forward} forward and {backward} backward", stmt.span)
    if inside is None:
        resolver.error(f"{stmt.kind}(...) is outside every `at step`: in a sequence ring's order every block "
                       "belongs to a step, `at step EXPR { ... }` (0..P-1 forward, P..2P-1 backward)", stmt.span)
    q_fn = resolver.expect(stmt.stage, scope, INT, "a block's query chunk")
    kv_fn = resolver.expect(stmt.mb, scope, INT, "a block's KV chunk")
    piece_fn = None if stmt.piece is None else resolver.expect(stmt.piece, scope, INT, "a block's KV piece")
    return schedule._state.ring_emitter(stmt, q_fn, kv_fn, piece_fn, stmt.kind in tasks.ring_forward)


def written_pieces(spec: RingSpec) -> int:
    """The pieces a written order's blocks are numbered with: ``pieces``, else one per ring of ``rings shift``
    or ``rings cycle``."""
    if spec.pieces is not None:
        return spec.pieces
    return len(spec.ring_args) if spec.rings in _ONE_RING_EACH else 1


# ------------------------------------------------------------------ evaluation


def ring_spec(decls: RingDecls, env: list, P: int, resolver: Resolver, budget: "Budget", label: str) -> RingSpec:
    """Evaluate the sequence-ring declarations into a ``RingSpec``.

    Args:
        decls: the declarations (``sequence``, ``hold``, ``mask`` and ``rings`` among them).
        env: the schedule's slots, parameters and lets set.
        P: the ranks (the ring's size).
        resolver, budget: for the expressions' costs and the evaluation budget.
        label: the schedule and its parameter values, for the size message.
    Returns:
        the ``RingSpec``, defaults filled in.
    Raises:
        EvalError: chunks outside 1..MAX_CHUNKS or not a multiple of P, a
            holder outside 0..P-1, ranks holding unequal shares, a ring offset
            not coprime with P, rails that do not make P ranks, hamilton rings
            on one rank, a cycle that is not every rank once or that shares
            an arc with another, fewer than one piece, more attention tasks
            than MAX_TASKS.
    """
    source = resolver.source
    node, fn = decls.sequence
    chunks = fn(env)
    if chunks < 1:
        raise EvalError(f"the sequence is cut into at least 1 chunk, not {chunks}", node.count.span, source)
    if chunks > MAX_CHUNKS:
        raise EvalError(f"the sequence is cut into {chunks:,} chunks; pipec's limit is {MAX_CHUNKS:,} (a rank "
                        "runs a forward and a backward for every pair of a query chunk and a KV chunk it sees)",
                        node.count.span, source)
    if chunks % P != 0:
        raise EvalError(f"{_chunks(chunks)} cannot be shared equally by {P} ranks: ring attention gives every rank "
                        "the same share of the sequence", node.count.span, source)
    holders = _holders(decls, env, chunks, P, resolver, budget)
    mask, when = decls.mask
    causal = mask.mode == "causal" and (when is None or bool(when(env)))
    kind, ring_args, ring_count = _rings(decls, env, P, source)
    pieces = None
    if decls.pieces is not None:
        pieces_node, pieces_fn = decls.pieces
        pieces = pieces_fn(env)
        if pieces < 1:
            raise EvalError(f"`pieces` must be at least 1, got {pieces}", pieces_node.value.span, source)
    _check_blocks(decls, chunks, causal, pieces, ring_count, label, source)
    modes = {what: mode.mode for what, mode in decls.modes.items()}
    rings_node = decls.rings[0]
    rings_span = _cover(rings_node.values[0].span, rings_node.values[-1].span) if rings_node.values \
        else rings_node.span
    return RingSpec(chunks=chunks, holders=holders, causal=causal, rings=kind, ring_args=ring_args, pieces=pieces,
                    kv=modes.get("kv", DEFAULT_MODES["kv"]), dkv=modes.get("dkv", DEFAULT_MODES["dkv"]),
                    transfer=modes.get("transfer", DEFAULT_MODES["transfer"]), rings_span=rings_span)


def _holders(decls: RingDecls, env: list, chunks: int, P: int, resolver: Resolver,
             budget: "Budget") -> tuple[int, ...]:
    """``hold chunk c on rank E`` for every chunk: each a rank, every rank holding ``chunks / P``."""
    node, slot, fn = decls.hold
    source = resolver.source
    budget.charge(chunks, resolver.cost(node.rank), "the holder of each chunk", node.span, source)
    holders = []
    for c in range(chunks):
        env[slot] = c
        rank = fn(env)
        if not 0 <= rank < P:
            raise EvalError(f"chunk {c} is held by rank {rank}, outside 0..{P - 1}", node.rank.span, source)
        holders.append(rank)
    counts = [0] * P
    for rank in holders:
        counts[rank] += 1
    share = chunks // P
    if any(count != share for count in counts):
        most = max(range(P), key=counts.__getitem__)
        fewest = min(range(P), key=counts.__getitem__)
        raise EvalError(f"rank {most} holds {_chunks(counts[most])} and rank {fewest} holds "
                        f"{_chunks(counts[fewest])}: ring attention gives every rank the same share of the sequence "
                        f"({_chunks(share)} each)", node.rank.span, source)
    return tuple(holders)


def _rings(decls: RingDecls, env: list, P: int, source: str) -> tuple[str, tuple[int, ...], int]:
    """``rings ...``: its kind, its values and how many rings it makes (at most).

    Raises:
        EvalError: a shift not coprime with P, rails that are not P ranks, hamilton on one rank, cycles
            that are not rings over the P ranks or share an arc.
    """
    node, fns = decls.rings
    values = tuple(fn(env) for fn in fns)
    if node.kind == "cycle":
        cycles = _check_cycles(node, values, P, source)
        return "cycle", cycles, len(cycles)
    if node.kind == "shift":
        _check_shifts(node, values, P, source)
        return "shift", values, len(values)
    if node.kind == "rails":
        for value, expr, what in zip(values, node.values, ("node", "rank per node")):
            if value < 1:
                raise EvalError(f"rails have at least 1 {what}, not {value}", expr.span, source)
        nodes, per_node = values
        if nodes * per_node != P:
            raise EvalError(f"rails of {nodes} nodes x {per_node} ranks per node are {nodes * per_node:,} ranks, "
                            f"not the ring's {P}", _cover(node.values[0].span, node.values[1].span), source)
        return "rails", values, per_node  # one ring per rank of a node
    if P < 2:
        raise EvalError("`rings hamilton` needs at least 2 ranks (its rings run over the links between them), "
                        f"not {P}", node.span, source)
    return "hamilton", (), P - 1  # the most arc-disjoint Hamiltonian rings of P ranks


def _check_shifts(node: ast.Rings, offsets: tuple[int, ...], P: int, source: str) -> None:
    """Each offset makes a ring r -> r + by through every rank, and no two make the same ring.

    Raises:
        EvalError: at the offset that is a multiple of P, shares a factor with
            P, or equals (modulo P) an earlier one.
    """
    seen: dict[int, int] = {}
    for by, expr in zip(offsets, node.values):
        if P > 1 and by % P == 0:
            raise EvalError(f"the ring offset is {by}, a multiple of the {P} ranks: every rank would pass its KV to "
                            "itself", expr.span, source)
        common = gcd(by % P, P)
        if common != 1:
            raise EvalError(f"the ring offset {by} shares the factor {common} with the {P} ranks: the ring "
                            f"r -> r + {by} would visit only {P // common} of them; pick an offset coprime with {P}",
                            expr.span, source)
        if by % P in seen:
            raise EvalError(f"the ring offsets {seen[by % P]} and {by} make the same ring on {P} ranks (r -> r + "
                            f"{by % P}): write each ring once", expr.span, source)
        seen[by % P] = by


def _check_cycles(node: ast.Rings, cycles: tuple[tuple[int, ...], ...], P: int,
                  source: str) -> tuple[tuple[int, ...], ...]:
    """Each cycle lists every rank once (a ring through all P), and no two share an arc.

    Arc-disjoint, as every other kind's rings are (distinct shift offsets,
    hamilton, rails): each link then carries one ring's KV, and more KV per
    ring is ``pieces``' to say, not a ring written twice.
    Returns:
        the cycles, each turned to start at rank 0 (the same ring however written).
    Raises:
        EvalError: at the rank out of range or repeated, else at the cycle
            of the wrong length, missing a rank, or sharing an arc.
    """
    used: dict[tuple[int, int], int] = {}  # arc -> the cycle (from 1) that uses it
    turned = []
    for index, (cycle, expr) in enumerate(zip(cycles, node.values), start=1):
        if len(cycle) > P:
            raise EvalError(f"cycle {index} lists {len(cycle)} ranks, but a ring over {P} ranks visits each once",
                            expr.span, source)
        first_at: dict[int, int] = {}
        for at, (rank, item) in enumerate(zip(cycle, expr.items)):
            if not 0 <= rank < P:
                raise EvalError(f"rank {rank} of cycle {index} is outside 0..{P - 1}", item.span, source)
            if rank in first_at:
                raise EvalError(f"rank {rank} is listed twice in cycle {index} (items {first_at[rank] + 1} and "
                                f"{at + 1}), so it leaves out {_missing(cycle, P)}: a ring visits every rank once",
                                item.span, source)
            first_at[rank] = at
        if len(cycle) < P:
            raise EvalError(f"cycle {index} lists {len(cycle)} of the {P} ranks and leaves out "
                            f"{_missing(cycle, P)}: a ring visits every rank once", expr.span, source)
        for tail, head in zip(cycle, cycle[1:] + cycle[:1]):
            if (tail, head) in used:
                other = used[(tail, head)]
                same = sorted(zip(cycle, cycle[1:] + cycle[:1])) == sorted(
                    arc for arc, owner in used.items() if owner == other)
                what = "are the same ring" if same else f"share the arc {tail} -> {head}"
                raise EvalError(f"cycles {other} and {index} {what}: the rings must be arc-disjoint, as "
                                "every other kind's are, so that each link carries one ring's KV (`pieces EXPR` "
                                "cuts more KV pieces over the same rings)", expr.span, source)
            used[(tail, head)] = index
        zero = cycle.index(0)
        turned.append(cycle[zero:] + cycle[:zero])
    return tuple(turned)


def _missing(cycle: tuple[int, ...], P: int) -> str:
    """The ranks of 0..P-1 not in ``cycle``, named ("rank 3", "ranks 1 and 4")."""
    absent = [str(rank) for rank in range(P) if rank not in cycle]
    if len(absent) == 1:
        return f"rank {absent[0]}"
    return f"ranks {', '.join(absent[:-1])} and {absent[-1]}"


def _check_blocks(decls: RingDecls, chunks: int, causal: bool, pieces: int | None, ring_count: int, label: str,
                  source: str) -> None:
    """Refuse, before anything is built, more attention tasks than pipec's limit.

    A block is a query chunk against a KV piece: chunks x chunks pairs of
    chunks under a full mask, C (C + 1) / 2 under a causal one, times the
    pieces of a chunk (one per ring when ``pieces`` is not written); each
    block is a forward and a backward task.
    """
    pairs = chunks * (chunks + 1) // 2 if causal else chunks * chunks
    per_chunk = ring_count if pieces is None else pieces
    blocks = pairs * per_chunk
    if 2 * blocks <= MAX_TASKS:
        _check_ring_work(decls, blocks, label, source)  # past the task limit, that limit is the one named
        return
    mask = "pairs of chunks under the causal mask" if causal else "pairs of chunks"
    if pieces is None:
        where, written = decls.sequence[0].count.span, ", one per ring"
    else:
        where, written = decls.pieces[0].value.span, ""
    raise EvalError(f"{label} has {2 * blocks:,} attention tasks, a forward and a backward for each of {blocks:,} "
                    f"blocks ({pairs:,} {mask} x {per_chunk:,} KV pieces{written}); pipec's limit is "
                    f"{MAX_TASKS:,} tasks ({BYTES_PER_TASK_TEXT})", where, source)


def _check_ring_work(decls: RingDecls, blocks: int, label: str, source: str) -> None:
    """Refuse, before anything is built, a ring program whose compile, check and simulation would pass
    about 120 s of CPU (issue 24, item 4): more blocks than ``MAX_RING_BLOCKS``."""
    if blocks > MAX_RING_BLOCKS:
        raise EvalError(f"{label} has {blocks:,} attention blocks; pipec's limit for a sequence ring is "
                        f"{MAX_RING_BLOCKS:,} blocks ({RING_LIMIT_TEXT})", decls.sequence[0].count.span, source)


def _chunks(count: int) -> str:
    return f"{count} chunk" if count == 1 else f"{count} chunks"


def _cover(first: Span, last: Span) -> Span:
    """The span from the start of ``first`` to the end of ``last``."""
    return Span(first.file, first.line, first.col, last.end_line, last.end_col)


@dataclass
class RingOrder:
    """A sequence ring's written order as the order body checks it, block by block.

    Attributes:
        spec: the evaluated declarations (chunks, holders, pieces).
        pieces: the pieces its blocks are numbered with (``written_pieces``).
        written: the blocks written so far, on every rank (bounded by the task limit).
    """

    spec: RingSpec
    pieces: int
    written: int = 0


# Activation passing's declarations a sequence ring cannot hold, and why.
_REFUSALS = {
    ast.Recompute: "`recompute stage` belongs to activation passing: a sequence ring keeps no stage activations to "
                   "recompute (its attention backward recomputes each block from the (out, lse) its forward kept)",
    ast.Stash: "`stash weights` belongs to activation passing: a sequence ring has no weights that an update could "
               "change under a microbatch in flight",
}


class _SequenceRings(Declared):
    """Sequence rings' declarations: they lay the schedule out (a stage per chunk on its holder), and a
    written order numbers blocks, each at a step of the two passes."""

    field = "rings"
    at_steps = True
    decls = RING_DECLS
    derives_layout = True
    foreign = OTHER_DECLS
    microbatches = False

    def declares(self, schedule):
        return any(isinstance(decl, ast.Sequence) for decl in schedule.decls)

    def resolve_decl(self, schedule, decl, scope):
        resolve_ring_decl(schedule.resolver, schedule.ring_decls, decl, scope)

    def check_schedule(self, schedule, node):
        check_ring_rules(schedule.resolver, schedule.ring_decls, node)  # without `sequence`: each declaration

    def refusal(self, decl):
        return _REFUSALS.get(type(decl))

    def resolve_task(self, schedule, stmt, scope, inside):
        return resolve_ring_task(schedule, stmt, scope, inside)

    def kind_elsewhere(self, tasks, kind):
        if kind not in tasks.ring:
            return None
        return f"{kind}(...) is a sequence ring's task (an attention block): it needs `sequence chunks EXPR`"

    def piece_elsewhere(self, tasks, kind):
        return (f"{kind}(...) takes two arguments, a stage and a microbatch; a third, a KV piece, is for a "
                f"sequence ring's {' and '.join(tasks.ring)}")

    def layout(self, schedule, env, P, label):
        rings = ring_spec(schedule.ring_decls, env, P, schedule.resolver, schedule.budget, label)
        return Layout(rings, list(rings.holders), schedule.ring_decls.sequence[0].span)

    def step_refusal(self, declared, step, ranks):
        if step < 2 * ranks:
            return None
        return (f"step {step} is past a sequence ring's last on {ranks} rank(s): its steps are 0..{ranks - 1} "
                f"forward and {ranks}..{2 * ranks - 1} backward (every ring visits every rank once a pass)")

    def written_blocks(self, declared):
        return RingOrder(declared, written_pieces(declared))


register(_SequenceRings())
