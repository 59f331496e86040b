"""Deadlock freedom: simulate every rank's progress under a runtime's semantics.

``check_deadlock(program, semantics)`` proves that every rank reaches the end
of its list, or raises ``DeadlockError`` naming every rank of the wait-for
cycle (or of the chain that ends in an instruction that never comes), marked
in the grid and listed in ``cycle`` as (rank, step, what it waits on). An
instruction is *posted* once its rank has reached it, and stays posted. Two
semantics are modelled, both stated at ``check_deadlock``'s argument:
``"rendezvous"`` (blocking sends and receives, atomic batches: the strictest,
which pipec's own programs must pass) and ``"async"`` (torch's runtime,
under which imported CSVs are proved: sends never block, a receive is waited
at the first compute that reads it).

Under both, a rank's k-th collective on a communicator (ALLREDUCE_GRAD) is a
meeting of every member's k-th collective there, so meetings on several
communicators in inconsistent orders are caught (NCCL's warning); and
counterparts pair as the runtime pairs them, FIFO per ordered pair of ranks
(``check_matching`` proves the tensors agree). The run is the wait-for engine
of ``compiler/waitgraph.py``: each rank parks on the one position it waits for.
"""
from __future__ import annotations

from itertools import repeat

from pipec.compiler.ir import Program, StageTables, stage_tables
from pipec.compiler.ops import (
    BATCH_OF,
    COMPUTE,
    FREE,
    COLLECTIVE_WAIT,
    COLLECTIVE_OPS,
    COMPUTE_OPS,
    DEPENDENCIES,
    MESSAGE_KIND_CODE,
    NUM_TASK_CODES,
    PART_RULES,
    MESSAGE_READERS,
    RULES,
    TASK_CODE,
    WEIGHT_OPS,
    declare_pass,
)
from pipec.compiler.checks.matching import (
    MessageLog,
    consumer_stage,
    describe_tensor,
    part_tensor,
    scan_messages,
    tensor_id,
)
from pipec.compiler.checks.wellformed import TaskIndex, locate_tasks
from pipec.compiler.waitgraph import WaitGraph, add_collectives, add_meetings, add_waits, blocked_ranks, empty_graph
from pipec.errors import DeadlockError

RENDEZVOUS, ASYNC = "rendezvous", "async"
SEMANTICS = (RENDEZVOUS, ASYNC)


# ------------------------------------------------------------------ the check


def check_deadlock(
    program: Program,
    semantics: str = RENDEZVOUS,
    *,
    log: MessageLog | None = None,
    tasks: TaskIndex | None = None,
    tables: StageTables | None = None,
) -> None:
    """Prove every rank reaches the end of its list under ``semantics``.

    Args:
        program: a program with in-range communication (``scan_messages``
            raises MatchError otherwise); under "async" its compute actions must
            be well formed too.
        semantics: "rendezvous" (the strictest; pipec's own programs must
            pass it): a SEND or RECV waits until its counterpart is posted
            (NCCL's blocking point-to-point); a BATCH (``batch_isend_irecv``)
            posts all its parts at once and completes when every part's
            counterpart is posted; compute, frees and ALLREDUCE_WAIT never
            wait. Or "async" (torch.distributed.pipelining's runtime, for
            imported CSV): sends never block and a RECV only posts; the first
            compute that reads a received tensor waits until the matching send
            is posted (and can never run if its receive comes later on its own
            rank; ``check_conflict`` proves each such tensor has a receive).
        log, tasks, tables: precomputed ``scan_messages``, ``locate_tasks`` and
            ``stage_tables`` results (``check_all`` shares them); computed when
            omitted.
    Raises:
        DeadlockError: with ``cycle`` = [(rank, step, what it waits on), ...].
        ValueError: an unknown ``semantics``.
    """
    if semantics not in SEMANTICS:
        raise ValueError(f"unknown semantics {semantics!r}; expected one of {SEMANTICS}")
    tables = tables or stage_tables(program)
    log = log or scan_messages(program, tables)
    graph = empty_graph(program.num_ranks, max((len(row) for row in program.ranks), default=0))
    if semantics == RENDEZVOUS:
        for src, dst, sent, received in _pairs(log, program.num_ranks):
            add_meetings(graph, src, dst, sent[0::2], received[0::2])
    else:
        _add_async_waits(graph, program, log, tasks or locate_tasks(program, tables), tables)
    add_collectives(graph, _collective_groups(program, log, graph.never))
    blocked = blocked_ranks(graph)
    if blocked:
        raise _deadlock_error(program, tables, graph, blocked)


