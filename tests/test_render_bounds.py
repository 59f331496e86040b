"""An SVG timeline stays bounded whatever the costs and however many boxes.

Before the bound, a cost file whose widest box was 10^7 times its narrowest
(F = 1e-7, B = 1) asked for a plot 10^7 boxes wide: hundreds of MB of ticks.
Now the plot is at most ``MAX_PLOT_PX`` wide, boxes narrower than a pixel
merge into runs, and a drawing holds at most about ``MAX_ELEMENTS`` boxes and
message bars, so the file stays under ``MAX_SVG_BYTES``.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from pipec.cli import main
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.render import make_drawing, timeline_svg
from pipec.compiler.render.svg import MAX_ELEMENTS, MAX_PLOT_PX
from pipec.compiler.simulate import simulate

SVG = "{http://www.w3.org/2000/svg}"
# The size docs promise (README, `pipec render`): under 7 MB.
MAX_SVG_BYTES = 7_000_000


def _drawn(text: str) -> tuple[list, list, list]:
    """(boxes, runs, message bars) of an SVG timeline, as elements."""
    rects = list(ET.fromstring(text).iter(SVG + "rect"))
    kind = lambda r: (r.get("class") or "").split(" ")[0]  # noqa: E731
    return ([r for r in rects if kind(r) == "box"], [r for r in rects if kind(r) == "run"],
            [r for r in rects if kind(r) == "comm"])


def _svg(name: str, params: dict, cost_file: dict) -> tuple[str, object]:
    costs = costs_from_json(cost_file)
    program = compile_target(name, params, costs=costs).program
    result = simulate(program, costs)
    return timeline_svg(make_drawing(result, program)), result


def test_a_box_ten_million_times_shorter_than_another_draws_a_small_file(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text('{"compute": {"F": 1e-7, "B": 1}}')
    assert main(["render", "1f1b", "-D", "P=4", "-D", "N=8", "--costs", str(path), "-o", str(tmp_path / "t.svg")]) == 0
    text = (tmp_path / "t.svg").read_text()
    assert len(text.encode()) < 200_000
    root = ET.fromstring(text)
    assert float(root.get("width")) <= MAX_PLOT_PX + 400
    boxes, runs, _ = _drawn(text)
    # every backward is wide enough to be drawn alone; the forwards, a pixel's fraction each, merge into runs
    assert sum(1 for r in boxes if r.get("data-op") == "B") == 32
    assert runs and sum(int(r.get("data-count")) for r in runs) + len(boxes) == 64
    assert all(float(r.get("width")) >= 0.5 for r in boxes + runs)
    assert main(["render", "1f1b", "-D", "P=4", "-D", "N=8", "--costs", str(path), "-o", str(tmp_path / "t.html")]) == 0
    assert (tmp_path / "t.html").stat().st_size < 200_000


def test_many_boxes_merge_until_the_drawing_holds_a_bounded_number_of_elements():
    # 1F1B on 16 ranks, 1000 microbatches: 32000 boxes, and as many messages, sub-pixel at this width
    text, result = _svg("1f1b", {"P": 16, "N": 1000}, {"links": {"latency": 0.25}})
    boxes, runs, comms = _drawn(text)
    lanes = len(result.ranks)
    assert len(boxes) + len(runs) + len(comms) <= MAX_ELEMENTS + 2 * lanes
    assert len(text.encode()) < MAX_SVG_BYTES
    # nothing is lost: runs and boxes together hold every compute slot once, in time order
    computes = sum(1 for lane in result.timeline for slot in lane if not slot.is_comm)
    assert len(boxes) + sum(int(r.get("data-count")) for r in runs) == computes
    # and a run spans its boxes: it starts at the first one's start and ends at the last one's end
    slots = sorted((slot.start, slot.end) for lane in result.timeline for slot in lane if not slot.is_comm)
    starts = {start for start, _ in slots}
    assert all(float(r.get("data-start")) in starts for r in runs)


def test_a_drawing_whose_boxes_all_fit_is_drawn_box_for_box():
    text, result = _svg("zb_h1", {"P": 4, "N": 8}, {})
    boxes, runs, _ = _drawn(text)
    assert runs == [] and len(boxes) == sum(len(lane) for lane in result.timeline)


@pytest.mark.parametrize("cost_file", [
    {"compute": {"F": 0, "B": 0}},  # every box empty: nothing to scale by
    {"compute": {"F": 1e-9, "B": 1e3}, "links": {"latency": 1e-12}},
])
def test_degenerate_costs_still_draw(cost_file):
    text, _ = _svg("gpipe", {"P": 3, "N": 5}, cost_file)
    assert len(text.encode()) < 500_000
    assert re.search(r'<svg [^>]*width="\d+"', text)
