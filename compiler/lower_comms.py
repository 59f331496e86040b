"""Insert the communication of an activation-passing program.

Contract: ``insert_communication(program)`` turns per-rank compute orders into
complete per-rank instruction lists. Every message comes from placement and
the rule table's dataflow (``ops.py``): a value a task makes that a
neighbouring stage reads (an activation forward, a gradient back) travels by
its kind's route policy (``routes.py``: ``direct``, one hop to the consumer's
home rank), and nothing is sent when both live on one rank. Replicated stages
get their communicator's ALLREDUCE_GRAD after each replica's last weight
gradient, and its ALLREDUCE_WAIT at the end of the list (``_collectives``).

Guarantee: the result runs to the end under rendezvous semantics whenever the
compute order is acyclic, and every send is posted right after the compute
that produces its tensor, so a message leaves when its data is made and the
placement adds no wait of its own (``simulate`` of the result equals
``simulate`` of the compute-only order when links are not shared and posting
is free). Two placements keep that, tried in order: ``_near_use`` (Megatron's
1F1B: each receive just before its reader), kept when its simulation (on
integer codes, before any instruction is built) runs to the end, else
``_place_in_global_order`` (torch's ``_add_send_recv``: each receive posted
when its send is, one instruction per message, deadlock-free by
construction). A cyclic order gets the near-use placement, and
``check_well_formed`` names the cycle. (Megatron's interleaved pairing, which
holds a forward's send until after the backward that follows it, is not
used: it exposes the link latency that torch's placement hides;
docs/torch.md, "Message placement".)

Performance: programs reach a few hundred thousand instructions, so the passes
work on flat integer lists with C-level builtins (map, zip, accumulate, sort)
and build each Action once.
"""
from __future__ import annotations

import operator
from bisect import bisect_left, bisect_right
from collections import Counter, deque
from dataclasses import replace
from itertools import accumulate, chain, compress, groupby, repeat
from typing import NamedTuple

from pipec.compiler.gc_pause import paused_gc
from pipec.compiler.ir import BATCH, NO_PEER, Action, Program, StageTables, stage_tables
from pipec.compiler.ops import (
    COLLECTIVE_OPS,
    COLLECTIVE_WAIT_OPS,
    COMM_OP_OF_KIND,
    MESSAGE_KIND_CODE,
    MESSAGE_KINDS,
    MESSAGE_READERS,
    NUM_TASK_CODES,
    OP_OF_CODE,
    READER_OF,
    RULES,
    TASK_CODE,
    VALUE_KINDS,
    producers,
)
from pipec.compiler.routes import ROUTES, Hop
from pipec.compiler.waitgraph import WaitGraph, add_collectives, add_waits, blocked_ranks, empty_graph

_new_action = tuple.__new__  # Action(...) without the NamedTuple constructor's overhead
_stage_of = operator.itemgetter(0)
_op_of = operator.itemgetter(1)
_mb_of = operator.itemgetter(2)

_NOWHERE = -1
_CODES = NUM_TASK_CODES
# From the rule table: the ops that write the value a collective reduces (the
# last of them on a rank finishes a chunk's weight gradient: B or W) ...
_COLLECTIVE_OF_PURPOSE = {RULES[op].communicator: op for op in COLLECTIVE_OPS}
_WAIT_OF_PURPOSE = {RULES[op].communicator: op for op in COLLECTIVE_WAIT_OPS}
_REDUCED_BY = {op: producers(RULES[op].reads[0].kind) for op in COLLECTIVE_OPS}
# ... and, per message kind code, its send and receive ops and the codes of the
# ops that read it (the first present wins: B, else I when split).
_SEND_OF_KIND = [COMM_OP_OF_KIND[kind][0] for kind in MESSAGE_KINDS]
_RECV_OF_KIND = [COMM_OP_OF_KIND[kind][1] for kind in MESSAGE_KINDS]
_READER_CODES = [tuple(TASK_CODE[op] for op in MESSAGE_READERS[kind]) for kind in MESSAGE_KINDS]


