"""The safety checks: each proves one property of a per-rank Program.

* ``check_well_formed``: exactly the family's tasks, in range, at home, in an
  order whose dependencies can be met.
* ``check_matching``: every message routed producer -> consumer and matched
  FIFO per ordered pair of ranks.
* ``check_conflict``: no buffer read before it is received or after it is freed.
* ``check_deadlock``: every rank reaches its end ("rendezvous" or "async").
* ``prove_exchanges`` (``checks/symbolic.py``): one symbolic run of every
  family's exchanges (parts matched, collectives met in one order, waits, no
  deadlock), each family giving its ops their meaning: weight passing
  (``check_weights``: every copy and gradient where it must be, buffers within
  their bound), sequence rings (``check_rings``: every visible attention
  block computed exactly once forward and backward, every KV bundle where it
  must be, every dK, dV contribution home once), tensor parallelism
  (``checks/tensor_parallel.py``: every slice computed once on whole inputs,
  every partial all-reduced once). A family whose programs do
  not speak of stages and microbatches (rings: ``Family.stage_checks``) is
  proved by this run alone.
* ``check_mesh`` (``checks/mesh.py``): a composed program's mesh agrees with
  its placements and its members' shares, so the coordinates it is labelled
  with are true.
* ``check_placed`` (``checks/placement.py``): a program with stages on rank
  groups is proved per member instead of by the single-home checks above
  (groups real, each member's tasks once, sub-steps alike; ``checks/sharding.py``:
  a sharded stage's weights whole wherever a compute runs on them, every
  member's gradient reduced once after its last contribution and waited), its
  messages, sub-steps and reductions by the one symbolic run; a program with
  no stage on a group holds none of a group's ops. A context-parallel
  composition's ``stage_ring`` (the ring every stage's group runs) is proved
  by all of these, alone, its errors prefixed as the stage ring's.
* ``version_plan`` (optimizer updates in the order): every backward on the
  weights its forward ran on, every weight gradient applied
  (``compiler/versions.py``).
* ``check_memory`` / ``peak_activations``: live activations per rank, and
  live bytes per size class given the bytes of one value of each.

``check_all`` runs them in that order, so that each check can rely on the ones
before it, and builds the shared indexes (task positions, message log) once.
"""
from __future__ import annotations

from typing import Mapping

from pipec.compiler.ir import Program
from pipec.compiler.checks.conflict import check_conflict
from pipec.compiler.checks.deadlock import ASYNC, RENDEZVOUS, SEMANTICS, check_deadlock
from pipec.compiler.checks.matching import MessageLog, check_matching, describe_tensor, scan_messages
from pipec.compiler.checks.memory import check_memory, peak_activations
from pipec.compiler.checks.mesh import check_mesh
from pipec.compiler.checks.placement import check_placed
from pipec.compiler.checks.sharding import check_no_group_ops
from pipec.compiler.checks.rings import RingReport, check_rings
from pipec.compiler.checks.symbolic import prove_exchanges, proves_exchanges
from pipec.compiler.checks import tensor_parallel  # noqa: F401  (registers the family's semantics)
from pipec.compiler.checks.weights import WeightReport, check_weights
from pipec.compiler.family import families_of
from pipec.compiler.memory_counts import Number
from pipec.compiler.versions import version_plan
from pipec.errors import ProgramError
from pipec.compiler.checks.wellformed import (
    StageTables,
    TaskIndex,
    check_well_formed,
    locate_tasks,
    stage_tables,
)


def check_all(
    program: Program,
    *,
    semantics: str = RENDEZVOUS,
    memory_budget: int | None = None,
    byte_budget: Mapping[str, Number] | None = None,
    sizes: Mapping[str, Number] | None = None,
) -> None:
    """Run every check on ``program``: well-formed, matching, conflict, deadlock, memory.

    Args:
        program: the program to prove safe.
        semantics: the runtime model for ``check_deadlock``: "rendezvous"
            (pipec's own programs) or "async" (imported torch CSV).
        memory_budget: the most live activations per rank, or None.
        byte_budget: size class -> the most bytes of live values of that
            class per rank, or None (see ``check_memory``).
        sizes: size class -> bytes of one value of it; needed for every
            class ``byte_budget`` names.
    Raises:
        ProgramError: the first failing check's error (WellFormedError,
            MatchError, ConflictError, DeadlockError, VersionError or BudgetError).
        ValueError: a byte budget for a class without a size, or an unknown class.
    """
    if semantics not in SEMANTICS:
        raise ValueError(f"unknown semantics {semantics!r}; expected one of {SEMANTICS}")
    check_mesh(program)
    if program.stage_ring is not None:
        _check_stage_ring(program.stage_ring, semantics)
    stage_checks = all(family.stage_checks for family in families_of(program))
    if program.placed_on_groups:  # each member's share, by the placement checks and the symbolic run
        check_placed(program)
    else:
        check_no_group_ops(program)
        if stage_checks:
            tables = stage_tables(program)
            tasks = locate_tasks(program, tables)
            check_well_formed(program, tasks=tasks, tables=tables)
            log = scan_messages(program, tables)
            check_matching(program, log=log, tables=tables)
            check_conflict(program, tasks=tasks, log=log, tables=tables)
            check_deadlock(program, semantics, log=log, tasks=tasks, tables=tables)
    if proves_exchanges(program):  # one symbolic run for every family's exchanges
        prove_exchanges(program)
    if stage_checks:
        version_plan(program)
        check_memory(program, memory_budget, byte_budget=byte_budget, sizes=sizes)

def _check_stage_ring(ring: Program, semantics: str) -> None:
    """The ring a context-parallel composition's stages run, proved alone; its errors say it is the stage
    ring (its ranks are a group's members, ring rank i member i), so they are not read as the pipeline's."""
    try:
        check_all(ring, semantics=semantics)
    except ProgramError as error:
        error.message = (f"in the stage ring ({ring.name or 'the ring'} on {ring.num_ranks} ranks, ring rank i = "
                         f"member i of every stage's group): {error.message}")
        error.args = (error.message,)
        raise


__all__ = [
    "ASYNC",
    "RENDEZVOUS",
    "SEMANTICS",
    "MessageLog",
    "StageTables",
    "TaskIndex",
    "check_all",
    "check_conflict",
    "check_deadlock",
    "check_matching",
    "check_memory",
    "check_mesh",
    "check_placed",
    "check_rings",
    "check_weights",
    "prove_exchanges",
    "RingReport",
    "WeightReport",
    "check_well_formed",
    "describe_tensor",
    "locate_tasks",
    "peak_activations",
    "scan_messages",
    "stage_tables",
]
