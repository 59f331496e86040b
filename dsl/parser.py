"""Parse ``.pipe`` text into the AST of ``pipec.dsl.ast``.

Contract: ``parse(source, path)`` returns a ``Module`` or raises ``ParseError``
with the span of the offending token, a message that says what was expected,
and, for the mistakes people actually make, a hint learnt from examples
(Lark's ``match_examples``).
"""
from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from importlib import resources
from itertools import islice

import lark
from lark import Lark, Token, Transformer_NonRecursive, v_args

from pipec.dsl import ast
from pipec.dsl.limits import INT_LIMIT, INT_LIMIT_TEXT, MAX_LITERAL_DIGITS, MAX_NESTING, MAX_TOKENS
from pipec.errors import ParseError, Span


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("pipec.grammars").joinpath("pipe.lark").read_text()
    # No table cache: Lark's cache option pickles the tables into the shared
    # temp folder and unpickles whatever lies there on every run (code
    # execution for anyone who can write it). Building them costs ~80 ms per
    # process; tests/test_hostile_source.py holds that nothing is unpickled.
    return Lark(
        grammar,
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=True,
        lexer_callbacks={"NAME": _refuse_keyword},
    )


@lru_cache(maxsize=1)
def keywords() -> frozenset[str]:
    """The language's reserved words, read off the grammar's terminals.

    A word a rule writes literally (``"schedule"``, ``"for"``) and the words of
    a terminal that is an alternation of words (``PARAM_TYPE``, ``BACKWARD_MODE``).
    """
    words: set[str] = set()
    for terminal in _parser().terminals:
        pattern = terminal.pattern
        if pattern.type == "str" and _WORD.fullmatch(pattern.value):
            words.add(pattern.value)
        elif pattern.type == "re":
            alternation = _WORD_ALTERNATION.fullmatch(pattern.value)
            if alternation:
                words.update(alternation.group(1).split("|"))
    return frozenset(words)


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD_ALTERNATION = re.compile(r"\(\?:([A-Za-z_]\w*(?:\|[A-Za-z_]\w*)*)\)")


class _KeywordAsName(Exception):
    """Raised by the lexer when a NAME token is a reserved word; ``parse`` locates it."""

    def __init__(self, token: Token):
        super().__init__(str(token))
        self.token = token


def _refuse_keyword(token: Token) -> Token:
    if token in keywords():
        raise _KeywordAsName(token)
    return token


def _keyword_error(token: Token, source: str, path: str) -> ParseError:
    """The error of a reserved word lexed as a name.

    Where the grammar takes a name, the word is a keyword used as one. Where
    it takes only other words (``gradients staged``: ``staged`` is a weight
    route, not a gradient route), the word is unexpected there: say what is.
    """
    word = str(token)
    accepts = _accepted_before(source)
    if accepts is not None and "NAME" not in accepts:
        return ParseError(f"unexpected {word!r}" + _expected(accepts), _span_of(path, token), source)
    return ParseError(f"'{word}' is a keyword and cannot be used as a name; pick another name",
                      _span_of(path, token), source)


def _accepted_before(source: str) -> set[str] | None:
    """The terminals the parser accepts just before the keyword lexed as a name, or None if unknown.

    Parses again, interactively, up to that word (only on this error path).
    """
    interactive = _parser().parse_interactive(source)
    try:
        for _ in interactive.iter_parse():
            pass
    except _KeywordAsName:
        return set(interactive.accepts())
    except lark.exceptions.LarkError:
        return None
    return None


def parse(source: str, path: str = "<string>") -> ast.Module:
    """Parse a ``.pipe`` file.

    Args:
        source: the file's text.
        path: the name used in error messages.
    Returns:
        the ``Module`` with one ``Schedule`` per ``schedule`` block.
    Raises:
        ParseError: the text is not a ``.pipe`` program.
    """
    _check_length(source, path)
    try:
        tree = _parser().parse(source)
    except lark.exceptions.UnexpectedInput as error:
        raise _friendly(error, source, path) from None
    except _KeywordAsName as error:
        raise _keyword_error(error.token, source, path) from None
    module = ast.Module(path, source)
    try:
        module.schedules = _ToAst(path).transform(tree)
    except lark.exceptions.VisitError as error:  # a callback refused a node (a literal too large)
        if isinstance(error.orig_exc, ParseError):
            raise error.orig_exc.with_source(source) from None
        raise
    _check_nesting(module.schedules, source)
    _check_unique_names(module.schedules, source)
    return module