class _Plan(NamedTuple):
    """The messages and all-reduces of a compute-only program.

    Messages are numbered in producer order, rank by rank: per ordered pair of
    ranks, increasing ids are the FIFO order. A communication is coded
    ``2 * message`` (its send) or ``2 * message + 1`` (its receive).

    Attributes:
        senders: per rank, the input indices whose compute sends a message, ascending.
        first: per rank, the id of its first message (then consecutive).
        stage, mb: message -> producer stage, microbatch.
        kind: message -> its value kind's code (``ops.MESSAGE_KIND_CODE``: 0 activation, 1 gradient).
        consumer: message -> consumer stage.
        sources, targets: message -> sending rank, receiving rank.
        reader: message -> index of the compute that reads it in the receiver's
            input list, or that list's length when there is none.
        pairs: pair key ``src * R + dst`` -> its messages in FIFO order.
        collectives: per rank, (input index, ALLREDUCE_GRAD) in list order: each
            all-reduce follows that compute (and the run of communication after it).
    """

    senders: list[list[int]]
    first: list[int]
    stage: list[int]
    mb: list[int]
    kind: list[int]
    consumer: list[int]
    sources: list[int]
    targets: list[int]
    reader: list[int]
    pairs: dict[int, list[int]]
    collectives: list[list[tuple[int, Action]]]


def insert_communication(program: Program) -> Program:
    """Add sends, receives, batches and gradient all-reduces to a compute-only program.

    Args:
        program: per-rank compute orders (F, B, I, W); it is not modified.
            Actions that are not valid compute tasks are kept where they are and
            take part in no message (``check_well_formed`` reports them).
    Returns:
        a new Program with the same stages and the complete per-rank lists
        (see the module docstring for the placement and its guarantee).
    """
    with paused_gc():
        tables = stage_tables(program)
        plan = _plan(program, tables)
        near_use = _near_use(program, plan)
        if not _deadlocks_early(program, plan, near_use):  # interleaved schedules: skip near use's whole simulation
            layout = _layout(program, plan, near_use)
            if not blocked_ranks(_wait_graph(program, plan, layout)):
                return replace(program, ranks=_materialize(program, plan, layout))
        ordered = _place_in_global_order(program, plan)
        if ordered is None:
            ordered = _materialize(program, plan, _layout(program, plan, near_use))
        return replace(program, ranks=ordered)




# ------------------------------------------------------------------------ plan


def _plan(program: Program, tables: StageTables) -> _Plan:
    """Number every message and find where each is read; place the all-reduces."""
    num_stages, num_mb, num_ranks = len(program.stages), program.num_microbatches, program.num_ranks
    target_of, consumer_of, kind_of = _routes(tables)
    where: dict[int, int] = {}
    senders, first = [], []
    stage, mb, kinds_sent, consumer, sources, targets = [], [], [], [], [], []
    for rank in range(num_ranks - 1, -1, -1):  # backwards, so that where keeps first occurrences
        row = program.ranks[rank]
        kinds, keys = _task_codes(row, num_stages, num_mb)
        where.update(zip(reversed(keys), range(rank + (len(row) - 1) * num_ranks, -1, -num_ranks)))
        dsts = list(map(target_of.__getitem__, kinds))
        picked = [index for index, dst in enumerate(dsts) if dst >= 0]
        senders.append(picked)
        sent = [row[index] for index in picked]
        kind = [kinds[index] for index in picked]
        stage.append(list(map(_stage_of, sent)))
        mb.append(list(map(_mb_of, sent)))
        kinds_sent.append(list(map(kind_of.__getitem__, kind)))
        consumer.append(list(map(consumer_of.__getitem__, kind)))
        targets.append(list(map(dsts.__getitem__, picked)))
        sources.append([rank] * len(picked))
    senders.reverse()
    flat = [list(chain.from_iterable(reversed(part))) for part in (stage, mb, kinds_sent, consumer, sources, targets)]
    stage, mb, kinds_sent, consumer, sources, targets = flat
    first = list(accumulate(map(len, senders), initial=0))[:-1]
    reader = _readers(program, where, mb, kinds_sent, consumer, targets)
    return _Plan(senders, first, stage, mb, kinds_sent, consumer, sources, targets, reader,
                 _pairs(sources, targets, num_ranks), _collectives(program, tables))


