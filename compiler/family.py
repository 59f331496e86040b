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

from pipec.compiler.ops import RULES
from pipec.errors import counted

if TYPE_CHECKING:  # types only: the family modules import the passes, not the other way round
    from fractions import Fraction

    from typing import Sequence

    from pipec.compiler.costs import CostModel
    from pipec.compiler.family_search import FamilySearch
    from pipec.compiler.ir import Action, Mesh, Program
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
        keeps_own_ops: whether its ops may stand only in its own programs (a program file of
            another family holding one is refused as it is read).
        counts_activations: whether its ranks hold activations between stages (``pipec simulate``
            reports their peak); a ring's memory is KV.
        runs_in_stages: whether a program of it can run inside every compute of a context-parallel
            stage, as a composition's ``Program.stage_ring`` (a sequence ring).
        writes_own_steps: whether its schedules write steps of their own (a ring's ``at step``), so that
            an error names a list position an "instruction" and gives the written step beside it.
        searches_itself: whether ``pipec search`` asks the family's own ``search`` (its candidates priced
            by the simulator) instead of the exact job-shop model of activation passing
            (``compiler/search.py``).
    """

    name: str = ""
    frees_values: bool = True
    exact_times: bool = False
    runs_ops_of: tuple[str, ...] = ()
    stage_checks: bool = True
    keeps_own_ops: bool = False
    counts_activations: bool = True
    runs_in_stages: bool = False
    writes_own_steps: bool = False
    searches_itself: bool = False

    def spec_plan(self, spec: "ScheduleSpec") -> object | None:
        """The family's declarations in an evaluated schedule, or None when it has none."""
        return None

    def plan_of(self, program: "Program") -> object | None:
        """The family's plan in ``program`` (``Program.plans``), or None when it holds none."""
        return None

    def lower(self, spec: "ScheduleSpec", costs: "CostModel | None") -> tuple["Program", "Program"]:
        """Order and lower ``spec``: (compute-only program, program with communication), unchecked."""
        raise NotImplementedError(self.name)

    def plan_to_json(self, program: "Program") -> dict:
        """The family's fields of the program file's header (``emit/json_program.py``), in the format's order."""
        return {}

    def plan_from_json(self, data: dict, header: dict) -> object | None:
        """The family's plan from a program file's header fields (``plan_to_json``'s), or None when they are unset.

        ``header`` holds what was read before it: ``num_ranks``, ``num_microbatches``, ``stages``,
        ``pipelines``, ``communicators`` (the file's, possibly empty). Families are asked in
        registration order. Raises ``ImportError_`` naming the first bad field.
        """
        return None

    def instruction_bounds(self, plan: object | None, op: str, bounds: tuple[int, int, int]) -> tuple | None:
        """The bounds of ``op``'s stage, mb and peer in the family's program files (``bounds``: the header's),
        or None where they cannot hold ``op`` (an op of a family that keeps its ops to its own programs)."""
        return None if RULES[op].family in _kept_to_themselves() else bounds

    def reduced_stages(self, program: "Program") -> frozenset[int] | None:
        """The stages on rank groups whose weight gradient every member reduces over the group, where only
        some are (weight passing: each layer's owner's stage), or None: every stage on a group."""
        return None

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
        return f"{counted(len(program.stages), 'stage')}, {counted(program.num_microbatches, 'microbatch')}"

    def grid_shape_text(self, program: "Program") -> str:
        """What a text grid's header (``emit/text_grid.py``) says the program is made of, after its ranks."""
        return self.shape_text(program)

    def note(self, program: "Program") -> str:
        """A note the family's plan carries for the user (``pipec simulate`` prints it), or ''."""
        return ""

    def value_share(self, program: "Program", part: "Action", kind: str) -> "Fraction | None":
        """The share of one value of ``kind`` that the message ``part`` moves, where the family's messages
        carry pieces of values (a ring's bundles), else None (a whole value)."""
        return None

    def ring_step_giver(self, program: "Program", rank: int) -> int | None:
        """The rank whose slot a ring step (SHIFT_*) on ``rank`` takes, or None where the family has no
        ring of ranks."""
        return None

    def block_area(self, program: "Program", action: "Action") -> "Fraction | None":
        """The share of its op's cost an attention block (AF, AB) takes, or None when it names no block
        of the family."""
        return None

    def written_step(self, program: "Program", rank: int, index: int) -> int | None:
        """The step the schedule wrote for ``rank``'s instruction ``index`` (``writes_own_steps``), or None."""
        return None

    def refuse_mesh_policy(self, program: "Program", data: object) -> str | None:
        """Why no program of the family composes under ``data`` (a ``mesh_placement`` policy: replicated,
        sharded, context parallel), said at the composition's policy line; None when one may."""
        return None

    def place_composed(self, compute: "Program", program: "Program", mesh: "Mesh", pp_axis: str, data: object,
                       name: str) -> tuple["Program", "Program"]:
        """The (compute-only, final) programs of a composition: ``compute`` and ``program`` (the named schedule's,
        compiled and checked) placed on ``mesh`` under ``data``.

        Raises:
            UsageError: a program or mesh the placement does not take, with the reason.
        """
        from pipec.compiler.mesh_placement import place_on_mesh  # the placement imports the passes

        placed = place_on_mesh(program, mesh, pp_axis, data, name=name)  # first: its plans say why it cannot be
        return place_on_mesh(compute, mesh, pp_axis, data, name=name), placed

    def refuse_search(self, program: "Program") -> str | None:
        """Why ``pipec search`` does not search ``program``'s order, or None when it does.

        A composition (a program on a mesh) is refused here for every family: its order is its pipeline's,
        placed on groups whose collectives no search prices; the pipeline is searched alone."""
        if program.mesh is None:
            return None
        return (f"{program.name or 'this program'} is a composition on a mesh: pipec search orders one family's "
                "program, not a pipeline placed on groups (its stages' collectives are not priced); search the "
                "pipeline it places on its own and compose the written .pipe")

    def search(self, spec: "ScheduleSpec", program: "Program", costs: "CostModel | None",
               memory: "Sequence[int] | None", *, time_limit: float, candidates: int | None,
               seed: int = 0) -> "FamilySearch":
        """The family's own search of ``spec``'s free choices (``searches_itself``); ``program`` is ``spec``
        compiled, ``memory`` the most live activations per rank (None: unlimited), ``candidates`` a cap on
        the candidates priced (None: the family's default), ``seed`` the seed of any random choice (the same
        seed and cap give the same answer).

        Raises:
            UsageError: a choice the family does not search, or no candidate within the limits.
        """
        raise NotImplementedError(self.name)

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


