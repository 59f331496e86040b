"""One deadline for every phase of a run (issue 24, item 1): a stopped or hung rank ends the run, named.

A worker is stopped at a precise phase by the test hook ``PIPEC_TEST_STOP_AT=RANK:PHASE``
(runtime/phases.py: the rank sends itself SIGSTOP on entering the phase), so
nothing depends on sleeping and hoping. Each run must end within ``--timeout``
+ 10 s of the stop (the stopped rank's phase file, kept in the run's folder,
says when it entered the phase), with exit status 1, the line ``rank R (host H),
phase X: waited T s``, no traceback, and no process of the run left alive.
"""
from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time

import pytest

from test_run_cli import run_command_line, run_pipec

from pipec.runtime.phases import STOP_AT_ENV, phase_file
from slow_build_spec import SLOW_BUILD_S

TESTS = os.path.dirname(os.path.abspath(__file__))

TIMEOUT_S = 5
# --join-timeout where a test waits for a phase of getting ready to overrun (start-up, under load, fits in it).
JOIN_S = 15
# How long after the stop the run may end (the promise).
GRACE_S = 10
# Deadline of a whole run: start-up of three Pythons with torch on a loaded machine, plus the above.
DEADLINE_S = 120
ONE_F_ONE_B = ["1f1b", "-D", "P=2", "-D", "N=4", "--steps", "2", "--timeout", str(TIMEOUT_S)]
PHASE_LINE = re.compile(r"^rank (\d+) \(host .+\), phase (.+?): waited (\d+\.\d) s \((.*)\)$", re.M)
LOG_FOLDER = re.compile(r"^worker logs: (.+)$", re.M)


def _stopped_run(monkeypatch, rank: int, phase: str):
    monkeypatch.setenv(STOP_AT_ENV, f"{rank}:{phase}")
    done = run_pipec("run", *ONE_F_ONE_B, deadline_s=DEADLINE_S)
    ended = time.time()
    assert done.status == 1, done.describe()
    assert "Traceback" not in done.stderr, done.describe()
    assert not done.survivors, f"processes left behind: {done.survivors}\n{done.describe()}"
    named = PHASE_LINE.search(done.stderr)
    assert named, done.describe()
    assert (int(named.group(1)), named.group(2)) == (rank, phase), done.describe()
    assert TIMEOUT_S <= float(named.group(3)) < TIMEOUT_S + GRACE_S, done.describe()
    assert "stopped" in named.group(4), done.describe()
    folder = LOG_FOLDER.search(done.stderr).group(1)
    with open(phase_file(folder, rank), encoding="utf-8") as handle:
        record = json.load(handle)
    assert record["phase"] == phase and record["rank"] == rank
    assert ended - record["since"] < TIMEOUT_S + GRACE_S, done.describe()  # from the stop to the run's end
    return done


def test_a_worker_stopped_in_group_formation_ends_the_run_named(monkeypatch):
    # before this, the run waited 300 s in the process group's rendezvous and ended in a traceback
    _stopped_run(monkeypatch, 1, "group formation")


def test_a_worker_stopped_in_model_build_ends_the_run_named(monkeypatch):
    _stopped_run(monkeypatch, 1, "model build")


def test_a_worker_stopped_entering_step_1_ends_the_run_named(monkeypatch):
    done = _stopped_run(monkeypatch, 0, "step 1")
    assert "step 1 loss" not in done.stdout, done.describe()


def test_a_checkpoint_load_is_under_the_deadline_too(monkeypatch, tmp_path):
    saved = tmp_path / "model.pt"
    first = run_pipec("run", "1f1b", "-D", "P=2", "-D", "N=4", "--steps", "1", "--save", str(saved),
                      deadline_s=DEADLINE_S)
    assert first.status == 0, first.describe()
    monkeypatch.setenv(STOP_AT_ENV, "1:checkpoint load")
    done = run_pipec("run", *ONE_F_ONE_B, "--resume", str(saved), deadline_s=DEADLINE_S)
    assert done.status == 1 and "Traceback" not in done.stderr and not done.survivors, done.describe()
    named = PHASE_LINE.search(done.stderr)
    assert named and named.group(1, 2) == ("1", "checkpoint load"), done.describe()


HANGING_MODULE = textwrap.dedent("""\
    import time
    while True:  # an import that never returns, as a module waiting on a lock or a network share would
        time.sleep(0.05)
""")


