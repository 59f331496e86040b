"""Discrete-event simulation of a Program: makespan, bubble, memory, timeline.

Semantics (what the runtime does, priced by a ``CostModel``):

* Each rank runs its list in order. A compute task (F, B, I, W) starts when
  the rank is free and its inputs are on the rank, and holds the rank for
  ``costs.compute(op, chunk)``.
* Inputs follow the activation-passing dataflow of ``ir.py``: F(s, m) needs
  the activation of F(prev(s), m); B(s, m) or I(s, m) needs F(s, m) and the
  gradient of B or I of next(s) for m; W(s, m) needs I(s, m). A producer on the
  same rank hands off locally, at its end time.
* Across ranks, a program without communication instructions gets the data at
  producer end + ``costs.transfer``. A program with them gets it from the RECV
  that carries it: the k-th SEND from rank a to rank b matches the k-th RECV on
  b from a (messages are untagged, FIFO per ordered pair), and the data is on b
  at the time the sender posted its SEND plus the transfer time. Sends and
  receives are posted asynchronously (isend/irecv): neither waits for its peer;
  the compute that uses the data waits for it. A BATCH posts all its parts at
  once. Posting holds the rank ``costs.post`` per message (0 by default), not
  counted as busy; a send leaves when its batch is posted.
* ALLREDUCE_GRAD joins the gradient all-reduce of its stage's model chunk
  without stalling; the all-reduce ends ``costs.allreduce`` after the last
  replica joined. ALLREDUCE_WAIT stalls the rank until it ends. FREE_F is free.

Because a rank never waits for anything but data and all-reduces, the timing is
a longest-path computation over the program's dependency graph; the simulator
evaluates it with a worklist: a rank runs until an input is missing, parks on
that input, and is woken by whoever produces it. Each instruction is executed
once, so the cost is linear in the number of instructions. A rank parked on an
input that is never produced is reported as a DeadlockError (a safety net; the
deadlock check proves programs safe under stricter semantics).

peak_activations counts, along a rank's list, the forwards whose B (or I) has
not run yet; peak_waiting_w the I whose W has not (split backward).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from operator import itemgetter
from typing import NamedTuple, Union

from pipec.compiler.checks.memory import peak_waiting_w
from pipec.compiler.costs import CostModel
from pipec.compiler.gc_pause import paused_gc
from pipec.compiler.ir import (
    ALLREDUCE_GRAD,
    ALLREDUCE_WAIT,
    BATCH,
    COMM_OPS,
    FREE_F,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Program,
)
from pipec.errors import DeadlockError, MatchError, WellFormedError

Number = Union[int, float]
# A bubble fraction with a larger denominator is shown as a decimal only (float
# costs give exact but meaningless ones, like 7130774469997077/21935682705033476).
_EXACT_DENOMINATOR_LIMIT = 10_000


class Slot(NamedTuple):
    """One interval on a rank's timeline.

    Attributes:
        start, end: simulated times.
        action: the instruction (a compute action, or the RECV / ALLREDUCE_GRAD
            a communication slot belongs to).
        is_comm: True for a message in flight to this rank or an all-reduce it
            is part of; these overlap compute slots (they do not hold the rank).
    """

    start: Number
    end: Number
    action: Action
    is_comm: bool = False


@dataclass
class RankStats:
    """Per-rank totals: compute time, time without compute, peak live activations,
    and (split backward) the most weight gradients waiting at once: an I done
    whose W is not, each holding what its W will read."""

    busy: Number
    idle: Number
    peak_activations: int
    peak_waiting_w: int = 0


@dataclass
class SimResult:
    """The outcome of ``simulate``.

    Attributes:
        makespan: end of the last instruction (or all-reduce) on any rank.
        bubble_ratio: 1 - mean busy / makespan (0 for an empty program).
        ranks: per-rank totals.
        timeline: per rank, its slots sorted by start: one per compute action,
            plus communication slots (``is_comm``) where messages or all-reduces
            take time.
    """

    makespan: Number
    bubble_ratio: float
    ranks: list[RankStats]
    timeline: list[list[Slot]]

    def bubble_fraction(self) -> Fraction:
        """The bubble ratio as an exact fraction of the simulated totals.

        Exact (e.g. 3/11) when every cost is an integer; with float costs it is
        the exact ratio of the floating-point totals.
        """
        total = Fraction(self.makespan) * len(self.ranks)
        if total == 0:
            return Fraction(0)
        busy = sum((Fraction(rank.busy) for rank in self.ranks), Fraction(0))
        return 1 - busy / total

    def bubble_text(self) -> str:
        """The bubble ratio for people: ``3/11 = 0.2727`` when it is a small exact fraction, else ``0.2727``."""
        fraction = self.bubble_fraction()
        if fraction.denominator <= _EXACT_DENOMINATOR_LIMIT and fraction != int(fraction):
            return f"{fraction} = {float(fraction):.4f}"
        return f"{self.bubble_ratio:.4f}"

    def to_json(self) -> dict:
        """{"makespan", "bubble_ratio", "ranks": [{"busy", "idle", "peak_activations", "peak_waiting_w"}]} as plain numbers."""
        return {
            "makespan": _plain(self.makespan),
            "bubble_ratio": float(self.bubble_ratio),
            "ranks": [
                {"busy": _plain(rank.busy), "idle": _plain(rank.idle), "peak_activations": int(rank.peak_activations),
                 "peak_waiting_w": int(rank.peak_waiting_w)}
                for rank in self.ranks
            ],
        }


def _plain(value: Number) -> Number:
    return value if isinstance(value, int) else float(value)


# Key spaces of the simulator's ``ready`` table: the time a value is available,
# indexed by space * (stages * microbatches) + stage * microbatches + mb.
_FWD, _BWD, _WGT, _ACT_IN, _GRAD_IN = range(5)
# After them: one key per model chunk for the end of its gradient all-reduce.
_ALLREDUCE = 5

# Compute op -> (space it publishes its end time in, change of the live
# activation count, the inputs it waits for). "activation" comes from the
# previous stage, "gradient" from the next one (none at a pipeline's ends);
# "own F" / "own B or I" are this stage's earlier tasks for the same microbatch.
_COMPUTE_RULES = {
    "F": (_FWD, +1, ("activation",)),
    "B": (_BWD, -1, ("own F", "gradient")),
    "I": (_BWD, -1, ("own F", "gradient")),
    "W": (_WGT, 0, ("own B or I",)),
}
# Marks an op that is not a SEND/RECV where only those may stand.
_NOT_A_MESSAGE = object()
# Message kinds, indexed in a channel's transfer times.
_KINDS = ("act", "grad")
_ACT, _GRAD = range(2)
# Communication op -> (is a send, space of the tensor it carries, whose tensor
# it is relative to the action's stage, space a receive publishes the arrival
# in, message kind). A RECV names its consumer stage (torch's convention), so
# the tensor it carries is its neighbour's.
_COMM_RULES = {
    SEND_F: (True, _FWD, "self", None, _ACT),
    SEND_B: (True, _BWD, "self", None, _GRAD),
    RECV_F: (False, _FWD, "prev", _ACT_IN, _ACT),
    RECV_B: (False, _BWD, "next", _GRAD_IN, _GRAD),
}


def simulate(program: Program, costs: CostModel | None = None) -> SimResult:
    """Simulate ``program`` under ``costs`` (unit costs when None).

    Args:
        program: a compute-only program, or one with communication instructions
            (SEND/RECV/BATCH, ALLREDUCE_GRAD/WAIT, FREE_F).
        costs: the cost model.
    Returns:
        makespan, bubble ratio, per-rank stats and the timeline.
    Raises:
        WellFormedError: an unknown op, or a stage/microbatch/peer out of range.
        MatchError: a RECV matched (FIFO) to a SEND of another tensor.
        DeadlockError: a rank waits for an input that never arrives.
    """
    with paused_gc():
        return _Simulation(program, costs or CostModel.unit()).run()


class _Simulation:
    """State of one simulation; ``run`` drives the worklist."""

    def __init__(self, program: Program, costs: CostModel):
        self.program = program
        self.costs = costs
        self.num_ranks = len(program.ranks)
        self.num_stages = len(program.stages)
        self.num_mbs = program.num_microbatches
        # key arithmetic needs a non-zero stride even for an empty program
        self.stride = max(self.num_mbs, 1)
        self.space = self.num_stages * self.stride
        self.devices = program.devices or list(range(self.num_ranks))
        self.has_comms = _has_comms(program)
        self.ready: list = [None] * (_ALLREDUCE * self.space + max(program.num_chunks, 1))
        self.waiters: dict[int, list[int]] = {}
        self.work: list[int] = list(reversed(range(self.num_ranks)))
        # per-rank progress, saved whenever a rank parks
        self.pc = [0] * self.num_ranks
        self.clock: list[Number] = [0] * self.num_ranks
        self.busy: list[Number] = [0] * self.num_ranks
        self.live = [0] * self.num_ranks
        self.peak = [0] * self.num_ranks
        self.parked_on = [-1] * self.num_ranks
        self.slots: list[list[Slot]] = [[] for _ in range(self.num_ranks)]
        self.comm_slots: list[list[Slot]] = [[] for _ in range(self.num_ranks)]
        # channels[src][dst]: the FIFO channel from src to dst, opened on first use
        self.channels: list[list[tuple | None]] = [[None] * self.num_ranks for _ in range(self.num_ranks)]
        self.allreduce_joined: dict[int, list[tuple[Number, int, Action]]] = {}
        self.allreduce_stages: set[int] = set()
        self.compute_plan = self._plan_compute()
        self.comm_plan = self._plan_comms()
        # what the first pass of posting needs: send op -> per stage the key base
        # of the tensor it sends (None: no neighbour); receive op -> None
        self.sent_tensors = {
            op: [None if message is None else message[1] for message in row] if _COMM_RULES[op][0] else None
            for op, row in self.comm_plan.items()
        }
        # the rare ops drain does not handle inline:
        # op -> handler(rank, step, action, clock) -> new clock, or None when parked
        self.handlers = {ALLREDUCE_GRAD: self.join_allreduce, ALLREDUCE_WAIT: self.wait_allreduce}

    # -- plans -------------------------------------------------------------------

    def _plan_compute(self) -> dict[str, list[tuple]]:
        """op -> per stage (duration, ((input key base, delay), ...), output key base, activation delta).

        The key of an input or output for microbatch m is its base + m.
        """
        program, costs, n, space = self.program, self.costs, self.stride, self.space
        plan: dict[str, list[tuple]] = {op: [] for op in _COMPUTE_RULES}
        for stage in program.stages:
            s = stage.id
            inputs = {
                "activation": self._input(s, program.prev_stage(s), _FWD, _ACT_IN, "act"),
                "gradient": self._input(s, program.next_stage(s), _BWD, _GRAD_IN, "grad"),
                "own F": ((_FWD * space + s * n, 0),),
                "own B or I": ((_BWD * space + s * n, 0),),
            }
            for op, (out_space, delta, needs) in _COMPUTE_RULES.items():
                waits = sum((inputs[name] for name in needs), ())
                plan[op].append((costs.compute(op, stage.chunk), waits, out_space * space + s * n, delta))
        return plan

    def _plan_comms(self) -> dict[str, list[tuple | None]]:
        """op -> per stage (is send, tensor key base, arrival key base, kind), or None where
        the stage has no neighbour to exchange with. Keys for microbatch m are base + m."""
        program, n, space = self.program, self.stride, self.space
        neighbours = {"self": lambda s: s, "prev": program.prev_stage, "next": program.next_stage}
        plan: dict[str, list[tuple | None]] = {}
        for op, (is_send, tensor_space, whose, arrival_space, kind) in _COMM_RULES.items():
            row: list[tuple | None] = []
            for stage in range(self.num_stages):
                producer = neighbours[whose](stage)
                arrival = -1 if arrival_space is None else arrival_space * space + stage * n
                row.append(None if producer < 0 else (is_send, tensor_space * space + producer * n, arrival, kind))
            plan[op] = row
        return plan

    def _input(self, stage: int, producer: int, produced_in: int, arrives_in: int, kind: str) -> tuple:
        """The (key base, delay) a task of ``stage`` waits on for data made by ``producer``'s stage."""
        program, n, space = self.program, self.stride, self.space
        if producer < 0:
            return ()
        source, target = program.rank_of(producer), program.rank_of(stage)
        if source == target:
            return ((produced_in * space + producer * n, 0),)
        if self.has_comms:
            return ((arrives_in * space + stage * n, 0),)
        delay = self.costs.transfer(self.devices[source], self.devices[target], kind)
        return ((produced_in * space + producer * n, delay),)

    # -- driver ------------------------------------------------------------------

    def run(self) -> SimResult:
        self.drain()
        stuck = [r for r in range(self.num_ranks) if self.pc[r] < len(self.program.ranks[r])]
        if stuck:
            self._report_stuck(stuck)
        return self._result()

    def park(self, rank: int, key: int) -> None:
        """Make ``rank`` wait until ``key`` is published."""
        self.parked_on[rank] = key
        waiting = self.waiters.get(key)
        if waiting is None:
            self.waiters[key] = [rank]
        else:
            waiting.append(rank)

    def publish(self, key: int, time: Number) -> None:
        """Record that ``key`` is available at ``time`` and wake its waiters."""
        self.ready[key] = time
        waiting = self.waiters.pop(key, None)
        if waiting:
            self.work.extend(waiting)

    def drain(self) -> None:
        """Run ranks off the worklist, each from where it stopped until it parks
        or finishes, until no rank can move.

        One loop serves every rank: a rank parks and resumes every few
        instructions, so resuming must cost little. Compute tasks, messages and
        FREE_F (nearly every instruction) are handled inline; the rare
        all-reduce ops go through ``handlers``.
        """
        ready, waiters, work = self.ready, self.waiters, self.work
        compute_plan, comm_plan, handlers = self.compute_plan, self.comm_plan, self.handlers
        sent_tensors = self.sent_tensors
        post = self.costs.post
        channels, ranks, all_slots = self.channels, self.program.ranks, self.slots
        # per rank: what a resume needs that never changes, and its progress
        fixed = [(row, len(row), channels[r], all_slots[r].append) for r, row in enumerate(ranks)]
        progress = list(zip(self.pc, self.clock, self.busy, self.live, self.peak))
        parked_ons = self.parked_on
        comm_slots = self.comm_slots
        new_tuple = tuple.__new__
        num_stages, num_mbs, num_ranks = self.num_stages, self.num_mbs, self.num_ranks
        while work:
            r = work.pop()
            row, end_of_row, outgoing, slots_append = fixed[r]
            pc, clock, busy, live, peak = progress[r]
            parked_on = -1
            while pc < end_of_row:
                action = row[pc]
                stage, op, mb, _, parts = action
                plan = compute_plan.get(op)
                if plan is not None:
                    if not (0 <= stage < num_stages and 0 <= mb < num_mbs):
                        raise self._error(WellFormedError, f"{action.text()}: stage or microbatch out of range", r, pc)
                    duration, inputs, out, delta = plan[stage]
                    start = clock
                    for base, delay in inputs:
                        arrival = ready[base + mb]
                        if arrival is None:
                            parked_on = base + mb
                            break
                        arrival += delay
                        if arrival > start:
                            start = arrival
                    if parked_on >= 0:
                        break
                    clock = start + duration
                    key = out + mb
                    ready[key] = clock
                    if key in waiters:
                        work.extend(waiters.pop(key))
                    slots_append(new_tuple(Slot, (start, clock, action, False)))
                    busy += duration
                    live += delta
                    if live > peak:
                        peak = live
                    pc += 1
                    continue
                # A single SEND/RECV posts exactly like a one-part BATCH: all
                # parts or none, each at ``clock``; the rank goes on.
                if op == BATCH:
                    group = parts
                elif op == FREE_F:  # memory bookkeeping only; it takes no time
                    pc += 1
                    continue
                elif op in comm_plan:
                    group = (action,)
                else:
                    handler = handlers.get(op)
                    if handler is None:
                        raise self._error(WellFormedError, f"unknown instruction {action.text()}", r, pc)
                    next_clock = handler(r, pc, action, clock)
                    if next_clock is None:  # the handler parked the rank
                        break
                    clock = next_clock
                    pc += 1
                    continue
                # Posting is all or none, in two passes (the order of checks
                # decides which error a program with several faults gets).
                # First pass: every part is a message, and every tensor sent is
                # produced (by this rank, earlier in its list) or the rank parks.
                if not group:
                    raise self._error(WellFormedError, f"{action.text()} posts nothing", r, pc)
                for part in group:
                    bases = sent_tensors.get(part[1], _NOT_A_MESSAGE)
                    if bases is None:  # a receive: it never waits
                        continue
                    if bases is _NOT_A_MESSAGE:
                        raise self._malformed(part, r, pc)
                    p_stage, _, p_mb, p_peer, _ = part
                    if 0 <= p_stage < num_stages and 0 <= p_mb < num_mbs:
                        base = bases[p_stage]
                        if base is not None and ready[base + p_mb] is None:
                            if op != BATCH and (not 0 <= p_peer < num_ranks or p_peer == r):
                                raise self._malformed(part, r, pc)  # a lone send is checked in full first
                            parked_on = base + p_mb
                            break
                if parked_on >= 0:
                    break
                if post:  # the rank posts every part; the sends leave when it is done
                    clock += post * len(group)
                # Second pass: check each part in full, then post it; a part
                # that finds its counterpart waiting in the channel delivers.
                for part in group:
                    p_stage, p_op, p_mb, p_peer, _ = part
                    if not (0 <= p_stage < num_stages and 0 <= p_mb < num_mbs and 0 <= p_peer < num_ranks) or p_peer == r:
                        raise self._malformed(part, r, pc)
                    message = comm_plan[p_op][p_stage]
                    if message is None:
                        raise self._malformed(part, r, pc)
                    is_send, tensor_base, arrival_base, kind = message
                    if is_send:
                        sends, receives, transfer = outgoing[p_peer] or self._channel(r, p_peer)
                        produced = ready[tensor_base + p_mb]
                        sent = (tensor_base + p_mb, produced if produced > clock else clock, r, pc)
                        if not receives:
                            sends.append(sent)
                            continue
                        posted = receives.popleft()
                    else:
                        sends, receives, transfer = channels[p_peer][r] or self._channel(p_peer, r)
                        posted = (tensor_base + p_mb, arrival_base + p_mb, r, pc, part)
                        if not sends:
                            receives.append(posted)
                            continue
                        sent = sends.popleft()
                    # sent: (tensor, time, rank, step); posted: (tensor, arrival key, rank, step, part)
                    if sent[0] != posted[0]:
                        raise self._mismatch(sent, posted)
                    sent_at, delay = sent[1], transfer[kind]
                    arrival = sent_at + delay
                    if delay:
                        comm_slots[posted[2]].append(new_tuple(Slot, (sent_at, arrival, posted[4], True)))
                    key = posted[1]
                    ready[key] = arrival
                    if key in waiters:
                        work.extend(waiters.pop(key))
                pc += 1
            if parked_on >= 0:  # wait until parked_on is published
                parked_ons[r] = parked_on
                waiters.setdefault(parked_on, []).append(r)
            progress[r] = (pc, clock, busy, live, peak)
        # hand the progress back to the per-rank lists that results and reports read
        for r, state in enumerate(progress):
            self.pc[r], self.clock[r], self.busy[r], self.live[r], self.peak[r] = state

    def _malformed(self, part: Action, rank: int, step: int) -> WellFormedError:
        """The error for a message (or batch part) of ``rank`` that cannot be posted."""
        stage, op, mb, peer, _ = part
        if op not in self.comm_plan:
            problem = " cannot be part of a batch"
        elif not (0 <= stage < self.num_stages and 0 <= mb < self.num_mbs and 0 <= peer < self.num_ranks) or peer == rank:
            problem = ": stage, microbatch or peer out of range"
        else:
            problem = f": stage {stage} has no neighbour to exchange with"
        return self._error(WellFormedError, part.text() + problem, rank, step)

    def _channel(self, src: int, dst: int) -> tuple[deque, deque, tuple]:
        """Open the channel from ``src`` to ``dst``: (unmatched sends, unmatched receives,
        transfer time by kind). Channels live in ``self.channels[src][dst]``."""
        a, b = self.devices[src], self.devices[dst]
        channel = (deque(), deque(), tuple(self.costs.transfer(a, b, kind) for kind in _KINDS))
        self.channels[src][dst] = channel
        return channel

    def _mismatch(self, sent: tuple, posted: tuple) -> MatchError:
        """The error for a receive matched (FIFO) with a send of another tensor."""
        tensor, _, src, src_step = sent
        expected, _, dst, dst_step, part = posted
        return MatchError(
            f"{part.text()} expects {self._describe_tensor(expected)} but the matching send "
            f"(rank {src}, step {src_step}) carries {self._describe_tensor(tensor)}",
            rank=dst, step=dst_step, grid=self.program.grid(), marks=[(src, src_step)],
        )

    def join_allreduce(self, rank: int, step: int, action: Action, clock: Number) -> Number:
        """ALLREDUCE_GRAD: join the all-reduce of this stage's chunk; it ends once every replica joined."""
        stage = self._stage_of(rank, step, action)
        if stage in self.allreduce_stages:
            raise self._error(WellFormedError, f"stage {stage} starts its gradient all-reduce twice", rank, step)
        self.allreduce_stages.add(stage)
        chunk = self.program.stages[stage].chunk
        joined = self.allreduce_joined.setdefault(chunk, [])
        joined.append((clock, rank, action))
        members = len(self.program.replicas(stage))
        if len(joined) == members:
            start = max(time for time, _, _ in joined)
            end = start + self.costs.allreduce(members, chunk)
            if end > start:
                for _, member, member_action in joined:
                    self.comm_slots[member].append(Slot(start, end, member_action, True))
            self.publish(_ALLREDUCE * self.space + chunk, end)
        return clock

    def wait_allreduce(self, rank: int, step: int, action: Action, clock: Number) -> Number | None:
        """ALLREDUCE_WAIT: stall until the all-reduce of this stage's chunk has ended."""
        stage = self._stage_of(rank, step, action)
        key = _ALLREDUCE * self.space + self.program.stages[stage].chunk
        end = self.ready[key]
        if end is None:
            self.park(rank, key)
            return None
        return max(clock, end)

    def _stage_of(self, rank: int, step: int, action: Action) -> int:
        if not 0 <= action.stage < self.num_stages:
            raise self._error(WellFormedError, f"{action.text()}: stage out of range", rank, step)
        return action.stage

    # -- results and reports -------------------------------------------------------

    def _result(self) -> SimResult:
        allreduce_ends = [t for t in self.ready[_ALLREDUCE * self.space:] if t is not None]
        makespan = max(self.clock + allreduce_ends, default=0)
        ranks = [RankStats(busy, makespan - busy, peak, peak_waiting_w(row))
                 for busy, peak, row in zip(self.busy, self.peak, self.program.ranks)]
        bubble = 1 - sum(self.busy) / (makespan * self.num_ranks) if makespan else 0.0
        timeline = []
        for compute, comms in zip(self.slots, self.comm_slots):
            # compute slots are already in start order; sorting is needed only to merge comms in
            timeline.append(sorted(compute + comms, key=itemgetter(0)) if comms else compute)
        return SimResult(makespan, float(bubble), ranks, timeline)

    def _error(self, kind: type, message: str, rank: int, step: int) -> Exception:
        return kind(message, rank=rank, step=step, grid=self.program.grid())

    def _describe_tensor(self, key: int) -> str:
        space, rest = divmod(key, self.space)
        stage, mb = divmod(rest, self.stride)
        what = {_FWD: f"the activation of {stage}F{mb}", _BWD: f"the gradient of {stage}B{mb} (or {stage}I{mb})"}
        return what.get(space, f"value {key}")

    def _describe_wait(self, key: int) -> str:
        if key >= _ALLREDUCE * self.space:
            return f"the gradient all-reduce of chunk {key - _ALLREDUCE * self.space}, which not every replica joins"
        space, rest = divmod(key, self.space)
        stage, mb = divmod(rest, self.stride)
        waits = {
            _FWD: f"the output of {stage}F{mb}, which never runs before it is needed",
            _BWD: f"the output of {stage}B{mb} (or {stage}I{mb}), which never runs before it is needed",
            _WGT: f"the output of {stage}W{mb}",
            _ACT_IN: f"the activation for {stage}F{mb}, which no matched RECV_F/SEND_F pair delivers",
            _GRAD_IN: f"the gradient for {stage}B{mb}, which no matched RECV_B/SEND_B pair delivers",
        }
        return waits[space]

    def _report_stuck(self, stuck: list[int]) -> None:
        first = stuck[0]
        waits = self._describe_wait(self.parked_on[first])
        others = [(r, self.pc[r]) for r in stuck[1:]]
        raise DeadlockError(
            f"simulation stuck: waits for {waits} ({len(stuck)} rank(s) stuck)",
            rank=first, step=self.pc[first], grid=self.program.grid(), marks=others,
            cycle=[(r, self.pc[r], self._describe_wait(self.parked_on[r])) for r in stuck],
        )


def _has_comms(program: Program) -> bool:
    """Whether any rank's list holds a send, receive or batch (data then travels only by them)."""
    comm_ops = set(COMM_OPS) | {BATCH}
    op_of = itemgetter(1)
    return any(not comm_ops.isdisjoint(map(op_of, row)) for row in program.ranks)

