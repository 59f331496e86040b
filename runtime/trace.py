"""Instruction timings as a Chrome / Perfetto trace.

The interpreter records ``(index, start, end, waited)`` per instruction in
``perf_counter`` seconds. ``chrome_events`` turns one rank's records into the
trace-event format's complete events (``"ph": "X"``, microseconds from a common
``t0`` taken right after a barrier, ``pid`` = rank, ``tid`` = 0, ``name`` = the
instruction's text). A compute that waited for its inputs gets a nested
``wait`` slice over its first ``waited`` seconds, so the compute's own time is
the rest (``args.compute_us``). A record may name the call it ran in (a
sequence ring runs its list once per attention call: ``attention 3's
forward``), kept as ``args.call``. ``write_chrome_trace`` writes every rank's events as one
``{"traceEvents": [...]}`` file that chrome://tracing and ui.perfetto.dev open.
"""
from __future__ import annotations

import json
from typing import Iterable, Sequence

from pipec.compiler import ops
from pipec.compiler.spread import usable_cores
from pipec.compiler.atomic_write import atomic_writer
from pipec.compiler.ir import LABEL_SCHEME, Action

# Trace category of each op (its rule's ``trace``: compute, comm or memory):
# the viewers colour and filter by it.
_CATEGORY = {op: rule.trace for op, rule in ops.RULES.items()}
ops.declare_pass("runtime trace", _CATEGORY)
OPTIMIZER_NAME = "optimizer step"


def chrome_events(
    rank: int,
    row: Sequence[Action],
    steps: Iterable[Sequence[tuple]],
    t0: float,
) -> list[dict]:
    """One rank's trace events.

    Args:
        rank: the rank (the trace's pid).
        row: the rank's instruction list; index ``len(row)`` is the optimizer step.
        steps: per training step, its (index, start, end, waited) records, each optionally followed
            by the call it ran in (a ring's ``attention 3's forward``).
        t0: the common origin, perf_counter seconds.
    Returns:
        complete events with name, cat, ph, pid, tid, ts, dur (microseconds) and
        args {step (from 1), index, op, wait_us, compute_us, and call when the record names one}; after a compute
        that waited, its nested "wait" event (cat "wait").
    """
    names = [action.text() for action in row] + [OPTIMIZER_NAME]
    ops = [action.op for action in row] + ["OPTIMIZER"]
    out = []
    for iteration, records in enumerate(steps, start=1):
        for record in records:
            index, start, end, waited = record[:4]
            op = ops[index]
            category = _CATEGORY.get(op, "other")
            ts = round((start - t0) * 1e6, 3)
            args = {"step": iteration, "index": index, "op": op, "wait_us": round(waited * 1e6, 3),
                    "compute_us": round((end - start - waited) * 1e6, 3)}
            if len(record) > 4:
                args["call"] = record[4]
            out.append({"name": names[index], "cat": category, "ph": "X", "pid": rank, "tid": 0,
                        "ts": ts, "dur": round((end - start) * 1e6, 3), "args": args})
            if waited > 0 and category == "compute":
                out.append({"name": "wait", "cat": "wait", "ph": "X", "pid": rank, "tid": 0, "ts": ts,
                            "dur": round(waited * 1e6, 3), "args": {"step": iteration, "index": index}})
    return out


def rank_metadata(num_ranks: int) -> list[dict]:
    """Metadata events naming each pid "rank R" and keeping them in rank order."""
    out = []
    for rank in range(num_ranks):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    return out


def write_chrome_trace(path: str, per_rank: Sequence[list[dict]], metadata: dict | None = None) -> None:
    """Write every rank's events as one Chrome trace JSON file.

    Args:
        path: the file to write.
        per_rank: each rank's events from ``chrome_events``, in rank order.
        metadata: optional top-level "otherData" (schedule, parameters, ...); ``cores``
            (``compiler.spread.usable_cores``) is added to it.
    Raises:
        UsageError: the file cannot be written (``compiler.atomic_write``).
    """
    events = rank_metadata(len(per_rank))
    for rank_events in per_rank:
        events.extend(rank_events)
    document = {"traceEvents": events, "displayTimeUnit": "ms"}
    # the cores the writing rank could use: `pipec costs` warns when the ranks outnumbered them
    document["otherData"] = {**(metadata or {}), "cores": usable_cores(), "labels": LABEL_SCHEME}
    with atomic_writer(path, what="the trace") as handle:  # whole or not at all: the old trace stays until then
        json.dump(document, handle, separators=(",", ":"))


__all__ = ["OPTIMIZER_NAME", "chrome_events", "rank_metadata", "write_chrome_trace"]