@pytest.fixture
def hanging_model(tmp_path, monkeypatch):
    (tmp_path / "hangs_on_import.py").write_text(HANGING_MODULE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    return "hangs_on_import:SPEC"


def test_a_model_module_whose_import_hangs_is_named_by_pipec_run(hanging_model):
    # importing the user's module is getting ready: --join-timeout bounds it, not a step's --timeout
    done = run_pipec("run", *ONE_F_ONE_B, "--model", hanging_model, "--join-timeout", str(JOIN_S),
                     deadline_s=DEADLINE_S)
    assert done.status == 1 and "Traceback" not in done.stderr and not done.survivors, done.describe()
    assert re.search(r"^pipec run \(host .+\), phase model build: waited (\d+\.\d) s", done.stderr, re.M), \
        done.describe()
    assert done.seconds < JOIN_S + GRACE_S + 20, done.describe()  # + one Python's start-up


def test_a_model_module_whose_import_hangs_is_named_by_the_worker_itself(hanging_model):
    # the torchrun entry: the worker's own watch, no launcher watching it (alone, it is rank 0 of 1)
    done = run_command_line(["-m", "pipec.runtime", "1f1b", "-D", "P=1", "-D", "N=2", "--steps", "1",
                             "--timeout", str(TIMEOUT_S), "--join-timeout", str(JOIN_S), "--model", hanging_model],
                            DEADLINE_S)
    assert done.status == 1 and "Traceback" not in done.stderr and not done.survivors, done.describe()
    named = PHASE_LINE.search(done.stderr)
    assert named and named.group(1, 2) == ("0", "model build"), done.describe()
    assert JOIN_S <= float(named.group(3)) < JOIN_S + GRACE_S, done.describe()


def test_a_slow_build_is_getting_ready_and_a_fault_after_it_is_named_at_the_steps_timeout(monkeypatch):
    """Rank 1 builds its chunks for 6 s, past --timeout + 3 s, and rank 0 waits that long at the barrier: both
    are getting ready, bounded by --join-timeout; then rank 1 hangs at its first instruction, and rank 0 names
    it at the step's --timeout. (Before, the build's phase had --timeout + 3 s, and the run ended there naming
    the model build: a fault's deadline depended on how fast the machine ran the phases before the fault.)"""
    timeout = 1.5
    assert SLOW_BUILD_S > timeout + 3
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    done = run_pipec("run", "1f1b", "-D", "P=2", "-D", "N=4", "--steps", "2", "--timeout", str(timeout),
                     "--model", "slow_build_spec:SPEC", "--inject", "hang:1:0", deadline_s=DEADLINE_S)
    assert done.status == 1 and "Traceback" not in done.stderr and not done.survivors, done.describe()
    assert not PHASE_LINE.search(done.stderr), done.describe()  # no phase overran: the fault is the step's
    match = re.search(r"^rank 0, step \d+ \(.*\): waited (\d+(?:\.\d+)?) s for rank 1: no answer within the "
                      r"timeout.*training step 1$", done.stderr, re.M)
    assert match and timeout <= float(match.group(1)) < timeout + 2.0, done.describe()


def test_the_test_hook_names_a_phase_the_worker_announces():
    # a hook naming a phase no worker enters would make the tests above wait for nothing
    from pipec.runtime import phases

    for phase in ("group formation", "model build", "checkpoint load"):
        assert phase in phases.PHASES
    assert phases.step_phase(1) == "step 1"
    assert sys.modules["pipec.runtime.phases"] is phases


LEFTOVER_WATCH = textwrap.dedent("""\
    import time
    from pipec.runtime import phases

    with phases.launcher_checks(0.1, 0.1):  # what `pipec run` called from Python does before it launches
        phases.announce(phases.MODEL_BUILD)
    phases.announce(phases.CHECKPOINT_SAVE)  # later in the same process: an in-process training's save
    time.sleep(phases.MARGIN_S + 1.0)  # past the deadline a leftover watch would have given that phase
    print("alive", phases._current is None)
""")


def test_pipec_runs_own_watch_ends_with_its_checks():
    # before this, the watch `pipec run` started for its checks stayed in the process: a later announce armed
    # it, and it ended the process (os._exit) when that phase outlived --timeout + MARGIN_S (it killed pytest
    # workers that had run `pipec run` in-process)
    done = run_command_line(["-c", LEFTOVER_WATCH], 60)
    assert done.status == 0 and done.stdout.strip() == "alive True", done.describe()
