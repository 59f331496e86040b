"""Malformed `.pipe` input never produces a traceback: random and mutated programs go
through the CLI, which must answer with exit 0 or 1 (and an error message), nothing else."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.cli import main
from pipec.compiler.driver import shipped_schedules

SOURCES = [Path(p).read_text() for p in shipped_schedules().values()]

# Pieces a mutation inserts: tokens of the language, and near misses.
TOKENS = [
    "schedule", "require", "let", "def", "stages", "pipelines", "route", "microbatch", "to", "pipeline", "place",
    "stage", "of", "on", "rank", "when", "map", "device", "backward", "split", "full", "order", "greedy", "inflight",
    "warmup", "priority", "prefer", "for", "in", "step", "if", "else", "and", "or", "not", "true", "false",
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
