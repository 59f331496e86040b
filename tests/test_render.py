"""Drawings: the SVG and HTML timelines agree with the simulator box for box,
the Chrome trace round-trips, a measured run lines up above the prediction, a
planted deadlock shows its cycle in the DOT graph, and a headless Chromium
draws the HTML page (not a blank one).

The timelines in docs/timelines/ are golden files: a test regenerates each and
compares; ``PIPEC_UPDATE_DOCS=1 pytest tests/test_render.py -k docs`` rewrites
them after an intended change.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from pipec.cli import main
from pipec.compiler.costs import costs_from_json
from pipec.compiler.ir import LABEL_SCHEME
from pipec.compiler.checks import check_all
from pipec.compiler.driver import compile_target
from pipec.compiler.emit import program_to_json
from pipec.compiler.ir import COMPUTE_OPS, FREE_F, Program
from pipec.compiler.lower_comms import insert_communication
from pipec.compiler.render import (
    make_drawing,
    style,
    task_graph_dot,
    timeline_from_trace,
    timeline_html,
    timeline_svg,
    write_graph,
    write_timeline,
)
from pipec.compiler.render.model import format_time
from pipec.compiler.simulate import simulate
from pipec.errors import DeadlockError, UsageError
from pipec.runtime.trace import chrome_events, write_chrome_trace
from reference_orders import one_f_one_b

REPO = Path(__file__).resolve().parent.parent
DOC_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "bitpipe")
CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)


def compiled(name: str, **params):
    program = compile_target(name, {key: str(value) for key, value in params.items()}).program
    return program, simulate(program)


def compute_slots(result) -> list[list[tuple]]:
    """Per rank, (op, stage, mb, start, end) of every compute slot, in start order."""
    return [[(s.action.op, s.action.stage, s.action.mb, s.start, s.end) for s in lane if not s.is_comm]
            for lane in result.timeline]


def compute_count(program: Program) -> int:
    return sum(1 for row in program.ranks for action in row if action.op in COMPUTE_OPS)


# ------------------------------------------------------------------------- SVG

SVG = "{http://www.w3.org/2000/svg}"


def svg_panels(text: str) -> list[tuple[str, list[list[tuple]], list[list[float]]]]:
    """Per panel: its kind, per rank its boxes (op, stage, mb, start, end), and per rank their (x, width)."""
    root = ET.fromstring(text)
    assert root.tag == SVG + "svg"
    panels = []
    for panel in root.iter(SVG + "g"):
        if panel.get("class") != "panel":
            continue
        boxes, geometry = [], []
        for lane in panel.iter(SVG + "g"):
            if lane.get("class") != "lane":
                continue
            assert int(lane.get("data-rank")) == len(boxes)
            rects = [r for r in lane.iter(SVG + "rect") if (r.get("class") or "").startswith("box ")]
            boxes.append([(r.get("data-op"), int(r.get("data-stage")), int(r.get("data-mb")),
                           float(r.get("data-start")), float(r.get("data-end"))) for r in rects])
            geometry.append([(float(r.get("x")), float(r.get("width"))) for r in rects])
            for r in rects:  # the class names the kind and the shade: the fill the legend explains
                op, shade = r.get("class").split()[1:]
                assert op == r.get("data-op") and shade == f"s{int(r.get('data-mb')) % style.SHADES}"
        panels.append((panel.get("data-kind"), boxes, geometry))
    return panels


@pytest.mark.parametrize("name", DOC_SCHEDULES + ("zb_h1", "chimera"))
def test_svg_has_one_box_per_compute_instruction_at_its_simulated_place(name):
    program, result = compiled(name, P=4)
    text = timeline_svg(make_drawing(result, program))
    [(kind, boxes, geometry)] = svg_panels(text)
    assert kind == "predicted"
    assert boxes == compute_slots(result)
    assert sum(map(len, boxes)) == compute_count(program)
    # drawn where the data says: x and width are one linear map of start and end, shared by every lane
    flat = [(box, shape) for lane_boxes, lane_shapes in zip(boxes, geometry) for box, shape in zip(lane_boxes, lane_shapes)]
    (_, _, _, s0, _), (x0, _) = min(flat, key=lambda item: item[0][3])
    (_, _, _, s1, _), (x1, _) = max(flat, key=lambda item: item[0][3])
    scale = (x1 - x0) / (s1 - s0)
    for (_, _, _, start, end), (x, width) in flat:
        assert x == pytest.approx(x0 + (start - s0) * scale, abs=0.02)
        assert width == pytest.approx((end - start) * scale, abs=0.02)
    root = ET.fromstring(text)
    assert float(root.get("data-makespan")) == result.makespan
    heading = root.find(SVG + "title").text
    assert f"makespan {result.makespan}" in heading and "bubble ratio" in heading


def test_svg_title_shows_the_exact_bubble_and_labels_are_the_tasks_text_form_explained_in_the_legend():
    program, result = compiled("bitpipe", P=4)
    text = timeline_svg(make_drawing(result, program))
    assert "makespan 28, bubble ratio 1/7 = 0.1429" in text  # DESIGN.md section 8
    labels = re.findall(r'<text class="box-label"[^>]*>([^<]+)</text>', text)
    # every box is labelled as compile --format text, traces and torch's CSV write its task (ir.LABEL_SCHEME)
    texts = {action.text() for row in program.ranks for action in row}
    assert labels and set(labels) <= texts and "0F0" in labels
    assert LABEL_SCHEME in html.unescape(text)
    program, result = compiled("1f1b", P=4, N=8)
    labels = re.findall(r'<text class="box-label"[^>]*>([^<]+)</text>', timeline_svg(make_drawing(result, program)))
    assert Counter(re.sub(r"[0-9]", "", label) for label in labels) == {"F": 32, "B": 32} and "3F7" in labels


def test_svg_draws_message_slots_when_links_cost_time():
    program = compile_target("1f1b", {"P": "3", "N": "3"}).program
    result = simulate(program, costs_from_json({"links": {"latency": 0.5}}))
    comm_slots = sum(1 for lane in result.timeline for slot in lane if slot.is_comm)
    assert comm_slots > 0
    root = ET.fromstring(timeline_svg(make_drawing(result, program)))
    comm_rects = [r for r in root.iter(SVG + "rect") if r.get("class") == "comm" and r.get("data-start")]
    assert len(comm_rects) == comm_slots
    assert {float(r.get("data-end")) - float(r.get("data-start")) for r in comm_rects} == {0.5}


# ------------------------------------------------------------------------ HTML

VOID = {"meta", "link", "br", "img", "input", "hr", "area", "base", "col", "embed", "source", "track", "wbr"}


class _PageParser(HTMLParser):
    """Checks that tags nest and close, and collects what the tests look at."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.tags, self.external, self.scripts, self.errors = [], Counter(), [], {}, []
        self.legend_ops, self._script_id = set(), None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags[tag] += 1
        self.external += [value for key, value in attrs.items() if key in ("src", "href") and value]
        if tag == "script":
            self._script_id = attrs.get("id", "")
            self.scripts[self._script_id] = ""
        if "data-op" in attrs:
            self.legend_ops.add(attrs["data-op"])
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(f"</{tag}> closes nothing open")

    def handle_data(self, data):
        if self._script_id is not None and self.stack and self.stack[-1] == "script":
            self.scripts[self._script_id] += data


