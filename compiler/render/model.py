"""What a timeline drawing shows, whatever its file format.

A ``Drawing`` is a heading and one or more ``Timeline`` panels: the prediction
alone, or a measured run above the prediction. A panel keeps the simulator's
own ``Slot`` tuples as its boxes, without a copy per box (a 64-rank,
512-microbatch interleaved schedule has 131k of them): per rank, the compute
slots in start order, and apart from them the communication slots. A measured
panel builds the same ``Slot`` tuples from the Chrome trace that
``pipec run --trace`` writes (``pipec.runtime.trace``), so every format draws
prediction and measurement with the same code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipec.compiler.emit.text_grid import rank_labels
from pipec.compiler.gc_pause import paused_gc
from pipec.compiler.ir import Program
from pipec.compiler.render import style
from pipec.compiler.simulate import Number, SimResult, Slot
from pipec.compiler.trace_events import compute_events, event_action, event_number, event_step
from pipec.errors import UsageError

# The measured panel's time unit: trace events are in microseconds.
_MEASURED_UNIT, _US_PER_MEASURED_UNIT = "ms", 1000.0


@dataclass
class Timeline:
    """One panel of a timeline drawing.

    Attributes:
        title: e.g. "predicted: makespan 33, bubble ratio 3/11 = 0.2727".
        makespan: time from 0 to the last box's end.
        bubble_ratio: 1 - mean busy time / makespan.
        boxes: per rank, its compute slots in start order (they do not overlap).
        comms: per rank, its communication slots (messages in flight, all-reduces).
        notes: per rank, a short summary shown at the lane's end.
        unit: the time unit of the axis ("" for the simulator's cost units).
        kind: "predicted" or "measured".
    """

    title: str
    makespan: Number
    bubble_ratio: float
    boxes: list[list[Slot]]
    comms: list[list[Slot]]
    notes: list[str]
    unit: str = ""
    kind: str = "predicted"


@dataclass
class Drawing:
    """Everything a timeline file shows.

    Attributes:
        heading: schedule, parameters, makespan and bubble ratio (measured and
            predicted when a run is drawn).
        panels: measured first (when there is one), then the prediction.
        stage_chunk: stage id -> model chunk, for labels and tips.
        show_chunk: whether a rank holds several stages (tips name the chunk; labels are ir.LABEL_SCHEME's).
        lane_labels: per rank, its lane's label: ``rank 2``, or on a mesh ``rank 2: pp 1, dp 0``
            (``emit.text_grid.rank_labels``).
        layout: ``style.LAYOUT``, its left margin widened to hold the longest lane label (``style.layout_for``).
    """

    heading: str
    panels: list[Timeline]
    stage_chunk: list[int]
    show_chunk: bool
    lane_labels: list[str] = field(default_factory=list)
    layout: dict = field(default_factory=lambda: style.LAYOUT)

    def label(self, rank: int) -> str:
        """The label of ``rank``'s lane."""
        return self.lane_labels[rank] if rank < len(self.lane_labels) else f"rank {rank}"

    def ops_present(self) -> set[str]:
        """The compute ops drawn (for the legend)."""
        return {slot[2][1] for panel in self.panels for lane in panel.boxes for slot in lane}


def make_drawing(result: SimResult, program: Program, measured: Timeline | None = None, unit: str = "") -> Drawing:
    """The drawing of a simulated program, with a measured run above it when given.

    Args:
        result: ``simulate(program)``.
        program: the program simulated.
        measured: ``timeline_from_trace`` of a run of the same program, or None.
        unit: the time unit of ``result``'s costs ("" for abstract units).
    Returns:
        the ``Drawing``; its heading carries the makespan and bubble ratio:
        with a measured run, the measured one first, then the prediction.
    """
    predicted = timeline_from_simulation(result, unit)
    heading = f"{program.name} ({format_params(program.params)}): "
    if measured is None:
        heading += f"makespan {format_time(result.makespan, unit)}, bubble ratio {result.bubble_text()}"
    else:  # the run is what happened; the prediction is what it is held to
        heading += (f"measured {format_time(measured.makespan, measured.unit)}, predicted "
                    f"{format_time(result.makespan, unit)} (bubble ratio measured {measured.bubble_ratio:.4f}, "
                    f"predicted {result.bubble_text()})")
    panels = [measured, predicted] if measured is not None else [predicted]
    stage_chunk = [stage.chunk for stage in program.stages]
    labels = rank_labels(program)
    return Drawing(heading, panels, stage_chunk, len(program.stages) > program.num_ranks, labels,
                   style.layout_for(labels))


def timeline_from_simulation(result: SimResult, unit: str = "") -> Timeline:
    """The predicted panel.

    Args:
        result: a simulation.
        unit: the time unit of its costs ("" for abstract units).
    Returns:
        a ``Timeline`` whose boxes are ``result``'s compute slots themselves.
    """
    boxes, comms = [], []
    for lane in result.timeline:
        has_comms = any(slot[3] for slot in lane)
        # without communication slots the simulator's list is the compute list: no copy
        boxes.append([slot for slot in lane if not slot[3]] if has_comms else lane)
        comms.append([slot for slot in lane if slot[3]] if has_comms else [])
    notes = [_note(stats.busy, result.makespan, stats.peak_activations) for stats in result.ranks]
    title = f"predicted (simulator): makespan {format_time(result.makespan, unit)}, bubble ratio {result.bubble_text()}"
    return Timeline(title, result.makespan, result.bubble_ratio, boxes, comms, notes, unit)


def timeline_from_trace(document: Any, program: Program, step: int | None = None, name: str = "trace") -> Timeline:
    """The measured panel: one training step of a Chrome trace of a run of ``program``.

    Reads the complete events of category "compute" (``pipec.runtime.trace``):
    ``pid`` is the rank, ``args.index`` the instruction's place in its list,
    ``args.step`` the training step (1 when absent), ``args.wait_us`` the time
    the instruction waited for its inputs before computing. A box spans the
    compute itself, from ``ts + wait_us`` to ``ts + dur``, so a wait shows as
    idle time. Times are shifted so that the step's first box starts at 0, in ms.

    Args:
        document: the parsed JSON file.
        program: the program that ran (to name and place each event).
        step: the training step to draw; the last one when None.
        name: how to call the trace in the panel's title.
    Returns:
        the measured ``Timeline``.
    Raises:
        UsageError: not a Chrome trace, no such step, or an event that does not
            match ``program`` (a trace of another schedule or other parameters).
    """
    with paused_gc():  # one tuple per event, no cycles
        return _measured_timeline(compute_events(document), program, step, name)


def _measured_timeline(events: list[dict], program: Program, step: int | None, name: str) -> Timeline:
    steps = sorted({event_step(event) for event in events})
    if not steps:
        raise UsageError(f"{name} holds no compute events (is it a `pipec run --trace` file?)")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise UsageError(f"{name} has no step {chosen} (it has steps {steps[0]}..{steps[-1]})")
    lanes: list[list[tuple]] = [[] for _ in range(program.num_ranks)]
    for event in events:
        if event_step(event) == chosen:
            rank, action = event_action(event, program, name)
            start = float(event["ts"])
            end = start + max(float(event["dur"]), 0.0)
            lanes[rank].append((min(start + max(event_number(event, "wait_us"), 0.0), end), end, action))
    origin = min(start for lane in lanes for start, _, _ in lane)
    scale = 1.0 / _US_PER_MEASURED_UNIT
    boxes = [
        sorted((Slot((start - origin) * scale, (end - origin) * scale, action, False) for start, end, action in lane),
               key=lambda slot: slot[0])
        for lane in lanes
    ]
    makespan = max((lane[-1][1] for lane in boxes if lane), default=0.0)
    busy = [sum(end - start for start, end, _, _ in lane) for lane in boxes]
    bubble = 1 - sum(busy) / (makespan * len(boxes)) if makespan else 0.0
    notes = [_note(rank_busy, makespan, None) for rank_busy in busy]
    title = (f"measured ({name}, step {chosen}): makespan {format_time(makespan, _MEASURED_UNIT)}, "
             f"bubble ratio {bubble:.4f}")
    return Timeline(title, makespan, bubble, boxes, [[] for _ in boxes], notes, _MEASURED_UNIT, "measured")


# --------------------------------------------------------------------- wording


def format_params(params: dict) -> str:
    """Returns: ``P=4, N=8, remat=false`` (a bool as the language writes it)."""
    from pipec.compiler.defines import params_text

    return params_text(params)


def format_time(value: Number, unit: str = "") -> str:
    """Returns: an integer as it is, any other number with 4 significant digits; then the unit."""
    text = str(int(value)) if float(value).is_integer() else f"{value:.4g}"
    return f"{text} {unit}" if unit else text


def _note(busy: Number, makespan: Number, peak: int | None) -> str:
    share = f"busy {busy / makespan:.0%}" if makespan else "busy 0%"
    return share if peak is None else f"{share}, peak {peak} act."
