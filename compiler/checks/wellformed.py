"""Well-formedness of an activation-passing program.

``check_well_formed`` proves four things about a ``Program``, mostly about its
compute actions (F, B, I, W); communication, frees and collectives are left to
the other checks:

0. Every instruction is one the family knows (compute, send/receive, batch,
   free, all-reduce).
1. Every task is valid and in place: its stage and microbatch are in range, the
   microbatch rides the stage's pipeline, and it runs on the stage's home rank.
2. Every task of the family appears exactly once: for each pipeline, each of
   its stages and each microbatch riding it, F once and either B once or I and
   W once each.
3. The dependencies can be met: the graph whose edges are the per-rank order
   and the dataflow (F(s) after F(prev s); B or I(s) after F(s) and after the B
   or I of next(s); W after I) is acyclic. A failure names the task that can
   never run, its rank and step, and the cycle it sits on.

Everything works on integer task keys, ``(stage * N + mb) * 4 + code`` with
code F=0, B=1, I=2, W=3, and task positions ``step * R + rank``, so each pass
touches each instruction a constant number of times.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

from pipec.compiler.ir import Action, Program, StageTables, stage_tables
from pipec.compiler.ops import OP_OF_CODE, OPS, TASK_CODE
from pipec.errors import WellFormedError

NOWHERE = -1

_op_of = operator.itemgetter(1)
_present = NOWHERE.__lt__  # where[key] > -1: the task appears


def task_key(stage: int, op: str, mb: int, num_microbatches: int) -> int:
    """The integer key of compute task ``op(stage, mb)``."""
    return (stage * num_microbatches + mb) * 4 + TASK_CODE[op]


def task_text(key: int, num_microbatches: int) -> str:
    """torch's token of the task with integer key ``key`` (``2B0``)."""
    stage_mb, code = divmod(key, 4)
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
    where = [NOWHERE] * (num_stages * num_mb * 4)
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
            key = (stage * num_mb + mb) * 4 + code
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
    """Every (stage, riding mb) has F, and B xor (I and W); compared as whole lists."""
    where = tasks.where
    num_mb = program.num_microbatches
    mb_pipeline = program.mb_pipeline
    expected = [pipe == ride for pipe in tables.pipeline for ride in mb_pipeline]
    has_f = list(map(_present, where[0::4]))
    has_b = list(map(_present, where[1::4]))
    has_i = list(map(_present, where[2::4]))
    has_w = list(map(_present, where[3::4]))
    # Invalid (stage, mb) pairs never get a key (locate_tasks), so "present"
    # implies "expected"; only missing tasks and bad B/I/W mixes remain.
    if (has_f == expected and list(map(operator.or_, has_b, has_i)) == expected
            and not any(map(operator.and_, has_b, has_i)) and has_i == has_w):
        return
    for index, wanted in enumerate(expected):
        if not wanted:
            continue
        stage, mb = divmod(index, num_mb)
        text = _task_problem(has_f[index], has_b[index], has_i[index], has_w[index])
        if text is None:
            continue
        base = index * 4
        found = [where[base + code] for code in (0, 1, 2, 3) if where[base + code] != NOWHERE]
        rank, step = (found[0] % program.num_ranks, found[0] // program.num_ranks) if found else (tables.home[stage], None)
        raise _error(program, text.format(s=stage, m=mb), rank, step)


# (has F, has B, has I, has W) -> problem text; the first rule that matches wins.
_TASK_RULES = (
    (lambda f, b, i, w: not f, "task {s}F{m} is missing"),
    (lambda f, b, i, w: b and i, "{s}B{m} and {s}I{m} both appear: a backward is either B or split into I and W"),
    (lambda f, b, i, w: i and not w, "task {s}W{m} is missing ({s}I{m} splits the backward)"),
    (lambda f, b, i, w: w and not i, "task {s}I{m} is missing ({s}W{m} needs it)"),
    (lambda f, b, i, w: not (b or i), "task {s}B{m} is missing (or {s}I{m} and {s}W{m})"),
)


def _task_problem(f: bool, b: bool, i: bool, w: bool) -> str | None:
    for rule, text in _TASK_RULES:
        if rule(f, b, i, w):
            return text
    return None


# ---------------------------------------------------------------- dependencies


def _dependency_deltas(program: Program, tables: StageTables) -> list[tuple[int, ...]]:
    """For each (stage * 4 + code): key offsets of the task's dataflow inputs.

    A backward's input from the next stage is named by that stage's B key; the
    caller moves to the I key (+1) when that microbatch's backward is split.
    """
    span = program.num_microbatches * 4
    deltas: list[tuple[int, ...]] = []
    for stage in range(len(program.stages)):
        prev, nxt = tables.prev[stage], tables.next[stage]
        from_prev = ((prev - stage) * span,) if prev >= 0 else ()
        from_next = lambda code: ((nxt - stage) * span + 1 - code,) if nxt >= 0 else ()  # noqa: E731
        deltas.append(from_prev)                      # F: F(prev)
        deltas.append((-1,) + from_next(1))           # B: F(self), B|I(next)
        deltas.append((-2,) + from_next(2))           # I: F(self), B|I(next)
        deltas.append((-1,))                          # W: I(self)
    return deltas


def _check_dependencies(program: Program, tables: StageTables, tasks: TaskIndex) -> None:
    """Kahn's algorithm, one cursor per rank: run every task whose inputs are done.

    A rank's cursor stops at a task with an input not done yet and is woken when
    that input completes, so each task is visited O(1) times. Whatever is left
    blocked when no rank can move forms the report.
    """
    where, rank_keys = tasks.where, tasks.keys
    num_mb = program.num_microbatches
    span = num_mb * 4
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
            for delta in deltas[(key // span) * 4 + (key & 3)]:
                need = key + delta
                if where[need] == NOWHERE:  # B of the next stage absent: its backward is split
                    need += 1
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
    for delta in deltas[(key // span) * 4 + (key & 3)]:
        need = key + delta
        if tasks.where[need] == NOWHERE:
            need += 1
        if not done[need]:
            return need
    raise AssertionError("a stuck task has all its inputs")


def _dependency_error(program, tasks, deltas, done, cursor, stuck) -> WellFormedError:
    """Name a task that can never run: a later task on its own rank, or a cycle across ranks."""
    num_mb, num_ranks = program.num_microbatches, program.num_ranks
    span = num_mb * 4
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


__all__ = [
    "StageTables",
    "TaskIndex",
    "TASK_CODE",
    "check_well_formed",
    "first_misplaced_compute",
    "locate_tasks",
    "stage_tables",
    "task_key",
    "task_text",
]
