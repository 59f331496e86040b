"""Conflicts: no computation reads a buffer that is not (or no longer) there.

What ``check_conflict`` proves, per rank, for a program whose compute actions
are well formed:

1. Every compute runs on its stage's home rank, so the buffers it reads and
   writes are that rank's.
2. Message buffers: every tensor a compute reads from another rank (F's input
   activation, a backward's output gradient) is received into this rank
   exactly once, before that compute; every tensor sent is sent after the
   compute that makes it. So no receive overwrites a buffer still waiting for
   its reader, no compute reads a buffer not yet filled, and no send ships a
   buffer not yet written.
3. Saved activations: a FREE_F(stage, mb) is on the stage's home rank, comes
   once, and comes after everything that uses the activation: the F that made
   it (or, on a recomputed stage, the R that made it again), the SEND_F that
   ships the output (the buffer is in flight until posted), and the backward
   that reads it (B, or I and W when split).

Two computations in one time slot cannot happen: each rank's program is one
sequential list, and stages merged from several pipelines onto a rank share
that list. Message routing and order are ``check_matching``'s, progress is
``check_deadlock``'s.

Which tasks make and read each message, and what a free drops and who uses
it, come from the rule table (``ops.HANDOFFS``, ``ops.producers``,
``ops.consumers``, ``ops.stored_by``, ``ops.last_uses``); tasks are the
integer keys of ``check_well_formed`` (``ops.TASK_CODE``), tensors the ids of
``check_matching`` (``ops.MESSAGE_KIND_CODE``).
"""
from __future__ import annotations

import operator
from itertools import compress, repeat
from typing import NamedTuple

from pipec.compiler import ops
from pipec.compiler.ir import Program
from pipec.compiler.checks.matching import MessageLog, describe_tensor, scan_messages, tensor_id
from pipec.compiler.checks.wellformed import (
    StageTables,
    TaskIndex,
    first_misplaced_compute,
    locate_tasks,
    stage_tables,
    task_text,
)
from pipec.errors import ConflictError

_MISSING = 1 << 60  # the step of a receive that does not exist: after every use
_CODES = ops.NUM_TASK_CODES  # task keys: (stage * N + mb) * _CODES + ops.TASK_CODE[op]
_stage_of, _op_of, _mb_of = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)

# What the check looks at, per category: computes make and read message
# buffers and use stored values; sends and receives (alone or in a batch, from
# check_matching's log) ship and fill buffers; frees drop stored values.
# Collectives touch the weight gradient, which no message carries and no free
# drops: there is nothing to check for them here.
_CHECKED = {
    ops.COMPUTE: "message ends and uses of a stored value",
    ops.SEND: "ships a message buffer",
    ops.RECV: "fills a message buffer",
    ops.BATCH_OF: "its parts",
    ops.FREE: "drops a stored value",
    ops.COLLECTIVE: None,
    ops.COLLECTIVE_WAIT: None,
    # weight passing's copies and partials: ``checks.weights`` proves their buffers
    **{category: None for category in ops.WEIGHT_CATEGORIES},
}
ops.declare_pass("conflict", [op for op, rule in ops.RULES.items() if rule.category in _CHECKED])


def check_conflict(
    program: Program,
    *,
    tasks: TaskIndex | None = None,
    log: MessageLog | None = None,
    tables: StageTables | None = None,
) -> None:
    """Prove no buffer is read before it is filled or after it is freed (module docstring).

    Args:
        program: a program with well-formed compute actions (``locate_tasks``
            raises WellFormedError otherwise; a compute off its home rank is a
            ConflictError).
        tasks, log, tables: precomputed ``locate_tasks``, ``scan_messages`` and
            ``stage_tables`` results (``check_all`` shares them).
    Raises:
        ConflictError: at the instruction that reads or frees a buffer wrongly.
    """
    tables = tables or stage_tables(program)
    if tasks is None:
        misplaced = first_misplaced_compute(program, tables)
        if misplaced is not None:
            rank, step, action = misplaced
            raise _error(program, f"{action.text()} runs on rank {rank}, but stage {action.stage} lives on "
                                  f"rank {tables.home[action.stage]}: it would use another rank's buffers", rank, step)
        tasks = locate_tasks(program, tables)
    log = log or scan_messages(program, tables)
    received, shipped = _received(program, log), _shipped(log, program.num_ranks)
    _check_messages(program, tables, tasks, received, shipped)
    _check_frees(program, tables, tasks, shipped)