def parse_page(text: str) -> _PageParser:
    assert text.startswith("<!DOCTYPE html>")
    page = _PageParser()
    page.feed(text)
    page.close()
    assert not page.errors and page.stack == []
    return page


def test_html_is_self_contained_and_its_data_agrees_with_the_simulator():
    program, result = compiled("zbv", P=4)
    page = parse_page(timeline_html(make_drawing(result, program)))
    assert page.external == []  # nothing from the network
    assert page.tags["canvas"] == 1 and page.tags["script"] == 2
    assert page.legend_ops == {"F", "I", "W"}  # ZB-V splits every backward
    data = json.loads(page.scripts["timeline-data"])
    [panel] = data["panels"]
    assert panel["makespan"] == result.makespan and panel["kind"] == "predicted"
    boxes = [list(zip(lane["op"], lane["stage"], lane["mb"], lane["start"], lane["end"])) for lane in panel["lanes"]]
    assert boxes == compute_slots(result)
    assert data["chunk"] == [stage.chunk for stage in program.stages]
    assert data["palette"]["F"][0] == style.palette()["F"][0]
    # the script the tip and the zoom run on is there, whole
    script = page.scripts[""]
    assert "function lastStartingBy" in script and "tip.textContent = describe(found)" in script


def test_html_data_cannot_close_its_script_element():
    program, result = compiled("1f1b", P=2, N=2)
    program.name = "evil</script><b>x"
    page = parse_page(timeline_html(make_drawing(result, program)))
    assert page.tags["b"] == 0
    assert json.loads(page.scripts["timeline-data"])["heading"].startswith("evil</script><b>x (P=2, N=2, remat=false)")


