"""Drawings of schedules: timelines (SVG, HTML, Chrome trace) and task graphs (DOT, PNG).

The file suffix picks the form:

* ``.svg``: a timeline, one lane per rank, a box per compute instruction at its
  simulated start and end, idle time hatched (``svg``);
* ``.html``: the same timeline as a self-contained page with hover tips, zoom
  and a legend, drawn on a canvas (``html``);
* ``.json``: the simulated timeline as a Chrome / Perfetto trace (``chrome``);
* ``.dot`` / ``.png``: the task dependency graph, ranks as clusters, a
  deadlock's wait-for cycle in red (``graph``).

A timeline may carry a measured run (``timeline_from_trace`` of a
``pipec run --trace`` file) drawn above the prediction.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from pipec.compiler.atomic_write import write_atomically
from pipec.compiler.gc_pause import paused_gc
from pipec.compiler.ir import Program
from pipec.compiler.render.chrome import chrome_trace
from pipec.compiler.render.graph import task_graph_dot, task_graph_png
from pipec.compiler.render.html import timeline_html
from pipec.compiler.render.model import Drawing, Timeline, make_drawing, timeline_from_simulation, timeline_from_trace
from pipec.compiler.render.svg import timeline_svg
from pipec.compiler.simulate import SimResult
from pipec.errors import UsageError

# suffix -> drawing -> text
TIMELINE_FORMS: dict[str, Callable[[Drawing], str]] = {".svg": timeline_svg, ".html": timeline_html}
# the simulated trace, which has no measured panel
TRACE_FORM = ".json"
GRAPH_FORMS = (".dot", ".png")
FORMS = (*TIMELINE_FORMS, TRACE_FORM, *GRAPH_FORMS)


def form_of(path: str) -> str:
    """The form a file name asks for.

    Returns:
        its suffix, lower case, one of ``FORMS``.
    Raises:
        UsageError: any other suffix.
    """
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMS:
        raise UsageError(f"cannot tell what to draw from '{path}': use a file ending in {', '.join(FORMS)}")
    return suffix


def write_timeline(
    result: SimResult, program: Program, path: str, *, measured: Timeline | None = None, unit: str = ""
) -> None:
    """Write the timeline of a simulated program; the suffix of ``path`` picks SVG, HTML or Chrome trace JSON.

    Args:
        result: ``simulate(program)``.
        program: the program simulated.
        path: where to write; ends in .svg, .html or .json.
        measured: a measured run of ``program`` to draw above the prediction
            (``timeline_from_trace``); SVG and HTML only.
        unit: the cost model's time unit ("" for abstract units), for the axis.
    Raises:
        UsageError: another suffix, a measured run with .json, or a file that cannot be written.
    """
    form = form_of(path)
    if form == TRACE_FORM and measured is not None:
        raise UsageError("a .json timeline is the simulated trace alone; write .svg or .html to compare with a run")
    if form != TRACE_FORM and form not in TIMELINE_FORMS:
        raise UsageError(f"'{path}' is not a timeline form: use .svg, .html or .json")
    with paused_gc():  # a few hundred thousand small objects, no cycles
        if form == TRACE_FORM:
            text = json.dumps(chrome_trace(result, program), separators=(",", ":"), default=float)  # exact Fraction times
        else:
            text = TIMELINE_FORMS[form](make_drawing(result, program, measured, unit))
    _write(path, text)


def write_graph(program: Program, path: str, *, cycle: Sequence[tuple[int, int, str]] = ()) -> None:
    """Write the task dependency graph of ``program``; the suffix picks DOT text or a PNG picture.

    Args:
        program: the program (it need not pass the checks).
        path: where to write; ends in .dot or .png.
        cycle: a ``DeadlockError.cycle`` to draw in red.
    Raises:
        UsageError: another suffix, a PNG without Graphviz's ``dot``, or a file that cannot be written.
    """
    draw = {".dot": task_graph_dot, ".png": task_graph_png}.get(form_of(path))
    if draw is None:
        raise UsageError(f"'{path}' is not a graph form: use .dot or .png")
    with paused_gc():
        content = draw(program, cycle)
    _write(path, content)


def _write(path: str, content: str | bytes) -> None:
    """Replace ``path`` with ``content`` atomically (``compiler.atomic_write``), so a failed write leaves the old file."""
    write_atomically(path, content)


__all__ = [
    "FORMS",
    "GRAPH_FORMS",
    "TIMELINE_FORMS",
    "Drawing",
    "Timeline",
    "chrome_trace",
    "form_of",
    "make_drawing",
    "task_graph_dot",
    "task_graph_png",
    "timeline_from_simulation",
    "timeline_from_trace",
    "timeline_html",
    "timeline_svg",
    "write_graph",
    "write_timeline",
]
