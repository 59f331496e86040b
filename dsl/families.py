"""The language's family declarations, as schedule evaluation and order bodies ask about them.

A family's declaration block (``dsl/weights.py``, ``dsl/rings.py``) registers
one ``Declared`` here, saying what its evaluated declarations are and where a
``ScheduleSpec`` keeps them; ``dsl/schedule.py`` and ``dsl/order_body.py``
never test which family a schedule is: they ask ``declared_families()``. The
defaults are a schedule's that declares no family (activation passing). The
compiler's families (``compiler/family.py``) are the same families after
lowering; this registry is the front end's, since dsl cannot import compiler.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pipec.dsl.schedule import ResolvedSchedule
    from pipec.dsl.spec import ScheduleSpec
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
    """

    field: str = ""
    at_steps: bool = False

    def evaluated(self, spec: "ScheduleSpec") -> object | None:
        """The family's evaluated declarations in ``spec``, or None when it has none."""
        return getattr(spec, self.field) if self.field else None

    def keep(self, spec: "ScheduleSpec", declared: object) -> None:
        """Keep the family's evaluated declarations in ``spec`` (its ``field``)."""
        setattr(spec, self.field, declared)

    def lays_out(self, schedule: "ResolvedSchedule") -> bool:
        """Whether the family's declarations lay ``schedule`` out instead of its stages and placement."""
        return False

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


_REGISTERED: list[Declared] = []
_MODULES = ("pipec.dsl.weights", "pipec.dsl.rings")


def register(family: Declared) -> Declared:
    """Register a family's declarations (each declaration module does so once, when imported)."""
    _REGISTERED.append(family)
    return family


def declared_families() -> list[Declared]:
    """Every registered family's declarations, in registration order (the modules' import order)."""
    for module in _MODULES:  # each registers when first imported; a no-op after
        importlib.import_module(module)
    return _REGISTERED


def declared_in(spec: "ScheduleSpec") -> list[tuple[Declared, object]]:
    """(family, its evaluated declarations) for each family ``spec`` declares, in registration order."""
    return [(family, declared) for family in declared_families()
            for declared in (family.evaluated(spec),) if declared is not None]
