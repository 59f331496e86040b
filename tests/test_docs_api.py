"""The examples of docs/api.md and docs/torch.md run as they are written.

Each page's fenced blocks are taken from the page itself: ```python blocks run
top to bottom in one fresh interpreter (in an empty folder, as a reader would
paste them), ```console lines (``$ pipec ...``) through the installed command
line, and the training script of docs/torch.md on 2 gloo processes. A page
whose example stops working fails here, naming the page and the block.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from runtime_util import _launch

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")
# A fresh interpreter compiling a few schedules, or 2 processes importing torch and training 3 steps: seconds
# on a quiet machine; generous, as the machine running the tests may be loaded.
DEADLINE_S = 240

_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


def blocks(page: str, language: str) -> list[str]:
    """The fenced blocks of ``docs/PAGE`` in ``language``, in page order."""
    with open(os.path.join(DOCS, page), encoding="utf-8") as handle:
        text = handle.read()
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def run_python(code: str, cwd, *, torch_allowed: bool) -> subprocess.CompletedProcess:
    """``code`` as a script in a fresh interpreter in ``cwd``; it prints whether torch was imported, last."""
    probe = "\nimport sys\nprint('torch imported:', 'torch' in sys.modules)\n"
    script = cwd / "example.py"
    script.write_text(code + probe)
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True,
                          timeout=DEADLINE_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    if not torch_allowed:
        assert done.stdout.rstrip().endswith("torch imported: False"), "the example imported torch"
    return done


def test_the_api_page_has_examples():
    assert len(blocks("api.md", "python")) >= 5


def test_the_api_page_runs_as_written_without_torch(tmp_path):
    run_python("\n".join(blocks("api.md", "python")), tmp_path, torch_allowed=False)


def test_an_api_example_that_is_wrong_fails(tmp_path):
    """The harness sees a failing example (the pages' asserts are what is tested)."""
    with pytest.raises(AssertionError):
        run_python("import pipec\nassert pipec.compile('1f1b', {'P': 4, 'N': 8}).simulate().makespan == 34\n",
                   tmp_path, torch_allowed=False)


def test_the_torch_pages_hand_placed_schedule_is_the_one_the_torch_path_test_trains():
    (doc,) = blocks("torch.md", "pipe")
    with open(os.path.join(HERE, "hand_placed.pipe"), encoding="utf-8") as handle:
        tested = "".join(line for line in handle if not line.startswith("#"))
    assert doc == tested


def test_the_torch_pages_training_script_trains(tmp_path):
    script, _ = blocks("torch.md", "python")
    (tmp_path / "train.py").write_text(script)
    run = _launch([sys.executable, str(tmp_path / "train.py")], 2, DEADLINE_S, None)
    assert run.ok, run.describe()
    losses = [float(value) for value in re.findall(r"rank 0, step \d: loss ([0-9.]+)", run.stdout[0])]
    assert len(losses) == 3, run.stdout
    assert not run.stdout[1].strip(), "only the rank of the last stage has losses"


def test_the_torchtitan_recipe_runs(tmp_path):
    """The console lines make the CSVs the recipe names; the placement check passes as written."""
    (tmp_path / "hand_placed.pipe").write_text(blocks("torch.md", "pipe")[0])
    lines = [line[2:] for block in blocks("torch.md", "console") for line in block.splitlines() if line.startswith("$ ")]
    assert lines
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "pipec"
        done = subprocess.run([sys.executable, "-m", "pipec", *argv[1:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=DEADLINE_S)
        assert done.returncode == 0, f"{line}: {done.stderr}"
    first = (tmp_path / "zbv.csv").read_text().splitlines()[0].split(",")
    assert first[0] == "0F0" and "7F0" in first, "zbv's rank 0 holds stages 0 and 7"
    _, placements = blocks("torch.md", "python")
    run_python(placements, tmp_path, torch_allowed=False)
