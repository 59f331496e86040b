"""Workload families as modules: what the engine asks of a family, and where it finds one.

A family (DESIGN.md section 2) is a module under ``compiler/families/`` that
builds one ``Family`` and registers it with the kind of plan its programs
carry (``WeightPlan``, ``RingPlan``; activation passing needs none). Passes
outside the family modules never test which family a program is: they ask
``families_of(program)`` (or ``family_of_spec(spec)`` before lowering) and
call the hooks below, whose defaults are activation passing's behaviour, so
a family overrides only what it does differently.

A program's families are the ones whose plans it holds (``Program.plans``),
or activation passing alone when it holds none. The registry is filled when
``pipec.compiler.families`` is imported; the lookups import it on first use,
so a pass that only reads a program need not know the family modules exist.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:  # types only: the family modules import the passes, not the other way round
    from pipec.compiler.costs import CostModel
    from pipec.compiler.ir import Program
    from pipec.dsl.spec import ScheduleSpec


class Family:
    """One workload family's answers to what the engine asks. Subclasses override what differs.

    Attributes:
        name: the family's name (``ops.FAMILIES``), as the rule table's ``family`` field spells it.
        frees_values: whether liveness inserts frees into its programs (a ring's buffers are
            replaced by its exchanges, never freed).
        exact_times: whether the simulator reports its timeline's times as exact plain numbers.
        runs_ops_of: the families whose ops its programs may hold (weight passing trains stages with
            activation passing's computes; a ring runs only its own blocks); the prover refuses others.
        stage_checks: whether the checks that speak of stages and microbatches (well-formed,
            matching, conflict, deadlock, versions, memory) apply to its programs; a ring's blocks
            are proved by the symbolic run alone.
    """

    name: str = ""
    frees_values: bool = True
    exact_times: bool = False
    runs_ops_of: tuple[str, ...] = ()
    stage_checks: bool = True

    def spec_plan(self, spec: "ScheduleSpec") -> object | None:
        """The family's declarations in an evaluated schedule, or None when it has none."""
        return None

    def lower(self, spec: "ScheduleSpec", costs: "CostModel | None") -> tuple["Program", "Program"]:
        """Order and lower ``spec``: (compute-only program, program with communication), unchecked."""
        raise NotImplementedError(self.name)

    def plan_to_json(self, program: "Program") -> dict:
        """The family's fields of the program file's header (``emit/json_program.py``), in the format's order."""
        return {}

    def refuse_memory_budget(self, name: str) -> str | None:
        """Why activation and byte budgets do not apply to the family's program ``name``, or None."""
        return None

    def refuse_torch_csv(self, name: str) -> str | None:
        """Why torch's schedule CSV cannot hold the family's program ``name``, or None."""
        return None

    def refuse_updates(self) -> str | None:
        """Why an optimizer update cannot stand inside the family's lists, or None."""
        return None

    def node_of(self, program: "Program") -> Callable[[int], int] | None:
        """Rank -> node as the family's plan groups them (when the cost file gives no node size), or None."""
        return None

    def borrowed_buffers(self, program: "Program") -> list[int] | None:
        """Peak borrowed weight buffers per rank, or None where the family borrows none."""
        return None

    def peak_bytes(self, program: "Program", sizes: Mapping[str, object]) -> list[dict] | None:
        """Peak bytes per rank and size class when the family counts memory its own way, else None."""
        return None

    def shape_text(self, program: "Program") -> str:
        """What ``pipec check`` says the program is made of, after its ranks."""
        return f"{len(program.stages)} stages, {program.num_microbatches} microbatches"

    def proof_text(self, program: "Program", memory_text: Callable[[], str]) -> str:
        """What ``pipec check`` says it proved; ``memory_text()`` says the activation and byte peaks."""
        return f"well-formed, messages matched, deadlock-free, no conflict; {memory_text()}"


_BY_PLAN: dict[type, Family] = {}
_DEFAULT: list[Family] = []


def register(family: Family, plan_type: type | None) -> Family:
    """Register ``family`` for programs holding a plan of ``plan_type`` (None: the family of plan-less programs)."""
    if plan_type is None:
        _DEFAULT[:] = [family]
    else:
        _BY_PLAN[plan_type] = family
    return family


def _registered() -> None:
    if not _DEFAULT:
        importlib.import_module("pipec.compiler.families")


def families_of(program: "Program") -> list[Family]:
    """The families whose plans ``program`` holds, in plan order; activation passing when it holds none."""
    _registered()
    found = [_BY_PLAN[type(plan)] for plan in program.plans]
    return found or list(_DEFAULT)


def family_of_spec(spec: "ScheduleSpec") -> Family:
    """The family whose declarations the evaluated schedule holds (activation passing when none does)."""
    _registered()
    return next((f for f in _BY_PLAN.values() if f.spec_plan(spec) is not None), _DEFAULT[0])


def first_refusal(program: "Program", ask: Callable[[Family], str | None]) -> str | None:
    """The first of ``program``'s families' answers to ``ask`` that is a refusal, or None."""
    return next((why for why in map(ask, families_of(program)) if why is not None), None)
