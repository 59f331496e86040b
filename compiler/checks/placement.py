"""Stages placed on groups of ranks: what the prover proves of them (docs/ir.md, placements).

A stage on a group (``ir.Placement``) is run by every member on its share, so
the single-home checks (well-formed, matching, conflict, deadlock) do not
apply; ``check_all`` runs these instead, and they say the same things of each
member's share:

* ``check_placed``: every group is real (ranks of the program, two or more,
  its communicator of exactly its members; under HSDP no whole-group
  communicator, its shard and replica groups each splitting its ranks evenly
  and crossing in one member); every member's stated roles (``_check_roles``:
  shares that cut each microbatch once and agree across a rank's stages, shards
  at the member's place in its gather's group and one per replica group, a
  saver among the members); every compute runs on a member of
  its stage; each member runs each of its stage's tasks exactly once (the
  family's task sets, per member); a compute's sub-steps (its ``parts``) are
  sub-step ops of its own stage and microbatch, on a stage on a group, and
  every member runs a compute with the same sub-steps; a free (FREE_F) of what a
  member stored stands once on that member, after its last use there; then, per member
  (``checks/sharding.py``), a sharded stage's weights whole wherever a compute
  runs on them, and each stage's gradient reduced once after its last
  contribution and waited.
* ``PlacedStages``, the activation family's meaning in the one symbolic run
  (``checks/symbolic.py``): its messages are inlined exchanges (rendezvous,
  a batch atomic), its sub-steps blocking meetings of the group's
  communicator in list order, its gradient reductions (SYNC_GRAD, REDUCE_GRAD)
  meetings of the same communicator posted by an EXCHANGE and completed at its
  wait, counted with the sub-steps (under HSDP the member's shard group, and
  SYNC_SHARD a meeting of its replica group, ``Program.communicator_on``);
  every compute of a stage split by sequence (``SEQUENCE_SHARE``, PP x CP) an
  operation of its group's communicator, counted with the reductions there,
  since its attention runs the stage's ring over the group on it (so members
  that take the stage's computes, or a reduction and a compute, in different
  orders are named at their first disagreement); a message goes between
  the members whose shares meet (``Program.share_peers``: a hand-off stays at
  its cp coordinate); a compute reads only shares this rank made
  or received before it, a send ships only what this rank made.

Errors name the rank and step, as the single-home checks do.
"""
from __future__ import annotations

from pipec.compiler import ops
from pipec.compiler.checks.sharding import check_sharding
from pipec.compiler.checks.symbolic import Part, RankState, Semantics, communicator_text, register_semantics
from pipec.compiler.checks.wellformed import task_problem
from pipec.compiler.ir import SEQUENCE_SHARE, Action, Program, stage_tables
from pipec.errors import ConflictError, MatchError, WellFormedError

_SUBSTEPS = frozenset(ops.SUBSTEP_OPS)
# What meets on a stage's group: sub-steps inside computes, and the gradient reductions that stand in EXCHANGEs
# (under HSDP, on the member's shard group; the shard's all-reduce on its replica group).
_GROUP_PARTS = _SUBSTEPS | frozenset(ops.STAGE_EXCHANGE_OPS) | frozenset(ops.SHARD_REPLICA_OPS)
_TASK_SETS = ops.FAMILY_TASKS[ops.ACTIVATION_PASSING]
# The replica all-reduce meets on replicas' ranks, which a placement does not define yet.
_NOT_YET = (ops.COLLECTIVE, ops.COLLECTIVE_WAIT)


def ranks_text(ranks) -> str:
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def check_placed(program: Program) -> None:
    """Prove the groups, the computes' places, each member's tasks and the sub-steps (module docstring).

    Raises:
        WellFormedError: at the group's first rank for a bad group; at the instruction otherwise.
        ConflictError: a free of a member's stored values before their last use (``_check_frees``).
    """
    _check_groups(program)
    _check_roles(program)
    tasks = _locate(program)
    _check_complete(program, tasks)
    _check_substeps_agree(program, tasks)
    _check_frees(program, tasks)
    check_sharding(program)


