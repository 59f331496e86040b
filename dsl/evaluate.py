"""Name resolution, type checking and evaluation of ``.pipe`` expressions.

pipec's own evaluator: an expression is resolved once against a ``Scope`` and
turned into a Python closure ``fn(env) -> value`` over a flat list of slots. No
Python ``eval``/``exec`` is involved; a ``.pipe`` file is data. Closures are
used (rather than walking the tree on every evaluation) because an order body
runs once per task, hundreds of thousands of times for large schedules.

Types are ``int``, ``bool`` and ``key`` (a tuple of ints, only where a priority
is expected). Arithmetic is on integers with floor semantics for ``/`` and
``%`` (as in Python, unlike C): ``-1 / 2 == -1`` and ``-1 % 2 == 1``.

Errors found while resolving (unknown names, type mismatches, shadowing) are
collected in ``Resolver.errors`` so that all of them are reported at once.
Errors found while evaluating (division by zero, a zero loop step, a value past
pipec's integer limit, ``pipec.dsl.limits``) raise
``EvalError`` at the expression's span.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

from pipec.dsl import ast
from pipec.dsl.limits import INT_LIMIT, INT_LIMIT_TEXT, MAX_EXPANSION, MAX_NESTING
from pipec.errors import EvalError, ResolveError, Span

INT, BOOL, KEY, ERROR = "int", "bool", "key", "error"
Fn = Callable[[list], Any]


@dataclass(frozen=True)
class Binding:
    slot: int
    type: str
    span: Span
    # For a user function: its parameters' slots and its compiled body, and
    # its definition (scope and AST) for inlining at a call site.
    param_slots: tuple[int, ...] = ()
    body: "Fn | None" = None
    definition: "tuple[Scope, ast.FuncDef] | None" = None
    # For a user function: how deep its body nests and how many operations it
    # expands to, every call in it expanded (what a call site adds).
    depth: int = 0
    size: int = 0
    # Its body had an error (reported at the definition): calls to it are not
    # compiled again.
    broken: bool = False


class Scope:
    """Names visible at a point of the program; inner scopes see outer ones."""

    def __init__(self, parent: "Scope | None" = None):
        self.parent = parent
        self.names: dict[str, Binding] = {}

    def lookup(self, name: str) -> Binding | None:
        scope = self
        while scope is not None:
            binding = scope.names.get(name)
            if binding is not None:
                return binding
            scope = scope.parent
        return None

    def child(self) -> "Scope":
        return Scope(self)


_ARITH = ("+", "-", "*")
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
# Builtin functions: name -> (minimum arity, maximum arity or None, implementation).
_BUILTINS: dict[str, tuple[int, int | None, Callable[..., int]]] = {
    "min": (1, None, min),
    "max": (1, None, max),
    "abs": (1, 1, abs),
}

# A call whose arguments are plain names compiles the body again in place when
# the body is at most this many operations (each inlined copy is compile work).
_INLINE_MAX = 64

# Names a user cannot bind, because they mean something already.
RESERVED = frozenset(_BUILTINS) | {"true", "false"}


class Resolver:
    """Resolves names and types and compiles expressions into closures.

    One resolver serves one schedule: slots are numbered across the whole
    schedule, so a single ``env`` list (``new_env()``) holds every binding.
    """

    def __init__(self, path: str, source: str):
        self.path = path
        self.source = source
        self.errors: list[ResolveError] = []
        self.slot_count = 0
        # The expression being compiled: its nesting so far, the deepest level
        # reached and the operations it expands to (user calls expanded).
        self.depth = 0
        self.deepest = 0
        self.size = 0
        # Functions being defined (innermost last), and every ``def`` of the
        # schedule by name, to explain a call that would recurse.
        self.defining: list[str] = []
        self.functions: dict[str, ast.FuncDef] = {}
        # id(outermost expression node) -> the operations it expands to: what
        # one evaluation of it costs the evaluation budget.
        self.sizes: dict[int, int] = {}

    # -- bindings --------------------------------------------------------------

    def error(self, message: str, span: Span) -> None:
        self.errors.append(ResolveError(message, span, self.source))

    def bind(self, scope: Scope, name: str, type_: str, span: Span) -> Binding:
        """Define ``name`` in ``scope``; redefining a visible name is an error."""
        previous = scope.lookup(name)
        if name in RESERVED:
            self.error(f"'{name}' is a builtin and cannot be redefined", span)
        elif previous is not None:
            self.error(f"'{name}' is already defined (line {previous.span.line}); pick another name", span)
        binding = Binding(self.slot_count, type_, span)
        self.slot_count += 1
        scope.names[name] = binding
        return binding

    def define_function(self, scope: Scope, node: ast.FuncDef) -> None:
        """Resolve ``def name(params) = body`` and bind ``name`` in ``scope``.

        The body sees the names visible at the definition and its parameters;
        the function's own name is bound only after, so it cannot recurse.
        """
        inner = scope.child()
        slots = tuple(self.bind(inner, p, INT, s).slot for p, s in zip(node.params, node.param_spans))
        self.defining.append(node.name)
        reported = len(self.errors)
        try:
            body, type_ = self.expr(node.body, inner)
        finally:
            self.defining.pop()
        if type_ == KEY:
            self.error("a function returns an integer or a boolean, not a priority key", node.body.span)
        previous = scope.lookup(node.name)
        if node.name in RESERVED or previous is not None:
            self.bind(scope, node.name, type_, node.name_span)  # reports the clash
            return
        scope.names[node.name] = Binding(
            -1, type_, node.name_span, slots, body, (scope, node), depth=self.deepest, size=self.size,
            broken=len(self.errors) > reported,
        )

    def new_env(self) -> list:
        return [None] * self.slot_count

    # -- expressions -----------------------------------------------------------

    def expect(self, node: ast.Node, scope: Scope, want: str, what: str) -> Fn:
        """Compile ``node`` and check that its type is ``want``.

        Args:
            node: the expression.
            scope: names visible to it.
            want: INT or BOOL (or KEY, which also accepts INT).
            what: what the value is for, used in the message.
        Returns:
            the closure; on a type error the error is recorded and a closure
            returning a harmless value is returned so that resolution goes on.
        """
        fn, got = self.expr(node, scope)
        if got == ERROR or got == want or (want == KEY and got == INT):
            return fn
        self.error(f"{what} must be {_article(want)}, not {_article(got)}", node.span)
        return fn

    def expr(self, node: ast.Node, scope: Scope) -> tuple[Fn, str]:
        """Compile ``node`` into a closure; returns it and the expression's type.

        Counts the nesting and the operations of the outermost expression (the
        parser bounds the nesting as written; calls, checked where they are
        made, may add to both).
        """
        if self.depth == 0:
            self.deepest = self.size = 0
        self.depth += 1
        self.size += 1
        if self.depth > self.deepest:
            self.deepest = self.depth
        try:
            return getattr(self, "_" + type(node).__name__)(node, scope)
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.sizes[id(node)] = self.size

    def cost(self, node: ast.Node | None) -> int:
        """The operations one evaluation of the outermost expression ``node`` takes (0 for none)."""
        return 0 if node is None else self.sizes.get(id(node), 1)

    def _IntLit(self, node: ast.IntLit, scope: Scope):
        value = node.value
        return (lambda env: value), INT

    def _BoolLit(self, node: ast.BoolLit, scope: Scope):
        value = node.value
        return (lambda env: value), BOOL

    def _Name(self, node: ast.Name, scope: Scope):
        binding = scope.lookup(node.id)
        if binding is not None and binding.body is not None:
            self.error(f"'{node.id}' is a function; call it: {node.id}(...)", node.span)
            return (lambda env: 0), ERROR
        if binding is None:
            hint = _did_you_mean(node.id, scope)
            self.error(f"unknown name '{node.id}'{hint}", node.span)
            return (lambda env: 0), ERROR
        slot = binding.slot
        return (lambda env: env[slot]), binding.type

    def _Negate(self, node: ast.Negate, scope: Scope):
        fn = self.expect(node.operand, scope, INT, "the operand of '-'")
        return (lambda env: -fn(env)), INT  # the range is symmetric: never leaves it

    def _Binary(self, node: ast.Binary, scope: Scope):
        left = self.expect(node.left, scope, INT, f"the left operand of '{node.op}'")
        right = self.expect(node.right, scope, INT, f"the right operand of '{node.op}'")
        # Order bodies run once per task: specialise the shapes that dominate
        # them (a slot or any expression against a constant) into one closure.
        # + - * check their result against pipec's integer range (/ % cannot
        # leave it); a value outside raises ``overflow`` at this expression.
        overflow = _Overflow(node.span, self.source)
        constant = _constant(node.right)
        if constant is not None and (node.op in _ARITH or constant != 0):
            slot = self._slot(node.left, scope)
            if slot is not None:
                return _SLOT_CONST[node.op](slot, constant, overflow), INT
            return _FN_CONST[node.op](left, constant, overflow), INT
        if node.op in _ARITH:
            return _FN_FN[node.op](left, right, overflow), INT
        # / and %: floor semantics, and a located error instead of ZeroDivisionError.
        span, source = node.right.span, self.source
        divisor_slot = self._slot(node.right, scope)
        if node.op == "/":
            if divisor_slot is not None:

                def divide_by_slot(env):
                    divisor = env[divisor_slot]
                    if divisor == 0:
                        raise EvalError("division by zero ('/' by a value that is 0)", span, source)
                    return left(env) // divisor

                return divide_by_slot, INT

            def divide(env):
                divisor = right(env)
                if divisor == 0:
                    raise EvalError("division by zero ('/' by a value that is 0)", span, source)
                return left(env) // divisor

            return divide, INT
        if divisor_slot is not None:

            def modulo_by_slot(env):
                divisor = env[divisor_slot]
                if divisor == 0:
                    raise EvalError("division by zero ('%' by a value that is 0)", span, source)
                return left(env) % divisor

            return modulo_by_slot, INT

        def modulo(env):
            divisor = right(env)
            if divisor == 0:
                raise EvalError("division by zero ('%' by a value that is 0)", span, source)
            return left(env) % divisor

        return modulo, INT

    def _slot(self, node: ast.Node, scope: Scope) -> int | None:
        """The slot a plain name reads, or None for anything else."""
        if isinstance(node, ast.Name):
            binding = scope.lookup(node.id)
            if binding is not None and binding.body is None and binding.slot >= 0:
                return binding.slot
        return None

    def _Compare(self, node: ast.Compare, scope: Scope):
        left, left_type = self.expr(node.left, scope)
        right, right_type = self.expr(node.right, scope)
        if ERROR not in (left_type, right_type):
            if node.op in ("==", "!="):
                if left_type != right_type:
                    self.error(f"cannot compare {_article(left_type)} with {_article(right_type)}", node.span)
            elif left_type != INT or right_type != INT:
                wrong = left_type if left_type != INT else right_type
                self.error(f"'{node.op}' compares integers, not {_article(wrong)}", node.span)
        op = _COMPARE[node.op]
        return (lambda env: op(left(env), right(env))), BOOL

    def _Logic(self, node: ast.Logic, scope: Scope):
        left = self.expect(node.left, scope, BOOL, f"the left operand of '{node.op}'")
        right = self.expect(node.right, scope, BOOL, f"the right operand of '{node.op}'")
        if node.op == "and":
            return (lambda env: left(env) and right(env)), BOOL
        return (lambda env: left(env) or right(env)), BOOL

    def _Not(self, node: ast.Not, scope: Scope):
        fn = self.expect(node.operand, scope, BOOL, "the operand of 'not'")
        return (lambda env: not fn(env)), BOOL

    def _Conditional(self, node: ast.Conditional, scope: Scope):
        cond = self.expect(node.cond, scope, BOOL, "a condition")
        then, then_type = self.expr(node.then, scope)
        otherwise, other_type = self.expr(node.otherwise, scope)
        result = then_type if then_type != ERROR else other_type
        if ERROR not in (then_type, other_type) and then_type != other_type:
            if {then_type, other_type} == {INT, KEY}:
                result = KEY
            else:
                self.error(
                    f"both branches must have one type; here {_article(then_type)} and {_article(other_type)}",
                    node.span,
                )
        return (lambda env: then(env) if cond(env) else otherwise(env)), result

    def _Call(self, node: ast.Call, scope: Scope):
        user = scope.lookup(node.func)
        if user is not None and user.body is not None:
            return self._call_user(node, user, scope)
        builtin = _BUILTINS.get(node.func)
        if builtin is None and user is None and self.defining:
            if node.func in self.defining:  # the function's own name is bound only after its body
                cycle = " -> ".join(self.defining[self.defining.index(node.func):] + [node.func])
                self.error(f"function {node.func} calls itself ({cycle}): recursion is not allowed", node.span)
                return (lambda env: 0), ERROR
            later = self.functions.get(node.func)
            if later is not None:
                self.error(
                    f"function {self.defining[-1]} calls {node.func}, defined later (line {later.span.line}): a "
                    "function calls only the functions defined before it, so none can recurse",
                    node.span,
                )
                return (lambda env: 0), ERROR
        if builtin is None:
            known = ", ".join(sorted(_BUILTINS))
            self.error(f"unknown function '{node.func}' (the functions are {known})", node.span)
            return (lambda env: 0), ERROR
        low, high, impl = builtin
        count = len(node.args)
        if count < low or (high is not None and count > high):
            arity = f"{low}" if high == low else f"at least {low}"
            self.error(f"{node.func}() takes {arity} argument(s), got {count}", node.span)
            return (lambda env: 0), ERROR
        args = [self.expect(a, scope, INT, f"an argument of {node.func}()") for a in node.args]
        if count == 1:
            (only,) = args
            if impl is abs:
                return (lambda env: abs(only(env))), INT
            return only, INT  # min(x) == max(x) == x
        if count == 2:
            first, second = args
            return (lambda env: impl(first(env), second(env))), INT
        return (lambda env: impl(*(a(env) for a in args))), INT

    def _call_user(self, node: ast.Call, user: Binding, scope: Scope):
        if len(node.args) != len(user.param_slots):
            self.error(f"{node.func}() takes {len(user.param_slots)} argument(s), got {len(node.args)}", node.span)
            return (lambda env: 0), ERROR
        args = [self.expect(a, scope, INT, f"an argument of {node.func}()") for a in node.args]
        if user.broken:
            return (lambda env: 0), ERROR
        # The body runs (or is compiled again, inlined) at this depth: bound the sum.
        if self.depth + user.depth > MAX_NESTING:
            self.error(f"calling {node.func}() here nests this expression {self.depth + user.depth} levels deep "
                       f"(its body is {user.depth}); pipec's limit is {MAX_NESTING}", node.span)
            return (lambda env: 0), ERROR
        if self.size + user.size > MAX_EXPANSION:
            if self.size <= MAX_EXPANSION:  # once per expression, at its first call past the limit
                self.error(f"with {node.func}() expanded at each call, this expression is more than "
                           f"{MAX_EXPANSION} operations (pipec's limit); compute a part once with `let`", node.span)
            self.size = MAX_EXPANSION + 1
            return (lambda env: 0), ERROR
        self.deepest = max(self.deepest, self.depth + user.depth)
        arg_slots = [self._slot(a, scope) for a in node.args]
        if None not in arg_slots and user.size <= _INLINE_MAX:
            return self._inline(user, arg_slots), user.type
        self.size += user.size
        slots, body = user.param_slots, user.body
        if len(args) == 1:
            (arg,), (slot,) = args, slots

            def call_one(env):
                env[slot] = arg(env)
                return body(env)

            return call_one, user.type

        def call(env):
            values = [a(env) for a in args]  # all arguments before any parameter is set
            for slot, value in zip(slots, values):
                env[slot] = value
            return body(env)

        return call, user.type

    def _inline(self, user: Binding, arg_slots: list[int]) -> Fn:
        """Compile the body again with each parameter reading its argument's slot.

        Every argument is a plain name, so reading its slot at the body's use
        is the same as passing the value; the call costs nothing at run time.
        Errors in the body were reported at the definition; not again here.
        """
        definition_scope, node = user.definition
        inner = definition_scope.child()
        for name, span, slot in zip(node.params, node.param_spans, arg_slots):
            inner.names[name] = Binding(slot, INT, span)
        reported = len(self.errors)
        body, _ = self.expr(node.body, inner)
        del self.errors[reported:]
        return body

    def _Tuple(self, node: ast.Tuple, scope: Scope):
        items = [self.expect(i, scope, INT, "an item of a priority key") for i in node.items]
        return (lambda env: tuple(i(env) for i in items)), KEY


def _constant(node: ast.Node) -> int | None:
    if isinstance(node, ast.IntLit):
        return node.value
    if isinstance(node, ast.Negate) and isinstance(node.operand, ast.IntLit):
        return -node.operand.value
    return None


class _Overflow:
    """Raises the located error of a value outside pipec's integer range."""

    def __init__(self, span: Span, source: str):
        self.span, self.source = span, source

    def __call__(self, value: int) -> int:
        raise EvalError(f"the value of this expression exceeds pipec's integer limit {INT_LIMIT_TEXT} "
                        f"(|value| < {INT_LIMIT_TEXT})", self.span, self.source)


