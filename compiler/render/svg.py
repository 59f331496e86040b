"""A timeline ``Drawing`` as a standalone SVG file (template ``timeline.svg.j2``).

One lane per rank, time on the x axis, one ``<rect class="box OP sSHADE">`` per
compute slot carrying its exact simulated (or measured) ``data-start`` and
``data-end``, its ``data-op``, ``data-stage`` and ``data-mb``; idle time shows
as the hatched lane background. Labels (``F3``, ``F3c1``) are written only in
boxes wide enough for them. Panels share one time axis: the longer of a
measured run and its prediction sets the scale, so equal times line up.

The file is bounded whatever the costs: the plot is at most ``MAX_PLOT_PX``
wide (so a box 10^7 times shorter than another cannot ask for a plot 10^7
boxes wide), boxes narrower than a pixel are merged with their neighbours into
one ``<rect class="run OP ...">`` (coloured by the op that fills most of it,
``data-count`` boxes from ``data-start`` to ``data-end``), and if the drawing
would still hold more than ``MAX_ELEMENTS`` boxes and message bars, the width
below which boxes merge doubles until it does not: at most about
``MAX_ELEMENTS`` x 260 bytes, under 7 MB. Every box keeps its exact data in
the HTML and JSON forms.

The per-box work is one tuple of preformatted numbers; the template's loops
write the markup.
"""
from __future__ import annotations

from operator import itemgetter

from pipec.compiler.ir import LABEL_SCHEME
from pipec.compiler.render import style
from pipec.compiler.render._templates import render
from pipec.compiler.render.model import Drawing, Timeline, format_time

# The shortest op gets this many pixels, room for its label ...
SHORTEST_BOX_PX = 34
# ... unless the plot would then be wider than this ...
WIDE_PLOT_PX = 1800
# ... and then never fewer than this, so that every box stays visible ...
MIN_SHORTEST_BOX_PX = 3
# ... but the plot is never wider than this: shorter boxes merge (see above).
MAX_PLOT_PX = 10_000
# The most box and message-bar elements a drawing holds (the file's size bound).
MAX_ELEMENTS = 25_000
LEGEND_HEIGHT = 52  # two lines: the colours, then the label scheme
# A slot's start (comms are not kept in start order).
_start = itemgetter(0)


def timeline_svg(drawing: Drawing) -> str:
    """Args: drawing: the panels to draw (``make_drawing``).
    Returns: the SVG document text."""
    layout = drawing.layout
    span = time_span(drawing)
    plot = plot_width(drawing)
    scale = plot / span if span else 0.0
    merge_px = merge_width(drawing, scale)
    top = layout["top"]
    panels = []
    for panel in drawing.panels:
        panels.append(_panel_context(panel, drawing, top, plot, span, merge_px))
        top += _panel_height(panel)
    width = layout["left"] + plot + layout["right"]
    legend = style.legend(drawing.ops_present())
    has_comms = any(lane for panel in drawing.panels for lane in panel.comms)
    return render(
        "timeline.svg.j2",
        heading=drawing.heading,
        width=f"{width:.0f}",
        height=f"{top + LEGEND_HEIGHT:.0f}",
        legend_y=top + 8,
        panels=panels,
        plot=f"{plot:.2f}",
        layout=layout,
        palette=style.palette(),
        legend=legend,
        label_scheme=LABEL_SCHEME,
        has_comms=has_comms,
        shades=style.SHADES,
        idle_fill=style.IDLE_FILL,
        idle_hatch=style.IDLE_HATCH,
        comm_fill=style.COMM_FILL,
        text_color=style.TEXT_COLOR,
        predicted=drawing.panels[-1],
    )


def time_span(drawing: Drawing) -> float:
    """The time the shared axis covers: the longest panel's makespan."""
    return max((panel.makespan for panel in drawing.panels), default=0)


def plot_width(drawing: Drawing) -> float:
    """The pixel width of the shared time axis (see the constants above).

    Returns:
        at least 1 and at most ``MAX_PLOT_PX``; the shortest box of any panel
        is ``SHORTEST_BOX_PX`` wide when the plot stays within
        ``WIDE_PLOT_PX``, else at least ``MIN_SHORTEST_BOX_PX`` unless that
        would pass ``MAX_PLOT_PX``.
    """
    span = time_span(drawing)
    shortest = min((end - start for panel in drawing.panels for lane in panel.boxes
                    for start, end, _, _ in lane if end > start), default=0)
    if not shortest or not span:
        return float(WIDE_PLOT_PX)
    natural = span * SHORTEST_BOX_PX / shortest
    if natural <= WIDE_PLOT_PX:
        return float(max(natural, 1.0))
    return float(min(max(WIDE_PLOT_PX, span * MIN_SHORTEST_BOX_PX / shortest), MAX_PLOT_PX))


