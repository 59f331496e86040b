"""Every line of README.md's "Using it" runs as written on a fresh clone (issue 25, item 7).

The lines are read from the README itself, in order, and run by bash in one fresh folder, so a line
that makes a file (``schedule.csv``, ``layers.json``, ``part.pipe``) makes it for the lines after it,
as it would for a reader going down the list. The lines that train for long, start worker processes
or need what a fresh clone has not are skipped, each with its reason (``SKIPPED``); every other one
must exit 0 without a traceback. Each command is at most a few seconds (profile, the slowest, about 3).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# A README line's trailing comment: two or more spaces, then '#'.
_COMMENT = re.compile(r"\s{2,}#\s.*$")

# The start of a line -> why it is not run here.
SKIPPED = {
    "pipec run ": "trains with worker processes for 10 s to minutes (tests/test_run_cli.py and the runtime "
                  "tests run schedules on tiny models)",
    "torchrun ": "trains under torchrun (tests/test_multinode.py covers the launch)",
    "pipec attention ": "starts 3 worker processes (tests/test_ring_runtime.py)",
    "pipec costs --trace run.json": "needs run.json, written by the skipped `pipec run zb_h1 ... --trace run.json` "
                                    "(tests/test_spread.py and tests/test_measured_costs.py run pipec costs)",
    "pipec simulate zb_h1 -D P=4 -D N=8 --json --costs my_costs.json": "needs my_costs.json from the skipped "
                                                                       "`pipec costs` line",
    "pipec render --trace run.json": "needs run.json, written by the skipped `pipec run zb_h1 ... --trace run.json` "
                                     "(tests/test_render.py draws traces)",
    "python benchmarks/": "a benchmark, run from the clone (tests/test_bitpipe_benchmark.py)",
    "python -m pipec.examples.make_tokens notes.txt": "needs the reader's notes.txt, then trains",
}


def using_it_lines() -> list[str]:
    """The command lines of README.md's "Using it" section (its indented lines before the example
    schedule's fenced block), comments cut, in order."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0].split("\n```", 1)[0]  # not the .pipe example
    return [_COMMENT.sub("", line).strip() for line in section.splitlines() if line.startswith("    ")]


def _why_skipped(line: str) -> str | None:
    for start, reason in SKIPPED.items():
        if line.startswith(start):
            return reason
    if "mymodel:SPEC" in line:
        return "needs the reader's own model file, mymodel.py (docs/runtime.md, \"Your own model\")"
    if ".png" in line and shutil.which("dot") is None:
        return "a .png needs Graphviz's dot on the PATH"
    return None


LINES = using_it_lines()


def test_the_section_has_lines_and_every_skip_reason_is_used():
    assert len(LINES) >= 20
    for start in SKIPPED:
        assert any(line.startswith(start) for line in LINES), f"no README line starts with {start!r}: drop it"


@pytest.fixture(scope="module")
def fresh_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("line", LINES)
def test_the_line_runs_as_written(line, fresh_folder):
    reason = _why_skipped(line)
    if reason is not None:
        pytest.skip(reason)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # `pipec` as the README's reader has it: the venv's, first on the PATH (an activated venv)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    done = subprocess.run(["bash", "-c", line], cwd=fresh_folder, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, done.stderr
