"""``pipec compile --format json``: compact, streamed, exact, atomic, and cheap next to the compile.

The JSON is written rank by rank (``write_program_json``) instead of building
one dict of every instruction and dumping it: the document is the same as
``json.dumps(program_to_json(p))`` with compact separators, it reads back to
the same program, writing it holds no more than a rank's line at a time, and
``-o FILE`` replaces FILE only once the whole document is written.
"""
from __future__ import annotations

import io
import json
import os
import re
import tracemalloc

import pytest

from pipec.cli import main
from pipec.compiler import ops
from pipec.compiler.driver import compile_target, shipped_schedules
from pipec.compiler.emit import json_program
from pipec.compiler.emit.json_program import program_from_json, program_to_json, write_program_json


def _written(program) -> str:
    out = io.StringIO()
    write_program_json(program, out)
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(shipped_schedules()))
def test_streamed_json_is_the_same_document_and_reads_back_exactly(name):
    program = compile_target(name, {}).program
    text = _written(program)
    assert json.loads(text) == program_to_json(program)
    assert program_from_json(json.loads(text)) == program
    # compact: no indentation, one line for the header and one per rank
    lines = text.splitlines()
    assert len(lines) == 1 + program.num_ranks and not any(line.startswith(" ") for line in lines)
    assert ": " not in lines[1] and ", " not in lines[1]


def test_every_op_and_its_tokens_need_no_json_escaping():
    # write_program_json formats instructions without an encoder: only plain names may appear
    assert all(re.fullmatch(r"[A-Z_]+", op) for op in ops.RULES)


class _Sink:
    """A text stream that only counts what it is given."""

    def __init__(self):
        self.chars = 0

    def write(self, text: str) -> None:
        self.chars += len(text)


def test_writing_holds_about_a_rank_not_the_document():
    program = compile_target("interleaved_1f1b", {"P": 16, "N": 128, "v": 2}).program
    sink = _Sink()
    tracemalloc.start()
    try:
        write_program_json(program, sink)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a rank's line is 1/16 of the document; the dict-then-dumps path held ~10 documents
    assert peak < sink.chars / 4, (peak, sink.chars)


def test_compile_json_to_a_file_reads_back(tmp_path, capsys):
    path = tmp_path / "program.json"
    assert main(["compile", "zbv", "-D", "P=2", "-D", "N=4", "--format", "json", "-o", str(path)]) == 0
    assert capsys.readouterr().err == ""
    program = compile_target("zbv", {"P": 2, "N": 4}).program
    assert program_from_json(json.loads(path.read_text())) == program
    assert os.listdir(tmp_path) == ["program.json"]  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fail_midway(error):
    """A write_program_json that writes part of the document, then fails with ``error``."""
    def write(program, out):
        out.write('{"format":"pipec-program","ranks":[')
        raise error
    return write


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, capsys, monkeypatch):
    path = tmp_path / "program.json"
    path.write_text("the old program\n")
    monkeypatch.setattr(json_program, "write_program_json", _fail_midway(OSError(28, "No space left on device")))
    assert main(["compile", "1f1b", "-D", "P=2", "-D", "N=2", "--format", "json", "-o", str(path)]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "No space left" in err and "Traceback" not in err
    assert path.read_text() == "the old program\n" and os.listdir(tmp_path) == ["program.json"]


def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path, capsys, monkeypatch):
    path = tmp_path / "program.json"
    path.write_text("the old program\n")
    monkeypatch.setattr(json_program, "write_program_json", _fail_midway(KeyboardInterrupt()))
    assert main(["compile", "1f1b", "-D", "P=2", "-D", "N=2", "--format", "json", "-o", str(path)]) == 130
    assert path.read_text() == "the old program\n" and os.listdir(tmp_path) == ["program.json"]


def test_an_unwritable_target_is_a_pipec_error(tmp_path, capsys):
    status = main(["compile", "1f1b", "--format", "json", "-o", str(tmp_path / "missing" / "program.json")])
    err = capsys.readouterr().err
    assert status == 1 and "cannot write" in err and "Traceback" not in err
