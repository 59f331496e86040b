"""Well-formedness of an activation-passing program.

``check_well_formed`` proves four things about a ``Program``, mostly about its
compute actions (F, B, I, W); communication, frees and collectives are left to
the other checks:

0. Every instruction is one the family knows (compute, send/receive, batch,
   free, all-reduce).
1. Every task is valid and in place: its stage and microbatch are in range, the
   microbatch rides the stage's pipeline, and it runs on the stage's home rank.
2. Every task of the family appears exactly once: for each pipeline, each of
   its stages and each microbatch riding it, F once, or (a recomputed stage)
   FC and R once each; and either B once or I and W once each.
3. The dependencies can be met: the graph whose edges are the per-rank order
   and the dataflow (F or FC(s) after F or FC(prev s); R(s) after FC(s); B or
   I(s) after F(s), or R(s) when recomputed, and after the B or I of next(s);
   W after I) is acyclic. A failure names the task that can never run, its
   rank and step, and the cycle it sits on (a recompute after its backward:
   the backward needs it, and it comes later on the rank).

The task sets (2) and the dataflow (3) come from the rule table
(``ops.FAMILY_TASKS``, ``ops.DEPENDENCIES``). Everything works on integer
task keys, ``(stage * N + mb) * C + code`` with C = ``ops.NUM_TASK_CODES``
and the code of ``ops.TASK_CODE`` (F=0, B=1, I=2, W=3, FC=4, R=5), and task positions
``step * R + rank``, so each pass touches each instruction a constant number
of times.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

from pipec.compiler.ir import Action, Program, StageTables, stage_tables
from pipec.compiler.ops import (
    ACTIVATION_PASSING,
    DEPENDENCIES,
    FAMILY_TASKS,
    NUM_TASK_CODES,
    OP_OF_CODE,
    OPS,
    TASK_CODE,
    declare_pass,
)
from pipec.errors import WellFormedError

NOWHERE = -1
_CODES = NUM_TASK_CODES

_op_of = operator.itemgetter(1)
_present = NOWHERE.__lt__  # where[key] > -1: the task appears


def task_key(stage: int, op: str, mb: int, num_microbatches: int) -> int:
    """The integer key of compute task ``op(stage, mb)``."""
    return (stage * num_microbatches + mb) * _CODES + TASK_CODE[op]


def task_text(key: int, num_microbatches: int) -> str:
    """torch's token of the task with integer key ``key`` (``2B0``)."""
    stage_mb, code = divmod(key, _CODES)
    stage, mb = divmod(stage_mb, num_microbatches)
    return f"{stage}{OP_OF_CODE[code]}{mb}"


class TaskIndex(NamedTuple):
    """Where each compute task sits; built by ``locate_tasks``.

    Attributes:
        where: task key -> ``step * num_ranks + rank``, or -1 when absent.
        keys: per rank, the task keys of its compute actions in list order.
    """

    where: list[int]
    keys: list[list[int]]


def locate_tasks(program: Program, tables: StageTables | None = None) -> TaskIndex:
    """Index every compute action, rejecting invalid, misplaced and duplicate tasks.

    Args:
        program: any program; non-compute actions are skipped.
        tables: ``stage_tables(program)``, when the caller has it.
    Returns:
        the ``TaskIndex``.
    Raises:
        WellFormedError: a stage or microbatch out of range, a microbatch that
            does not ride the stage's pipeline, a task off its stage's home
            rank, or a task that appears twice (both places marked).
    """
    tables = tables or stage_tables(program)
    home, pipeline, mb_pipeline = tables.home, tables.pipeline, program.mb_pipeline
    num_stages, num_mb, num_ranks = len(program.stages), program.num_microbatches, program.num_ranks
    where = [NOWHERE] * (num_stages * num_mb * _CODES)
    rank_keys = []
    code_of = TASK_CODE.get
    for rank, row in enumerate(program.ranks):
        keys = []
        append = keys.append
        for step, (stage, op, mb, _peer, _parts) in enumerate(row):
            code = code_of(op)
            if code is None:
                continue
            if not (0 <= stage < num_stages and 0 <= mb < num_mb and home[stage] == rank
                    and pipeline[stage] == mb_pipeline[mb]):
                raise _invalid_task(program, tables, rank, step)
            key = (stage * num_mb + mb) * _CODES + code
            if where[key] != NOWHERE:
                first_step, first_rank = divmod(where[key], num_ranks)
                raise _error(program, f"{row[step].text()} appears twice (first at rank {first_rank}, step {first_step})",
                             rank, step, [(first_rank, first_step)])
            where[key] = step * num_ranks + rank
            append(key)
        rank_keys.append(keys)
    return TaskIndex(where, rank_keys)


