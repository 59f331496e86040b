"""A timeline ``Drawing`` as one self-contained HTML page (template ``timeline.html.j2``).

The page holds the boxes as JSON in ``<script type="application/json"
id="timeline-data">`` and a small script (``timeline_script.js.j2``) that draws
them on a canvas: a 131k-box timeline opens in a browser in about a second,
where as many SVG elements would crawl. Hovering a box shows its rank, op,
stage, chunk, microbatch, start and end (found by lane and binary search);
the wheel zooms in time and a drag pans. Nothing is loaded from the network.

Every panel shares one time axis (``span``, the longest panel's makespan), so
a measured run and its prediction line up time for time and zoom together.
The data, per panel: title, kind, unit, makespan, and per lane its label and
note, the columns start, end, op, stage, mb of its boxes (in start order), and
comms as [start, end, text]. Colours and geometry come from ``style``.
"""
from __future__ import annotations

import json

from pipec.compiler.ir import LABEL_SCHEME
from pipec.compiler.render import style
from pipec.compiler.render._templates import render
from pipec.compiler.render.model import Drawing, Timeline


def timeline_html(drawing: Drawing) -> str:
    """Args: drawing: the panels to draw (``make_drawing``).
    Returns: the HTML document text."""
    data = {
        "heading": drawing.heading,
        "palette": style.palette(),
        "shades": style.SHADES,
        "idle": style.IDLE_FILL,
        "comm": style.COMM_FILL,
        "chunk": drawing.stage_chunk,
        "show_chunk": drawing.show_chunk,
        "layout": drawing.layout,
        "panels": [_panel_data(panel, drawing) for panel in drawing.panels],
        # one time axis for every panel: the longest makespan sets its scale
        "span": max(panel.makespan for panel in drawing.panels),
    }
    # "</" would end the script element early; "<\/" is the same JSON string; exact (Fraction) times as floats
    data_json = json.dumps(data, separators=(",", ":"), allow_nan=False, default=float).replace("</", "<\\/")
    return render(
        "timeline.html.j2",
        heading=drawing.heading,
        data_json=data_json,
        legend=style.legend(drawing.ops_present()),
        label_scheme=LABEL_SCHEME,
        has_comms=any(lane for panel in drawing.panels for lane in panel.comms),
        shades=style.SHADES,
        idle_fill=style.IDLE_FILL,
        comm_fill=style.COMM_FILL,
    )


def _panel_data(panel: Timeline, drawing: Drawing) -> dict:
    lanes = []
    for rank, lane in enumerate(panel.boxes):
        actions = [slot[2] for slot in lane]
        lanes.append({
            "label": drawing.label(rank),
            "note": panel.notes[rank],
            "start": [slot[0] for slot in lane],
            "end": [slot[1] for slot in lane],
            "op": [action[1] for action in actions],
            "stage": [action[0] for action in actions],
            "mb": [action[2] for action in actions],
            "comms": [[start, end, action.text()] for start, end, action, _ in panel.comms[rank]],
        })
    return {"title": panel.title, "kind": panel.kind, "unit": panel.unit, "makespan": panel.makespan, "lanes": lanes}
