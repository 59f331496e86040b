"""Message matching: every send meets exactly one receive, in the same order.

Messages are untagged and matched FIFO per ordered pair of ranks (what
torch.distributed does), so a receive gets whatever the peer sent next. The
check proves, for the point-to-point parts of a program (plain SEND/RECV and
the parts of each BATCH):

* every message has a home: its tensor's producer runs on the sending rank, its
  consumer on the receiving rank, and those are different ranks (a hand-off
  inside one rank is local and must not be a message);
* per ordered pair (src, dst), the tensors src sends and the tensors dst
  receives are the same sequence: no send without a receive, no receive without
  a send, no tensor twice, no two messages swapped;
* every collective meets on a communicator of the program, and its rank is a
  member; per communicator, every member issues the same sequence of
  collectives (op, root, value, size class) as far as each goes; each rank
  waits exactly for the collectives it started. Whether every member reaches
  its collective, and whether members meet several communicators in a
  consistent order, is a question of progress: ``check_deadlock`` answers it.

What a send or receive carries comes from its rule (``ops.PART_RULES``).
Tensors are integer ids ``kind * S * N + producer_stage * N + mb`` (kind:
``ops.MESSAGE_KIND_CODE``, 0 for the activation F(producer) made, 1 for the
gradient its B or I made); ``MessageLog`` holds, per ordered pair, the steps
and tensor ids of its sends and of its receives, and is shared with
``check_deadlock`` and ``check_conflict``.
"""
from __future__ import annotations

import operator
from collections import Counter
from itertools import chain, repeat
from typing import NamedTuple

from pipec.compiler.ir import Action, Program, StageTables, stage_tables
from pipec.compiler.ops import (
    BATCH_OF,
    COMPUTE,
    FREE,
    COLLECTIVE_OPS,
    COLLECTIVE_WAIT_OPS,
    MESSAGE_KIND_CODE,
    MESSAGE_KINDS,
    PART_RULES,
    READER_OF,
    RULES,
    VALUE_KINDS,
    WEIGHT_OPS,
    Value,
    describe,
    declare_pass,
)
from pipec.errors import MatchError

ACT, GRAD = MESSAGE_KIND_CODE["act"], MESSAGE_KIND_CODE["grad"]
_WEIGHT_OPS = frozenset(WEIGHT_OPS)


class MessageLog(NamedTuple):
    """Every point-to-point part and collective of a program, grouped for matching.

    Attributes:
        sends: pair key ``src * R + dst`` -> flat list ``[step, tensor, step,
            tensor, ...]`` of src's sends to dst in list order (slice [0::2] for
            steps, [1::2] for tensors).
        recvs: pair key ``src * R + dst`` -> the same for dst's receives from src.
        collectives: communicator id -> rank -> steps of its collectives on it.
        collective_waits: communicator id -> rank -> steps of its waits for them.
    """

    sends: dict[int, list[int]]
    recvs: dict[int, list[int]]
    collectives: dict[int, dict[int, list[int]]]
    collective_waits: dict[int, dict[int, list[int]]]


def tensor_id(kind: int, producer: int, mb: int, num_stages: int, num_microbatches: int) -> int:
    """The integer id of the tensor ``kind`` made by ``producer`` for ``mb``."""
    return (kind * num_stages + producer) * num_microbatches + mb


def describe_tensor(tensor: int, num_stages: int, num_microbatches: int) -> str:
    """Words for a tensor id: ``activation of 0F1`` / ``gradient of 2B0``."""
    kind_stage, mb = divmod(tensor, num_microbatches)
    kind, stage = divmod(kind_stage, num_stages)
    return describe(Value(MESSAGE_KINDS[kind], (stage, mb)))