# ------------------------------------------------------------- receive buffers


def _received(program: Program, log: MessageLog) -> list[dict[int, int]]:
    """Per rank: tensor -> the step that receives it; a tensor received twice is an error."""
    num_ranks = program.num_ranks
    received: list[dict[int, int]] = [{} for _ in range(num_ranks)]
    counts = [0] * num_ranks
    for key, entry in log.recvs.items():
        dst = key % num_ranks
        received[dst].update(zip(entry[1::2], entry[0::2]))
        counts[dst] += len(entry) // 2
    for rank, into in enumerate(received):
        if len(into) != counts[rank]:
            raise _received_twice(program, log, rank)
    return received


def _received_twice(program: Program, log: MessageLog, rank: int) -> ConflictError:
    num_ranks = program.num_ranks
    first: dict[int, int] = {}
    hits = sorted((entry[i], entry[i + 1]) for key, entry in log.recvs.items() if key % num_ranks == rank
                  for i in range(0, len(entry), 2))
    for step, tensor in hits:
        if tensor in first:
            what = describe_tensor(tensor, len(program.stages), program.num_microbatches)
            return _error(program, f"the {what} is received a second time (first at step {first[tensor]}): "
                                   f"the receive overwrites its buffer", rank, step, [(rank, first[tensor])])
        first[tensor] = step
    raise AssertionError("a duplicate receive was counted but not found")


class _MessageEnd(NamedTuple):
    """One end of a stage's messages: a tensor it makes for a neighbour, or reads from one.

    A produced tensor must be sent after its task; a read one received before.
    """

    kind: int                  # ops.MESSAGE_KIND_CODE of the tensor
    side: str                  # where the stage at the other end is (ops.PREV or NEXT)
    task_ops: tuple[str, ...]  # the tasks of this stage involved (whichever is present)
    produces: bool             # this stage makes the tensor (else it reads it)


# The producer, seen from its reader, sits on the other side.
_OPPOSITE = {ops.PREV: ops.NEXT, ops.NEXT: ops.PREV}
# A stage s's message ends, for each microbatch that rides it, from the
# dataflow's hand-offs (F makes the activation next(s) reads; B or I makes the
# gradient prev(s) reads): first the ends where s makes a tensor, then those
# where s reads one from the other side (F reads the activation of prev(s); B
# or I the gradient of next(s)). Errors are looked for in this order.
_MESSAGE_ENDS = tuple(
    [_MessageEnd(ops.MESSAGE_KIND_CODE[kind], reader, ops.producers(kind), True) for kind, reader in ops.HANDOFFS]
    + [_MessageEnd(ops.MESSAGE_KIND_CODE[kind], _OPPOSITE[reader], ops.consumers(kind, _OPPOSITE[reader]), False)
       for kind, reader in ops.HANDOFFS])


def _check_messages(program: Program, tables: StageTables, tasks: TaskIndex, received, shipped) -> None:
    """Each cross-rank tensor is sent after its producer and received before its reader.

    Compared per (stage, end) over all its microbatches at once: two lists of
    steps, elementwise ordered.
    """
    num_stages, num_mb, num_ranks = len(program.stages), program.num_microbatches, program.num_ranks
    home = tables.home
    riding = [[m for m, p in enumerate(program.mb_pipeline) if p == line] for line in range(len(program.pipelines))]
    ends = [(end, tables.neighbour(end.side)) for end in _MESSAGE_ENDS]
    for stage in range(num_stages):
        mbs, rank = riding[tables.pipeline[stage]], home[stage]
        for (kind, _side, task_ops, produces), neighbour in ends:
            other = neighbour[stage]
            if not mbs or other < 0 or home[other] == rank:
                continue  # no such end, or a local hand-off
            first = tensor_id(kind, stage if produces else other, 0, num_stages, num_mb)
            tensors = [first + m for m in mbs]
            task_steps = _task_steps(tasks.where, stage, task_ops, mbs, num_mb, num_ranks)
            comm_steps = list(map((shipped if produces else received)[rank].get, tensors, repeat(_MISSING)))
            before, after = (task_steps, comm_steps) if produces else (comm_steps, task_steps)
            if not all(map(operator.lt, before, after)):
                raise _misordered(program, rank, other, tensors, task_steps, comm_steps, produces, received)


