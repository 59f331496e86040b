"""Colours and labels shared by every drawing (SVG, HTML, DOT), so that one op
looks the same in each.

A compute box is coloured by its kind (hue) and shaded by its microbatch
(lightness, cycling every ``SHADES`` microbatches), so that one microbatch can
be followed across ranks and neighbouring microbatches stay distinguishable.
Every shade is light enough for black text. Other instructions are drawn by
their op's category, alike (a message or all-reduce bar in ``COMM_FILL``, a
free not at all), so only a compute op needs an entry here.
"""
from __future__ import annotations

import colorsys
from functools import lru_cache

from pipec.compiler import ops

# compute op -> (hue in degrees, words for the legend); presentation, so kept
# here, but every compute op of the rule table must have one (declared below).
KINDS = {
    ops.F: (214, "forward"),
    ops.B: (135, "backward"),
    ops.I: (30, "backward, input gradient"),
    ops.W: (282, "backward, weight gradient"),
    ops.FC: (248, "forward, keeping only its input (recomputed)"),
    ops.R: (54, "recompute (the forward again)"),
    ops.U: (0, "optimizer update of the stage's weights"),
    ops.AF: (186, "attention forward block"),
    ops.AB: (350, "attention backward block"),
    ops.TF: (160, "forward of a layer's tensor-parallel slices"),
    ops.TB: (95, "backward of a layer's tensor-parallel slices"),
}
# The compute ops with a colour, and every other op (drawn by its category).
ops.declare_pass("drawing style", [op for op in ops.COMPUTE_OPS if op in KINDS]
                 + [op for op in ops.OPS if op not in ops.COMPUTE_OPS])
# Lightness of the shades; microbatch m gets shade m % SHADES.
LIGHTNESS = (0.52, 0.60, 0.68, 0.76)
SHADES = len(LIGHTNESS)
SATURATION = 0.62

IDLE_FILL = "#f1f1f1"      # a lane where the rank computes nothing: a bubble
IDLE_HATCH = "#dddddd"
COMM_FILL = "#7f7f7f"      # a message in flight to the rank, or an all-reduce
CYCLE_COLOR = "#d62728"    # a deadlock's wait-for cycle
CYCLE_FILL = "#ffd6d6"
TEXT_COLOR = "#111111"


def _hex(hue: float, lightness: float) -> str:
    red, green, blue = colorsys.hls_to_rgb(hue / 360, lightness, SATURATION)
    return "#{:02x}{:02x}{:02x}".format(round(red * 255), round(green * 255), round(blue * 255))


@lru_cache(maxsize=None)
def palette() -> dict[str, tuple[str, ...]]:
    """Returns: op -> its colour per shade (index m % SHADES), as "#rrggbb" (shared: do not modify)."""
    return {op: tuple(_hex(hue, level) for level in LIGHTNESS) for op, (hue, _) in KINDS.items()}


def fill_of(op: str, mb: int) -> str:
    """Returns: the colour of a box of ``op`` for microbatch ``mb``."""
    return palette()[op][mb % SHADES]


def box_label(stage: int, op: str, mb: int) -> str:
    """Returns: the text of a box, the task's text form (``ir.LABEL_SCHEME``): ``2F3``, stage 2's F of microbatch 3."""
    return f"{stage}{op}{mb}"


def legend(ops_present) -> list[tuple[str, str, str]]:
    """Args: ops_present: the compute ops the drawing holds.
    Returns: (op, words, darkest colour) per kind present, in KINDS order."""
    colours = palette()
    return [(op, words, colours[op][0]) for op, (_, words) in KINDS.items() if op in ops_present]


# Geometry of a timeline, in CSS pixels; the SVG writer and the HTML page's
# script both read it from here.
LAYOUT = {
    "top": 34,           # the heading above the first panel
    "left": 70,          # lane labels ("rank 12")
    "right": 150,        # lane notes ("busy 93%, peak 4 act.")
    "lane_height": 22,
    "lane_gap": 4,
    "panel_head": 46,    # a panel's title and time axis
    "panel_gap": 16,
    "comm_height": 4,    # a message bar along a lane's bottom edge
    "font_px": 11,
    "char_px": 6.5,      # width of one label character, to decide whether a label fits
    "tick_gap_px": 70,   # at least this much room between time-axis ticks
}


def layout_for(labels: list[str]) -> dict:
    """``LAYOUT`` itself when every lane label fits its left margin ("rank 12"), else a copy whose left
    margin holds the longest (a mesh's ``rank 2: pp 1, dp 0``), so plain drawings are what they were."""
    needed = max((len(label) for label in labels), default=0) * LAYOUT["char_px"] + 12
    if needed <= LAYOUT["left"]:
        return LAYOUT
    return dict(LAYOUT, left=int(needed + 0.999))


def label_fits(label: str, width_px: float) -> bool:
    """Returns: whether ``label`` can be written inside a box ``width_px`` wide."""
    return width_px >= len(label) * LAYOUT["char_px"] + 4


def tick_step(span: float, width_px: float) -> float:
    """The time between axis ticks: 1, 2 or 5 times a power of ten, at least ``tick_gap_px`` apart.

    Args:
        span: the time the axis covers (> 0).
        width_px: the axis length in pixels.
    Returns:
        the step.
    """
    raw = span * LAYOUT["tick_gap_px"] / max(width_px, 1.0)
    power = 1.0
    while power * 10 <= raw:
        power *= 10
    while power > raw:
        power /= 10
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return factor * power
    return 10 * power
