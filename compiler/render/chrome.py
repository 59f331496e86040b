"""A simulated timeline as a Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev).

The same event shape as the trace ``pipec run --trace`` writes
(``pipec.runtime.trace``): complete events (``"ph": "X"``), ``pid`` = rank,
``name`` = the instruction's text, ``cat`` "compute" with ``args.index`` (its
place in the rank's list), op, stage, chunk and mb. So ``pipec render --trace``
reads a predicted trace as readily as a measured one, and the two open side by
side in Perfetto. Communication slots go on a second track (``tid`` 1) because
they overlap the compute.

One simulated cost unit is written as ``US_PER_UNIT`` microseconds (1 ms), so
unit costs read as whole milliseconds.
"""
from __future__ import annotations

from pipec.compiler.emit.text_grid import rank_labels
from pipec.compiler.ir import COMPUTE_OPS, LABEL_SCHEME, Program
from pipec.compiler.simulate import SimResult

US_PER_UNIT = 1000
_COMPUTE_TRACK, _COMM_TRACK = 0, 1


def chrome_trace(result: SimResult, program: Program) -> dict:
    """The trace document of a simulation.

    Args:
        result: ``simulate(program)``.
        program: the program simulated.
    Returns:
        {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {schedule,
        params, makespan, bubble_ratio, time_unit}}, ready for ``json.dump``.
    """
    events = []
    labels = rank_labels(program)
    for rank, lane in enumerate(result.timeline):
        events += _metadata(rank, labels[rank])
        # a rank runs its list in order, so its compute slots follow its compute instructions
        indices = iter([index for index, action in enumerate(program.ranks[rank]) if action[1] in COMPUTE_OPS])
        for start, end, action, is_comm in lane:
            event = {"name": action.text(), "ph": "X", "pid": rank, "ts": start * US_PER_UNIT,
                     "dur": (end - start) * US_PER_UNIT}
            if is_comm:
                event.update(cat="comm", tid=_COMM_TRACK, args={"op": action.op})
            else:
                stage = action.stage
                event.update(cat="compute", tid=_COMPUTE_TRACK, args={
                    "index": next(indices), "op": action.op, "stage": stage,
                    "chunk": program.stages[stage].chunk, "mb": action.mb})
            events.append(event)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": program.name,
            "params": dict(program.params),
            "makespan": result.makespan,
            "bubble_ratio": result.bubble_ratio,
            "time_unit": f"one simulated cost unit = {US_PER_UNIT} us",
            "source": "pipec simulator",
            "labels": LABEL_SCHEME,
        },
    }


def _metadata(rank: int, label: str) -> list[dict]:
    """Name the rank's process (``label``: ``rank 2``, on a mesh ``rank 2: pp 1, dp 0``) and its two
    tracks, and keep ranks in order."""
    def meta(name: str, tid: int, args: dict) -> dict:
        return {"name": name, "ph": "M", "pid": rank, "tid": tid, "args": args}

    return [
        meta("process_name", _COMPUTE_TRACK, {"name": label}),
        meta("process_sort_index", _COMPUTE_TRACK, {"sort_index": rank}),
        meta("thread_name", _COMPUTE_TRACK, {"name": "compute"}),
        meta("thread_name", _COMM_TRACK, {"name": "communication"}),
    ]
