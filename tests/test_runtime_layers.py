"""Layers and hand-offs between the command line, the compiler and the runtime.

* Imports go one way (DESIGN.md section 1): the runtime never imports the
  command line, the compiler neither the runtime nor the command line, the
  front end none of them, and the compiler's passes never import its checks.
* ``pipec run`` compiles once and hands the workers the program: with
  ``--program`` a worker loads it and compiles nothing.
* The device map reaches the runtime: a rank's GPU on its node, and a clear
  error for a map that would move a rank to another node.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipec.cli import main
from pipec.commands import run as run_command
from pipec.compiler import driver
from pipec.compiler.driver import compile_target
from pipec.errors import UsageError
from pipec.runtime import worker

ROOT = Path(__file__).resolve().parents[1]
# Top-level folders and the import names they install as (pyproject's package-dir).
PACKAGES = {"dsl": "pipec.dsl", "compiler": "pipec.compiler", "runtime": "pipec.runtime", "examples": "pipec.examples"}
# For each folder, the modules its code must not import (the module or anything under it).
FORBIDDEN = {
    "examples": ("pipec.commands", "pipec.cli"),
    "runtime": ("pipec.commands", "pipec.cli", "pipec.examples"),
    "compiler": ("pipec.runtime", "pipec.commands", "pipec.cli", "pipec.examples"),
    "dsl": ("pipec.compiler", "pipec.runtime", "pipec.commands", "pipec.cli", "pipec.examples"),
}
CHECKS = "pipec.compiler.checks"
# The modules whose job is to run the checks: the driver (after the last pass)
# and the torch CSV import. Every other compiler module (the passes, the
# simulator, the emitters, the renderers, the IR and its tables) must not
# import a check: passes produce programs, the checks judge them.
CHECK_RUNNERS = ("compiler/driver.py", "compiler/import_torch.py")


# ------------------------------------------------------------------ imports


def module_name(path: Path) -> str:
    """The import name of a source file under one of PACKAGES, e.g. compiler/checks/memory.py -> pipec.compiler.checks.memory."""
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path) -> set[str]:
    """Every module an ``import`` anywhere in the file names (lazy imports inside functions too).

    ``from A import B`` counts as A and as A.B (B may be a module); relative
    imports are resolved against the file's package.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def within(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def forbidden_edges(files, forbidden) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_names(path))
        if any(within(name, module) for module in forbidden)
    ]