def _error(program: Program, message: str, rank: int | None, step: int | None, marks=()) -> WellFormedError:
    return WellFormedError(message, rank, step, program.grid(), marks)


def _check_groups(program: Program) -> None:
    count = len(program.communicators)
    for info in program.stages:
        placement = info.placement
        if placement is None:
            continue
        ranks, where = placement.ranks, info.rank if 0 <= info.rank < program.num_ranks else None
        outside = [r for r in ranks if not 0 <= r < program.num_ranks]
        if outside:
            message = (f"stage {info.id} is placed on {ranks_text(ranks)}, but rank {outside[0]} is none of the "
                       f"program's (ranks 0..{program.num_ranks - 1})")
        elif len(ranks) < 2 or list(ranks) != sorted(set(ranks)):
            message = (f"stage {info.id} is placed on {ranks_text(ranks) if ranks else 'no ranks'}: a group lists "
                       "two or more ranks, ascending (a stage on one rank has no placement)")
        elif info.rank != ranks[0]:
            message = (f"stage {info.id} is on rank {info.rank} and placed on {ranks_text(ranks)}: a stage on a "
                       "group names its first member as its rank")
        elif placement.hybrid or placement.replica_groups:
            message = _hybrid_problem(program, info)
            if message is None:
                continue
        elif not 0 <= placement.communicator < count:
            message = (f"stage {info.id} is placed on {ranks_text(ranks)} meeting on communicator "
                       f"{placement.communicator}, but the program has {count} communicators")
        elif program.communicators[placement.communicator].ranks != ranks \
                or program.communicators[placement.communicator].purpose != ops.STAGE_GROUP:
            group = program.communicators[placement.communicator]
            message = (f"stage {info.id} is placed on {ranks_text(ranks)}, but its communicator {group.id} is "
                       f"{group.purpose!r} on {ranks_text(group.ranks)}: a stage's group meets on a communicator "
                       f"of exactly its members ({ops.STAGE_GROUP!r})")
        else:
            continue
        raise _error(program, message, where, None)


def _check_roles(program: Program) -> None:
    """Every member's stated roles (``Placement.shares``, ``shards``, ``saver``) are ones the runtime can act on
    and train exactly by: each stage's shares cut every microbatch once, a rank takes one share in all its stages
    (the runtime reads its rows once), a context-parallel member's share is its place in the group (ring rank i is
    group rank i of the ring's all_to_all), a shard is the member's place in the communicator its weights are
    gathered on (an all-gather puts group rank j's piece j-th), a replica group joins holders of one shard, and
    each stage's parameters are saved by one of its members.

    Raises:
        WellFormedError: at the first member whose role breaks one, naming the stage, the communicator and why.
    """
    taken: dict[int, tuple[int, int, int]] = {}  # rank -> (share, of k, in stage): its first stage's
    for info in program.stages:
        placement = info.placement
        if placement is None:
            continue
        ranks, k, where = placement.ranks, len(placement.ranks), f"stage {info.id} (on {ranks_text(placement.ranks)})"
        shares = placement.shares
        if len(shares) != k or sorted(shares) != list(range(k)):
            raise _error(program, f"{where} gives its members the shares {list(shares)}: a stage's members take "
                         f"shares 0..{k - 1} of every microbatch, each once, so each row (or token) is computed once",
                         ranks[0], None)
        for rank, share in zip(ranks, shares):
            if placement.split == SEQUENCE_SHARE and share != ranks.index(rank):
                raise _error(program, f"rank {rank} takes share {share} of every sequence in {where}, but is member "
                             f"{ranks.index(rank)} of its group: a context-parallel member runs ring rank i of the "
                             "stage ring, which meets its group as group rank i, so member i takes share i",
                             rank, None)
            first = taken.setdefault(rank, (share, k, info.id))
            if first[:2] != (share, k):
                raise _error(program, f"rank {rank} takes share {share} of {k} of every microbatch in {where}, but "
                             f"share {first[0]} of {first[1]} in stage {first[2]}: a rank takes one share in all its "
                             "stages (it reads its rows, or tokens, and its loss's targets once), so its roles "
                             "must agree", rank, None)
        problem = _shard_problem(program, info)
        if problem is not None:
            rank, message = problem
            raise _error(program, message, rank, None)
        if placement.saver not in ranks:
            raise _error(program, f"{where} is saved by rank {placement.saver}, which is not one of its members: "
                         f"no rank saves its parameters (a checkpoint would lack chunk {info.position})", ranks[0],
                         None)