def merge_width(drawing: Drawing, scale: float) -> float:
    """The width in pixels below which boxes (and message bars) merge into runs.

    One pixel, doubled until the drawing holds at most ``MAX_ELEMENTS`` elements.
    """
    lanes = [lane for panel in drawing.panels for lane in panel.boxes]
    lanes += [sorted(lane, key=_start) for panel in drawing.panels for lane in panel.comms if lane]
    merge_px = 1.0
    while sum(_count_runs(lane, scale, merge_px) for lane in lanes) > MAX_ELEMENTS:
        merge_px *= 2
    return merge_px


def _count_runs(lane, scale: float, merge_px: float) -> int:
    """How many elements ``_runs`` would draw for ``lane`` (without building them)."""
    if len(lane) * 2 < MAX_ELEMENTS and merge_px <= 1.0 and all((end - start) * scale >= 1.0 for start, end, _, _ in lane):
        return len(lane)
    return sum(1 for _ in _runs(lane, scale, merge_px))


def _runs(lane, scale: float, merge_px: float):
    """Group a lane's slots (in start order) for drawing.

    Yields:
        lists of slots: one slot at least ``merge_px`` wide alone, or slots
        narrower than that, each joining the run before it while it starts
        less than ``merge_px`` after that run's start.
    """
    limit = merge_px / scale if scale else float("inf")
    run: list = []
    for slot in lane:
        start, end = slot[0], slot[1]
        if end - start >= limit:
            if run:
                yield run
                run = []
            yield [slot]
        elif run and start - run[0][0] < limit:
            run.append(slot)
        else:
            if run:
                yield run
            run = [slot]
    if run:
        yield run


def _panel_height(panel: Timeline) -> float:
    layout = style.LAYOUT
    return layout["panel_head"] + len(panel.boxes) * (layout["lane_height"] + layout["lane_gap"]) + layout["panel_gap"]


def _panel_context(panel: Timeline, drawing: Drawing, top: float, plot: float, span: float, merge_px: float) -> dict:
    """What the template needs for one panel: positions preformatted, one tuple per box or run."""
    layout = drawing.layout
    left = layout["left"]
    scale = plot / span if span else 0.0
    step = style.tick_step(span, plot) if span else 1
    count = int(span / step * (1 + 1e-9)) + 1
    ticks = [(f"{left + i * step * scale:.2f}", format_time(round(i * step, 9))) for i in range(count)]
    pitch = layout["lane_height"] + layout["lane_gap"]
    lanes = []
    for rank, lane in enumerate(panel.boxes):
        boxes, runs = _box_rows(lane, left, scale, merge_px, drawing)
        lanes.append({
            "y": layout["panel_head"] + rank * pitch,
            "label": drawing.label(rank),
            "note": panel.notes[rank],
            "boxes": boxes,
            "runs": runs,
            "comms": _comm_rows(sorted(panel.comms[rank], key=_start), left, scale, merge_px),
        })
    return {"top": f"{top:.0f}", "title": panel.title, "kind": panel.kind, "ticks": ticks,
            "axis_name": f"time ({panel.unit})" if panel.unit else "time", "lanes": lanes}


def _box_rows(lane, left: float, scale: float, merge_px: float, drawing: Drawing) -> tuple[list[tuple], list[tuple]]:
    """The boxes drawn alone and the merged runs of one lane.

    Returns:
        (boxes, runs): per box (op, shade, x, width, start, end, stage, mb,
        label or "", label x); per run (op filling most of it, shade, x,
        width, start, end, number of boxes).
    """
    shades = style.SHADES
    label_of, fits = style.box_label, style.label_fits
    rows, runs = [], []
    for group in _runs(lane, scale, merge_px):
        if len(group) > 1:
            runs.append(_run_row(group, left, scale))
            continue
        start, end, action, _ = group[0]
        stage, op, mb = action[0], action[1], action[2]
        # a box under half a pixel alone (no neighbour to merge with) is kept visible
        x, width = left + start * scale, max((end - start) * scale, 0.5)
        label = label_of(stage, op, mb)
        rows.append((op, mb % shades, f"{x:.2f}", f"{width:.2f}", start, end, stage, mb,
                     label if fits(label, width) else "", f"{x + width / 2:.2f}"))
    return rows, runs


def _run_row(group, left: float, scale: float) -> tuple:
    """(op, shade, x, width, start, end, count) of a run of merged boxes."""
    share: dict[str, float] = {}
    for start, end, action, _ in group:
        share[action[1]] = share.get(action[1], 0) + (end - start)
    op = max(share, key=share.__getitem__)
    start, end = group[0][0], max(slot[1] for slot in group)
    return (op, group[0][2][2] % style.SHADES, f"{left + start * scale:.2f}", f"{max((end - start) * scale, 0.5):.2f}",
            start, end, len(group))


def _comm_rows(lane, left: float, scale: float, merge_px: float) -> list[tuple]:
    """(x, width, start, end, text) per message bar, merged runs named by their count."""
    rows = []
    for group in _runs(lane, scale, merge_px):
        start, end = group[0][0], max(slot[1] for slot in group)
        text = group[0][2].text() if len(group) == 1 else f"{len(group)} messages or all-reduces"
        rows.append((f"{left + start * scale:.2f}", f"{max((end - start) * scale, 0.5):.2f}", start, end, text))
    return rows
