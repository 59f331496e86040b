"""A timeline ``Drawing`` as a standalone SVG file (template ``timeline.svg.j2``).

One lane per rank, time on the x axis, one ``<rect class="box OP sSHADE">`` per
compute slot carrying its exact simulated (or measured) ``data-start`` and
``data-end``, its ``data-op``, ``data-stage`` and ``data-mb``; idle time shows
as the hatched lane background. Labels (``F3``, ``F3c1``) are written only in
boxes wide enough for them, so a 131k-box timeline stays a plain, scalable
picture. Panels share one pixel width: a measured panel above the prediction
is stretched to it, so the two line up from start to end.

The per-box work is one tuple of preformatted numbers; the template's loops
write the markup.
"""
from __future__ import annotations

from pipec.compiler.render import style
from pipec.compiler.render._templates import render
from pipec.compiler.render.model import Drawing, Timeline, format_time

# The shortest op gets this many pixels, room for its label ...
SHORTEST_BOX_PX = 34
# ... unless the plot would then be wider than this ...
MAX_PLOT_PX = 1800
# ... and then never fewer than this, so that every box stays visible.
MIN_SHORTEST_BOX_PX = 3
LEGEND_HEIGHT = 36


def timeline_svg(drawing: Drawing) -> str:
    """Args: drawing: the panels to draw (``make_drawing``).
    Returns: the SVG document text."""
    layout = style.LAYOUT
    plot = plot_width(drawing.panels[-1])
    top = layout["top"]
    panels = []
    for panel in drawing.panels:
        panels.append(_panel_context(panel, drawing, top, plot))
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
        has_comms=has_comms,
        shades=style.SHADES,
        idle_fill=style.IDLE_FILL,
        idle_hatch=style.IDLE_HATCH,
        comm_fill=style.COMM_FILL,
        text_color=style.TEXT_COLOR,
        predicted=drawing.panels[-1],
    )


def plot_width(panel: Timeline) -> float:
    """The pixel width of the time axis for ``panel`` (see the constants above).

    Returns:
        at least 1; the shortest box is ``SHORTEST_BOX_PX`` wide when the plot
        stays within ``MAX_PLOT_PX``, else at least ``MIN_SHORTEST_BOX_PX``.
    """
    shortest = min((end - start for lane in panel.boxes for start, end, _, _ in lane if end > start), default=0)
    if not shortest or not panel.makespan:
        return float(MAX_PLOT_PX)
    natural = panel.makespan * SHORTEST_BOX_PX / shortest
    if natural <= MAX_PLOT_PX:
        return float(max(natural, 1.0))
    return float(max(MAX_PLOT_PX, panel.makespan * MIN_SHORTEST_BOX_PX / shortest))


def _panel_height(panel: Timeline) -> float:
    layout = style.LAYOUT
    return layout["panel_head"] + len(panel.boxes) * (layout["lane_height"] + layout["lane_gap"]) + layout["panel_gap"]


def _panel_context(panel: Timeline, drawing: Drawing, top: float, plot: float) -> dict:
    """What the template needs for one panel: positions preformatted, one tuple per box."""
    layout = style.LAYOUT
    left = layout["left"]
    scale = plot / panel.makespan if panel.makespan else 0.0
    step = style.tick_step(panel.makespan, plot) if panel.makespan else 1
    count = int(panel.makespan / step * (1 + 1e-9)) + 1
    ticks = [(f"{left + i * step * scale:.2f}", format_time(round(i * step, 9))) for i in range(count)]
    pitch = layout["lane_height"] + layout["lane_gap"]
    lanes = [
        {
            "y": layout["panel_head"] + rank * pitch,
            "label": f"rank {rank}",
            "note": panel.notes[rank],
            "boxes": _box_rows(lane, left, scale, drawing),
            "comms": [(f"{left + start * scale:.2f}", f"{max((end - start) * scale, 0.5):.2f}", start, end, action.text())
                      for start, end, action, _ in panel.comms[rank]],
        }
        for rank, lane in enumerate(panel.boxes)
    ]
    return {"top": f"{top:.0f}", "title": panel.title, "kind": panel.kind, "ticks": ticks,
            "axis_name": f"time ({panel.unit})" if panel.unit else "time", "lanes": lanes}


def _box_rows(lane, left: float, scale: float, drawing: Drawing) -> list[tuple]:
    """(op, shade, x, width, start, end, stage, mb, label or "", label x) per compute slot."""
    shades, chunk_of, show_chunk = style.SHADES, drawing.stage_chunk, drawing.show_chunk
    label_of, fits = style.box_label, style.label_fits
    rows = []
    for start, end, action, _ in lane:
        stage, op, mb = action[0], action[1], action[2]
        x, width = left + start * scale, (end - start) * scale
        label = label_of(op, mb, chunk_of[stage], show_chunk)
        rows.append((op, mb % shades, f"{x:.2f}", f"{width:.2f}", start, end, stage, mb,
                     label if fits(label, width) else "", f"{x + width / 2:.2f}"))
    return rows