def all_families() -> list[Family]:
    """Every registered family, plan-less first, then in registration order."""
    _registered()
    return _DEFAULT + list(_BY_PLAN.values())


def _kept_to_themselves() -> frozenset[str]:
    return frozenset(family.name for family in all_families() if family.keeps_own_ops)


def families_of(program: "Program") -> list[Family]:
    """The families whose plans ``program`` holds, in plan order; activation passing when it holds none."""
    _registered()
    found = [_BY_PLAN[type(plan)] for plan in program.plans]
    return found or list(_DEFAULT)


def family_of_spec(spec: "ScheduleSpec") -> Family:
    """The family whose declarations the evaluated schedule holds (activation passing when none does)."""
    _registered()
    return next((f for f in _BY_PLAN.values() if f.spec_plan(spec) is not None), _DEFAULT[0])


def runs_in_stages(program: "Program") -> bool:
    """Whether ``program`` can be a composition's stage ring (every family of it ``runs_in_stages``)."""
    return all(family.runs_in_stages for family in families_of(program))


def first_answer(families: list[Family], ask: Callable[[Family], object | None]) -> object | None:
    """The first of ``families``' answers to ``ask`` that is not None, or None."""
    return next((answer for answer in map(ask, families) if answer is not None), None)


def first_refusal(program: "Program", ask: Callable[[Family], str | None]) -> str | None:
    """The first of ``program``'s families' answers to ``ask`` that is a refusal, or None."""
    return first_answer(families_of(program), ask)