def _routes(tables: StageTables) -> tuple[list[int], list[int], list[int]]:
    """Tables indexed by ``stage * C + task code`` (and -1, the last entry, for no task).

    From the rule table: the value a task makes that a neighbouring stage
    reads, and its kind's route policy from the producer's home to the
    reader's. Activation passing hands each such value to one rank (``direct``).

    Returns:
        (rank the task's output is sent to or -1, the stage that reads it,
        the message kind's code).
    """
    home = tables.home
    target, consumer, kind_code = [], [], []
    for stage in range(len(home)):
        for op in OP_OF_CODE:
            sent = [use.kind for use in RULES[op].writes if use.kind in MESSAGE_KIND_CODE]
            kind = sent[0] if sent else None
            reader = tables.neighbour(READER_OF[kind])[stage] if kind else -1
            legs = ROUTES[VALUE_KINDS[kind].route](home[stage], (home[reader],)) if reader >= 0 else ()
            hops = [leg for leg in legs if isinstance(leg, Hop)]
            target.append(hops[0].dst if hops else -1)
            consumer.append(reader)
            kind_code.append(MESSAGE_KIND_CODE[kind] if kind else 0)
    return target + [-1], consumer + [-1], kind_code + [0]


def _task_codes(row: list[Action], num_stages: int, num_mb: int) -> tuple[list[int], list[int]]:
    """Per action: ``stage * C + code`` and its task key; -1 for anything but a valid compute task."""
    try:
        codes = list(map(TASK_CODE.__getitem__, map(_op_of, row)))
        stages, mbs = list(map(_stage_of, row)), list(map(_mb_of, row))
        if row and not (0 <= min(stages) and max(stages) < num_stages and 0 <= min(mbs) and max(mbs) < num_mb):
            raise KeyError("out of range")
    except KeyError:  # something other than valid compute: sort it out action by action
        valid = [TASK_CODE.get(a.op, -1) if 0 <= a.stage < num_stages and 0 <= a.mb < num_mb else -1 for a in row]
        kinds = [a.stage * _CODES + code if code >= 0 else -1 for a, code in zip(row, valid)]
        keys = [(a.stage * num_mb + a.mb) * _CODES + code if code >= 0 else -1 for a, code in zip(row, valid)]
        return kinds, keys
    kinds = [s * _CODES + c for s, c in zip(stages, codes)]
    keys = [(s * num_mb + m) * _CODES + c for s, m, c in zip(stages, mbs, codes)]
    return kinds, keys


def _readers(program: Program, where, mb, kind, consumer, targets) -> list[int]:
    """Per message: the index of its reader on the receiving rank (the first of its kind's readers present)."""
    num_mb, num_ranks = program.num_microbatches, program.num_ranks
    bases = [(c * num_mb + m) * _CODES for c, m in zip(consumer, mb)]
    found = [where.get(base + _READER_CODES[k][0], _NOWHERE) for base, k in zip(bases, kind)]
    for message in [m for m, place in enumerate(found) if place < 0 and len(_READER_CODES[kind[m]]) > 1]:
        for code in _READER_CODES[kind[message]][1:]:  # e.g. a split backward: read by I
            found[message] = where.get(bases[message] + code, _NOWHERE)
            if found[message] >= 0:
                break
    ends = [len(row) for row in program.ranks]
    # nobody reads it on the receiver: receive it at the end, the checks report the missing task
    return [place // num_ranks if place >= 0 and place % num_ranks == dst else ends[dst]
            for place, dst in zip(found, targets)]