def first_misplaced_compute(program: Program, tables: StageTables | None = None) -> tuple[int, int, Action] | None:
    """The first compute action (rank-major) that is not on its stage's home rank.

    Args:
        program: a program whose compute stages are in range (others are skipped).
    Returns:
        (rank, step, action), or None when every compute runs at home.
    """
    home = (tables or stage_tables(program)).home
    num_stages = len(home)
    for rank, row in enumerate(program.ranks):
        for step, action in enumerate(row):
            if action.op in TASK_CODE and 0 <= action.stage < num_stages and home[action.stage] != rank:
                return rank, step, action
    return None


def check_well_formed(program: Program, *, tasks: TaskIndex | None = None, tables: StageTables | None = None) -> None:
    """Prove the compute actions form exactly the family's tasks in a feasible order.

    Args:
        program: the program to check (compute-only or lowered).
        tasks, tables: ``locate_tasks`` and ``stage_tables`` results, when the
            caller has them (``check_all``).
    Raises:
        WellFormedError: see the module docstring; the error names the task,
            its rank and step, and renders the grid window.
    """
    tables = tables or stage_tables(program)
    _check_known_ops(program)
    tasks = tasks or locate_tasks(program, tables)
    _check_complete(program, tables, tasks)
    _check_dependencies(program, tables, tasks)


# Every op the rule table knows.
KNOWN_OPS = frozenset(OPS)


def _check_known_ops(program: Program) -> None:
    for rank, row in enumerate(program.ranks):
        if not KNOWN_OPS.issuperset(map(_op_of, row)):
            step = next(step for step, action in enumerate(row) if action.op not in KNOWN_OPS)
            raise _error(program, f"{row[step].text()}: unknown instruction {row[step].op!r}", rank, step)


# ---------------------------------------------------------------- completeness


