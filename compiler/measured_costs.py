"""A cost file measured by a run: per model chunk, the median time of each compute op.

``pipec run --trace`` records, for every instruction of every step, how long
it computed (``args.compute_us``, its time after waiting for its inputs). The
cost file the simulator reads (``costs``) prices each compute op per model
chunk, so the measured times give one directly: the median of each (chunk, op)
over the run's steps, leaving out the first step when there are more (it pays
for warming up: allocator, autograd, first messages). The file's default for
an op is its median over all chunks, so another schedule with the same chunks
is priced by this run too. A run with split backward measures I and W; its B
is then I + W (what a whole backward does, see ``runtime.split_backward``), so
that a schedule without the split is priced too. (The other way round the cost
file's own rule applies: I and W default to half of B.) A run with
recomputed stages measures their FC and R; where it ran no plain F, its F is
R's time (R is F's computation again, with autograd recording as F's does:
``ops.CHECKPOINTS``), so that a schedule without recomputation is priced too.
(The other way round the cost file's own rule applies: FC and R default to F.)

Posting a message (an isend or irecv, each part of a batch) holds the rank;
its median time per message is the file's ``links.post``. How long a message
then travels is not measured: on a machine where ranks share cores it cannot
be told apart from the time its reader spent waiting for a slower rank, so
latency and bandwidth stay free (the unit model's zero), to be added by hand.

Times are milliseconds.
"""
from __future__ import annotations

from collections import defaultdict
from statistics import median
from typing import Any, NamedTuple

from pipec.compiler.costs import SPLITS, costs_from_json
from pipec.compiler.ir import Program
from pipec.compiler.ops import CHECKPOINTS, COMPUTE_OPS, POSTING_OPS
from pipec.compiler.spread import Spread
from pipec.compiler.trace_events import compute_events, event_action, event_number, event_step, events_of
from pipec.errors import UsageError

# Instructions that post messages (all-reduces are not priced per message):
# sends, receives and batches, whose parts (``Action.comms``) are the messages.
_POSTING = frozenset(POSTING_OPS)
UNIT = "ms"
_US_PER_UNIT = 1000.0
_DIGITS = 4  # decimals kept, in ms: 0.1 microsecond


class MeasuredCosts(NamedTuple):
    """What ``measure_costs`` found.

    Attributes:
        data: the cost file (a JSON value ``costs.costs_from_json`` accepts).
        samples: (chunk, op) -> how many tasks the median is over; a B made
            of I + W has none.
        messages: how many posted messages ``links.post`` is the median over (0: none, no links section).
        steps: the training steps measured.
        spreads: (chunk, op) -> the spread of its tasks' times, ms (``compiler.spread``).
    """

    data: dict[str, Any]
    samples: dict[tuple[int, str], int]
    messages: int
    steps: list[int]
    spreads: dict[tuple[int, str], Spread]


def measure_costs(document: Any, program: Program, name: str = "trace") -> MeasuredCosts:
    """The cost file of a run of ``program``.

    Args:
        document: the parsed trace (``pipec run --trace``).
        program: the program that ran (each event is checked against it).
        name: how to call the trace in errors.
    Raises:
        UsageError: no compute events, or events of another program.
        CostFileError: a measured time past a cost file's limits (``guarded_read.cost_number_problem``).
    """
    events = compute_events(document)
    steps = sorted({event_step(event) for event in events})
    if not steps:
        raise UsageError(f"{name} holds no compute events (is it a `pipec run --trace` file?)")
    measured = steps[1:] or steps
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    for event in events:
        if event_step(event) not in measured:
            continue
        _, action = event_action(event, program, name)
        times[program.stages[action.stage].chunk, action.op].append(_compute_us(event))
    by_op: dict[str, list[float]] = defaultdict(list)
    for (_, op), values in times.items():
        by_op[op] += values
    compute: dict[str, Any] = _completed({op: _ms(median(by_op[op])) for op in COMPUTE_OPS if op in by_op})
    per_chunk: dict[str, dict[str, float]] = {}
    for chunk, op in sorted(times):
        per_chunk.setdefault(str(chunk), {})[op] = _ms(median(times[chunk, op]))
    compute["per_chunk"] = {chunk: _completed(ops) for chunk, ops in per_chunk.items()}
    samples = {key: len(values) for key, values in sorted(times.items())}
    data: dict[str, Any] = {"compute": compute}
    posts = _posting_times(document, program, name, measured)
    if posts:
        data["links"] = {"post": _ms(median(posts))}
    # what `pipec costs` writes, `--costs` must read: a trace's times past the cost file's limits (a
    # hostile or broken trace) are named here, at their key, rather than written
    costs_from_json(data, f"the costs measured from {name}")
    spreads = {key: Spread(*(value / _US_PER_UNIT for value in Spread.of(values))) for key, values in times.items()}
    return MeasuredCosts(data, samples, len(posts), measured, spreads)


def _posting_times(document: Any, program: Program, name: str, measured: list[int]) -> list[float]:
    """Microseconds per message posted, one entry per message (a batch's time split over its parts)."""
    out = []
    for event in events_of(document, "comm"):
        if event_step(event) in measured:
            _, action = event_action(event, program, name)
            if action.op in _POSTING:
                parts = len(action.comms())
                out += [max(float(event["dur"]), 0.0) / parts] * parts
    return out


def _completed(ops: dict[str, float]) -> dict[str, float]:
    """``ops`` with B = I + W (``costs.SPLITS``) when it has I and W but no B, and F = R
    (``ops.CHECKPOINTS``) when it has R but no F, in the table's order (F B I W FC R)."""
    for whole, parts in SPLITS.items():
        if whole not in ops and all(part in ops for part in parts):
            ops = {**ops, whole: round(sum(ops[part] for part in parts), _DIGITS)}
    for plain, (_keeping, remaking) in CHECKPOINTS.items():
        if plain not in ops and remaking in ops:
            ops = {**ops, plain: ops[remaking]}
    return {op: ops[op] for op in COMPUTE_OPS if op in ops}


def _compute_us(event: dict) -> float:
    """The event's own compute time: ``compute_us``, or its duration less its wait for traces without it."""
    own = event_number(event, "compute_us", float(event["dur"]) - event_number(event, "wait_us"))
    return max(own, 0.0)


def _ms(microseconds: float) -> float:
    return round(microseconds / _US_PER_UNIT, _DIGITS)


__all__ = ["UNIT", "MeasuredCosts", "measure_costs"]