# ---------------------------------------------------------------- Chrome trace


def test_json_is_a_chrome_trace_of_the_simulation_that_reads_back_the_same(tmp_path):
    program, result = compiled("interleaved_1f1b", P=4)
    path = tmp_path / "sim.json"
    write_timeline(result, program, str(path))
    document = json.loads(path.read_text())
    compute = [e for e in document["traceEvents"] if e.get("cat") == "compute"]
    assert len(compute) == compute_count(program)
    for event in compute:
        action = program.ranks[event["pid"]][event["args"]["index"]]
        assert event["ph"] == "X" and event["name"] == action.text() and event["args"]["op"] == action.op
    by_rank = [[(e["name"], e["ts"], e["dur"]) for e in compute if e["pid"] == rank] for rank in range(program.num_ranks)]
    assert by_rank == [[(s.action.text(), s.start * 1000, (s.end - s.start) * 1000) for s in lane]
                       for lane in result.timeline]
    assert document["otherData"]["makespan"] == result.makespan
    # read back as a "measured" panel, it is the prediction again (1 unit = 1 ms)
    again = timeline_from_trace(document, program)
    assert [[(s.action, s.start, s.end) for s in lane] for lane in again.boxes] == \
           [[(s.action, s.start, s.end) for s in lane] for lane in result.timeline]
    assert again.makespan == result.makespan and again.bubble_ratio == pytest.approx(result.bubble_ratio)


# ------------------------------------------------------------- measured traces


def fake_run_trace(program: Program, result, path: Path, steps: int = 2, **ran) -> list[list[tuple]]:
    """Write a trace as ``pipec run --trace`` does (runtime.trace), where step k runs the prediction
    stretched k-fold (1 unit = 2k ms), offset by k s, and each compute waited 0.5 ms first.

    Returns the expected boxes of the last step: per rank (action, start ms, end ms).
    """
    per_rank, expected = [], []
    for rank, lane in enumerate(result.timeline):
        indices = [i for i, action in enumerate(program.ranks[rank]) if action.op in COMPUTE_OPS]
        records = []
        for k in range(1, steps + 1):
            unit, origin = 0.002 * k, float(k)
            records.append([(index, origin + slot.start * unit - 0.0005, origin + slot.end * unit, 0.0005)
                            for index, slot in zip(indices, lane)])
        per_rank.append(chrome_events(rank, program.ranks[rank], records, t0=0.0))
        expected.append([(slot.action, slot.start * 2 * steps, slot.end * 2 * steps) for slot in lane])
    write_chrome_trace(str(path), per_rank, {"schedule": program.name, "params": dict(program.params), **ran})
    return expected