def _pairs(sources: list[int], targets: list[int], num_ranks: int) -> dict[int, list[int]]:
    keys = [src * num_ranks + dst for src, dst in zip(sources, targets)]
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: FIFO within a pair
    return {key: list(group) for key, group in groupby(order, key=keys.__getitem__)}


def _collectives(program: Program, tables: StageTables) -> list[list[tuple[int, Action]]]:
    """Per rank: the collective of each communicator it is in, after its last task writing the reduced value.

    For the replica communicators: one ALLREDUCE_GRAD per replicated chunk a
    rank holds, after its last B or W of that chunk. A rank holding a replica
    that no microbatch rides still joins (its weights must follow the other
    replicas), after its last compute. In the near-use placement an all-reduce
    comes right after the run of communication that follows its compute, and
    all-reduces at the same place go in chunk order; every rank then waits
    for each (ALLREDUCE_WAIT) at the end of its list.
    """
    held: list[dict[int, tuple[int, str]]] = [{} for _ in program.ranks]  # rank -> chunk -> (a stage, op)
    for communicator in program.communicators:
        op = _COLLECTIVE_OF_PURPOSE[communicator.purpose]
        for stage in range(len(program.stages)):
            if tables.chunk[stage] == communicator.key:
                held[tables.home[stage]].setdefault(communicator.key, (stage, op))
    placed = []
    for rank, row in enumerate(program.ranks):
        last: dict[int, tuple[int, int]] = {}  # chunk -> (index, stage) of its last writer here
        if held[rank]:
            writers = {op for _, op in held[rank].values() for op in _REDUCED_BY[op]}
            for index, action in enumerate(row):
                stage = action.stage
                if action.op in writers and 0 <= stage < len(tables.chunk) and tables.chunk[stage] in held[rank]:
                    last[tables.chunk[stage]] = (index, stage)
        for chunk, (stage, _) in held[rank].items():
            last.setdefault(chunk, (len(row) - 1, stage))
        # collectives at the same place go in chunk order, the same on every rank
        placed.append([(index, Action(stage, held[rank][chunk][1]))
                       for index, chunk, stage in sorted((index, chunk, stage) for chunk, (index, stage) in last.items())])
    return placed


# ------------------------------------------------------------------ placements
#
# A placement is, per rank, a sorted list of entries, one per communication:
#     entry = (gap * 2 + side) * K + code,   K = 2 * number of messages,
# where gap k means "posted just before input compute k" (gap len(row): after
# the last), side is 0 for a send and 1 for a receive, and code is the
# communication's code. Sorting puts each gap's sends before its receives and
# keeps message order inside each, which is each pair's FIFO order.


def _stride(plan: _Plan) -> int:
    return max(2 * len(plan.sources), 2)


def _near_use(program: Program, plan: _Plan) -> list[list[int]]:
    """Sends right after their producers, receives just before their readers (the first placement, Megatron's 1F1B).

    A SEND comes right after the compute that produces its tensor; the RECVs
    of a pair (src, dst) come in src's send order (messages are untagged and
    FIFO per pair), each just before the first compute on dst that reads it,
    or earlier when a message sent after it is needed sooner. Every maximal
    run of two or more communications between two computes becomes one BATCH
    (``batch_isend_irecv``), sends first: a rank's
    send_forward and recv_backward are posted together, so neighbours cannot
    wait on each other.
    """
    stride = _stride(plan)
    placed = [[((index + 1) * 2) * stride + 2 * message for message, index in enumerate(senders, first)]
              for senders, first in zip(plan.senders, plan.first)]
    reader = plan.reader
    for key, messages in plan.pairs.items():
        # A receive comes before its reader and before every later receive of
        # the pair: the suffix minimum of the readers' indices.
        gaps = list(accumulate(reversed(list(map(reader.__getitem__, messages))), min))
        gaps.reverse()
        placed[key % program.num_ranks].extend(
            (gap * 2 + 1) * stride + 2 * message + 1 for gap, message in zip(gaps, messages))
    for entries in placed:
        entries.sort()
    return placed


