"""Weights and gradients of stages on rank groups, per member: gathers, reshards and gradient reductions.

A stage placed on a group (``ir.Placement``) keeps its weights whole on every
member (replicated, PP x DP) or a shard of them on each (``sharded``, PP x
FSDP). What its members hold changes along each member's list, so this is a
walk of every list in order, kept apart from the one symbolic run (which
proves the group's meetings: each member's k-th collective on the group's
communicator the same, every exchange waited) and run before it by
``check_placed``:

* a sharded stage's weights are whole on a member from a GATHER (a sub-step
  of a compute) to the next RESHARD; every compute that runs on the weights
  runs while they are whole; a GATHER makes them whole only when they are not
  (a second copy would be gathered for nothing) and only on a sharded stage;
  a RESHARD drops them only while whole; the list ends with them dropped (the
  optimizer steps on the shards, so a whole copy kept past the step is stale);
* each member reduces each of its stages' weight gradients over the group
  exactly once: REDUCE_GRAD on a sharded stage, SYNC_GRAD on a replicated one,
  never on a stage on one rank (under weight passing on a mesh only each layer's
  owner's stage is reduced, ``Family.reduced_stages``: the other ranks' partials
  were folded into it); no gradient contribution (B, W) of the stage
  comes after the reduction on that member (it would miss the sum, or race
  it), and the member waits for the reduction's exchange before its list ends;
* under HSDP (a placement with shard groups) each member also all-reduces
  its shard of the gradient over its replica group exactly once (SYNC_SHARD),
  only after the wait of the exchange whose REDUCE_GRAD made that shard (it
  would sum a shard still being reduce-scattered), and waits for it too.

The ops are the rule table's (``ops.GATHER_OPS``, ``ops.RESHARD_OPS``,
``ops.STAGE_EXCHANGE_OPS``, ``ops.SHARD_REPLICA_OPS``); errors name the rank and step, with the grid.
"""
from __future__ import annotations

import operator
from itertools import chain

from pipec.compiler import ops
from pipec.compiler.family import families_of, first_answer
from pipec.compiler.ir import Action, Program
from pipec.errors import ConflictError, MatchError, RouteError, WellFormedError

_GATHERS = frozenset(ops.GATHER_OPS)
_RESHARDS = frozenset(ops.RESHARD_OPS)
_REDUCTIONS = frozenset(ops.STAGE_EXCHANGE_OPS)
_SHARDED_REDUCTIONS = frozenset(ops.SHARDED_REDUCTION_OPS)
_SHARD_SYNCS = frozenset(ops.SHARD_REPLICA_OPS)
_ON_WEIGHTS = frozenset(ops.WEIGHT_PASS)  # the computes that run on their stage's weights
_CONTRIBUTORS = frozenset(ops.GRADIENT_CONTRIBUTORS)
# Which reduction each kind of stage takes, for messages.
_REDUCTION_OF = {True: ops.SHARDED_REDUCTION_OPS[0], False: ops.REPLICATED_REDUCTION_OPS[0]}
# Every op of a stage's group, which a program that places no stage on one may not hold.
_GROUP_OPS = frozenset(ops.SUBSTEP_OPS + ops.STAGE_EXCHANGE_OPS + ops.RESHARD_OPS + ops.SHARD_REPLICA_OPS)
_op_of = operator.itemgetter(1)


def check_sharding(program: Program) -> None:
    """Walk every member's list (module docstring).

    Raises:
        RouteError: a compute of a sharded stage on its shard alone; a RESHARD of weights not whole.
        WellFormedError: a GATHER, RESHARD or reduction on a stage that cannot take it, a gather of weights
            already whole, whole weights left at the end, a member that reduces a stage's gradient never
            or twice.
        ConflictError: a gradient contribution after its stage's reduction.
        MatchError: a reduction never waited.
    """
    for rank, row in enumerate(program.ranks):
        member = _Member(program, rank)
        for step, action in enumerate(row):
            member.visit(step, action)
        member.finish(row)