def test_measured_step_is_drawn_above_the_prediction(tmp_path):
    program, result = compiled("1f1b", P=4, N=8)
    expected = fake_run_trace(program, result, tmp_path / "run.json")
    document = json.loads((tmp_path / "run.json").read_text())
    measured = timeline_from_trace(document, program, name="run.json")
    got = [[(s.action, s.start, s.end) for s in lane] for lane in measured.boxes]
    assert len(got) == len(expected)
    for got_lane, want_lane in zip(got, expected):  # the last step, its waits shown as idle time
        assert [a for a, _, _ in got_lane] == [a for a, _, _ in want_lane]
        assert [t for _, s, e in got_lane for t in (s, e)] == pytest.approx([t for _, s, e in want_lane for t in (s, e)],
                                                                          abs=1e-6)
    assert measured.unit == "ms" and "step 2" in measured.title
    assert measured.bubble_ratio == pytest.approx(result.bubble_ratio, abs=1e-6)
    first = timeline_from_trace(document, program, step=1)
    assert first.makespan == pytest.approx(result.makespan * 2, abs=1e-6)
    with pytest.raises(UsageError, match="no step 3"):
        timeline_from_trace(document, program, step=3)

    panels = svg_panels(timeline_svg(make_drawing(result, program, measured)))
    assert [kind for kind, _, _ in panels] == ["measured", "predicted"]
    (_, measured_boxes, measured_xy), (_, predicted_boxes, predicted_xy) = panels
    assert predicted_boxes == compute_slots(result)
    assert [[box[:3] for box in lane] for lane in measured_boxes] == [[box[:3] for box in lane] for lane in predicted_boxes]
    # one time axis: the run took 4 ms per unit of the plan, so on the shared scale (the longer panel, the run,
    # sets it) each measured box sits 4 times as far from 0 and is 4 times as wide as its predicted box
    left = style.LAYOUT["left"]
    flatten = lambda lanes: [value for lane in lanes for box in lane for value in box]  # noqa: E731
    stretched = [[(left + (x - left) * 4, width * 4) for x, width in lane] for lane in predicted_xy]
    assert flatten(measured_xy) == pytest.approx(flatten(stretched), abs=0.1)
    text = timeline_svg(make_drawing(result, program, measured))
    root = ET.fromstring(text)
    plot_end = max(x + width for lane in measured_xy for x, width in lane)
    assert plot_end == pytest.approx(float(root.get("width")) - style.LAYOUT["right"], abs=0.02)
    # the page is titled with what was measured, then what was predicted
    heading = root.find(SVG + "title").text
    assert f"measured {format_time(measured.makespan, 'ms')}, predicted {result.makespan}" in heading
    data = json.loads(parse_page(timeline_html(make_drawing(result, program, measured))).scripts["timeline-data"])
    assert [panel["kind"] for panel in data["panels"]] == ["measured", "predicted"]
    assert data["span"] == pytest.approx(measured.makespan) and data["span"] == pytest.approx(4 * result.makespan)
    assert data["heading"] == heading


def test_a_trace_of_another_program_is_refused_with_the_reason(tmp_path):
    program, result = compiled("1f1b", P=4, N=8)
    fake_run_trace(program, result, tmp_path / "run.json")
    document = json.loads((tmp_path / "run.json").read_text())
    other = compile_target("1f1b", {"P": "4", "N": "4"}).program
    with pytest.raises(UsageError, match="does not match the program"):
        timeline_from_trace(document, other)
    with pytest.raises(UsageError, match="not a Chrome trace"):
        timeline_from_trace({"events": []}, program)


# ------------------------------------------------------------------ task graph

DOT_NODE = re.compile(r'^\s+(r\d+_\d+) \[(.*)\];$', re.M)
DOT_EDGE = re.compile(r'^\s+(r\d+_\d+) -> (r\d+_\d+) \[(.*)\];$', re.M)


def planted_deadlock() -> tuple[Program, list]:
    """1F1B on 2 ranks whose facing send pairs are unbatched: each rank's blocking send waits for the other."""
    program = insert_communication(one_f_one_b(2, 3))
    for rank, text in ((0, "(0SEND_F1;0RECV_B0)BATCH"), (1, "(1SEND_B0;1RECV_F1)BATCH")):
        row = program.ranks[rank]
        step = [action.text() for action in row].index(text)
        row[step:step + 1] = list(row[step].parts)
    with pytest.raises(DeadlockError) as caught:
        check_all(program)
    return program, caught.value.cycle