class _Layout(NamedTuple):
    """Where a placement's instructions land.

    Attributes:
        codes, steps: per rank, the communication codes in placement order and
            the step (index in the rank's final list) of each.
        starts: per rank, where each run starts in ``codes``.
        run_gaps: per rank, the gap of each run.
        reduces: per rank, (chunk, step) of each all-reduce.
        longest: the length of the longest final list.
    """

    codes: list[list[int]]
    steps: list[list[int]]
    starts: list[list[int]]
    run_gaps: list[list[int]]
    reduces: list[list[tuple[int, int]]]
    longest: int


def _layout(program: Program, plan: _Plan, placed: list[list[int]]) -> _Layout:
    """Number the final instructions: per gap, its run (if any), an all-reduce, the compute."""
    stride = _stride(plan)
    layout = _Layout([], [], [], [], [], 0)
    longest = 0
    for rank, entries in enumerate(placed):
        row, collectives = program.ranks[rank], plan.collectives[rank]
        gaps = list(map(operator.floordiv, entries, repeat(2 * stride)))
        starts = list(compress(range(len(gaps)), map(operator.ne, gaps, chain((-1,), gaps))))  # a new gap: a run
        run_gaps = list(map(gaps.__getitem__, starts))
        # a run's step: the computes before its gap, the runs and all-reduces before it
        run_steps = list(map(operator.add, run_gaps, range(len(run_gaps))))
        reduces = []
        for index, started in collectives:
            # The all-reduce after compute ``index`` follows the run of gap index + 1;
            # it sits after index + 1 computes, the runs up to that gap and the
            # all-reduces before it, and pushes every later run one step on.
            later = next((i for i, gap in enumerate(run_gaps) if gap > index + 1), len(run_gaps))
            reduces.append((program.stages[started.stage].position, index + 1 + later + len(reduces)))
            run_steps[later:] = map(operator.add, run_steps[later:], repeat(1))
        lengths = map(operator.sub, chain(starts[1:], (len(entries),)), starts)
        layout.codes.append(list(map(operator.mod, entries, repeat(stride))))
        layout.steps.append(list(chain.from_iterable(map(repeat, run_steps, lengths))))
        layout.starts.append(starts)
        layout.run_gaps.append(run_gaps)
        layout.reduces.append(reduces)
        longest = max(longest, len(row) + len(starts) + 2 * len(collectives))
    return layout._replace(longest=longest)