def _check_complete(program: Program, tables: StageTables, tasks: TaskIndex) -> None:
    """Every (stage, riding mb) has exactly one alternative of each task set; compared as whole lists."""
    where = tasks.where
    mb_pipeline = program.mb_pipeline
    expected = [pipe == ride for pipe in tables.pipeline for ride in mb_pipeline]
    has = {op: list(map(_present, where[code::_CODES])) for op, code in TASK_CODE.items()}
    # Invalid (stage, mb) pairs never get a key (locate_tasks), so "present"
    # implies "expected"; only missing tasks and bad mixes remain.
    task_sets = FAMILY_TASKS[ACTIVATION_PASSING]
    if all(_complete_everywhere(task_set, has, expected) for task_set in task_sets):
        return
    for index, wanted in enumerate(expected):
        if not wanted:
            continue
        stage, mb = divmod(index, program.num_microbatches)
        for task_set in task_sets:
            text = task_problem(task_set, {op: column[index] for op, column in has.items()}, stage, mb)
            if text is None:
                continue
            base = index * _CODES
            found = [where[base + code] for code in range(_CODES) if where[base + code] != NOWHERE]
            rank, step = (found[0] % program.num_ranks, found[0] // program.num_ranks) if found else (tables.home[stage], None)
            raise _error(program, text, rank, step)


def _complete_everywhere(task_set, has: dict[str, list[bool]], expected: list[bool]) -> bool:
    """Whether each alternative is all there or all absent, and exactly one is there where expected
    (at most one, for an optional set: one with an empty alternative)."""
    alternatives = [alternative for alternative in task_set.alternatives if alternative]
    if any(has[op] != has[alternative[0]] for alternative in alternatives for op in alternative[1:]):
        return False
    firsts = [has[alternative[0]] for alternative in alternatives]
    if len(alternatives) < len(task_set.alternatives):  # optional
        return all(sum(row) <= 1 for row in zip(*firsts))
    if len(firsts) == 1:
        return firsts[0] == expected
    return list(map(any, zip(*firsts))) == expected and all(sum(row) <= 1 for row in zip(*firsts))


def task_problem(task_set, present: dict[str, bool], s: int, m: int) -> str | None:
    """What is wrong with one (stage, mb)'s task set, in words; None when nothing is.

    In order: two alternatives whose first ops both appear; an alternative
    begun but not complete (a later op missing: the first one splits the
    work; the first op missing: a later one needs it); none begun.
    """
    task = lambda op: f"{s}{op}{m}"  # noqa: E731
    optional = () in task_set.alternatives
    alternatives = tuple(alt for alt in task_set.alternatives if alt)
    started = [alt for alt in alternatives if present[alt[0]]]
    if len(started) > 1:
        first, second = started[0], started[1]
        if task_set.per_stage:  # the others are a recomputed stage's
            ways = ", or ".join(" then ".join(alt) for alt in alternatives) + " on a recomputed stage"
        else:
            ways = " or split into ".join(" and ".join(alt) for alt in alternatives)
        return f"{task(first[0])} and {task(second[0])} both appear: a {task_set.name} is either {ways}"
    for alternative in alternatives:
        if not any(present[op] for op in alternative) or all(present[op] for op in alternative):
            continue
        missing = next(op for op in alternative if not present[op])
        if missing != alternative[0] and task_set.per_stage:
            return (f"task {task(missing)} is missing ({task(alternative[0])} keeps only its input: the stage "
                    f"is recomputed, and its backward reads what {missing} remakes)")
        if missing != alternative[0]:
            return f"task {task(missing)} is missing ({task(alternative[0])} splits the {task_set.name})"
        later = next(op for op in alternative if present[op])
        return f"task {task(missing)} is missing ({task(later)} needs it)"
    if started or optional:
        return None
    if len(alternatives) == 1:
        return f"task {task(alternatives[0][0])} is missing"
    first, *others = alternatives
    return (f"task {task(first[0])} is missing (or "
            + " or ".join(" and ".join(task(op) for op in alt) for alt in others) + ")")


# ---------------------------------------------------------------- dependencies


def _dependency_deltas(program: Program, tables: StageTables) -> list[tuple[tuple[int, ...], ...]]:
    """For each (stage * C + code): per dataflow input (``ops.DEPENDENCIES``), the key
    offsets of the ops that may make it, in table order (the first present wins:
    a backward reads the next stage's B, or its I when that backward is split).
    """
    span = program.num_microbatches * _CODES
    deltas: list[tuple[tuple[int, ...], ...]] = []
    for stage in range(len(program.stages)):
        for op in OP_OF_CODE:
            code = TASK_CODE[op]
            inputs = []
            for dependency in DEPENDENCIES[op]:
                other = tables.neighbour(dependency.where)[stage]
                if other >= 0:
                    inputs.append(tuple((other - stage) * span + TASK_CODE[made] - code for made in dependency.made_by))
            deltas.append(tuple(inputs))
    return deltas


def _input_key(key: int, alternatives: tuple[int, ...], where: list[int]) -> int:
    """The key of the input made by the first of ``alternatives`` present (the first when none is)."""
    for delta in alternatives:
        if where[key + delta] != NOWHERE:
            return key + delta
    return key + alternatives[0]


def _check_dependencies(program: Program, tables: StageTables, tasks: TaskIndex) -> None:
    """Kahn's algorithm, one cursor per rank: run every task whose inputs are done.

    A rank's cursor stops at a task with an input not done yet and is woken when
    that input completes, so each task is visited O(1) times. Whatever is left
    blocked when no rank can move forms the report.
    """
    where, rank_keys = tasks.where, tasks.keys
    num_mb = program.num_microbatches
    span = num_mb * _CODES
    deltas = _dependency_deltas(program, tables)
    done = bytearray(len(where))
    cursor = [0] * program.num_ranks
    waiting: dict[int, list[int]] = {}
    ready = list(range(program.num_ranks))
    while ready:
        rank = ready.pop()
        keys = rank_keys[rank]
        index, count = cursor[rank], len(keys)
        while index < count:
            key = keys[index]
            blocked = -1
            for alternatives in deltas[(key // span) * _CODES + key % _CODES]:
                need = key + alternatives[0]
                if where[need] == NOWHERE and len(alternatives) > 1:  # e.g. the next stage's backward is split
                    need = _input_key(key, alternatives, where)
                if not done[need]:
                    blocked = need
                    break
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(rank)
                break
            done[key] = 1
            woken = waiting.pop(key, None)
            if woken:
                ready.extend(woken)
            index += 1
        cursor[rank] = index
    stuck = [r for r in range(program.num_ranks) if cursor[r] < len(rank_keys[r])]
    if stuck:
        raise _dependency_error(program, tasks, deltas, done, cursor, stuck)


def _blocking_input(key: int, tasks: TaskIndex, deltas, done, span: int) -> int:
    for alternatives in deltas[(key // span) * _CODES + key % _CODES]:
        need = _input_key(key, alternatives, tasks.where)
        if not done[need]:
            return need
    raise AssertionError("a stuck task has all its inputs")


def _dependency_error(program, tasks, deltas, done, cursor, stuck) -> WellFormedError:
    """Name a task that can never run: a later task on its own rank, or a cycle across ranks."""
    num_mb, num_ranks = program.num_microbatches, program.num_ranks
    span = num_mb * _CODES
    waits = {}  # rank -> (its stuck key, the input key it waits for)
    for rank in stuck:
        key = tasks.keys[rank][cursor[rank]]
        waits[rank] = (key, _blocking_input(key, tasks, deltas, done, span))
    rank = stuck[0]
    seen: dict[int, int] = {}
    while rank not in seen:
        seen[rank] = len(seen)
        rank = tasks.where[waits[rank][1]] % num_ranks
    cycle = [r for r, _ in sorted(seen.items(), key=lambda item: item[1])][seen[rank]:]
    start = cycle.index(min(cycle))
    cycle = cycle[start:] + cycle[:start]

    def place(key):
        step, at = divmod(tasks.where[key], num_ranks)
        return at, step

    if len(cycle) == 1:
        key, need = waits[cycle[0]]
        at, step = place(key)
        _, later = place(need)
        return _error(program, f"{task_text(key, num_mb)} needs {task_text(need, num_mb)}, "
                               f"which comes later on this rank (step {later})", at, step, [(at, later)])
    parts, marks = [], []
    for member in cycle:
        key, need = waits[member]
        at, step = place(key)
        need_rank, need_step = place(need)
        marks.append((at, step))
        parts.append(f"rank {at} step {step} ({task_text(key, num_mb)}) needs {task_text(need, num_mb)} "
                     f"(rank {need_rank} step {need_step})")
    first_rank, first_step = marks[0]
    return _error(program, "dependency cycle: " + "; ".join(parts), first_rank, first_step, marks[1:])


# ---------------------------------------------------------------------- errors


def _invalid_task(program: Program, tables: StageTables, rank: int, step: int) -> WellFormedError:
    action = program.ranks[rank][step]
    stage, mb = action.stage, action.mb
    text = action.text()
    if not 0 <= stage < len(program.stages):
        message = f"{text}: there is no stage {stage} (stages 0..{len(program.stages) - 1})"
    elif not 0 <= mb < program.num_microbatches:
        message = f"{text}: there is no microbatch {mb} (microbatches 0..{program.num_microbatches - 1})"
    elif tables.home[stage] != rank:
        message = f"{text} runs on rank {rank}, but stage {stage} lives on rank {tables.home[stage]}"
    else:
        message = (f"{text}: microbatch {mb} rides pipeline {program.mb_pipeline[mb]}, "
                   f"but stage {stage} belongs to pipeline {tables.pipeline[stage]}")
    return _error(program, message, rank, step)


def _error(program: Program, message: str, rank: int, step: int | None, marks=()) -> WellFormedError:
    return WellFormedError(message, rank, step, program.grid(), marks)


# Compute ops by their task codes and dataflow; every other op is only known here (the other checks take it).
declare_pass("well-formed", set(TASK_CODE) | KNOWN_OPS)

__all__ = [
    "StageTables",
    "TaskIndex",
    "TASK_CODE",
    "check_well_formed",
    "first_misplaced_compute",
    "locate_tasks",
    "stage_tables",
    "task_key",
    "task_problem",
    "task_text",
]