def _shard_problem(program: Program, info) -> tuple[int, str] | None:
    """(the rank, what is wrong) with a stage's stated shards, or None: none for whole weights; for sharded
    weights one per member, each the member's index in the communicator its weights are gathered on; under
    HSDP every replica group (``SYNC_SHARD``'s) joining members that hold the same shard."""
    placement = info.placement
    where = f"stage {info.id} (on {ranks_text(placement.ranks)})"
    if not placement.sharded:
        return None if not placement.shards else (placement.ranks[0], f"{where} holds whole weights but states "
                                                  f"shards {list(placement.shards)} for its members")
    if len(placement.shards) != len(placement.ranks):
        return (placement.ranks[0], f"{where} is sharded, but states {len(placement.shards)} shards for its "
                f"{len(placement.ranks)} members: each member holds one")
    for rank, shard in zip(placement.ranks, placement.shards):
        group = program.communicator_on(Action(info.id, ops.GATHER), rank)
        if group is None or shard != group.ranks.index(rank):
            place = "none" if group is None else f"member {group.ranks.index(rank)} of {communicator_text(group)}"
            return (rank, f"rank {rank} holds shard {shard} of the weights of {where}, but is {place}, where they are "
                    f"gathered: an all-gather puts the piece of the group's j-th rank j-th, so a member holds the "
                    f"shard of its place")
    for group_id in placement.replica_groups:
        group = program.communicators[group_id]
        held = {rank: placement.shard_of(rank) for rank in group.ranks}
        a = group.ranks[0]
        b = next((rank for rank in group.ranks if held[rank] != held[a]), None)
        if b is not None:
            return (b, f"{communicator_text(group)} all-reduces the shard of the weights of {where} that its "
                    f"members hold (SYNC_SHARD), but rank {a} holds shard {held[a]} and rank {b} shard {held[b]}: a replica "
                    "group joins holders of the same shard (it would sum different pieces of the weights)")
    return None


def _hybrid_problem(program: Program, info) -> str | None:
    """What is wrong with an HSDP placement's groups, or None: no whole-group communicator (-1), its shard
    groups (``STAGE_GROUP``) and its replica groups (``SHARD_REPLICAS``) each split its ranks into equal
    parts, and every shard group meets every replica group in exactly one member (a grid)."""
    placement, count = info.placement, len(program.communicators)
    where = f"stage {info.id} is placed on {ranks_text(placement.ranks)} with hybrid sharding"
    if not placement.sharded or placement.communicator != -1:
        return (f"{where}, but it is {'not sharded' if not placement.sharded else 'also on communicator '}"
                f"{'' if not placement.sharded else placement.communicator}: a hybrid placement is sharded and "
                "meets only on its shard and replica groups (communicator -1)")
    kinds = ((placement.shard_groups, ops.STAGE_GROUP, "shard"), (placement.replica_groups, ops.SHARD_REPLICAS,
                                                                   "replica"))
    parts = {}
    for ids, purpose, word in kinds:
        bad = next((i for i in ids if not 0 <= i < count or program.communicators[i].purpose != purpose), None)
        if not ids or bad is not None:
            return (f"{where}, but its {word} groups {list(ids)} are not communicators of purpose {purpose!r} "
                    f"(the program has {count} communicators)")
        groups = [program.communicators[i].ranks for i in ids]
        if sorted(r for group in groups for r in group) != list(placement.ranks) or len({len(g) for g in groups}) > 1:
            return (f"{where}, but its {word} groups ({'; '.join(ranks_text(g) for g in groups)}) do not split "
                    "its ranks into equal groups")
        parts[word] = groups
    crossing = next(((a, b) for a in parts["shard"] for b in parts["replica"] if len(set(a) & set(b)) != 1), None)
    if crossing is not None:
        return (f"{where}, but its shard group of {ranks_text(crossing[0])} and replica group of "
                f"{ranks_text(crossing[1])} share {len(set(crossing[0]) & set(crossing[1]))} members: each replica "
                "group holds one member of each shard group")
    return None