def _task_steps(where: list[int], stage: int, task_ops, mbs: list[int], num_mb: int, num_ranks: int) -> list[int]:
    """The step of ``op(stage, m)`` for each m (for several ops: whichever is present)."""
    base = stage * num_mb * _CODES
    codes = [ops.TASK_CODE[op] for op in task_ops]
    if len(mbs) == num_mb:  # every microbatch rides this stage: a strided slice
        columns = [where[base + code: base + _CODES * num_mb: _CODES] for code in codes]
    else:
        columns = [[where[base + _CODES * m + code] for m in mbs] for code in codes]
    columns = [column for column in columns if max(column) >= 0] or columns[:1]  # B only, I only, or a mix
    positions = columns[0] if len(columns) == 1 else list(map(max, *columns))  # an absent task is -1
    return list(map(operator.floordiv, positions, repeat(num_ranks)))


def _misordered(program, rank, other, tensors, task_steps, comm_steps, produces, received) -> ConflictError:
    describe = lambda t: describe_tensor(t, len(program.stages), program.num_microbatches)  # noqa: E731
    for tensor, task_step, comm_step in zip(tensors, task_steps, comm_steps):
        task = program.ranks[rank][task_step].text()
        if produces and comm_step <= task_step:
            return _error(program, f"the {describe(tensor)} is sent (step {comm_step}) before {task} makes it",
                          rank, comm_step, [(rank, task_step)])
        if produces or comm_step < task_step:
            continue
        if comm_step != _MISSING:
            return _error(program, f"{task} reads the {describe(tensor)} before it is received (step {comm_step})",
                          rank, task_step, [(rank, comm_step)])
        elsewhere = [r for r in range(program.num_ranks) if tensor in received[r]]
        tail = f"; it is received on rank {elsewhere[0]} instead" if elsewhere else ""
        return _error(program, f"{task} reads the {describe(tensor)} from rank {program.stages[other].rank}, "
                               f"but this rank never receives it{tail}", rank, task_step)
    raise AssertionError("a failed comparison has no failing element")