def consumer_stage(tensor: int, program: Program, tables: StageTables) -> int:
    """The stage that reads ``tensor`` (its kind's reader next to the producer; -1: none)."""
    kind, stage = divmod(tensor // program.num_microbatches, len(program.stages))
    return tables.neighbour(READER_OF[MESSAGE_KINDS[kind]])[stage]


def part_tensor(part, program: Program, tables: StageTables) -> int:
    """The tensor id a SEND/RECV part carries (-1 when no stage produces it)."""
    rule = PART_RULES[part.op]
    producer = tables.neighbour(rule.where)[part.stage]
    if producer < 0:
        return -1
    return tensor_id(rule.code, producer, part.mb, len(program.stages), program.num_microbatches)


def collective_signature(action: Action, program: Program, tables: StageTables) -> tuple:
    """What members of a communicator must agree on for one collective: (op, root, value, size class).

    The replica all-reduce has no root; its value is the weight gradient of
    the stage's chunk.
    """
    rule = RULES[action.op]
    value = rule.reads[0].kind if rule.reads else None
    index = (tables.chunk[action.stage],) if value is not None else ()
    return (action.op, -1, Value(value, index) if value else None, VALUE_KINDS[value].size_class if value else None)


def scan_messages(program: Program, tables: StageTables | None = None) -> MessageLog:
    """Collect the program's point-to-point parts and collectives.

    Args:
        program: any program (compute actions and frees are skipped).
        tables: ``stage_tables(program)``, when the caller has it.
    Returns:
        the ``MessageLog``.
    Raises:
        MatchError: a part whose op, stage, microbatch or peer is out of range,
            a receive of a tensor no stage produces (RECV_F on a first stage,
            RECV_B on a last one), or a BATCH part that is not a send/receive.
    """
    tables = tables or stage_tables(program)
    num_stages, num_mb, num_ranks = len(program.stages), program.num_microbatches, program.num_ranks
    first_tensor = _first_tensors(program, tables)
    sends: dict[int, list[int]] = {}
    recvs: dict[int, list[int]] = {}
    collectives: dict[int, dict[int, list[int]]] = {}
    waits: dict[int, dict[int, list[int]]] = {}
    for rank, row in enumerate(program.ranks):
        # This rank's lists per peer (the pair key depends only on the peer
        # here), reached from a part's op: its sends, or its receives.
        to_peer: dict[int, list[int]] = {}
        from_peer: dict[int, list[int]] = {}
        lists_of = {op: to_peer if rule.is_send else from_peer for op, rule in PART_RULES.items()}
        for step, action in enumerate(row):
            if action[1] in _WEIGHT_OPS:  # weight passing's exchanges: ``checks.weights`` matches them
                continue
            parts = action[4]
            if not parts:  # not a batch: a single send/receive, a collective, or nothing to log
                op = action[1]
                if op not in lists_of:
                    if op in COLLECTIVE_OPS or op in COLLECTIVE_WAIT_OPS:
                        _log_collective(program, rank, step, collectives if op in COLLECTIVE_OPS else waits)
                    continue
                parts = (action,)
            for part in parts:
                stage, part_op, mb, peer, _ = part
                lists = lists_of.get(part_op)
                if lists is None or not (0 <= stage < num_stages and 0 <= mb < num_mb):
                    raise _bad_part(program, rank, step, part)
                first = first_tensor[part_op][stage]
                if first < 0:
                    raise _error(program, f"{part.text()} receives a tensor no stage produces", rank, step)
                entry = lists.get(peer)
                if entry is None:
                    entry = lists[peer] = []
                entry += (step, first + mb)
        for peer in chain(to_peer, from_peer):  # peers are checked once per rank, not per part
            if not 0 <= peer < num_ranks:
                raise _bad_peer(program, rank, peer)
        for peer, entry in to_peer.items():
            sends[rank * num_ranks + peer] = entry
        for peer, entry in from_peer.items():
            recvs[peer * num_ranks + rank] = entry
    return MessageLog(sends, recvs, collectives, waits)


def _first_tensors(program: Program, tables: StageTables) -> dict[str, list[int]]:
    """part op -> per stage: the id of the tensor it carries for microbatch 0 (-1: none), so id = that + mb."""
    num_stages, num_mb = len(program.stages), program.num_microbatches
    return {op: [tensor_id(rule.code, producer, 0, num_stages, num_mb) if producer >= 0 else -1
                 for producer in tables.neighbour(rule.where)]
            for op, rule in PART_RULES.items()}


def _log_collective(program, rank, step, into) -> None:
    action = program.ranks[rank][step]
    if not 0 <= action.stage < len(program.stages):
        raise _error(program, f"{action.text()}: there is no stage {action.stage}", rank, step)
    communicator = program.communicator_of(action)
    if communicator is None:
        raise _error(program, f"{action.text()}: no communicator of the program serves it "
                              f"(it meets on the {RULES[action.op].communicator})", rank, step)
    into.setdefault(communicator.id, {}).setdefault(rank, []).append(step)


def check_matching(program: Program, *, log: MessageLog | None = None, tables: StageTables | None = None) -> None:
    """Prove every message is well routed and matched FIFO per pair (module docstring).

    Args:
        program: a program whose compute actions are well formed.
        log: ``scan_messages(program)``, when the caller has it (``check_all``).
        tables: ``stage_tables(program)``, when the caller has it.
    Raises:
        MatchError: at the offending send or receive, naming both ranks and the
            tensors involved.
    """
    tables = tables or stage_tables(program)
    log = log or scan_messages(program, tables)
    _check_routes(program, tables, log)
    for key in sorted(set(log.sends) | set(log.recvs)):
        sent, received = log.sends.get(key, []), log.recvs.get(key, [])
        if sent[1::2] != received[1::2]:
            raise _pair_mismatch(program, key, sent, received)
    _check_unique(program, log)
    _check_collectives(program, tables, log)


# ---------------------------------------------------------------------- routes


def _stage_routes(program: Program, tables: StageTables) -> list[int]:
    """For (kind * S + producer): the pair key its tensors must travel on.

    -1: the tensor has no consumer; -2: producer and consumer share a rank.
    """
    num_ranks, home = program.num_ranks, tables.home
    routes = []
    for neighbour in (tables.next, tables.prev):  # ACT goes to next, GRAD to prev
        for stage, consumer in enumerate(neighbour):
            if consumer < 0:
                routes.append(-1)
            elif home[consumer] == home[stage]:
                routes.append(-2)
            else:
                routes.append(home[stage] * num_ranks + home[consumer])
    return routes


def _check_routes(program: Program, tables: StageTables, log: MessageLog) -> None:
    """Each pair carries only tensors made on src and read on dst (compared per producer stage)."""
    routes = _stage_routes(program, tables)
    num_mb = program.num_microbatches
    for is_send, logged in ((True, log.sends), (False, log.recvs)):
        for key, entry in logged.items():
            for producer in set(map(operator.floordiv, entry[1::2], repeat(num_mb))):
                if routes[producer] != key:
                    raise _misrouted(program, tables, key, entry, producer, routes[producer], is_send)


def _misrouted(program, tables, key, entry, producer, route, is_send) -> MatchError:
    num_ranks, num_mb = program.num_ranks, program.num_microbatches
    src, dst = divmod(key, num_ranks)
    index = next(i for i in range(1, len(entry), 2) if entry[i] // num_mb == producer)
    step, tensor = entry[index - 1], entry[index]
    rank = src if is_send else dst
    part = _part_at(program, rank, step, tensor, tables)
    what = describe_tensor(tensor, len(program.stages), num_mb)
    consumer = consumer_stage(tensor, program, tables)
    if route == -1:
        message = f"{part} moves the {what}, which no stage reads"
    elif route == -2:
        message = (f"{part} moves the {what} between ranks {src} and {dst}, but its producer and its consumer "
                   f"(stage {consumer}) both live on rank {tables.home[consumer]}: the hand-off is local, not a message")
    else:
        right_src, right_dst = divmod(route, num_ranks)
        message = (f"{part} moves the {what} from rank {src} to rank {dst}, but it is made on rank {right_src} "
                   f"and read (by stage {consumer}) on rank {right_dst}")
    return _error(program, message, rank, step)


def _part_at(program, rank, step, tensor, tables) -> str:
    """The text of the part of instruction (rank, step) that carries ``tensor``."""
    action = program.ranks[rank][step]
    for part in action.comms():
        if part_tensor(part, program, tables) == tensor:
            return part.text()
    return action.text()


# -------------------------------------------------------------- pair sequences


def _pair_mismatch(program: Program, key: int, sent: list[int], received: list[int]) -> MatchError:
    """Explain why src's sends to dst and dst's receives from src differ.

    In order of preference: a tensor only one side moves, a tensor one side
    moves more often, and finally the first pair of swapped messages.
    """
    num_ranks, num_stages, num_mb = program.num_ranks, len(program.stages), program.num_microbatches
    src, dst = divmod(key, num_ranks)
    describe = lambda t: describe_tensor(t, num_stages, num_mb)  # noqa: E731
    sent_count, received_count = Counter(sent[1::2]), Counter(received[1::2])
    sides = (
        (src, sent, received_count, f"rank {src} sends the {{}} to rank {dst}, which never receives it from rank {src}",
         "sends"),
        (dst, received, sent_count, f"rank {dst} receives the {{}} from rank {src}, which never sends it to rank {dst}",
         "receives"),
    )
    for rank, entry, other_count, never, _ in sides:
        for index in range(1, len(entry), 2):
            if other_count[entry[index]] == 0:
                return _error(program, never.format(describe(entry[index])), rank, entry[index - 1])
    for rank, entry, other_count, _, verb in sides:
        seen: Counter = Counter()
        for index in range(1, len(entry), 2):
            tensor = entry[index]
            seen[tensor] += 1
            if seen[tensor] > other_count[tensor]:
                return _error(program, f"rank {rank} {verb} the {describe(tensor)} more often than rank "
                                       f"{dst if rank == src else src} matches it (pair {src} -> {dst})",
                              rank, entry[index - 1])
    sent_tensors = sent[1::2]
    for index, (out, back) in enumerate(zip(sent_tensors, received[1::2])):
        if out != back:
            send_step, recv_step = sent[2 * index], received[2 * index]
            later = sent_tensors.index(back, index)
            return _error(
                program,
                f"messages from rank {src} to rank {dst} out of order: rank {src} sends the {describe(out)} "
                f"(step {send_step}) before the {describe(back)} (step {sent[2 * later]}), but rank {dst} "
                f"receives the {describe(back)} first (step {recv_step}); untagged messages match in order, "
                f"so the data would be swapped",
                dst, recv_step, [(src, send_step), (src, sent[2 * later])])
    raise AssertionError("pair lists differ but no difference found")


def _check_unique(program: Program, log: MessageLog) -> None:
    """No tensor travels twice (pair lists are equal by now, so sends suffice)."""
    total = sum(len(entry) for entry in log.sends.values()) // 2
    if len(set(chain.from_iterable(entry[1::2] for entry in log.sends.values()))) == total:
        return
    seen: dict[int, tuple[int, int]] = {}
    num_ranks = program.num_ranks
    for key in sorted(log.sends):
        entry = log.sends[key]
        src = key // num_ranks
        for index in range(0, len(entry), 2):
            tensor = entry[index + 1]
            if tensor in seen:
                first = seen[tensor]
                what = describe_tensor(tensor, len(program.stages), program.num_microbatches)
                raise _error(program, f"the {what} is sent twice (first at rank {first[0]}, step {first[1]})",
                             src, entry[index], [first])
            seen[tensor] = (src, entry[index])


# ----------------------------------------------------------------- collectives


def _check_collectives(program: Program, tables: StageTables, log: MessageLog) -> None:
    """Collectives meet on their communicator, by members, in one sequence; each is waited once."""
    for comm_id, by_rank in sorted(log.collectives.items()):
        communicator = program.communicators[comm_id]
        for rank, steps in sorted(by_rank.items()):
            if rank not in communicator.ranks:
                raise _error(program, f"rank {rank} joins the all-reduce of chunk {communicator.key}, but holds no replica "
                                      f"of it (replicas on ranks {list(communicator.ranks)})", rank, steps[0])
        _check_same_sequence(program, tables, communicator, by_rank)
    for comm_id in sorted(set(log.collectives) | set(log.collective_waits)):
        started, waited = log.collectives.get(comm_id, {}), log.collective_waits.get(comm_id, {})
        for rank in sorted(set(started) | set(waited)):
            _check_waits(program, program.communicators[comm_id], rank, started.get(rank, []), waited.get(rank, []))


def _check_same_sequence(program: Program, tables: StageTables, communicator, by_rank: dict[int, list[int]]) -> None:
    """Every member issues the same (op, root, value, size) at each position both reach.

    A member that issues fewer is not an error here: whether it ever arrives
    is a question of progress, which ``check_deadlock`` answers.
    """
    sequences = {rank: [collective_signature(program.ranks[rank][step], program, tables) for step in steps]
                 for rank, steps in by_rank.items()}
    first = min(sequences)
    for rank, sequence in sorted(sequences.items()):
        for k, (mine, theirs) in enumerate(zip(sequence, sequences[first])):
            if mine != theirs:
                raise _error(program, f"collective {k} on communicator {communicator.id} (ranks "
                                      f"{list(communicator.ranks)}) differs between members: rank {first} issues "
                                      f"{program.ranks[first][by_rank[first][k]].text()}, rank {rank} issues "
                                      f"{program.ranks[rank][by_rank[rank][k]].text()}",
                             rank, by_rank[rank][k], [(first, by_rank[first][k])])


def _check_waits(program, communicator, rank, starts: list[int], waits: list[int]) -> None:
    chunk = communicator.key
    for index, wait in enumerate(waits):
        if index >= len(starts) or starts[index] > wait:
            raise _error(program, f"ALLREDUCE_WAIT of chunk {chunk} with no all-reduce started before it", rank, wait)
    if len(starts) > len(waits):
        raise _error(program, f"the all-reduce of chunk {chunk} started here is never waited for (ALLREDUCE_WAIT)",
                     rank, starts[len(waits)])


# ---------------------------------------------------------------------- errors


def _bad_part(program: Program, rank: int, step: int, part) -> MatchError:
    num_stages, num_mb = len(program.stages), program.num_microbatches
    checks = (
        (part.op in PART_RULES, f"{part.text()} in a batch is not a send or a receive"),
        (0 <= part.stage < num_stages, f"{part.text()}: there is no stage {part.stage}"),
        (0 <= part.mb < num_mb, f"{part.text()}: there is no microbatch {part.mb}"),
    )
    message = next(text for ok, text in checks if not ok)
    return _error(program, message, rank, step)


def _bad_peer(program: Program, rank: int, peer: int) -> MatchError:
    step, part = next((step, part) for step, action in enumerate(program.ranks[rank])
                      for part in action.comms() if part.peer == peer)
    return _error(program, f"{part.text()}: peer rank {peer} does not exist (ranks 0..{program.num_ranks - 1})",
                  rank, step)


def _error(program: Program, message: str, rank: int, step: int | None, marks=()) -> MatchError:
    return MatchError(message, rank, step, program.grid(), marks)


# Sends and receives by their part rules, batches by their parts, collectives
# and their waits by communicator; computes and frees carry no message.
declare_pass("matching", set(PART_RULES) | {op for op, rule in RULES.items()
                                           if rule.category in (BATCH_OF, COMPUTE, FREE)}
             | set(COLLECTIVE_OPS) | set(COLLECTIVE_WAIT_OPS) | _WEIGHT_OPS)