def test_planted_deadlock_draws_its_wait_for_cycle_in_red():
    program, cycle = planted_deadlock()
    members = {f"r{rank}_{step}" for rank, step, _ in cycle}
    assert len(members) == 2
    text = task_graph_dot(program, cycle)
    red = style.CYCLE_COLOR
    red_nodes = {node for node, attrs in DOT_NODE.findall(text) if red in attrs}
    assert red_nodes == members
    red_edges = {(a, b) for a, b, attrs in DOT_EDGE.findall(text) if red in attrs}
    assert red_edges == {(f"r{cycle[0][0]}_{cycle[0][1]}", f"r{cycle[1][0]}_{cycle[1][1]}"),
                         (f"r{cycle[1][0]}_{cycle[1][1]}", f"r{cycle[0][0]}_{cycle[0][1]}")}
    assert cycle[0][2] in text.replace('\\"', '"')  # each wait's words ride on its edge
    assert "deadlock" in text.splitlines()[1]


def test_graph_has_a_cluster_per_rank_and_an_edge_per_dependency():
    program = insert_communication(one_f_one_b(2, 3))
    text = task_graph_dot(program)
    assert text.count("subgraph cluster_rank") == 2
    nodes = DOT_NODE.findall(text)
    assert len(nodes) == sum(1 for row in program.ranks for a in row if a.op != FREE_F)
    # F(1,m) <- F(0,m) and B(0,m) <- B(1,m) cross ranks (6); B(s,m) <- F(s,m) stays on its rank (6)
    assert sum(1 for *_, attrs in DOT_EDGE.findall(text) if attrs.startswith('color="#333333"')) == 6
    assert sum(1 for *_, attrs in DOT_EDGE.findall(text) if attrs.startswith('color="#999999"')) == 6
    assert sum(1 for *_, attrs in DOT_EDGE.findall(text) if attrs.startswith("style=dashed")) == len(nodes) - 2
    assert style.CYCLE_COLOR not in text


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed (apt-get install graphviz)")
def test_dot_text_is_valid_graphviz_and_png_is_a_picture(tmp_path):
    program, cycle = planted_deadlock()
    laid_out = subprocess.run(["dot", "-Tplain"], input=task_graph_dot(program, cycle), capture_output=True,
                              text=True, timeout=60, check=True).stdout
    assert laid_out.count("\nnode ") == sum(1 for row in program.ranks for a in row if a.op != FREE_F)
    write_graph(program, str(tmp_path / "dead.png"), cycle=cycle)
    assert (tmp_path / "dead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_graphviz_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot anywhere
    with pytest.raises(UsageError, match="needs Graphviz's `dot` program"):
        write_graph(one_f_one_b(2, 2), str(tmp_path / "g.png"))
    write_graph(one_f_one_b(2, 2), str(tmp_path / "g.dot"))  # the text needs nothing
    assert (tmp_path / "g.dot").read_text().startswith("digraph")


# ------------------------------------------------------------------------ CLI


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_render_writes_each_form(capsys, tmp_path):
    for suffix, check in ((".svg", ET.fromstring), (".html", parse_page), (".json", json.loads), (".dot", str)):
        path = tmp_path / ("t" + suffix)
        status, out, err = run_cli(capsys, "render", "1f1b", "-D", "P=4", "-D", "N=8", "-o", str(path))
        assert (status, out, err) == (0, f"wrote {path}\n", "")
        check(path.read_text())


def test_render_draws_a_deadlocked_program_file_and_says_so(capsys, tmp_path):
    program, cycle = planted_deadlock()
    source = tmp_path / "dead.json"
    source.write_text(json.dumps(program_to_json(program)))
    status, out, err = run_cli(capsys, "render", str(source), "-o", str(tmp_path / "dead.dot"))
    assert status == 0 and "fails the deadlock check; its wait-for cycle is drawn in red" in err
    assert {(a, b) for a, b, attrs in DOT_EDGE.findall((tmp_path / "dead.dot").read_text())
            if style.CYCLE_COLOR in attrs} == {(f"r{cycle[0][0]}_{cycle[0][1]}", f"r{cycle[1][0]}_{cycle[1][1]}"),
                                               (f"r{cycle[1][0]}_{cycle[1][1]}", f"r{cycle[0][0]}_{cycle[0][1]}")}
    # a timeline of it is the deadlock error, not a drawing
    status, out, err = run_cli(capsys, "render", str(source), "-o", str(tmp_path / "dead.svg"))
    assert status == 1 and err.startswith("rank 0, step") and "deadlock" in err and "Traceback" not in err
    assert not (tmp_path / "dead.svg").exists()


def test_render_trace_finds_the_schedule_the_trace_names(capsys, tmp_path):
    program, result = compiled("1f1b", P=4, N=4)
    fake_run_trace(program, result, tmp_path / "run.json")
    status, _, err = run_cli(capsys, "render", "--trace", str(tmp_path / "run.json"), "-o", str(tmp_path / "cmp.svg"))
    assert (status, err) == (0, "")
    kinds = [kind for kind, _, _ in svg_panels((tmp_path / "cmp.svg").read_text())]
    assert kinds == ["measured", "predicted"]
    status, _, err = run_cli(capsys, "render", "1f1b", "--trace", str(tmp_path / "run.json"), "-o",
                             str(tmp_path / "cmp.html"))  # defaults P=4, N=8: not the program that ran
    assert status == 1 and "does not match the program" in err


def test_render_trace_redraws_the_file_the_run_recorded_from_any_folder_priced_by_the_run(capsys, tmp_path, monkeypatch):
    source = tmp_path / "mine.pipe"
    shipped = Path(__file__).resolve().parents[1] / "schedules" / "gpipe.pipe"
    source.write_text(shipped.read_text().replace("schedule gpipe(", "schedule my_gpipe("))
    costs = tmp_path / "slow_backward.json"
    costs.write_text(json.dumps({"compute": {"B": 3}}))
    program = compile_target(str(source), {"P": "2", "N": "3"}).program
    result = simulate(program, costs_from_json({"compute": {"B": 3}}))
    fake_run_trace(program, result, tmp_path / "run.json", target=str(source), costs=str(costs))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    status, _, err = run_cli(capsys, "render", "--trace", str(tmp_path / "run.json"), "-o", "cmp.svg")
    assert (status, err) == (0, "")
    text = (elsewhere / "cmp.svg").read_text()
    [(_, measured, _), (_, predicted, _)] = svg_panels(text)
    # without --costs the prediction is priced with the times the run measured, in ms: this run went exactly
    # as planned (the plan stretched to 4 ms per unit in its last step), so both panels end together
    end = max(box[4] for lane in measured for box in lane)
    assert end == pytest.approx(16 * 4) and max(box[4] for lane in predicted for box in lane) == pytest.approx(end)
    assert "predicted (simulator): makespan 64 ms" in text
    # with --costs, that file prices it: gpipe P=2 N=3, F=1, B=3 -> makespan (N + P - 1) * 4 = 16 units
    status, _, err = run_cli(capsys, "render", "--trace", str(tmp_path / "run.json"), "-o", "cmp.svg", "--costs", str(costs))
    assert (status, err) == (0, "")
    [_, (_, predicted, _)] = svg_panels((elsewhere / "cmp.svg").read_text())
    assert max(box[4] for lane in predicted for box in lane) == pytest.approx(16)
    # a recorded file that is gone is named, not guessed
    source.unlink()
    status, _, err = run_cli(capsys, "render", "--trace", str(tmp_path / "run.json"), "-o", "cmp.svg")
    assert status == 1 and re.search(r"ran '[^']*mine\.pipe'( \(\d+ characters\))?, which cannot be read now", err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["1f1b", "-o", "x.txt"], "cannot tell what to draw from 'x.txt'"),
    (["-o", "x.svg"], "render needs TARGET"),
    (["1f1b", "--trace", "missing.json", "-o", "x.svg"], "cannot read trace 'missing.json'"),
    (["1f1b", "--step", "2", "-o", "x.svg"], "--step picks a step of --trace"),
    (["nonesuch", "-o", "x.svg"], "no file or shipped schedule named 'nonesuch'"),
])
def test_render_usage_errors_are_one_message(capsys, tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(capsys, "render", *argv)
    assert status == 1 and words in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_render_trace_only_draws_timelines(capsys, tmp_path):
    trace = tmp_path / "run.json"
    trace.write_text("{}")
    status, _, err = run_cli(capsys, "render", "1f1b", "--trace", str(trace), "-o", str(tmp_path / "g.dot"))
    assert status == 1 and "write .svg or .html" in err


# -------------------------------------------------------------------- browser


def decode_png(blob: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA non-interlaced PNG as an (height, width, channels) array (what Chromium writes)."""
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks = 8, {}
    while position < len(blob):
        length, kind = struct.unpack(">I4s", blob[position:position + 8])
        chunks.setdefault(kind, []).append(blob[position + 8:position + 8 + length])
        position += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and colour in (2, 6) and interlace == 0
    channels = 3 if colour == 2 else 4
    stride = width * channels
    raw = zlib.decompress(b"".join(chunks[b"IDAT"]))
    out = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.int64)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], np.frombuffer(raw, np.uint8, stride, start + 1).astype(np.int64)
        if kind == 0:
            row = line
        elif kind == 1:  # sub: a running sum per channel
            row = line.reshape(width, channels).cumsum(axis=0).reshape(-1) & 255
        elif kind == 2:  # up
            row = (line + previous) & 255
        else:  # average, paeth: each byte depends on the one to its left
            row = _unfilter_sequential(kind, line.tolist(), previous.tolist(), channels)
        out[y] = row
        previous = np.asarray(row, dtype=np.int64)
    return out.reshape(height, width, channels)


def _unfilter_sequential(kind: int, line: list, up: list, bpp: int) -> list:
    row = [0] * len(line)
    for i, value in enumerate(line):
        a = row[i - bpp] if i >= bpp else 0
        b = up[i]
        if kind == 3:
            row[i] = (value + (a + b) // 2) & 255
            continue
        c = up[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        row[i] = (value + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return row


def screenshot(page: Path, png: Path, profile: Path, size: str = "1200,800") -> np.ndarray:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={size}",
               page.resolve().as_uri()]
    subprocess.run(command, capture_output=True, timeout=180)
    assert png.exists(), "chromium wrote no screenshot"
    return decode_png(png.read_bytes())


def pixels_of(image: np.ndarray, colour: str) -> int:
    """Pixels within 2 levels of the "#rrggbb" colour."""
    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(image[:, :, :3].astype(int) - rgb).max(axis=2) <= 2).sum())


def coloured_share(image: np.ndarray) -> float:
    """The share of pixels with a clear hue (the boxes; text, lanes and background are grey or white)."""
    rgb = image[:, :, :3].astype(int)
    return float(((rgb.max(axis=2) - rgb.min(axis=2)) > 40).mean())


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium)")


@needs_chromium
def test_headless_chromium_draws_the_html_timeline(tmp_path):
    program, result = compiled("1f1b", P=4, N=8)
    page = tmp_path / "t.html"
    write_timeline(result, program, str(page))
    image = screenshot(page, tmp_path / "t.png", tmp_path / "profile")
    assert image.shape[:2] == (800, 1200)
    colours = style.palette()
    # every shade of F and B fills boxes (the canvas drew them), and idle lanes show
    for op in ("F", "B"):
        for shade in colours[op]:
            assert pixels_of(image, shade) > 300, (op, shade)
    assert pixels_of(image, style.IDLE_FILL) > 2000
    assert coloured_share(image) > 0.03  # 4 lanes of boxes on a 1200 x 800 page


# Moves the pointer over box INDEX of lane RANK, then over an idle time of lane IDLE_RANK, and keeps each tip's text.
HOVER_PROBE = """<script>
window.addEventListener("load", function () {
  var data = JSON.parse(document.getElementById("timeline-data").textContent), L = data.layout;
  var canvas = document.getElementById("timeline"), frame = canvas.getBoundingClientRect();
  var panel = data.panels[0], k = (canvas.clientWidth - L.left - L.right) / panel.makespan;
  function hover(rank, time, name) {
    var y = L.panel_head + rank * (L.lane_height + L.lane_gap) + L.lane_height / 2;
    canvas.dispatchEvent(new MouseEvent("mousemove", {clientX: frame.left + L.left + time * k, clientY: frame.top + y}));
    document.body.setAttribute(name, document.getElementById("tip").textContent);
  }
  var lane = panel.lanes[RANK];
  hover(RANK, (lane.start[INDEX] + lane.end[INDEX]) / 2, "data-box-tip");
  hover(IDLE_RANK, IDLE_TIME, "data-idle-tip");
});
</script>
</body>"""


@needs_chromium
def test_hovering_a_box_in_chromium_shows_its_rank_op_stage_microbatch_start_and_end(tmp_path):
    program, result = compiled("interleaved_1f1b", P=4, N=8)
    rank, index = 2, 9
    slot = result.timeline[rank][index]
    idle_rank, idle_time = 3, 0.5  # rank 3 waits for its first activation
    assert all(not (s.start <= idle_time < s.end) for s in result.timeline[idle_rank])
    probe = HOVER_PROBE
    for name, value in (("IDLE_RANK", idle_rank), ("IDLE_TIME", idle_time), ("RANK", rank), ("INDEX", index)):
        probe = probe.replace(name, str(value))
    page = tmp_path / "hover.html"
    page.write_text(timeline_html(make_drawing(result, program)).replace("</body>", probe))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,800", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=180).stdout
    tips = {name: html.unescape(text) for name, text in re.findall(r'data-(box|idle)-tip="([^"]*)"', dom)}
    action = slot.action
    assert tips["box"].splitlines() == [
        f"rank {rank} (predicted)",
        f"op {action.op}  ({action.text()})",
        f"stage {action.stage}, chunk {program.stages[action.stage].chunk}",
        f"microbatch {action.mb}",
        f"start {slot.start}",
        f"end {slot.end}",
    ]
    # a pointer event lands on a whole pixel, so the time under it is the idle time to within a pixel
    at = re.fullmatch(rf"rank {idle_rank}: idle at (\S+) \(predicted\)", tips["idle"])
    assert at and float(at.group(1)) == pytest.approx(idle_time, abs=0.05)


@needs_chromium
def test_a_64_rank_512_microbatch_timeline_renders_and_opens_in_a_browser(tmp_path):
    # how fast is a figure of the machine: python benchmarks/render_speed.py prints it
    program, result = compiled("interleaved_1f1b", P=64, N=512)
    boxes = compute_count(program)
    assert boxes == 64 * 512 * 2 * 2
    write_timeline(result, program, str(tmp_path / "big.html"))
    write_timeline(result, program, str(tmp_path / "big.svg"))
    image = screenshot(tmp_path / "big.html", tmp_path / "big.png", tmp_path / "profile")
    # sub-pixel boxes blend into stripes: count coloured (not grey, not white) pixels instead of exact fills
    assert coloured_share(image) > 0.3


# ------------------------------------------------------------------------ docs


@pytest.mark.parametrize("name", DOC_SCHEDULES)
def test_docs_timelines_are_up_to_date(name):
    program, result = compiled(name, P=4)
    text = timeline_svg(make_drawing(result, program))
    path = REPO / "docs" / "timelines" / f"{name}.svg"
    if os.environ.get("PIPEC_UPDATE_DOCS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists() and path.read_text(encoding="utf-8") == text, \
        f"{path} is stale: PIPEC_UPDATE_DOCS=1 pytest tests/test_render.py -k docs"


def test_chrome_traces_of_the_simulator_and_of_runs_carry_the_label_scheme(tmp_path):
    from pipec.runtime.trace import write_chrome_trace

    out = tmp_path / "t.json"
    assert main(["render", "1f1b", "-D", "P=2", "-D", "N=2", "-o", str(out)]) == 0
    simulated = json.loads(out.read_text())
    assert simulated["otherData"]["labels"] == LABEL_SCHEME
    assert {event["name"] for event in simulated["traceEvents"] if event.get("cat") == "compute"} >= {"0F0", "1B1"}
    write_chrome_trace(str(tmp_path / "run.json"), [[]], {"schedule": "1f1b"})
    run = json.loads((tmp_path / "run.json").read_text())["otherData"]
    assert run["labels"] == LABEL_SCHEME and run["schedule"] == "1f1b" and run["cores"] >= 1
