"""Malformed input never produces a traceback: random and mutated programs, and mutated
traces of runs, go through the CLI, which must answer with exit 0 or 1 (and an error
message), nothing else."""
from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.cli import main
from pipec.compiler.driver import shipped_schedules

SOURCES = [Path(p).read_text() for p in shipped_schedules().values()]

# Pieces a mutation inserts: tokens of the language, and near misses.
TOKENS = [
    "schedule", "require", "let", "def", "stages", "pipelines", "route", "microbatch", "to", "pipeline", "place",
    "stage", "of", "on", "rank", "when", "map", "device", "backward", "split", "full", "order", "greedy", "inflight",
    "deferred", "warmup", "priority", "prefer", "for", "in", "step", "if", "else", "and", "or", "not", "true", "false",
    "F", "B", "I", "W", "P", "N", "r", "s", "m", "x", "min", "max", "abs", "(", ")", "{", "}", ",", ";", ":", "=",
    "==", "<=", "<", "?", "..", "+", "-", "*", "/", "%", "0", "1", "2", "7", "-1", '"msg"', "#", "\n", " ", "$", "\\",
]


def run_check(tmp_path: Path, text: str) -> int:
    path = tmp_path / "fuzz.pipe"
    path.write_text(text)
    sink_out, sink_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(sink_out), contextlib.redirect_stderr(sink_err):
        status = main(["check", str(path), "-D", "P=2", "-D", "N=2"]) if "N:" in text and "P:" in text else main(["check", str(path)])
    assert status in (0, 1)
    if status == 1:
        assert sink_err.getvalue().strip(), "an error must say what is wrong"
        assert "Traceback" not in sink_err.getvalue()
    return status


@st.composite
def mutated_program(draw):
    text = draw(st.sampled_from(SOURCES))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["insert", "delete", "replace", "duplicate"]))
        if action == "insert":
            text = text[:position] + draw(st.sampled_from(TOKENS)) + text[position:]
        elif action == "delete":
            text = text[:position] + text[position + draw(st.integers(1, 12)) :]
        elif action == "replace":
            text = text[:position] + draw(st.sampled_from(TOKENS)) + text[position + draw(st.integers(1, 6)) :]
        else:
            end = min(len(text), position + draw(st.integers(1, 40)))
            text = text[:end] + text[position:end] + text[end:]
    return text


FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=60).map(" ".join))
def test_random_token_soup_never_crashes(tmp_path, text):
    run_check(tmp_path, text)


@FUZZ
@given(mutated_program())
def test_mutated_shipped_programs_never_crash(tmp_path, text):
    run_check(tmp_path, text)


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_never_crashes(tmp_path, text):
    run_check(tmp_path, text)


def test_unmutated_programs_pass(tmp_path):
    for text in SOURCES:
        assert run_check(tmp_path, text) == 0


# ------------------------------------------------------------- traces of runs


def _trace_of_a_run() -> dict:
    """A trace as `pipec run --trace` writes one, for gpipe P=2 N=2 (every instruction 1 ms, two steps)."""
    from pipec.compiler.driver import compile_target
    from pipec.runtime.trace import chrome_events

    program = compile_target("gpipe", {"P": "2", "N": "2"}).program
    per_rank = []
    for rank, row in enumerate(program.ranks):
        steps = [[(i, step + i * 0.001, step + (i + 1) * 0.001, 0.0) for i in range(len(row))] for step in (1, 2)]
        per_rank.append(chrome_events(rank, row, steps, t0=0.0))
    events = [event for events in per_rank for event in events]
    return {"traceEvents": events, "otherData": {"schedule": "gpipe", "params": {"P": 2, "N": 2}, "target": "gpipe"}}


TRACE = _trace_of_a_run()
ODD_VALUES = [None, True, -1, 0, 10**12, 1.5, float("inf"), "", "x", "2F0", [], [1], {}, {"step": "1"}]


@st.composite
def mutated_trace(draw):
    document = copy.deepcopy(TRACE)
    for _ in range(draw(st.integers(1, 3))):
        events = document["traceEvents"]
        where = draw(st.sampled_from(["event", "args", "other", "top"]))
        value = draw(st.sampled_from(ODD_VALUES))
        if where == "top":
            document[draw(st.sampled_from(["traceEvents", "otherData"]))] = value
            break
        if where == "other":
            if isinstance(document.get("otherData"), dict):
                document["otherData"][draw(st.sampled_from(["schedule", "params", "target", "costs"]))] = value
            continue
        if not isinstance(events, list) or not events:
            break
        # mostly the instructions' own events (the metadata events are skipped by every reader)
        timed = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"] or events
        pool = timed if draw(st.integers(0, 4)) else events
        event = pool[draw(st.integers(0, len(pool) - 1))]
        if where == "event":
            event[draw(st.sampled_from(["name", "ph", "cat", "pid", "ts", "dur", "args"]))] = value
        elif isinstance(event.get("args"), dict):
            event["args"][draw(st.sampled_from(["step", "index", "wait_us", "compute_us"]))] = value
    return document