def _locate(program: Program) -> dict[tuple[int, int, str, int], int]:
    """(rank, stage, op, mb) -> the step of every compute, each checked in range, on a member, once per rank."""
    tasks: dict[tuple[int, int, str, int], int] = {}
    num_stages, num_mb = len(program.stages), program.num_microbatches
    for rank, row in enumerate(program.ranks):
        for step, action in enumerate(row):
            category = ops.RULES[action.op].category if action.op in ops.RULES else None
            if action.op in _SUBSTEPS or (category == ops.EXCHANGE_OF and _SUBSTEPS & {p.op for p in action.parts}):
                raise _error(program, f"{action.text()} stands outside a compute: a sub-step ({', '.join(_SUBSTEPS)}) "
                             "is a part of the compute it runs in", rank, step)
            if category in _NOT_YET:
                raise _error(program, f"{action.text()}: a program with stages on rank groups cannot hold "
                             f"{action.op} yet (the replica all-reduce has no placement on groups)", rank, step)
            if category != ops.COMPUTE:
                continue
            stage, mb, text = action.stage, action.mb, action.text()
            if not 0 <= stage < num_stages:
                raise _error(program, f"{text}: there is no stage {stage} (stages 0..{num_stages - 1})", rank, step)
            if not 0 <= mb < num_mb:
                raise _error(program, f"{text}: there is no microbatch {mb} (microbatches 0..{num_mb - 1})",
                             rank, step)
            info = program.stages[stage]
            if rank not in info.ranks:
                raise _error(program, f"{text} runs on rank {rank}, but stage {stage} lives on "
                             f"{ranks_text(info.ranks)}", rank, step)
            if info.pipeline != program.mb_pipeline[mb]:
                raise _error(program, f"{text}: microbatch {mb} rides pipeline {program.mb_pipeline[mb]}, but stage "
                             f"{stage} belongs to pipeline {info.pipeline}", rank, step)
            _check_parts(program, rank, step, action)
            key = (rank, stage, action.op, mb)
            if key in tasks:
                raise _error(program, f"{text} appears twice on rank {rank} (first at step {tasks[key]})",
                             rank, step, [(rank, tasks[key])])
            tasks[key] = step
    return tasks


def _check_parts(program: Program, rank: int, step: int, action: Action) -> None:
    """A compute's sub-steps: on a stage on a group, sub-step ops naming its own stage and microbatch."""
    if not action.parts:
        return
    text = action.text()
    if program.stages[action.stage].placement is None:
        raise _error(program, f"{text} holds sub-steps, but stage {action.stage} lives on one rank: sub-steps meet "
                     "on the group a stage is placed on", rank, step)
    for part in action.parts:
        if part.op not in _SUBSTEPS:
            raise _error(program, f"{text} holds {part.text()}, which is no sub-step (a compute may hold "
                         f"{', '.join(_SUBSTEPS)})", rank, step)
        if (part.stage, part.mb) != (action.stage, action.mb):
            raise _error(program, f"{text} holds {part.text()}, which names another compute: a sub-step names the "
                         "stage and microbatch of the compute it runs in", rank, step)


# A free (FREE_F) of (stage, mb) drops what a member stored for it: its makers are the computes that store
# what it drops and make what it reads (F, R), its users every other compute that makes, reads or ends a dropped
# value at its own stage (B, I, W), and its ships the sends of what its makers hand on (SEND_F): the rules of
# the single-home check (``checks/conflict.py``), per member.
def _free_rules(free_op: str) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    rule = ops.RULES[free_op]
    dropped, read = set(rule.ends), {use.kind for use in rule.reads}
    makers = frozenset(op for op in ops.stored_by(free_op) if read & {use.kind for use in ops.RULES[op].writes})
    users = frozenset(op for op in ops.COMPUTE_OPS if op not in makers and dropped & (
        set(ops.RULES[op].ends) | {use.kind for use in ops.RULES[op].reads + ops.RULES[op].writes
                                   if use.where == ops.SELF}))
    made = {use.kind for op in makers for use in ops.RULES[op].writes if use.where == ops.SELF}
    ships = frozenset(send for kind, (send, _recv) in ops.COMM_OP_OF_KIND.items() if kind in made)
    return makers, users, ships