# A token, roughly: a string, a comment (counted, harmlessly, as one), a word or
# number, or one other character. Counting these costs a regular expression
# scan; Lark's parser costs tens of microseconds a token.
_ROUGH_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|(?:#|//)[^\n]*|\w+|\S')


def _check_length(source: str, path: str) -> None:
    """Refuse, before parsing, a file of more than ``MAX_TOKENS`` tokens (it would take seconds to parse)."""
    beyond = next(islice(_ROUGH_TOKEN.finditer(source), MAX_TOKENS, None), None)
    if beyond is not None:
        line = source.count("\n", 0, beyond.start()) + 1
        column = beyond.start() - (source.rfind("\n", 0, beyond.start()) + 1) + 1
        raise ParseError(f"the file is longer than pipec's limit of {MAX_TOKENS:,} tokens (this is the next one); "
                         "a loop says the same in a few", Span(path, line, column), source)


def _check_unique_names(schedules: list[ast.Schedule], source: str) -> None:
    """Two schedules of one name: the second could never be addressed (``file.pipe:name``)."""
    first: dict[str, ast.Schedule] = {}
    for schedule in schedules:
        earlier = first.setdefault(schedule.name, schedule)
        if earlier is not schedule:
            raise ParseError(f"schedule '{schedule.name}' is already defined at line {earlier.span.line}; "
                             "pick another name", schedule.name_span or schedule.span, source)


def _check_nesting(schedules: list[ast.Schedule], source: str) -> None:
    """Refuse a declaration nested deeper than ``MAX_NESTING`` levels.

    Walks with an explicit stack (an AST of any depth is fine here); past this
    check, the resolver and the evaluator recurse at most ``MAX_NESTING`` deep.
    """
    for schedule in schedules:
        stack = [(node, 1) for node in reversed(list(_children(schedule)))]
        while stack:
            node, depth = stack.pop()
            if depth > MAX_NESTING:
                raise ParseError(
                    f"nested deeper than {MAX_NESTING} levels (pipec's limit): each operator, call, conditional, "
                    "statement and block adds a level, a chain `a + b + ...` one per operator; "
                    "split it with `let`",
                    node.span,
                    source,
                )
            # children pushed last-first: the first node found too deep is the first in the text
            stack.extend((child, depth + 1) for child in reversed(list(_children(node))))


def _children(node: ast.Node):
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if isinstance(value, ast.Node):
            yield value
        elif isinstance(value, tuple):
            for item in value:
                if isinstance(item, ast.Node):
                    yield item


# -------------------------------------------------------------- syntax errors

# Wrong programs and what to say about them: Lark matches the parser state of a
# failing input against these to pick a message.
_EXAMPLES = {
    "a range is written `a .. b` (half-open), not `to` or `range()`": [
        "schedule s(P: ranks) { order rank r { for m in 0 to P { F(r, m) } } }",
        "schedule s(P: ranks) { order rank r { for m in range(P) { F(r, m) } } }",
    ],
    "an order is `order rank r { ... }`, `order greedy { ... }` or `order sorted { ... }`": [
        "schedule s(P: ranks) { order r { } }",
        "schedule s(P: ranks) { order { } }",
    ],
    "a placement reads `place stage s on rank EXPR`": [
        "schedule s(P: ranks) { place stage s rank s }",
        "schedule s(P: ranks) { place s on rank s }",
    ],
    "a parameter needs a type: `NAME: ranks | microbatches | chunks | int | bool`": [
        "schedule s(P) { }",
        "schedule s(P = 4) { }",
        "schedule s(P: integer) { }",
    ],
    "a `require` needs a message: `require COND : \"why\"`": [
        "schedule s(P: ranks) { require P > 1 }",
        "schedule s(P: ranks) { require P > 1 stages P }",
    ],
    "a task is `F(stage, microbatch)` (also B, I, W), or in a sequence ring `AF(q, kv)` or `AF(q, kv, piece)` "
    "(also AB)": [
        "schedule s(P: ranks) { order rank r { F(r) } }",
        "schedule s(P: ranks) { order rank r { F(r, 0, 1, 2) } }",
    ],
    "`=` assigns only in `let`; compare with `==`": [
        "schedule s(P: ranks) { require P = 2 : \"x\" }",
        "schedule s(P: ranks) { order rank r { if r = 0 { } } }",
    ],
}


def _friendly(error: lark.exceptions.UnexpectedInput, source: str, path: str) -> ParseError:
    line = getattr(error, "line", None) or 1
    column = getattr(error, "column", None) or 1
    hint = None
    if not isinstance(error, lark.exceptions.UnexpectedCharacters):
        try:
            hint = error.match_examples(_parser().parse, _EXAMPLES, use_accepts=True)
        except Exception:  # pragma: no cover - matching is best effort, never fatal
            hint = None

    if isinstance(error, lark.exceptions.UnexpectedEOF):
        line, column = _end_of(source)
        message = "unexpected end of file" + _expected(error.expected)
    elif isinstance(error, lark.exceptions.UnexpectedCharacters):
        bad = source[error.pos_in_stream] if 0 <= error.pos_in_stream < len(source) else "?"
        message = f"unexpected character {bad!r}"
    elif isinstance(error, lark.exceptions.UnexpectedToken):
        token = error.token
        if token.type == "$END":
            line, column = _end_of(source)
            message = "unexpected end of file"
        else:
            message = f"unexpected {_describe(token)}"
        message += _expected(error.accepts or error.expected)
    else:  # pragma: no cover - lark has no other kinds today
        message = "syntax error"
    if not hint and isinstance(error, lark.exceptions.UnexpectedToken):
        hint = _fallback_hint(str(error.token), error.accepts or error.expected)
    if hint:
        message += f" ({hint})"
    return ParseError(message, Span(path, line, column), source)


def _fallback_hint(token: str, expected) -> str | None:
    """Hints that hold whatever surrounds the mistake (``match_examples`` keys on
    the whole parser state, so its examples miss some contexts)."""
    names = set(expected or ())
    range_expected = any(_terminal_text(n) == "'..'" for n in names)
    if range_expected and token in ("to", "range", ":", "in"):
        return "a range is written `a .. b` (half-open), not `to` or `range()`"
    if token == "=" and "COMPARE" in names:
        return "`=` assigns only in `let`; compare with `==`"
    return None


def _end_of(source: str) -> tuple[int, int]:
    lines = source.splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


def _describe(token: Token) -> str:
    text = str(token)
    if token.type in ("NAME", "INT"):
        return f"{text!r}"
    return f"{text!r}" if text else token.type


# How Lark's terminal names read to a user.
_TERMINAL_TEXT = {
    "NAME": "a name", "INT": "a number", "STRING": "a \"message\"", "LBRACE": "'{'",
    "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'", "COMMA": "','", "COLON": "':'",
    "SEMICOLON": "';'", "EQUAL": "'='", "COMPARE": "a comparison", "ADD": "'+' or '-'",
    "MUL": "'*', '/' or '%'", "MINUS": "'-'", "QMARK": "'?'", "TASK_KIND": "a task (F, B, I, W, ...)",
    "PARAM_TYPE": "a type (ranks, microbatches, chunks, int, bool)", "BACKWARD_MODE": "full or split",
    "WEIGHT_ROUTE": "a weight route (ring, direct, staged, all_gather)",
    "GRADIENT_ROUTE": "a gradient route (ring, direct, reduce, reduce_scatter)",
    "MASK_MODE": "a mask (full, causal)", "RING_KIND": "rings (shift, hamilton, rails, cycle)",
    "KV_ROUTE": "a KV route (again, kept)", "DKV_ROUTE": "a dKV route (behind, direct)",
    "TRANSFER_KIND": "a transfer (p2p, all_to_all)",
"LESSTHAN": "'<'", "MORETHAN": "'>'",
    "MESH": "'mesh'", "DATA_POLICY": "replicate or shard", "RESHARD": "'reshard'", "_FROM": "'from'",
    "_OVER": "'over'", "_AFTER": "'after'", "_FORWARD": "'forward'",
}


def _expected(names) -> str:
    if not names:
        return ""
    shown = []
    for name in sorted(names):
        if name.startswith("$"):
            continue
        text = _terminal_text(name)
        if text not in shown:
            shown.append(text)
    if not shown:
        return ""
    if len(shown) > 8:
        shown = shown[:8] + ["..."]
    return "; expected " + ", ".join(shown)


def _terminal_text(name: str) -> str:
    text = _TERMINAL_TEXT.get(name)
    if text is not None:
        return text
    try:
        pattern = _parser().get_terminal(name).pattern
    except KeyError:
        return name.lower()
    return f"'{pattern.value}'" if pattern.type == "str" else name.lower()


# ------------------------------------------------------------ tree -> AST


def _span_of(path: str, meta_or_token) -> Span:
    item = meta_or_token
    if isinstance(item, Token):
        return Span(path, item.line, item.column, item.end_line or item.line, item.end_column or item.column)
    if getattr(item, "empty", False):
        return Span(path, 1, 1)
    return Span(path, item.line, item.column, item.end_line, item.end_column)


def _unquote(token: Token) -> str:
    body = str(token)[1:-1]
    out, i = [], 0
    escapes = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            out.append(escapes.get(body[i + 1], body[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


@v_args(meta=True)
class _ToAst(Transformer_NonRecursive):
    """Lark tree -> AST nodes. Each callback receives (meta, children)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def _span(self, meta) -> Span:
        return _span_of(self.path, meta)

    # expressions -----------------------------------------------------------
    def literal_int(self, meta, children):
        text = str(children[0]).lstrip("0") or "0"
        # Compare digits before converting: int() refuses more than 4300 of them.
        if len(text) > MAX_LITERAL_DIGITS or int(text) >= INT_LIMIT:
            shown = text if len(text) <= 30 else f"{text[:12]}...{text[-6:]} ({len(text)} digits)"
            raise ParseError(f"the integer {shown} exceeds pipec's integer limit {INT_LIMIT_TEXT}", self._span(meta))
        return ast.IntLit(self._span(meta), int(text))

    def literal_true(self, meta, children):
        return ast.BoolLit(self._span(meta), True)

    def literal_false(self, meta, children):
        return ast.BoolLit(self._span(meta), False)

    def name(self, meta, children):
        return ast.Name(self._span(meta), str(children[0]))

    def call(self, meta, children):
        func, *args = children
        return ast.Call(self._span(meta), str(func), tuple(a for a in args if a is not None))

    def negate(self, meta, children):
        return ast.Negate(self._span(meta), children[0])

    def binary(self, meta, children):
        left, op, right = children
        return ast.Binary(self._span(meta), str(op), left, right)

    def compare(self, meta, children):
        left, op, right = children
        return ast.Compare(self._span(meta), str(op), left, right)

    def and_op(self, meta, children):
        return ast.Logic(self._span(meta), "and", children[0], children[1])

    def or_op(self, meta, children):
        return ast.Logic(self._span(meta), "or", children[0], children[1])

    def not_op(self, meta, children):
        return ast.Not(self._span(meta), children[0])

    def conditional(self, meta, children):
        return ast.Conditional(self._span(meta), *children)

    def tuple(self, meta, children):
        return ast.Tuple(self._span(meta), tuple(children))

    # statements ------------------------------------------------------------
    def let(self, meta, children):
        name, value = children
        return ast.Let(self._span(meta), str(name), _span_of(self.path, name), value)

    def func(self, meta, children):
        name, *params, body = children
        params = [p for p in params if p is not None]
        return ast.FuncDef(
            self._span(meta),
            str(name),
            _span_of(self.path, name),
            tuple(str(p) for p in params),
            tuple(_span_of(self.path, p) for p in params),
            body,
        )

    def block(self, meta, children):
        return tuple(c for c in children if isinstance(c, ast.Node))

    def task(self, meta, children):
        kind, stage, mb, piece = children
        return ast.Task(self._span(meta), str(kind), stage, mb, piece)

    def for_loop(self, meta, children):
        var, start, stop, step, body = children
        return ast.For(self._span(meta), str(var), _span_of(self.path, var), start, stop, step, body)

    def at_step(self, meta, children):
        step, body = children
        return ast.AtStep(self._span(meta), step, body)

    def if_stmt(self, meta, children):
        cond, then, otherwise = children
        if otherwise is None:
            otherwise = ()
        elif isinstance(otherwise, ast.If):
            otherwise = (otherwise,)
        return ast.If(self._span(meta), cond, then, otherwise)

    # declarations ----------------------------------------------------------
    def param(self, meta, children):
        name, type_, default = children
        return ast.Param(self._span(meta), str(name), str(type_), default)

    def require(self, meta, children):
        cond, message = children
        return ast.Require(self._span(meta), cond, _unquote(message))

    def stages(self, meta, children):
        return ast.Stages(self._span(meta), children[0])

    def pipelines(self, meta, children):
        return ast.Pipelines(self._span(meta), children[0])

    def route(self, meta, children):
        var, pipeline = children
        return ast.Route(self._span(meta), str(var), _span_of(self.path, var), pipeline)

    def place(self, meta, children):
        stage_var, pipeline_var, rank, when = children
        spans = tuple(_span_of(self.path, t) for t in (stage_var, pipeline_var) if t is not None)
        return ast.Place(
            self._span(meta), str(stage_var), None if pipeline_var is None else str(pipeline_var), rank, when, spans
        )

    def device_map(self, meta, children):
        var, device = children
        return ast.DeviceMap(self._span(meta), str(var), _span_of(self.path, var), device)

    def backward(self, meta, children):
        return ast.Backward(self._span(meta), str(children[0]))

    def recompute(self, meta, children):
        var, when = children
        return ast.Recompute(self._span(meta), str(var), _span_of(self.path, var), when)

    def stash(self, meta, children):
        return ast.Stash(self._span(meta), children[0])

    def home(self, meta, children):
        var, rank = children
        return ast.Home(self._span(meta), str(var), _span_of(self.path, var), rank)

    def own(self, meta, children):
        var, rank = children
        return ast.Own(self._span(meta), str(var), _span_of(self.path, var), rank)

    def group(self, meta, children):
        var, group = children
        return ast.Group(self._span(meta), str(var), _span_of(self.path, var), group)

    def weights(self, meta, children):
        route, by = children
        return ast.Weights(self._span(meta), str(route), by)

    def gradients(self, meta, children):
        return ast.Gradients(self._span(meta), str(children[0]))

    def prefetch(self, meta, children):
        return ast.WeightCount(self._span(meta), "prefetch", children[0])

    def buffers(self, meta, children):
        return ast.WeightCount(self._span(meta), "buffers", children[0])

    def sequence(self, meta, children):
        return ast.Sequence(self._span(meta), children[0])

    def hold(self, meta, children):
        var, rank = children
        return ast.Hold(self._span(meta), str(var), _span_of(self.path, var), rank)

    def mask(self, meta, children):
        mode, when = children
        return ast.Mask(self._span(meta), str(mode), when)

    def rings(self, meta, children):
        kind, *values = children
        return ast.Rings(self._span(meta), str(kind), tuple(v for v in values if v is not None))

    def pieces(self, meta, children):
        return ast.Pieces(self._span(meta), children[0])

    def tensor(self, meta, children):
        return ast.TensorParallel(self._span(meta), children[0])

    def kv(self, meta, children):
        return ast.RingMode(self._span(meta), "kv", str(children[0]))

    def dkv(self, meta, children):
        return ast.RingMode(self._span(meta), "dkv", str(children[0]))

    def transfer(self, meta, children):
        return ast.RingMode(self._span(meta), "transfer", str(children[0]))

    def mesh_axis(self, meta, children):
        name, size = children
        return ast.MeshAxis(self._span(meta), str(name), _span_of(self.path, name), size)

    def mesh(self, meta, children):
        return ast.Mesh(self._span(meta), tuple(c for c in children if isinstance(c, ast.MeshAxis)))

    def pipeline_arg(self, meta, children):
        name, value = children
        return ast.PipelineArg(self._span(meta), str(name), _span_of(self.path, name), value)

    def composed(self, meta, children):
        name, *args, target = children
        return ast.ComposedPipeline(self._span(meta), str(name), _span_of(self.path, name),
                                    tuple(a for a in args if a is not None), _unquote(target),
                                    _span_of(self.path, target))

    def data_policy(self, meta, children):
        policy, axis, reshard = children
        return ast.DataPolicy(self._span(meta), str(policy) == "shard", str(axis), _span_of(self.path, axis),
                              reshard is not None)

    def ring_call(self, meta, children):
        name, *args, target = children
        return str(name), _span_of(self.path, name), tuple(a for a in args if a is not None), target

    def context_policy(self, meta, children):
        _, axis, ring = children
        if isinstance(ring, tuple):
            name, name_span, args, target = ring
        else:
            target = ring
            name, name_span, args = None, _span_of(self.path, target), ()
        return ast.ContextPolicy(self._span(meta), str(axis), _span_of(self.path, axis), name, name_span, args,
                                 _unquote(target), _span_of(self.path, target))

    def order_explicit(self, meta, children):
        var, body = children
        return ast.ExplicitOrder(self._span(meta), str(var), _span_of(self.path, var), body)

    def inflight(self, meta, children):
        var, limit = children
        return ast.RankRule(self._span(meta), "inflight", str(var), _span_of(self.path, var), limit)

    def deferred(self, meta, children):
        var, limit = children
        return ast.RankRule(self._span(meta), "deferred", str(var), _span_of(self.path, var), limit)

    def warmup(self, meta, children):
        var, count = children
        return ast.RankRule(self._span(meta), "warmup", str(var), _span_of(self.path, var), count)

    def priority(self, meta, children):
        kind, stage_var, mb_var, key = children
        spans = (_span_of(self.path, stage_var), _span_of(self.path, mb_var))
        return ast.Priority(self._span(meta), str(kind), str(stage_var), str(mb_var), key, spans)

    def prefer(self, meta, children):
        return ast.Prefer(self._span(meta), tuple(str(k) for k in children))

    def in_order(self, meta, children):
        return ast.InOrder(self._span(meta), tuple(str(k) for k in children))

    def sort_key(self, meta, children):
        return self.priority(meta, children)

    def order_sorted(self, meta, children):
        items = [c for c in children if isinstance(c, ast.Node)]
        return ast.SortedOrder(
            self._span(meta),
            tuple(i for i in items if isinstance(i, ast.Let)),
            tuple(i for i in items if isinstance(i, ast.Priority)),
        )

    def order_greedy(self, meta, children):
        items = [c for c in children if isinstance(c, ast.Node)]
        return ast.GreedyOrder(
            self._span(meta),
            tuple(i for i in items if isinstance(i, ast.Let)),
            tuple(i for i in items if isinstance(i, ast.RankRule)),
            tuple(i for i in items if isinstance(i, ast.Priority)),
            tuple(i for i in items if isinstance(i, ast.Prefer)),
            tuple(i for i in items if isinstance(i, ast.InOrder)),
        )

    def schedule(self, meta, children):
        name, *rest = children
        params = tuple(c for c in rest if isinstance(c, ast.Param))
        decls = tuple(c for c in rest if isinstance(c, ast.Node) and not isinstance(c, ast.Param))
        return ast.Schedule(self._span(meta), str(name), params, decls, _span_of(self.path, name))

    def start(self, meta, children):
        return list(children)
