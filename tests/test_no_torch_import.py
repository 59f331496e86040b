"""The compile-side commands never import torch (issue 25, "commands start at once").

``import torch`` takes seconds; ``pipec check`` takes a fraction of one without it.
Only the commands that run models (``run``, ``demo``, ``attention``, ``profile``)
import it, and ``compile --format torch-csv-comms``, which writes the form the
installed torch's runtime loads and so looks at that torch (``emit.torch_csv.installed_torch_runtime``).

Each command runs in a fresh interpreter (an import made by another test cannot
hide one), through ``pipec.cli.main`` as the ``pipec`` script calls it, and
reports whether ``torch`` is in ``sys.modules`` when it has finished.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from pipec.cli import main
from pipec.compiler.driver import compile_target
from test_measured_costs import planted_trace

# Runs the command line with the arguments it is given, then prints, last on standard error,
# whether torch was imported. main may end in SystemExit (--version, --help, usage errors).
_PROBE = """\
import sys
from pipec.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit_:
    status = exit_.code
sys.stdout.flush()
sys.stderr.write(f"\\nstatus={status} torch={'torch' in sys.modules}\\n")
"""

LAYERS = {"layers": [
    {"name": "embed", "F": 0.18, "B": 0.10, "activation": 4096, "parameters": 8192},
    {"name": "layer0", "F": 0.52, "B": 0.72, "activation": 4096, "parameters": 41216},
    {"name": "layer1", "F": 0.52, "B": 0.72, "activation": 4096, "parameters": 41216},
    {"name": "head", "F": 0.30, "B": 0.40, "activation": 0, "parameters": 8192},
]}

COMMANDS = {
    "list": ["list"],
    "check": ["check", "1f1b", "-D", "P=4", "-D", "N=8"],
    "check-rings": ["check", "tasp", "-D", "P=5"],
    "simulate": ["simulate", "weipipe", "-D", "P=4", "-D", "N=8", "--json"],
    "compile-json": ["compile", "bitpipe", "-D", "P=4", "-D", "N=4", "--format", "json", "-o", "program.json"],
    "compile-torch-csv": ["compile", "1f1b", "-D", "P=4", "-D", "N=8", "--format", "torch-csv", "-o", "out.csv"],
    "compile-text": ["compile", "1f1b", "-D", "P=2", "-D", "N=2", "--format", "text"],
    "render-svg": ["render", "1f1b", "-D", "P=4", "-D", "N=8", "-o", "timeline.svg"],
    "render-trace": ["render", "--trace", "run.json", "-o", "run.html"],
    "rings": ["rings", "5"],
    "import-torch": ["import-torch", "schedule.csv"],
    "partition": ["partition", "--costs", "layers.json", "-D", "P=2", "-o", "part.json",
                  "--schedule-out", "part.pipe", "--costs-out", "chunks.json"],
    "costs": ["costs", "--trace", "run.json"],
    "search": ["search", "zb_h1", "-D", "P=2", "-D", "N=2", "--memory", "2,1", "--time-limit", "10"],
    "version": ["--version"],
    "help": ["--help"],
    "usage-error": ["check"],
}
# What each command exits with: 0, but a usage error (a missing target) exits 1.
STATUS = {"usage-error": 1}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A folder with the files the commands read: a torch CSV written by ``pipec compile``, a layer cost
    file, a run's trace."""
    folder = tmp_path_factory.mktemp("inputs")
    collecting = gc.isenabled()
    try:  # main turns the collector off for its short process; this one goes on
        assert main(["compile", "1f1b", "-D", "P=4", "-D", "N=8", "--format", "torch-csv",
                     "-o", str(folder / "schedule.csv")]) == 0
    finally:
        if collecting:
            gc.enable()
    (folder / "layers.json").write_text(json.dumps(LAYERS))
    program = compile_target("zb_h1", {"P": "2", "N": "6"}).program
    (folder / "run.json").write_text(json.dumps(planted_trace(program, target="zb_h1")))
    return folder


def run_probe(argv: list[str], cwd) -> tuple[int, bool, str]:
    """Run ``pipec ARGV`` in a fresh interpreter in ``cwd``: (its status, whether torch was imported, its stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    last = done.stderr.rstrip("\n").rsplit("\n", 1)[-1]
    fields = dict(field.split("=", 1) for field in last.split())
    return int(fields["status"]), fields["torch"] == "True", done.stderr


@pytest.mark.parametrize("name", COMMANDS)
def test_a_compile_side_command_imports_no_torch(name, inputs):
    status, imported, err = run_probe(COMMANDS[name], inputs)
    assert status == STATUS.get(name, 0), err
    assert not imported, f"`pipec {' '.join(COMMANDS[name])}` imported torch"


def test_the_probe_sees_an_import_where_there_is_one(inputs):
    """``compile --format torch-csv-comms`` asks the installed torch what its runtime loads: the probe sees it."""
    status, imported, err = run_probe(["compile", "1f1b", "-D", "P=2", "-D", "N=2", "--format", "torch-csv-comms"],
                                      inputs)
    assert status == 0, err
    assert imported


# The Python API's compile-side surface (docs/api.md), used as a user would: none of it imports torch;
# nor does importing pipec.torch, whose helper imports torch when it is called.
_API_PROBE = """\
import sys
import pipec
import pipec.torch
program = pipec.compile("1f1b", {"P": 4, "N": 8})
program.check(memory_budget=4)
assert program.simulate().makespan == 33
again = pipec.load(program.to_json())
again.render("timeline.svg")
again.to_torch_csv()
again.to_text()
print(f"torch={'torch' in sys.modules}")
"""


def test_the_python_api_imports_no_torch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _API_PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch=False"
    assert (tmp_path / "timeline.svg").exists()


def test_import_pipec_loads_no_compiler():
    """``import pipec`` costs what ``pipec.errors`` costs: the API is loaded on first use (PEP 562)."""
    probe = "import sys, pipec\nprint(sorted(m for m in sys.modules if m.startswith('pipec')))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['pipec', 'pipec.errors']"
