"""What the command line prints, under attack: a full or closed standard output, text from crafted
files, `--version`, and the demo's own files (never at a fixed path another user could plant)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from pipec.cli import main, version
from pipec.errors import ProgramError, RuntimeFault, SourceError, Span, UsageError, format_grid, printable


def _pipec(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipec", *args], capture_output=True, text=True, timeout=60, **kwargs)


# ---------------------------------------------------------------- standard output


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["list"], ["--help"], ["--version"]])
def test_a_full_standard_output_is_one_line_and_status_1(argv):
    # argparse's own help and version text included (argparse drops their write errors)
    with open("/dev/full", "w") as full:  # a device given to the child as its stdout, not a file pipec writes
        done = subprocess.run([sys.executable, "-m", "pipec", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == "pipec: cannot write to standard output: No space left on device\n"


@pytest.mark.parametrize("how", ["closed at start", "closed later"])
def test_a_closed_standard_output_is_one_line_and_status_1(how):
    if how == "closed at start":  # `pipec list >&-`: Python starts without a standard output
        argv = ["sh", "-c", f"exec '{sys.executable}' -m pipec list >&-"]
    else:  # closed under a running Python: the flush fails
        argv = [sys.executable, "-c", "import os, runpy, sys; os.close(1); sys.argv = ['pipec', 'list']; "
                "runpy.run_module('pipec', run_name='__main__')"]
    done = subprocess.run(argv, stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("pipec: cannot write to standard output: ") and done.stderr.count("\n") == 1, done.stderr


class _Gone:
    """A standard output whose reader went away (`pipec list | head -1` on a long list)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass

    def fileno(self):
        raise OSError("no descriptor")


def test_a_reader_that_goes_away_shows_no_traceback_and_status_1(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _Gone())
    assert main(["list"]) == 1
    assert capsys.readouterr().err == ""  # the reader left: nobody to tell
    print("the interpreter's last flush cannot fail now")


def test_version_is_the_packages():
    done = _pipec("--version")
    assert done.returncode == 0 and done.stdout == f"pipec {version()}\n"
    assert version() == "0.1.0"


# ---------------------------------------------------------- untrusted text escaped


def test_printable_escapes_controls_but_keeps_lines():
    assert printable("a\rb\x1b[2J\x00\x7f\x85\u202e\udcff\tc\nd") == "a\\rb\\x1b[2J\\x00\\x7f\\x85\\u202e\\udcff\tc\nd"
    assert UsageError("x\ry").render() == "x\\ry"
    assert RuntimeFault("m\r\nrank 1: fault", 0, 3, "0F0\x1b").render() == "rank 0, step 3 (0F0\\x1b): m\\r rank 1: fault"
    grid = [["0F0", "0B\r0"], ["1F0", "1B0"]]
    assert "\\r" in format_grid(grid, [(0, 1)]) and "\r" not in ProgramError("bad\x1b", 0, 1, grid).render()


def test_a_trace_whose_target_fakes_a_fault_line_is_shown_escaped(tmp_path, capsys):
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps({"traceEvents": [], "otherData": {
        "schedule": "gpipe", "params": {"P": 2, "N": 2}, "target": "x\rrank 0: fault"}}))
    assert main(["render", "--trace", str(trace), "-o", str(tmp_path / "run.html")]) == 1
    err = capsys.readouterr().err
    assert "\r" not in err and "x\\rrank 0: fault" in err, err
    assert "Traceback" not in err


def test_an_escape_sequence_in_a_source_line_is_quoted_escaped_under_its_caret(tmp_path, capsys):
    source = tmp_path / "bad.pipe"
    source.write_text("schedule bad(P: ranks = 2, N: microbatches = 2) {\n"
                      "  stages Q  // \x1b[2K\rrank 0: fault\n"
                      "  place stage s on rank s\n"
                      "  order rank r { for m in 0 .. N { F(r, m) } }\n"
                      "}\n")
    assert main(["check", str(source)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err, repr(err)
    assert "\\x1b[2K\\rrank 0: fault" in err, err
    error = SourceError("unknown", Span("f.pipe", 1, 8, 1, 9), "a \x1b[1m b = Q")
    line, caret = error.render().splitlines()[1:]
    assert line[caret.index("^")] == "b"  # the caret under the escaped text


# ------------------------------------------------------------------------ demo


def test_the_demo_writes_into_a_new_private_folder_not_a_planted_link(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    for name in ("pipec-demo-timeline.html", "pipec-demo-trace.json"):  # the old fixed names
        (tmp_path / name).symlink_to(victim)
    assert main(["demo", "--steps", "0"]) == 0
    out = capsys.readouterr().out
    assert victim.read_text() == "mine\n"
    folders = [entry for entry in tmp_path.iterdir() if entry.name.startswith("pipec-demo-") and entry.is_dir()]
    assert len(folders) == 1 and oct(folders[0].stat().st_mode & 0o777) == "0o700"
    assert f"the demo's files are in {folders[0]}" in out
    assert (folders[0] / "timeline.html").is_file()


def test_the_demo_keeps_the_schedules_own_parameters(tmp_path, capsys):
    two = tmp_path / "two.pipe"
    two.write_text("schedule tiny(P: ranks = 2, N: microbatches = 3) {\n"
                   "  stages P\n"
                   "  place stage s on rank s\n"
                   "  order rank r {\n"
                   "    for m in 0 .. N { F(r, m) }\n"
                   "    for m in 0 .. N { B(r, m) }\n"
                   "  }\n"
                   "}\n")
    assert main(["demo", "--schedule", f"{two}:tiny", "--steps", "0", "--timeline", str(tmp_path / "t.svg")]) == 0
    out = capsys.readouterr().out
    assert "(P=2, N=3)" in out and "compiled: 2 ranks" in out, out
    assert not any(entry.name.startswith("pipec-demo-") for entry in tmp_path.iterdir())