def check_no_group_ops(program: Program) -> None:
    """A program that places no stage on a group holds none of a group's ops (a gather, a reshard, a
    gradient reduction over a stage's group): they would meet on, or drop, what no stage has.

    Raises:
        WellFormedError: at the first such instruction (or the instruction holding it).
    """
    # The common case is settled by set work over the instructions' ops (a twentieth of check_all on a large
    # pipeline); only a program holding such an op is walked again to locate it.
    held = {part.op for action in chain.from_iterable(program.ranks) if action.parts for part in action.parts}
    if _GROUP_OPS.isdisjoint(held) and _GROUP_OPS.isdisjoint(map(_op_of, chain.from_iterable(program.ranks))):
        return
    for rank, row in enumerate(program.ranks):
        for step, action in enumerate(row):
            found = next((a for a in (action,) + action.parts if a.op in _GROUP_OPS), None)
            if found is not None:
                raise WellFormedError(f"{action.text()}: {found.op} belongs to a stage placed on a group of ranks, "
                                      "and this program places none", rank, step, program.grid())


def _stage_text(program: Program, stage: int) -> str:
    info = program.stages[stage]
    kind = ("hybrid sharded" if info.placement.hybrid else "sharded") if info.placement.sharded else "replicated"
    return f"stage {stage} ({kind} on ranks {', '.join(map(str, info.ranks))})"