def run_on_trace(tmp_path: Path, document, *argv: str) -> int:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(document))
    sink_out, sink_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(sink_out), contextlib.redirect_stderr(sink_err):
        status = main([argv[0], "--trace", str(path), *argv[1:]])
    assert status in (0, 1)
    if status == 1:
        assert sink_err.getvalue().strip() and "Traceback" not in sink_err.getvalue()
    return status


@FUZZ
@given(mutated_trace())
def test_mutated_traces_never_crash_costs_or_render(tmp_path, document):
    run_on_trace(tmp_path, document, "costs")
    run_on_trace(tmp_path, document, "render", "-o", str(tmp_path / "cmp.svg"))


def _compute_event(document) -> dict:
    return next(e for e in document["traceEvents"] if e.get("cat") == "compute")


NASTY_TRACES = [
    ("args", [1]), ("args", "x"), ("pid", True), ("pid", -1), ("ts", None), ("dur", "1"), ("dur", float("inf")),
    ("dur", -5.0), ("name", 3),
]


@pytest.mark.parametrize("key, value", NASTY_TRACES)
def test_a_malformed_event_is_an_error_or_ignored_never_a_crash(tmp_path, key, value):
    document = copy.deepcopy(TRACE)
    _compute_event(document)[key] = value
    run_on_trace(tmp_path, document, "costs")
    run_on_trace(tmp_path, document, "render", "-o", str(tmp_path / "cmp.svg"))


@pytest.mark.parametrize("key, value", [("index", True), ("index", "3"), ("step", "2"), ("wait_us", [1]),
                                        ("compute_us", None), ("wait_us", -1e9)])
def test_malformed_event_args_never_crash(tmp_path, key, value):
    document = copy.deepcopy(TRACE)
    _compute_event(document)["args"][key] = value
    run_on_trace(tmp_path, document, "costs")
    run_on_trace(tmp_path, document, "render", "-o", str(tmp_path / "cmp.svg"))


@pytest.mark.parametrize("other", [None, [], {"schedule": 3}, {"schedule": "gpipe", "params": [1]},
                                   {"schedule": "gpipe", "params": {"P": "x"}}, {"schedule": "gpipe", "target": 5},
                                   {"schedule": "gpipe", "target": "gpipe", "costs": "/no/such/costs.json"}])
def test_malformed_run_records_never_crash(tmp_path, other):
    document = dict(TRACE, otherData=other)
    for command in (("costs",), ("render", "-o", str(tmp_path / "cmp.svg"))):
        assert run_on_trace(tmp_path, document, *command) == 1


def test_the_unmutated_trace_passes(tmp_path):
    assert run_on_trace(tmp_path, TRACE, "costs") == 0
    assert run_on_trace(tmp_path, TRACE, "render", "-o", str(tmp_path / "cmp.svg")) == 0


# Numbers and nesting that json.dumps never writes but a hand-edited or hostile trace may hold:
# each is refused by the guarded reader (compiler.guarded_read) with exit 1, never a crash.
RAW_NUMBERS = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "9" * 5000, "123456789012345678901234567890",
               "[" * 50_000 + "]" * 50_000]


@pytest.mark.parametrize("raw", RAW_NUMBERS, ids=lambda raw: raw[:12])
def test_a_trace_with_numbers_json_cannot_hold_is_refused(tmp_path, raw):
    document = copy.deepcopy(TRACE)
    _compute_event(document)["dur"] = "@RAW@"
    text = json.dumps(document).replace('"@RAW@"', raw)
    path = tmp_path / "run.json"
    path.write_text(text)
    for argv in (["costs", "--trace", str(path)], ["render", "--trace", str(path), "-o", str(tmp_path / "x.svg")]):
        sink_out, sink_err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(sink_out), contextlib.redirect_stderr(sink_err):
            status = main(argv)
        assert status == 1 and "run.json" in sink_err.getvalue() and "Traceback" not in sink_err.getvalue()