def test_the_walker_sees_imports_of_every_form(tmp_path, monkeypatch):
    # guard the guard: lazy, dotted, from-import of a module, relative
    fake = tmp_path / "runtime" / "sub"
    fake.mkdir(parents=True)
    (fake / "mod.py").write_text(
        "def f():\n    from pipec.commands._common import x\n"
        "import pipec.cli\nfrom pipec import commands\nfrom .. import worker\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    names = imported_names(fake / "mod.py")
    assert {"pipec.commands._common", "pipec.cli", "pipec.commands", "pipec.runtime.worker"} <= names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layers_import_only_downwards(folder):
    files = sources(folder)
    assert files, f"no sources under {folder}/"
    assert forbidden_edges(files, FORBIDDEN[folder]) == []


def test_no_pass_imports_a_check():
    passes = [path for path in sources("compiler")
              if "checks" not in path.relative_to(ROOT).parts
              and str(path.relative_to(ROOT)) not in CHECK_RUNNERS]
    assert ROOT / "compiler" / "lower_comms.py" in passes and ROOT / "compiler" / "simulate.py" in passes
    assert forbidden_edges(passes, (CHECKS,)) == []


def test_the_defines_parser_is_one_function_shared_by_the_cli_and_the_runtime():
    from pipec.commands import _common
    from pipec.compiler.defines import parse_defines

    assert _common.parse_defines is parse_defines
    assert parse_defines([" P = 4", "N=8"]) == {"P": "4", "N": "8"}
    for bad, words in ((["P"], "NAME=VALUE"), (["=3"], "NAME=VALUE"), (["P=4", "P=5"], "given twice")):
        with pytest.raises(UsageError, match=words):
            parse_defines(bad)


# ------------------------------------------------- compile once, load in workers


@pytest.fixture
def no_compiling(monkeypatch):
    """Fail the test if anything compiles a target from here on."""

    def refuse(*args, **kwargs):
        raise AssertionError("compile_target was called")

    monkeypatch.setattr(driver, "compile_target", refuse)


def test_a_worker_given_a_program_file_does_not_compile(tmp_path, monkeypatch):
    program = compile_target("zb_h1", {"P": "2", "N": "4"}).program
    path = run_command.write_program(program, str(tmp_path))
    monkeypatch.setattr(driver, "compile_target", lambda *a, **k: pytest.fail("the worker compiled"))
    config = worker.parse_run_config(["zb_h1", "-D", "P=2", "-D", "N=4", "--program", path])
    plan = worker.make_plan(config, world=2)
    assert plan.program == program
    # the world size is still checked against the loaded program
    with pytest.raises(UsageError, match="compiled for 2 ranks"):
        worker.make_plan(config, world=3)


def test_a_worker_without_a_program_file_compiles_the_target():
    config = worker.parse_run_config(["zb_h1", "-D", "P=2", "-D", "N=4"])
    assert config.program is None
    assert worker.make_plan(config, world=2).program == compile_target("zb_h1", {"P": "2", "N": "4"}).program


@pytest.mark.parametrize("content, words", [(None, "cannot read the program"), ("{not json", "is not JSON"),
                                            ('{"format": "other"}', "not a pipec program")])
def test_a_bad_program_file_is_a_usage_error(tmp_path, content, words):
    path = tmp_path / "program.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(Exception, match=words) as caught:
        worker.load_program(str(path))
    from pipec.errors import PipecError

    assert isinstance(caught.value, PipecError)


def test_pipec_run_writes_the_program_once_and_the_workers_load_it(tmp_path, monkeypatch):
    """The whole hand-off without processes: what ``pipec run`` launches loads the program it compiled."""
    compiled = compile_target("1f1b", {"P": "2", "N": "4"}).program
    launched = {}

    def fake_launch(python_args, nproc, *, run_dir=None, **options):
        # from here on nothing may compile: the workers only load
        monkeypatch.setattr(driver, "compile_target", lambda *a, **k: pytest.fail("a worker compiled"))
        launched.update(python_args=python_args, nproc=nproc, run_dir=run_dir,
                        listing=sorted(os.listdir(run_dir)))
        assert python_args[:2] == ["-m", run_command.WORKER_MODULE]
        config = worker.parse_run_config(python_args[2:])
        launched["plan"] = worker.make_plan(config, nproc)
        launched["target"] = config.target
        shutil.rmtree(run_dir)  # as launch does after a successful run
        return run_command.LaunchResult(ok=True)

    monkeypatch.setattr(run_command, "launch", fake_launch)
    assert main(["run", "1f1b", "-D", "P=2", "-D", "N=4", "--steps", "1"]) == 0
    assert launched["nproc"] == 2 and launched["target"] == "1f1b"
    program_path = launched["python_args"][launched["python_args"].index("--program") + 1]
    # in the run's own folder, written whole (no temporary file left beside it)
    assert os.path.dirname(program_path) == launched["run_dir"]
    assert launched["listing"] == [run_command.PROGRAM_FILE]
    assert launched["plan"].program == compiled
    assert not os.path.exists(launched["run_dir"])


def test_write_program_replaces_atomically(tmp_path):
    first = compile_target("1f1b", {"P": "2", "N": "4"}).program
    second = compile_target("gpipe", {"P": "2", "N": "2"}).program
    path = run_command.write_program(first, str(tmp_path))
    assert run_command.write_program(second, str(tmp_path)) == path
    assert worker.load_program(path) == second
    assert os.listdir(tmp_path) == [run_command.PROGRAM_FILE]


def test_write_program_into_a_missing_folder_is_a_usage_error(tmp_path):
    program = compile_target("1f1b", {"P": "2", "N": "2"}).program
    with pytest.raises(UsageError, match="cannot write the compiled program"):
        run_command.write_program(program, str(tmp_path / "gone"))


# --------------------------------------------------------------- device map


@pytest.mark.parametrize(
    "devices, rank, local_rank, node_size, expected",
    [
        (None, 5, 1, 4, 1),                      # no map: LOCAL_RANK
        ([0, 3, 2, 1], 1, 1, 4, 3),              # BitPipe P=4 on one node of 4
        ([0, 3, 2, 1], 3, 3, 4, 1),
        ([1, 0, 3, 2], 2, 0, 2, 1),              # second node of 2: device 3 is its GPU 1
        ([1, 0, 3, 2], 3, 1, 2, 0),
        ([4, 5, 6, 7, 0, 1, 2, 3], 0, 0, 8, 4),  # one node of 8
    ],
)
def test_a_rank_runs_on_the_gpu_of_its_node_the_map_gives_it(devices, rank, local_rank, node_size, expected):
    assert worker.device_index(devices, rank, local_rank, node_size) == expected


def test_a_map_that_moves_a_rank_to_another_node_is_rejected_with_its_rank_and_device():
    with pytest.raises(UsageError) as caught:
        worker.device_index([0, 3, 2, 1], 1, 1, 2)
    message = caught.value.render()
    assert "rank 1 on device 3" in message and "another node" in message and "0..1" in message
    with pytest.raises(UsageError, match="rank 1 on device 3"):
        worker.check_device_map([0, 3, 2, 1], world=4, node_size=2)
    worker.check_device_map([0, 3, 2, 1], world=4, node_size=4)  # one node: any permutation
    worker.check_device_map(None, world=4, node_size=1)


def test_pipec_run_checks_the_map_before_launching_on_gpus(monkeypatch, capsys):
    """One node of P workers can honour any map; a map the node cannot honour stops the run with exit 1."""
    monkeypatch.setattr(run_command, "_check_gpus", lambda nproc: None)  # pretend: 4 GPUs

    def launched(python_args, nproc, *, run_dir=None, **options):
        shutil.rmtree(run_dir)
        return run_command.LaunchResult(ok=True)

    monkeypatch.setattr(run_command, "launch", launched)
    assert main(["run", "bitpipe", "-D", "P=4", "-D", "N=4", "--backend", "nccl"]) == 0
    # the same map on nodes of 2 GPUs (what the check would see on a smaller node)
    real = worker.check_device_map
    monkeypatch.setattr(worker, "check_device_map", lambda devices, world, node_size: real(devices, world, 2))
    assert main(["run", "bitpipe", "-D", "P=4", "-D", "N=4", "--backend", "nccl"]) == 1
    err = capsys.readouterr().err
    assert "rank 1 on device 3" in err and "Traceback" not in err


def test_a_torchrun_worker_rejects_the_map_before_joining_the_group():
    env = dict(os.environ, RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "pipec.runtime", "bitpipe", "-D", "P=4", "-D", "N=4", "--backend", "nccl"],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1, done.stderr
    assert "rank 1 on device 3" in done.stderr and "Traceback" not in done.stderr


def test_on_gloo_the_map_changes_nothing():
    import torch

    assert worker._device("gloo", 3) == torch.device("cpu")