def _shipped(log: MessageLog, num_ranks: int) -> list[dict[int, int]]:
    """Per rank: tensor -> the step that sends it."""
    shipped: list[dict[int, int]] = [{} for _ in range(num_ranks)]
    for key, entry in log.sends.items():
        shipped[key // num_ranks].update(zip(entry[1::2], entry[0::2]))
    return shipped


# -------------------------------------------------------------- saved activations


class _FreeRule(NamedTuple):
    """What must come before a free of (stage, mb), from the rule table (task codes and message kind codes)."""

    makers: tuple[int, ...]  # the computes that make the value it drops and reads (F): one must be present
    users: tuple[int, ...]   # every other compute that uses what it drops (B, I, W)
    shipped: tuple[int, ...]  # what the makers send from this rank (the activation): in flight until posted


def _free_rule(free_op: str) -> _FreeRule:
    """The ``_FreeRule`` of ``free_op``.

    Its makers are the computes storing what it drops (``ops.stored_by``) that
    make the value it reads; its users every other compute that makes, reads
    or ends a dropped value at its own stage (its last uses, ``ops.last_uses``,
    among them); what it ships is each message kind its makers make, sent by
    that kind's send (``ops.COMM_OP_OF_KIND``).
    """
    rule = ops.RULES[free_op]
    dropped, read = set(rule.ends), {use.kind for use in rule.reads}
    makers = [op for op in ops.stored_by(free_op) if read & {use.kind for use in ops.RULES[op].writes}]
    touching = set(ops.stored_by(free_op)) | {
        op for op in ops.COMPUTE_OPS
        if dropped & (set(ops.RULES[op].ends) | {use.kind for use in ops.RULES[op].reads if use.where == ops.SELF})}
    assert makers and touching.issuperset(ops.last_uses(free_op)), free_op
    users = [op for op in ops.COMPUTE_OPS if op in touching and op not in makers]
    made_here = {use.kind for op in makers for use in ops.RULES[op].writes if use.where == ops.SELF}
    shipped = [ops.PART_RULES[send].code for kind, (send, _recv) in ops.COMM_OP_OF_KIND.items() if kind in made_here]
    return _FreeRule(tuple(ops.TASK_CODE[op] for op in makers), tuple(ops.TASK_CODE[op] for op in users),
                     tuple(shipped))


# free op -> its rule (FREE_F: after F, its SEND_F, and B, or I and W)
_FREE_RULES = {free_op: _free_rule(free_op) for free_op in ops.FREE_OPS}


def _check_frees(program: Program, tables: StageTables, tasks: TaskIndex, shipped: list[dict[int, int]]) -> None:
    """Each FREE_F comes once, at home, after the F, its SEND_F and its backward (``_FREE_RULES``).

    Checked per rank on whole columns (C-level maps); the first failing rank
    is then walked free by free to name the culprit.
    """
    num_mb, num_ranks = program.num_microbatches, program.num_ranks
    where = tasks.where
    for free_op, (makers, users, shipped_kinds) in _FREE_RULES.items():
        used_codes = [code for code in users if max(where[code::_CODES], default=-1) >= 0]  # the users in this program
        for rank, row in enumerate(program.ranks):
            row_ops = list(map(_op_of, row))
            if free_op not in row_ops:
                continue
            steps = list(compress(range(len(row_ops)), map(operator.eq, row_ops, repeat(free_op))))
            frees = list(map(row.__getitem__, steps))
            stages, mbs = list(map(_stage_of, frees)), list(map(_mb_of, frees))
            if not (0 <= min(stages) and max(stages) < len(program.stages) and 0 <= min(mbs) and max(mbs) < num_mb
                    and set(map(tables.home.__getitem__, stages)) == {rank}):
                _explain_frees(program, tables, tasks, shipped, rank, free_op)
            bases = [(stage * num_mb + mb) * _CODES for stage, mb in zip(stages, mbs)]
            made = _latest([_column(where, bases, code) for code in makers])
            latest = _latest([made] + [_column(where, bases, code) for code in used_codes])
            last_use = map(operator.floordiv, latest, repeat(num_ranks))  # -1: no task at all
            for kind in shipped_kinds:
                first = tensor_id(kind, 0, 0, len(program.stages), num_mb)  # ids: first + stage * N + mb
                tensors = [first + stage * num_mb + mb for stage, mb in zip(stages, mbs)]
                last_use = map(max, last_use, map(shipped[rank].get, tensors, repeat(-1)))
            if len(set(bases)) != len(bases) or min(made) < 0 or not all(map(operator.lt, last_use, steps)):
                _explain_frees(program, tables, tasks, shipped, rank, free_op)


def _column(where: list[int], bases: list[int], code: int) -> list[int]:
    """The position of task ``code`` of each (stage, mb) key base (-1: absent)."""
    return list(map(where.__getitem__, map(operator.add, bases, repeat(code))))


def _latest(columns: list[list[int]]) -> list[int]:
    """Elementwise the latest of several position columns (an absent task is -1)."""
    return columns[0] if len(columns) == 1 else list(map(max, *columns))


def _explain_frees(program: Program, tables: StageTables, tasks: TaskIndex, shipped, rank: int, free_op: str) -> None:
    """Walk ``rank``'s frees of ``free_op`` in order and raise at the first wrong one."""
    num_stages, num_mb, num_ranks = len(program.stages), program.num_microbatches, program.num_ranks
    where, home = tasks.where, tables.home
    makers, users, shipped_kinds = _FREE_RULES[free_op]
    freed: dict[int, int] = {}
    for step, action in enumerate(program.ranks[rank]):
        if action.op != free_op:
            continue
        stage, mb, text = action.stage, action.mb, action.text()
        base = (stage * num_mb + mb) * _CODES
        if not (0 <= stage < num_stages and 0 <= mb < num_mb) or max(where[base + code] for code in makers) < 0:
            raise _error(program, f"{text} frees an activation that is never made", rank, step)
        if home[stage] != rank:
            raise _error(program, f"{text} on rank {rank}, but stage {stage} lives on rank {home[stage]}", rank, step)
        if base in freed:
            raise _error(program, f"{text} frees the activation twice (first at step {freed[base]})",
                         rank, step, [(rank, freed[base])])
        freed[base] = step
        uses = [(where[base + code] // num_ranks, task_text(base + code, num_mb))
                for code in makers + users if where[base + code] >= 0]
        for kind in shipped_kinds:
            sent = shipped[rank].get(tensor_id(kind, stage, mb, num_stages, num_mb))
            if sent is not None:
                uses.append((sent, program.ranks[rank][sent].text()))
        late = [(use_step, use) for use_step, use in uses if use_step > step]
        if late:
            use_step, use = min(late)
            raise _error(program, f"{text} frees the activation before {use} uses it (step {use_step})",
                         rank, step, [(rank, use_step)])
    raise AssertionError("a failed free check found no wrong free")


def _error(program: Program, message: str, rank: int, step: int, marks=()) -> ConflictError:
    return ConflictError(message, rank, step, program.grid(), marks)


__all__ = ["check_conflict"]