_FREE_RULES = {free_op: _free_rules(free_op) for free_op in ops.FREE_OPS}


def _check_frees(program: Program, tasks) -> None:
    """Each free of (stage, mb) stands on a member of the stage, once, after a compute of the member that made
    what it drops and after every compute and send of the member that uses it (``_FREE_RULES``).

    The runtime drops the member's stored values at the free: a backward after it finds nothing to run on.
    """
    sends = {}  # (rank, op, stage, mb) -> the step of the send (alone or in a batch)
    for rank, row in enumerate(program.ranks):
        for step, action in enumerate(row):
            for part in action.comms():
                sends.setdefault((rank, part.op, part.stage, part.mb), step)
    for rank, row in enumerate(program.ranks):
        freed: dict[tuple[str, int, int], int] = {}
        for step, action in enumerate(row):
            if action.op not in _FREE_RULES:
                continue
            makers, users, ships = _FREE_RULES[action.op]
            stage, mb, text = action.stage, action.mb, action.text()
            made = [tasks[key] for op in makers if (key := (rank, stage, op, mb)) in tasks]
            if not made:
                raise _conflict(program, f"{text} frees an activation that is never made on rank {rank}", rank, step)
            if (action.op, stage, mb) in freed:
                first = freed[action.op, stage, mb]
                raise _conflict(program, f"{text} frees the activation twice (first at step {first})", rank, step,
                                [(rank, first)])
            freed[action.op, stage, mb] = step
            uses = [(tasks[key], f"{stage}{op}{mb}") for op in makers | users
                    if (key := (rank, stage, op, mb)) in tasks]
            uses += [(sends[key], row[sends[key]].text()) for op in ships if (key := (rank, op, stage, mb)) in sends]
            late = [(use_step, use) for use_step, use in uses if use_step > step]
            if late:
                use_step, use = min(late)
                raise _conflict(program, f"{text} frees the activation before {use} uses it (step {use_step})",
                                rank, step, [(rank, use_step)])


def _conflict(program: Program, message: str, rank: int, step: int, marks=()) -> ConflictError:
    return ConflictError(message, rank, step, program.grid(), marks)


def _check_complete(program: Program, tasks) -> None:
    """Each member of each stage runs exactly one alternative of each task set for every microbatch riding it."""
    for info in program.stages:
        for rank in info.ranks:
            for mb in program.microbatches_of(info.id):
                for task_set in _TASK_SETS:
                    present = {op: (rank, info.id, op, mb) in tasks for alt in task_set.alternatives for op in alt}
                    text = task_problem(task_set, present, info.id, mb)
                    if text is None:
                        continue
                    steps = [tasks[(rank, info.id, op, mb)] for op in present if present[op]]
                    where = f" on rank {rank}" + (f" ({ranks_text(info.ranks)} run stage {info.id})"
                                                  if info.placement is not None else "")
                    raise _error(program, text + where, rank, steps[0] if steps else None)


def _check_substeps_agree(program: Program, tasks) -> None:
    """Every member runs each compute of its stage with the first member's sub-steps, in the same order."""
    for (rank, stage, op, mb), step in tasks.items():
        info = program.stages[stage]
        first = info.ranks[0]
        if info.placement is None or rank == first:
            continue
        theirs_step = tasks.get((first, stage, op, mb))
        if theirs_step is None:
            continue  # the first member lacks the task: _check_complete named it
        mine = program.ranks[rank][step].parts
        theirs = program.ranks[first][theirs_step].parts
        if mine == theirs:
            continue
        task, rule = f"{stage}{op}{mb}", (f"every member of stage {stage}'s group ({ranks_text(info.ranks)}) runs "
                                         "each compute with the same sub-steps, in the same order")
        missing = [p for p in theirs if p not in mine]
        extra = [p for p in mine if p not in theirs]
        if missing:
            message = (f"rank {rank} runs {task} without the sub-step {missing[0].text()} that rank {first} runs in "
                       f"it (step {theirs_step}): {rule}")
        elif extra:
            message = (f"rank {rank} runs {task} with the sub-step {extra[0].text()}, which rank {first}'s (step "
                       f"{theirs_step}) lacks: {rule}")
        else:
            message = (f"rank {rank} runs the sub-steps of {task} in another order than rank {first} (step "
                       f"{theirs_step}): {rule}")
        raise _error(program, message, rank, step, [(first, theirs_step)])