def _pairs(log: MessageLog, num_ranks: int):
    """(src, dst, send entry, receive entry) for every ordered pair with traffic."""
    for key in set(log.sends) | set(log.recvs):
        src, dst = divmod(key, num_ranks)
        yield src, dst, log.sends.get(key, []), log.recvs.get(key, [])


def _add_async_waits(graph: WaitGraph, program: Program, log: MessageLog, tasks: TaskIndex, tables: StageTables) -> None:
    """Sends are places others wait for; the reader of a received tensor waits for its send."""
    num_ranks = graph.num_ranks
    where = tasks.where
    for src, dst, sent, received in _pairs(log, num_ranks):
        sent_steps = sent[0::2]
        add_waits(graph, src, sent_steps, repeat(0), repeat(0))  # "rank 0 reached step 0": always met
        sent_steps += [graph.never] * (len(received) // 2 - len(sent_steps))  # receives nobody sends
        for index in range(0, len(received), 2):
            recv_step, tensor = received[index], received[index + 1]
            reader = _reader_key(tensor, program, tables, where)
            if reader < 0 or where[reader] % num_ranks != dst:
                continue  # nobody here reads it: check_matching reports the receive
            use_step = where[reader] // num_ranks
            # the reader waits for the send; and forever for itself if it comes before its receive
            waits_for = [(src, sent_steps[index // 2])] + ([(dst, recv_step)] if recv_step > use_step else [])
            add_waits(graph, dst, repeat(use_step), (o for o, _ in waits_for), (a for _, a in waits_for))


# message kind code -> the compute ops that read it at its consumer stage, in
# table order (a gradient: B, or I when the backward is split)
_READERS = [tuple(TASK_CODE[op] for op in MESSAGE_READERS[kind]) for kind in MESSAGE_KIND_CODE]


def _reader_key(tensor: int, program: Program, tables: StageTables, where: list[int]) -> int:
    """The task key of the compute that reads ``tensor`` (the first of its readers present), or -1."""
    num_mb = program.num_microbatches
    stage = consumer_stage(tensor, program, tables)
    if stage < 0:
        return -1
    base = (stage * num_mb + tensor % num_mb) * NUM_TASK_CODES
    codes = _READERS[tensor // num_mb // len(program.stages)]
    return next((base + code for code in codes if where[base + code] >= 0), base + codes[-1])


def _collective_groups(program: Program, log: MessageLog, never: int):
    """The k-th collective of each communicator: (rank, step) per member (``never`` if it has none)."""
    for comm_id, by_rank in log.collectives.items():
        members = sorted(set(program.communicators[comm_id].ranks) | set(by_rank))
        for k in range(max(len(steps) for steps in by_rank.values())):
            yield [(rank, by_rank[rank][k] if k < len(by_rank.get(rank, ())) else never) for rank in members]


# ---------------------------------------------------------------------- report


def _deadlock_error(program: Program, tables: StageTables, graph: WaitGraph, blocked) -> DeadlockError:
    """Follow the wait-for edges to a cycle (or to a wait that can never be met)."""
    members = _cycle(blocked, graph.never)
    cycle, texts = [], []
    for rank in members:
        step, other, other_step = blocked[rank]
        waits_on = _wait_text(program, tables, graph, rank, step, other, other_step)
        cycle.append((rank, step, waits_on))
        texts.append(f"rank {rank} step {step} ({program.ranks[rank][step].text()}) {waits_on}")
    first_rank, first_step, _ = cycle[0]
    return DeadlockError("deadlock: " + "; ".join(texts), first_rank, first_step, program.grid(),
                         [(rank, step) for rank, step, _ in cycle[1:]], cycle)


def _cycle(blocked, never: int) -> list[int]:
    """The ranks of one wait-for cycle, smallest rank first; else a rank whose wait never ends."""
    dead_end = None
    walk_of: dict[int, int] = {}
    for walk, start in enumerate(sorted(blocked)):
        path, rank = [], start
        while rank in blocked and rank not in walk_of:
            walk_of[rank] = walk
            path.append(rank)
            _, other, other_step = blocked[rank]
            if other_step == never:
                dead_end = rank if dead_end is None else dead_end
                break
            rank = other
        else:
            if rank in blocked and walk_of[rank] == walk:
                loop = path[path.index(rank):]
                first = loop.index(min(loop))
                return loop[first:] + loop[:first]
    if dead_end is None:
        raise AssertionError("blocked ranks without a cycle or a dead end")
    return [dead_end]


def _wait_text(program: Program, tables: StageTables, graph: WaitGraph, rank: int, step: int,
               other: int, other_step: int) -> str:
    """Words for "rank waits at step for other to reach other_step", from the two instructions."""
    action = program.ranks[rank][step]
    never = other_step == graph.never
    describe = lambda t: describe_tensor(t, len(program.stages), program.num_microbatches)  # noqa: E731
    if action.op in COLLECTIVE_OPS:
        chunk = program.communicator_of(action).key
        tail = ", which it never does" if never else f" (its step {other_step})"
        return f"waits for rank {other} to join the all-reduce of chunk {chunk}{tail}"
    if action.op in COMPUTE_OPS:  # async: a reader waits for the send of its input
        tensor = _input_of(program, tables, action)
        if other == rank:
            return f"needs the {describe(tensor)}, which this rank receives only later (step {other_step})"
        if never:
            return f"waits for rank {other} to send the {describe(tensor)}, which it never does"
        return (f"waits for rank {other} to send the {describe(tensor)} "
                f"(its step {other_step}, {program.ranks[other][other_step].text()})")
    mine = [part for part in action.comms() if part.peer == other]
    theirs = [] if never else [part for part in program.ranks[other][other_step].comms() if part.peer == rank]
    common = {part_tensor(p, program, tables) for p in mine} & {part_tensor(p, program, tables) for p in theirs}
    part = next((p for p in mine if part_tensor(p, program, tables) in common), mine[-1] if mine else None)
    if part is None:
        return f"waits for rank {other} to reach step {other_step}"
    verb = "receive" if PART_RULES[part.op].is_send else "send"
    what = describe(part_tensor(part, program, tables))
    if never:
        return f"waits for rank {other} to {verb} the {what}, which it never does"
    return f"waits for rank {other} to {verb} the {what} (its step {other_step}, {program.ranks[other][other_step].text()})"


def _input_of(program: Program, tables: StageTables, action) -> int:
    """The tensor a compute reads from another rank (its dataflow input that crosses stages)."""
    num_stages, num_mb = len(program.stages), program.num_microbatches
    for dependency in DEPENDENCIES[action.op]:
        if dependency.kind in MESSAGE_KIND_CODE:
            producer = tables.neighbour(dependency.where)[action.stage]
            return tensor_id(MESSAGE_KIND_CODE[dependency.kind], producer, action.mb, num_stages, num_mb)
    raise AssertionError(f"{action.text()} reads nothing from another stage")


# Messages meet by pair, collectives by communicator; a compute waits (async)
# for its input's send; frees and collective waits never wait.
# Weight passing's exchanges never wait here: ``checks.weights`` runs them
# under the strictest semantics and names their deadlocks.
declare_pass("deadlock", set(PART_RULES) | set(COLLECTIVE_OPS) | set(WEIGHT_OPS)
             | {op for op, rule in RULES.items() if rule.category in (BATCH_OF, COMPUTE, FREE, COLLECTIVE_WAIT)})

__all__ = [
    "ASYNC",
    "RENDEZVOUS",
    "SEMANTICS",
    "WaitGraph",
    "add_collectives",
    "add_meetings",
    "add_waits",
    "blocked_ranks",
    "check_deadlock",
    "empty_graph",
]
