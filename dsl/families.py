"""The language's family declarations, as resolution, schedule evaluation and order bodies ask about them.

A family's declaration block (``dsl/weights.py``, ``dsl/rings.py``) registers
one ``Declared`` here, saying which declarations are its own and which make a
schedule the family's, the rules between them, what its evaluated
declarations are and where a ``ScheduleSpec`` keeps them, and what it says of
activation passing's declarations and tasks, or of its own written elsewhere;
``dsl/resolve.py``, ``dsl/schedule.py`` and ``dsl/order_body.py`` never test
which family a schedule is: they ask ``declared_families()`` and the
schedule's family (``family_of``). The defaults are a schedule's that
declares no family (activation passing, ``ACTIVATION_PASSING``). The
compiler's families (``compiler/family.py``) are the same families after
lowering; this registry is the front end's, since dsl cannot import compiler.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    from pipec.dsl import ast
    from pipec.dsl.evaluate import Scope
    from pipec.dsl.schedule import ResolvedSchedule
    from pipec.dsl.spec import ScheduleSpec, TaskKinds
    from pipec.errors import Span


class Layout(NamedTuple):
    """What a family whose declarations lay a schedule out (a sequence ring) makes of them.

    Attributes:
        declared: its evaluated declarations (kept in the spec's ``Declared.field``).
        placement: stage -> rank, the one pipeline's stages.
        derived_order: where the order comes from when none is written (the compiler derives it).
    """

    declared: object
    placement: list[int]
    derived_order: "Span"


class Declared:
    """What the front end asks of one family's declarations. Subclasses override what differs.

    Attributes:
        field: the ``ScheduleSpec`` field holding the evaluated declarations ("" for none).
        at_steps: a written order puts each task at a step (``at step E``), recorded as
            ``ScheduleSpec.task_steps`` for the compiler.
        decls: the declaration nodes that are the family's own (``resolve_decl`` compiles them).
        derives_layout: the family's declarations lay out a schedule that declares it
            (``layout``; its order too unless written): its rules alone apply there.
        foreign: the other families' declarations a schedule it lays out cannot hold: not
            resolved there, ``check_schedule`` refuses them.
        microbatches: the family's schedules need a ``microbatches`` parameter.
    """

    field: str = ""
    at_steps: bool = False
    decls: tuple[type, ...] = ()
    derives_layout: bool = False
    foreign: tuple[type, ...] = ()
    microbatches: bool = True

    # ------------------------------------------------------------ resolution

    def declares(self, schedule: "ast.Schedule") -> bool:
        """Whether ``schedule`` holds a declaration that makes it the family's (read before any is resolved).

        Args:
            schedule: the parsed schedule.
        Returns:
            True when it declares the family (``weights``, ``sequence``).
        """
        return False

    def resolve_decl(self, schedule: "ResolvedSchedule", decl: "ast.Node", scope: "Scope") -> None:
        """Compile one of the family's declarations (one of ``decls``) into ``schedule``.

        Args:
            schedule: the schedule being resolved (errors go to its resolver).
            decl: the declaration.
            scope: the names visible at it.
        """
        raise NotImplementedError(type(decl).__name__)

    def check_schedule(self, schedule: "ResolvedSchedule", node: "ast.Schedule") -> None:
        """Report every broken rule between the family's declarations that needs no parameter value.

        Asked of every family of a pipeline's schedule (a declaration of a family the schedule
        does not declare is reported there), and of the family alone in a schedule it lays out.

        Args:
            schedule: the schedule resolved (errors go to its resolver).
            node: the parsed schedule (every family's declarations, in text order).
        """

    def refusal(self, decl: "ast.Node") -> str | None:
        """Why the family's schedules cannot hold ``decl``, one of activation passing's declarations.

        Args:
            decl: a ``recompute stage`` or a ``stash weights``.
        Returns:
            the message, or None when the family's schedules may hold it.
        """
        return None

    def places(self, schedule: "ResolvedSchedule") -> bool:
        """Whether the family's declarations lay a pipeline's stages on ranks (weight passing's ``home``).

        Returns:
            True when ``schedule`` needs no ``place``.
        """
        return False

    def resolve_task(self, schedule: "ResolvedSchedule", stmt: "ast.Task", scope: "Scope",
                     inside: "ast.AtStep | None") -> Callable | None:
        """Compile a task of a written order, where the family's tasks are not a pipeline's.

        Args:
            schedule: the schedule being resolved, of this family (its order state, task kinds).
            stmt: the task statement.
            scope: the names visible to it.
            inside: the ``at step`` block it is in, or None.
        Returns:
            its closure, or None: a pipeline's ``KIND(stage, mb)``, compiled by ``pipec.dsl.resolve``.
        """
        return None

    def outside_steps(self, kind: str) -> str | None:
        """What to say of a pipeline's task written outside every ``at step`` block.

        Args:
            kind: the task's kind.
        Returns:
            the message, or None when the family's tasks need no step.
        """
        return None

    def kind_refusal(self, tasks: "TaskKinds", kind: str) -> str | None:
        """Why the family's schedules cannot order a task activation passing may.

        Args:
            tasks: the task kinds.
            kind: the task's kind.
        Returns:
            the message, or None when the family's schedules may order it.
        """
        return None

    def kind_elsewhere(self, tasks: "TaskKinds", kind: str) -> str | None:
        """What to say of a task of the family's own kinds in a pipeline's schedule (not the family's).

        Args:
            tasks: the task kinds.
            kind: the task's kind.
        Returns:
            the message, or None when ``kind`` is not the family's own.
        """
        return None

    def piece_elsewhere(self, tasks: "TaskKinds", kind: str) -> str | None:
        """What to say of a pipeline's task written with a third argument, where the family's tasks take one.

        Args:
            tasks: the task kinds.
            kind: the task's kind.
        Returns:
            the message, or None when no task of the family takes a third argument.
        """
        return None

    def at_step_elsewhere(self) -> str | None:
        """What to say of an ``at step`` block in a schedule of a family without steps.

        Returns:
            the message, where the family is the one to declare for steps, else None.
        """
        return None

    # ------------------------------------------------------------ evaluation

    def evaluated(self, spec: "ScheduleSpec") -> object | None:
        """The family's evaluated declarations in ``spec``, or None when it has none."""
        return getattr(spec, self.field) if self.field else None

    def keep(self, spec: "ScheduleSpec", declared: object) -> None:
        """Keep the family's evaluated declarations in ``spec`` (its ``field``)."""
        setattr(spec, self.field, declared)

    def lays_out(self, schedule: "ResolvedSchedule") -> bool:
        """Whether the family's declarations lay ``schedule`` out instead of its stages and placement."""
        return self.derives_layout and schedule.family is self

    def layout(self, schedule: "ResolvedSchedule", env: list, P: int, label: str) -> Layout:
        """Evaluate the declarations of a schedule they lay out (``lays_out``) on ``P`` ranks;
        ``label``: the schedule and its parameter values, for messages."""
        raise NotImplementedError(self.field)

    def evaluate(self, schedule: "ResolvedSchedule", env: list, spec: "ScheduleSpec") -> None:
        """Add the family's evaluated declarations to ``spec`` (laid out by stages and placement), before its order."""

    def step_refusal(self, declared: object, step: int, ranks: int) -> str | None:
        """Why a written order cannot have an ``at step`` block at ``step`` (>= 0) on ``ranks`` ranks, or None."""
        return None

    def written_blocks(self, declared: object) -> object | None:
        """The record a written order of blocks is checked against, where the family's written
        orders number blocks instead of tasks (a sequence ring's ``RingOrder``), else None."""
        return None


# A schedule that declares no family: activation passing, every default.
ACTIVATION_PASSING = Declared()

_REGISTERED: list[Declared] = []
# The declaration modules, in the order the front end asks their families (a pipeline's
# schedule reports weight passing's broken rules before those of sequence rings).
_MODULES = ("pipec.dsl.weights", "pipec.dsl.rings", "pipec.dsl.tensor_parallel")


def register(family: Declared) -> Declared:
    """Register a family's declarations (each declaration module does so once, when imported)."""
    _REGISTERED.append(family)
    # in ``_MODULES``' order, whichever module is imported first; any other after them, as registered
    _REGISTERED.sort(key=lambda each: _MODULES.index(type(each).__module__)
                     if type(each).__module__ in _MODULES else len(_MODULES))
    return family


def declared_families() -> list[Declared]:
    """Every registered family's declarations, those of ``_MODULES`` first, in its order."""
    for module in _MODULES:  # each registers when first imported; a no-op after
        importlib.import_module(module)
    return _REGISTERED


def declared_in(spec: "ScheduleSpec") -> list[tuple[Declared, object]]:
    """(family, its evaluated declarations) for each family ``spec`` declares, in registration order."""
    return [(family, declared) for family in declared_families()
            for declared in (family.evaluated(spec),) if declared is not None]


def family_of(schedule: "ast.Schedule") -> Declared:
    """The family whose rules ``schedule`` follows, read before any declaration is resolved.

    Args:
        schedule: the parsed schedule.
    Returns:
        among the families it declares (``declares``), one that lays it out (``derives_layout``:
        the others' declarations are refused in it), else the first, else ``ACTIVATION_PASSING``.
    """
    declaring = [family for family in declared_families() if family.declares(schedule)]
    return next((family for family in declaring if family.derives_layout),
                declaring[0] if declaring else ACTIVATION_PASSING)


def owner_of(decl: "ast.Node") -> Declared | None:
    """The family whose declaration ``decl`` is (one of its ``decls``), or None."""
    return next((family for family in declared_families() if isinstance(decl, family.decls)), None)


def first_word(ask: Callable[[Declared], str | None]) -> str | None:
    """The first registered family's answer to ``ask`` that is not None (what a family says of its
    own syntax written where it does not belong), or None."""
    return next((word for word in map(ask, declared_families()) if word is not None), None)