def _wait_graph(program: Program, plan: _Plan, layout: _Layout, beyond: list[int] | None = None) -> WaitGraph:
    """The rendezvous ``WaitGraph`` of a laid-out placement (each all-reduce a collective of its ranks).

    With ``beyond`` (per rank, a step past its laid-out instructions) the
    layout may be a prefix: a counterpart missing from it is taken to be at
    its rank's ``beyond`` step.

    Built without a code -> step map: a rank's sends, in placement order, are
    its messages in id order; its receives, sorted by code, are grouped by
    sender (messages are numbered sender by sender) in FIFO order. Pairing each
    receive with its own message is the runtime's FIFO pairing because every
    placement keeps each pair's receives in send order.
    """
    num_ranks = program.num_ranks
    graph = empty_graph(num_ranks, layout.longest)
    send_step = [0] * len(plan.sources) if beyond is None else list(map(beyond.__getitem__, plan.sources))
    is_receive = [list(map(operator.and_, codes, repeat(1))) for codes in layout.codes]
    for rank, (steps, receives) in enumerate(zip(layout.steps, is_receive)):
        sent = list(compress(steps, map(operator.not_, receives)))
        send_step[plan.first[rank]:plan.first[rank] + len(sent)] = sent
    if beyond is not None:
        _wait_for_missing_receives(graph, plan, layout, is_receive, beyond)
    scale = layout.longest + 1
    for rank, (codes, steps, receives) in enumerate(zip(layout.codes, layout.steps, is_receive)):
        received = sorted(map(operator.add, map(operator.mul, compress(codes, receives), repeat(scale)),
                              compress(steps, receives)))
        messages = [entry // scale >> 1 for entry in received]
        at = list(map(operator.mod, received, repeat(scale)))
        senders = list(map(plan.sources.__getitem__, messages))
        their_steps = list(map(send_step.__getitem__, messages))
        add_waits(graph, rank, at, senders, their_steps)  # a receive waits for its send
        for src in set(senders):  # and each send for its receive (one contiguous group per sender)
            lo, hi = bisect_left(senders, src), bisect_right(senders, src)
            add_waits(graph, src, their_steps[lo:hi], repeat(rank), at[lo:hi])
    groups: dict[int, list[tuple[int, int]]] = {}
    for rank, reduces in enumerate(layout.reduces):
        for chunk, at in reduces:
            groups.setdefault(chunk, []).append((rank, at))
    add_collectives(graph, groups.values())
    return graph


# ------------------------------------------------------------- early deadlock

_PROBE_COMPUTES_PER_RANK = 4  # the probe covers this many computes per rank of the program
_PROBE_FRACTION = 8           # ... and is tried only on programs whose rows are this many times longer


def _deadlocks_early(program: Program, plan: _Plan, placed: list[list[int]]) -> bool:
    """Whether a placement surely deadlocks, judged from a prefix of every rank's list.

    The prefix is each rank's instructions before input compute ``horizon``;
    a rank that has more stops at a barrier (a wait that is never met) just
    after it. Every step the prefix simulation takes is one the full
    simulation takes too (it has every wait of those steps; a counterpart
    outside the prefix is taken to lie beyond its rank's barrier, which only
    holds ranks back). So when ranks end up waiting, at real waits, only on
    each other, no later instruction can free them: the full simulation
    blocks as well. Otherwise nothing is concluded (False) and the caller
    simulates the whole placement, so the chosen placement never depends on this.

    Args:
        program, plan: as for ``_layout``.
        placed: a placement (per rank, sorted entries).
    Returns:
        True only if ``blocked_ranks`` of the whole placement is non-empty.
    """
    horizon = _PROBE_COMPUTES_PER_RANK * program.num_ranks
    if any(plan.collectives) or _PROBE_FRACTION * horizon > max(map(len, program.ranks), default=0):
        return False  # all-reduces shift steps beyond the prefix; a probe must stay small next to the whole
    cut = horizon * 2 * _stride(plan)
    prefix = [entries[:bisect_left(entries, cut)] for entries in placed]
    layout = _layout(program, plan, prefix)
    never = layout.longest + 2
    # the barrier step: just after the prefix; a rank whose whole placement is in it has none (never)
    barrier = [never if len(part) == len(entries) else horizon + len(starts)
               for part, entries, starts in zip(prefix, placed, layout.starts)]
    graph = _wait_graph(program, plan, layout, [min(step + 1, never) for step in barrier])
    for rank, step in enumerate(barrier):
        if step != never:
            add_waits(graph, rank, (step,), (0,), (graph.never,))
    stuck = {rank: other for rank, (step, other, _) in blocked_ranks(graph).items() if step != barrier[rank]}
    # drop, until none changes, every rank that waits on a rank that may still move
    changed = True
    while changed and stuck:
        freed = [rank for rank, other in stuck.items() if other not in stuck]
        changed = bool(freed)
        for rank in freed:
            del stuck[rank]
    return bool(stuck)


def _wait_for_missing_receives(graph: WaitGraph, plan: _Plan, layout: _Layout, is_receive: list[list[int]],
                               beyond: list[int]) -> None:
    """Each laid-out send whose receive is not laid out waits for the receiver's ``beyond`` step."""
    received = bytearray(len(plan.sources))
    for codes, receives in zip(layout.codes, is_receive):
        for code in compress(codes, receives):
            received[code >> 1] = 1
    for rank, (codes, steps, receives) in enumerate(zip(layout.codes, layout.steps, is_receive)):
        missing = [(step, plan.targets[code >> 1]) for code, step, receive in zip(codes, steps, receives)
                   if not receive and not received[code >> 1]]
        add_waits(graph, rank, (step for step, _ in missing), (dst for _, dst in missing),
                  (beyond[dst] for _, dst in missing))


# ------------------------------------------------------------------ building


def _parts(plan: _Plan) -> list[Action]:
    """Every communication's instruction, indexed by its code."""
    count = len(plan.sources)
    sends = map(_new_action, repeat(Action, count), zip(
        plan.stage, map(_SEND_OF_KIND.__getitem__, plan.kind), plan.mb, plan.targets, repeat((), count)))
    recvs = map(_new_action, repeat(Action, count), zip(
        plan.consumer, map(_RECV_OF_KIND.__getitem__, plan.kind), plan.mb, plan.sources, repeat((), count)))
    parts: list[Action] = [None] * (2 * count)  # type: ignore[list-item]
    parts[0::2] = list(sends)
    parts[1::2] = list(recvs)
    return parts


def _materialize(program: Program, plan: _Plan, layout: _Layout) -> list[list[Action]]:
    """The instruction lists of a laid-out placement."""
    parts = _parts(plan)
    lowered = []
    for rank, (row, codes, starts) in enumerate(zip(program.ranks, layout.codes, layout.starts)):
        collectives = plan.collectives[rank]
        made = [parts[codes[a]] if b - a == 1 else _new_action(Action, (-1, BATCH, -1, NO_PEER, tuple(
                    map(parts.__getitem__, codes[a:b])))) for a, b in zip(starts, chain(starts[1:], (len(codes),)))]
        inserts = list(zip(layout.run_gaps[rank], made))
        if collectives:  # each all-reduce after the run that follows its compute (stable sort: runs first)
            inserts = sorted(inserts + [(index + 1, started) for index, started in collectives], key=_gap_of)
        out: list[Action] = []
        start = 0
        for gap, instruction in inserts:  # the computes before the gap, then what goes there
            out += row[start:gap]
            out.append(instruction)
            start = gap
        out += row[start:]
        _finish(out, collectives)
        lowered.append(out)
    return lowered


_gap_of = operator.itemgetter(0)


def _finish(out: list[Action], collectives: list[tuple[int, Action]]) -> None:
    """Wait for this rank's all-reduces, in the order it started them."""
    out.extend(_wait_for(started) for _, started in collectives)


# ---------------------------------------------------------------- global order


def _streams(rows: list[list[Action]], plan: _Plan) -> list[list[int]]:
    """Each rank's stream for ``_place_in_global_order``: its computes (input index k, sort key 2k) and its
    all-reduces (~their position in its collectives, sort key 2 * index + 1: after compute index)."""
    streams = []
    for rank, row in enumerate(rows):
        inserts = [(2 * index + 1, ~j) for j, (index, _) in enumerate(plan.collectives[rank])]
        streams.append([item for _, item in sorted([(2 * k, k) for k in range(len(row))] + inserts, key=_gap_of)])
    return streams


def _place_in_global_order(program: Program, plan: _Plan) -> list[list[Action]] | None:
    """Rebuild the lists by advancing ranks in turn (the second placement, torch's ``_add_send_recv``).

    Returns None if the order is cyclic.

    Ranks take turns, one compute each; a compute runs once its inputs have
    been delivered; a SEND is appended on the producer and its RECV on the
    consumer at the same moment; an all-reduce is appended on all its ranks
    when the last of them reaches it (the others go on meanwhile). Every
    rank's list is then a subsequence of one global sequence of events, each
    involving only ranks whose earlier events all precede it, so the program
    runs to the end under rendezvous semantics: deadlock-free by construction.
    Nothing is batched (``emit``). A send comes right after its producer, as
    in near use. It needs an acyclic compute order. Interleaved orders end up
    here (near use deadlocks once microbatches outnumber ranks), and so do
    mirrored pipelines (Chimera, BitPipe): their first sends face each other.
    """
    num_ranks = program.num_ranks
    rows = program.ranks
    parts = _parts(plan)
    streams = _streams(rows, plan)
    produced = [dict(zip(senders, range(first, first + len(senders))))
                for senders, first in zip(plan.senders, plan.first)]
    readers_of: dict[int, list[int]] = {}  # index * R + rank of a reader -> the messages it reads
    for message, (dst, index) in enumerate(zip(plan.targets, plan.reader)):
        readers_of.setdefault(index * num_ranks + dst, []).append(message)
    chunk_of = [s.position for s in program.stages]
    reduce_of = [{chunk_of[started.stage]: started for _, started in collectives} for collectives in plan.collectives]
    members = Counter(chunk for mine in reduce_of for chunk in mine)  # chunk -> how many ranks run its all-reduce
    delivered = bytearray(len(plan.sources))
    waiting: dict[int, list[int]] = {}
    arrived: dict[int, list[int]] = {}  # chunk -> ranks that have reached its all-reduce
    cursor = [0] * num_ranks
    out: list[list[Action]] = [[] for _ in range(num_ranks)]
    run: list[list[int]] = [[] for _ in range(num_ranks)]

    def emit(rank: int, action: Action) -> None:
        if run[rank]:
            # Each message its own instruction, in the order of its events (a
            # send first: it is appended as its producer runs). No batch: a
            # runtime that waits for a batch as a whole (NCCL coalesces one)
            # would hold the next compute for a receive only a later one reads.
            out[rank].extend(map(parts.__getitem__, run[rank]))
            run[rank] = []
        out[rank].append(action)

    turns = deque(range(num_ranks))
    while turns:
        rank = turns.popleft()
        if cursor[rank] == len(streams[rank]):
            continue
        item = streams[rank][cursor[rank]]
        if item < 0:
            # An all-reduce never holds a rank up here: the rank goes on, and
            # when the last member arrives the all-reduce is appended on every
            # member at once (one event), so ranks cannot meet them in
            # different orders.
            chunk = chunk_of[plan.collectives[rank][~item][1].stage]
            arrived.setdefault(chunk, []).append(rank)
            if len(arrived[chunk]) == members[chunk]:
                for member in arrived.pop(chunk):
                    emit(member, reduce_of[member][chunk])
            cursor[rank] += 1
            turns.append(rank)
            continue
        missing = next((m for m in readers_of.get(item * num_ranks + rank, ()) if not delivered[m]), -1)
        if missing >= 0:
            waiting.setdefault(missing, []).append(rank)
            continue
        emit(rank, rows[rank][item])
        cursor[rank] += 1
        message = produced[rank].get(item, -1)
        if message >= 0:
            run[rank].append(2 * message)
            run[plan.targets[message]].append(2 * message + 1)
            delivered[message] = 1
            turns.extend(waiting.pop(message, ()))
        turns.append(rank)
    if arrived or any(cursor[rank] < len(streams[rank]) for rank in range(num_ranks)):
        return None
    for rank in range(num_ranks):
        out[rank].extend(map(parts.__getitem__, run[rank]))
        out[rank].extend(_wait_for(started) for started in [a for a in out[rank] if a.op in COLLECTIVE_OPS])
    return out


def _wait_for(started: Action) -> Action:
    """The instruction that waits for the collective ``started`` began (ALLREDUCE_WAIT)."""
    return Action(started.stage, _WAIT_OF_PURPOSE[RULES[started.op].communicator])


__all__ = ["insert_communication"]