# Closure factories for arithmetic, by operator: slot (op) constant, closure (op)
# constant, closure (op) closure; ``o`` raises the overflow error. A constant
# divisor is never 0 here. The range test is written inline, with INT_LIMIT as
# a literal (asserted below): a call or a global per operation would cost more
# than the operation.
_SLOT_CONST = {
    "+": lambda s, c, o: lambda env: v if -9223372036854775808 < (v := env[s] + c) < 9223372036854775808 else o(v),
    "-": lambda s, c, o: lambda env: v if -9223372036854775808 < (v := env[s] - c) < 9223372036854775808 else o(v),
    "*": lambda s, c, o: lambda env: v if -9223372036854775808 < (v := env[s] * c) < 9223372036854775808 else o(v),
    "/": lambda s, c, o: lambda env: env[s] // c,
    "%": lambda s, c, o: lambda env: env[s] % c,
}
_FN_CONST = {
    "+": lambda f, c, o: lambda env: v if -9223372036854775808 < (v := f(env) + c) < 9223372036854775808 else o(v),
    "-": lambda f, c, o: lambda env: v if -9223372036854775808 < (v := f(env) - c) < 9223372036854775808 else o(v),
    "*": lambda f, c, o: lambda env: v if -9223372036854775808 < (v := f(env) * c) < 9223372036854775808 else o(v),
    "/": lambda f, c, o: lambda env: f(env) // c,
    "%": lambda f, c, o: lambda env: f(env) % c,
}
_FN_FN = {
    "+": lambda f, g, o: lambda env: v if -9223372036854775808 < (v := f(env) + g(env)) < 9223372036854775808 else o(v),
    "-": lambda f, g, o: lambda env: v if -9223372036854775808 < (v := f(env) - g(env)) < 9223372036854775808 else o(v),
    "*": lambda f, g, o: lambda env: v if -9223372036854775808 < (v := f(env) * g(env)) < 9223372036854775808 else o(v),
}
assert INT_LIMIT == 9223372036854775808


def _article(type_: str) -> str:
    return {INT: "an integer", BOOL: "a boolean", KEY: "a priority key (tuple)"}.get(type_, type_)


def _did_you_mean(name: str, scope: Scope) -> str:
    import difflib

    visible: list[str] = []
    s: Scope | None = scope
    while s is not None:
        visible.extend(s.names)
        s = s.parent
    close = difflib.get_close_matches(name, visible + list(_BUILTINS), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