@register_semantics
class PlacedStages(Semantics):
    """Activation passing on stages placed on rank groups: its messages, sub-steps and dataflow in the one run."""

    family = ops.ACTIVATION_PASSING
    part_ops = frozenset(ops.SEND_OPS + ops.RECV_OPS) | _GROUP_PARTS
    blocking = _SUBSTEPS  # a sub-step holds its compute; a reduction is posted, and waited by its EXCHANGE_WAIT

    @classmethod
    def applies(cls, program: Program) -> bool:
        return program.placed_on_groups

    def start(self) -> None:
        self.tables = stage_tables(self.program)
        self.done: list[set] = [set() for _ in range(self.P)]      # (op, stage, mb) this rank ran
        self.arrived: list[set] = [set() for _ in range(self.P)]   # (value, from rank) this rank received
        self.sent: list[set] = [set() for _ in range(self.P)]      # (value, to rank) this rank sent

    def inline(self, action: Action) -> tuple[Action, ...]:
        category = ops.RULES[action.op].category
        if category in (ops.SEND, ops.RECV):
            return (action,)
        if category in (ops.BATCH_OF, ops.COMPUTE):  # a batch's messages; a compute's sub-steps
            return action.parts
        return ()

    def rendezvous(self, action: Action, rank: int) -> tuple[int, str] | None:
        """A compute of a stage split by sequence is an operation of its group's communicator: its attention's
        ring (``Program.stage_ring``) exchanges KV among the members on that communicator, each running the
        compute of the same stage and microbatch, in the same count as the stage's gradient reductions there."""
        if ops.RULES[action.op].category != ops.COMPUTE:
            return None
        placement = self.program.stages[action.stage].placement  # in range: check_placed proved it
        if placement is None or placement.split != SEQUENCE_SHARE:
            return None
        return (placement.communicator,
                f"the stage ring of {action.text()} over its group ({ranks_text(placement.ranks)})")

    def value(self, action: Action) -> tuple:
        rule = ops.PART_RULES[action.op]
        return (rule.kind, self.tables.neighbour(rule.where)[action.stage], action.mb)

    def value_text(self, value: tuple) -> str:
        kind, stage, mb = value
        return ops.describe(ops.Value(kind, (stage, mb)))

    def signature(self, part: Part) -> tuple:
        return (part.action.op, part.action.stage, part.action.mb)

    def post(self, state: RankState, part: Part) -> None:
        action = part.action
        if action.op in _GROUP_PARTS:  # its place proved by check_sharding, its order by the meeting
            return
        if not (0 <= action.stage < len(self.program.stages) and 0 <= action.mb < self.program.num_microbatches):
            raise self.error(MatchError, f"{action.text()}: there is no stage {action.stage} or microbatch "
                             f"{action.mb} of the program", state.rank, part.step)
        self.check_route(state.rank, part)

    def check_route(self, rank: int, part: Part) -> None:
        """A message goes between the members whose shares of its value meet; a send ships what this rank made."""
        action, rule = part.action, ops.PART_RULES[part.action.op]
        kind, producer, mb = self.value(action)
        consumer = self.tables.neighbour(ops.READER_OF[kind])[producer] if producer >= 0 else -1
        what = self.value_text((kind, producer, mb)) if producer >= 0 else ops.VALUE_KINDS[kind].words
        mine, other = (producer, consumer) if rule.is_send else (consumer, producer)
        if other < 0:
            raise self.error(MatchError, f"{action.text()} moves the {what}, which no stage "
                             f"{'reads' if rule.is_send else 'makes'}", rank, part.step)
        if rank not in self.program.stages[mine].ranks:
            raise self.error(MatchError, f"{action.text()} runs on rank {rank}, but stage {mine} lives on "
                             f"{ranks_text(self.program.stages[mine].ranks)}", rank, part.step)
        right = self.program.share_peers(mine, rank, other)
        if action.peer not in right:
            verb, role = ("sends", "takes") if rule.is_send else ("takes", "makes")
            raise self.error(MatchError, f"{action.text()} {verb} rank {rank}'s share of the {what} "
                             f"{'to' if rule.is_send else 'from'} rank {action.peer}, but stage {other} (on "
                             f"{ranks_text(self.program.stages[other].ranks)}) {role} that share on "
                             f"{ranks_text(right)}{self.coordinates_text(action.peer, right)}", rank, part.step)
        if not rule.is_send:
            return
        if not any((op, producer, mb) in self.done[rank] for op in ops.producers(kind)):
            raise self.error(ConflictError, f"{action.text()} ships the {what} before this rank made its share",
                             rank, part.step)
        if ((kind, producer, mb), action.peer) in self.sent[rank]:
            raise self.error(MatchError, f"{action.text()} sends rank {rank}'s share of the {what} to rank "
                             f"{action.peer} a second time: every member of stage {other} (on "
                             f"{ranks_text(self.program.stages[other].ranks)}) takes its own share, from "
                             f"{ranks_text(self.program.share_peers(other, action.peer, mine))}", rank, part.step)
        self.sent[rank].add(((kind, producer, mb), action.peer))

    def coordinates_text(self, peer: int, right: tuple[int, ...]) -> str:
        """On a mesh, where the wrong peer and the right one sit (a hand-off keeps every coordinate but pp's)."""
        mesh = self.program.mesh
        if mesh is None or not 0 <= peer < mesh.size or len(right) != 1:
            return ""
        theirs, wanted = mesh.coords(peer), mesh.coords(right[0])
        differ = [axis for axis in mesh.names if theirs[axis] != wanted[axis]]
        return (f" (rank {peer} is at {', '.join(f'{axis} {theirs[axis]}' for axis in differ)}; the share is at "
                f"{', '.join(f'{axis} {wanted[axis]}' for axis in differ)})") if differ else ""

    def arrive(self, state: RankState, part: Part) -> None:
        if part.action.op in _GROUP_PARTS or ops.PART_RULES[part.action.op].is_send:
            return
        got = (self.value(part.action), part.action.peer)
        if got in self.arrived[state.rank]:
            raise self.error(MatchError, f"{part.action.text()}: rank {state.rank} receives rank {part.action.peer}'s "
                             f"share of the {self.value_text(got[0])} a second time", state.rank, part.step)
        self.arrived[state.rank].add(got)

    def step(self, state: RankState, action: Action) -> None:
        if action.op not in ops.DEPENDENCIES:
            return
        rank, stage, mb = state.rank, action.stage, action.mb
        for dependency in ops.DEPENDENCIES[action.op]:
            other = self.tables.neighbour(dependency.where)[stage]
            if other < 0:
                continue
            if dependency.where == ops.SELF:
                if not any((op, stage, mb) in self.done[rank] for op in dependency.made_by):
                    raise self.error(WellFormedError, f"{action.text()} needs {stage}{dependency.made_by[0]}{mb}, "
                                     "which this rank has not run before it", rank, state.pc)
                continue
            value = (dependency.kind, other, mb)
            for peer in self.program.share_peers(stage, rank, other):
                made_here = peer == rank and any((op, other, mb) in self.done[rank] for op in dependency.made_by)
                if not made_here and (value, peer) not in self.arrived[rank]:
                    raise self.error(ConflictError, f"{action.text()} reads rank {peer}'s share of the "
                                     f"{self.value_text(value)}, which this rank has not "
                                     f"{'made' if peer == rank else 'received'} before it", rank, state.pc)
        self.done[rank].add((action.op, stage, mb))