class _Member:
    """One rank's walk: which of its sharded stages are whole, and its reductions."""

    def __init__(self, program: Program, rank: int):
        self.program, self.rank = program, rank
        self.whole: dict[int, int] = {}      # sharded stage -> the step whose GATHER made it whole
        self.dropped: dict[int, int] = {}    # sharded stage -> the step of the RESHARD that last dropped it
        self.reduced: dict[int, tuple[int, Action]] = {}   # stage -> (step, EXCHANGE) of its reduction
        self.synced: dict[int, tuple[int, Action]] = {}    # HSDP stage -> (step, EXCHANGE) of its shard's all-reduce
        self.unwaited: dict[int, list[tuple[int, Action, int, str]]] = {}  # exchange number -> (step, EXCHANGE,
        # stage, part op) of each reduction it holds
        self.last_contribution: dict[int, int] = {}        # stage -> step of its last B or W here

    def error(self, cls, message: str, step: int | None, marks=()):
        return cls(message, self.rank, step, self.program.grid(), [(self.rank, s) for s in marks])

    def stage_on_group(self, step: int, action: Action, what: str) -> int:
        """``action``'s stage, which must exist and be placed on a group."""
        stage, stages = action.stage, self.program.stages
        if not 0 <= stage < len(stages):
            raise self.error(WellFormedError, f"{action.text()}: there is no stage {stage} (stages "
                             f"0..{len(stages) - 1})", step)
        if stages[stage].placement is None:
            raise self.error(WellFormedError, f"{action.text()} {what}, but stage {stage} lives on rank "
                             f"{stages[stage].rank} alone, not on a group of ranks", step)
        return stage

    def visit(self, step: int, action: Action) -> None:
        category = ops.RULES[action.op].category if action.op in ops.RULES else None
        if category == ops.COMPUTE:
            self.compute(step, action)
        elif action.op in _RESHARDS:
            self.reshard(step, action)
        elif category == ops.EXCHANGE_OF:
            for part in action.parts:
                if part.op in _REDUCTIONS:
                    self.reduce(step, action, part)
                elif part.op in _SHARD_SYNCS:
                    self.sync_shard(step, action, part)
        elif category == ops.EXCHANGE_WAIT_OF:
            self.unwaited.pop(action.mb, None)

    def compute(self, step: int, action: Action) -> None:
        stage = action.stage
        for part in action.parts:
            if part.op in _GATHERS:
                self.gather(step, action)
        if self.program.stages[stage].placement is None:
            return
        if action.op in _CONTRIBUTORS:
            if stage in self.reduced:
                reduced_at, exchange = self.reduced[stage]
                raise self.error(ConflictError, f"{action.text()} adds to stage {stage}'s weight gradient after "
                                 f"{exchange.text()} (step {reduced_at}) reduced it over the group: this "
                                 "contribution misses the sum (a reduction comes after the stage's last backward)",
                                 step, [reduced_at])
            self.last_contribution[stage] = step
        if action.op in _ON_WEIGHTS and self.program.stages[stage].placement.sharded and stage not in self.whole:
            if stage in self.dropped:
                why = (f"its whole weights were dropped by {stage}{ops.RESHARD_OPS[0]} (step "
                       f"{self.dropped[stage]}) and not gathered since")
            else:
                why = "no gather has made its weights whole on this rank"
            raise self.error(RouteError, f"{action.text()} runs stage {stage} on its shard alone: {why} (a "
                             f"{ops.GATHER_OPS[0]} in this compute or an earlier one of the stage makes them whole)",
                             step, [self.dropped[stage]] if stage in self.dropped else [])

    def gather(self, step: int, action: Action) -> None:
        stage = action.stage  # the placement checks proved the sub-step names its compute's stage, on a group
        if not self.program.stages[stage].placement.sharded:
            raise self.error(WellFormedError, f"{action.text()} gathers the weights of "
                             f"{_stage_text(self.program, stage)}: a replicated stage holds them whole on every "
                             "member, only a sharded one gathers", step)
        if stage in self.whole:
            raise self.error(WellFormedError, f"{action.text()} gathers stage {stage}'s weights, which are whole "
                             f"here since step {self.whole[stage]}: a second copy would be gathered for nothing "
                             f"(a {ops.RESHARD_OPS[0]} drops the first)", step, [self.whole[stage]])
        self.whole[stage] = step

    def reshard(self, step: int, action: Action) -> None:
        stage = self.stage_on_group(step, action, "drops whole weights")
        if not self.program.stages[stage].placement.sharded:
            raise self.error(WellFormedError, f"{action.text()} drops the whole weights of "
                             f"{_stage_text(self.program, stage)}: a replicated stage keeps them", step)
        if stage not in self.whole:
            why = (f"{action.text()} (step {self.dropped[stage]}) dropped them already" if stage in self.dropped
                   else "no gather has made them whole on this rank")
            raise self.error(RouteError, f"{action.text()} drops stage {stage}'s whole weights, which are not whole "
                             f"here: {why}", step, [self.dropped[stage]] if stage in self.dropped else [])
        del self.whole[stage]
        self.dropped[stage] = step

    def reduce(self, step: int, exchange: Action, part: Action) -> None:
        stage = self.stage_on_group(step, part, "reduces a weight gradient over its stage's group")
        sharded = self.program.stages[stage].placement.sharded
        if (part.op in _SHARDED_REDUCTIONS) != sharded:
            raise self.error(WellFormedError, f"{exchange.text()} reduces the weight gradient of "
                             f"{_stage_text(self.program, stage)} with {part.op}: a "
                             f"{'sharded' if sharded else 'replicated'} stage's is reduced by "
                             f"{_REDUCTION_OF[sharded]}", step)
        if stage in self.reduced:
            first = self.reduced[stage][0]
            raise self.error(WellFormedError, f"{exchange.text()} reduces stage {stage}'s weight gradient a second "
                             f"time on rank {self.rank} (first at step {first}): each member reduces it once",
                             step, [first])
        self.reduced[stage] = (step, exchange)
        self.unwaited.setdefault(exchange.mb, []).append((step, exchange, stage, part.op))

    def sync_shard(self, step: int, exchange: Action, part: Action) -> None:
        stage = self.stage_on_group(step, part, "all-reduces a shard's gradient over the members holding it")
        if not self.program.stages[stage].placement.hybrid:
            raise self.error(WellFormedError, f"{exchange.text()} all-reduces a shard of "
                             f"{_stage_text(self.program, stage)} over the members holding it: only a hybrid "
                             "sharded stage (HSDP) replicates its shards", step)
        if stage in self.synced:
            first = self.synced[stage][0]
            raise self.error(WellFormedError, f"{exchange.text()} all-reduces stage {stage}'s shard gradient a "
                             f"second time on rank {self.rank} (first at step {first}): each member does it once",
                             step, [first])
        if stage not in self.reduced:
            raise self.error(ConflictError, f"{exchange.text()} all-reduces stage {stage}'s shard gradient over "
                             f"its replica group before any {_REDUCTION_OF[True]} on rank {self.rank} made it: the "
                             "shard's all-reduce follows the reduce-scatter", step)
        reduced_at, reduction = self.reduced[stage]
        if reduction.mb in self.unwaited:
            raise self.error(ConflictError, f"{exchange.text()} all-reduces stage {stage}'s shard gradient before "
                             f"{ops.EXCHANGE_WAIT}{reduction.mb} waited for {reduction.text()} (step {reduced_at}): "
                             "it would sum a shard still being reduce-scattered (wait for the reduce-scatter first)",
                             step, [reduced_at])
        self.synced[stage] = (step, exchange)
        self.unwaited.setdefault(exchange.mb, []).append((step, exchange, stage, part.op))

    def finish(self, row: list[Action]) -> None:
        program = self.program
        if self.whole:
            stage, gathered = next(iter(self.whole.items()))
            raise self.error(WellFormedError, f"stage {stage}'s whole weights, gathered at step {gathered}, are "
                             f"still held when rank {self.rank}'s list ends: the optimizer steps on the shards, "
                             f"so the whole copy would be stale (a {ops.RESHARD_OPS[0]} after the stage's last "
                             "compute drops it)", gathered)
        if self.unwaited:
            number, held = next(iter(self.unwaited.items()))
            step, exchange, stage, op = held[0]
            what = ("all-reduces stage {}'s shard gradient" if op in _SHARD_SYNCS
                    else "reduces stage {}'s weight gradient")
            raise self.error(MatchError, f"{exchange.text()} {what.format(stage)}, but rank "
                             f"{self.rank} never waits for it ({ops.EXCHANGE_WAIT}{number}) before its list ends: "
                             "the optimizer would step on a gradient still being reduced", step)
        reduced = first_answer(families_of(program), lambda family: family.reduced_stages(program))
        for info in program.stages:
            if info.placement is None or self.rank not in info.ranks or info.id in self.reduced \
                    or (reduced is not None and info.id not in reduced):
                continue
            last = self.last_contribution.get(info.id)
            after = (f"after its last gradient contribution here, {row[last].text()} (step {last})"
                     if last is not None else "after its last backward")
            reduction = f"({info.id}{_REDUCTION_OF[info.placement.sharded]})EXCHANGE"
            raise self.error(WellFormedError, f"rank {self.rank} never reduces the weight gradient of "
                             f"{_stage_text(program, info.id)}: its members would step on different "
                             f"gradients (a {reduction} belongs {after})", last)
        for info in program.stages:
            if info.placement is None or not info.placement.hybrid or self.rank not in info.ranks \
                    or info.id in self.synced:
                continue
            step, exchange = self.reduced[info.id]
            raise self.error(WellFormedError, f"rank {self.rank} never all-reduces its shard of the weight gradient "
                             f"of {_stage_text(program, info.id)} over the members holding that shard: they would "
                             f"step on different gradients (a ({info.id}{ops.SHARD_REPLICA_OPS[0]})EXCHANGE belongs "
                             f"after {ops.EXCHANGE_WAIT}{exchange.mb})", step)
