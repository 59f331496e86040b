"""``pipec run`` and ``pipec demo``: checks before launching, the launch itself, torchrun's equivalence.

Multi-process runs are real: each starts 2 (the demo 4) worker processes on
CPU (gloo) under a hard deadline, and ``run_pipec`` reports any process of the
run still alive afterwards. The exactness of every schedule is
test_runtime_exact's; here one run is compared with one process and with the
same run under torchrun.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import pytest
import torch

from pipec.cli import build_parser, main
from pipec.commands import run as run_command
from pipec.runtime.model import ModelConfig, build_model
from pipec.runtime.reference import reference_run
from pipec.runtime.worker import build_parser as worker_parser

# Longest wall time of one multi-process run before the test kills it and fails.
DEADLINE_S = 90
# rank 0's line under torchrun; `pipec run` adds the step's speed and memory behind " | "
LOSS_LINE = re.compile(r"^step (\d+) loss (\S+)(?: grad norm \S+)?(?: \| .*)?$", re.M)
# Marks the processes of one run (through the environment every descendant inherits).
MARKER = "PIPEC_TEST_RUN_MARKER"


@dataclass
class Finished:
    """How a command ended: status, output, wall time, and the pids of its processes still alive."""

    status: int
    stdout: str
    stderr: str
    seconds: float
    survivors: list[int]

    def describe(self) -> str:
        return f"status {self.status} after {self.seconds:.1f} s\n--- stdout:\n{self.stdout}--- stderr:\n{self.stderr}"


def run_command_line(argv: list[str], deadline_s: float = DEADLINE_S, cwd=None) -> Finished:
    """Run ``python ARGV`` with a hard deadline and find any process it left behind.

    Every process the command starts inherits a unique environment marker; after
    the command ends, a process whose environment holds it is a survivor (it is
    killed, by pid, and reported). On the deadline the command is killed too.
    """
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{MARKER: marker}, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        stdout, stderr = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr += f"\n[test] killed after the {deadline_s} s deadline\n"
    seconds = time.monotonic() - start
    return Finished(proc.returncode, stdout, stderr, seconds, kill_survivors(marker))


def kill_survivors(marker: str) -> list[int]:
    """The processes marked ``marker`` still alive a second after their launcher returned, killed.

    The launcher reaps its workers before it returns; a dying one gets a moment to vanish.
    """
    survivors = _marked_processes(marker)
    for _ in range(20):
        if not survivors:
            break
        time.sleep(0.05)
        survivors = _marked_processes(marker)
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return survivors


def run_pipec(*args: str, deadline_s: float = DEADLINE_S, cwd=None) -> Finished:
    return run_command_line(["-m", "pipec", *args], deadline_s, cwd)


def _marked_processes(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment holds ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
            with open(f"/proc/{entry}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue  # gone, or not ours
        if needle in environ.split(b"\0") and state != b"Z":
            found.append(int(entry))
    return found


def losses_of(stdout: str) -> list[float]:
    return [float(value) for _, value in LOSS_LINE.findall(stdout)]


# ------------------------------------------------------- checks before launching


def test_a_schedule_the_checks_reject_fails_before_any_worker_starts(tmp_path, capsys, no_launch):
    bad = tmp_path / "backwards.pipe"
    bad.write_text(
        "schedule backwards(P: ranks = 2, N: microbatches = 2) {\n"
        "  stages P\n"
        "  place stage s on rank s\n"
        "  order rank r {\n"
        "    for m in 0 .. N { B(r, m) }\n"
        "    for m in 0 .. N { F(r, m) }\n"
        "  }\n"
        "}\n"
    )
    status = main(["run", str(bad), "--steps", "1"])
    _, err = capsys.readouterr()
    assert status == 1
    assert re.search(r"^rank \d, step \d+: ", err, re.M), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["gpipe", "-D", "P=2", "-D", "N=2", "--nproc", "3"], ["--nproc 3", "2 ranks"]),
        (["gpipe", "-D", "P=3", "-D", "N=3"], ["8 layers", "3 chunks"]),
        (["gpipe", "-D", "P=2", "--steps", "0"], ["--steps"]),
        (["gpipe", "-D", "P=2", "--model", "no_such_module_here:SPEC"], ["no_such_module_here"]),
        (["no_such_schedule"], ["no file or shipped schedule"]),
    ],
)
def test_a_launch_that_cannot_work_fails_before_any_worker_starts(argv, words, capsys, no_launch):
    status = main(["run", *argv])
    _, err = capsys.readouterr()
    assert status == 1
    for word in words:
        assert word in err
    assert "Traceback" not in err


def test_the_worker_accepts_exactly_what_the_launcher_passes(tmp_path):
    given = [
        "run", "zb_h1", "-D", "P=2", "-D", "N=4", "--steps", "7", "--backend", "gloo", "--seed", "3",
        "--timeout", "2.5", "--model", "pipec.runtime.model:LLAMA", "--config", "layers=4", "--trace", "t.json",
    ]
    args = build_parser().parse_args(given)
    passed = run_command.worker_arguments(args)
    worker = worker_parser().parse_args(passed)
    assert (worker.target, worker.defines, worker.steps, worker.seed, worker.timeout) == ("zb_h1", ["P=2", "N=4"], 7, 3, 2.5)
    assert worker.config == ["layers=4"] and worker.model == "pipec.runtime.model:LLAMA"
    assert worker.trace == os.path.abspath("t.json") and worker.save is None
    # an option the user did not give is not passed: the worker's default stays the one default
    bare = run_command.worker_arguments(build_parser().parse_args(["run", "gpipe"]))
    assert bare == ["gpipe"]


# --------------------------------------------------------------- real launches


def test_pipec_run_trains_exactly_and_torchrun_runs_the_same(tmp_path):
    schedule = ["1f1b", "-D", "P=2", "-D", "N=4", "--steps", "3", "--seed", "5"]
    ours = run_pipec("run", *schedule, "--save", "ours.pt", "--trace", "trace.json", cwd=tmp_path)
    assert ours.status == 0, ours.describe()
    assert not ours.survivors
    torchrun = run_command_line(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "pipec.runtime",
         *schedule, "--save", "torchrun.pt"],
        cwd=tmp_path,
    )
    assert torchrun.status == 0, torchrun.describe()
    assert not torchrun.survivors

    # the same run: same losses, same parameters bit for bit
    assert len(losses_of(ours.stdout)) == 3
    assert losses_of(ours.stdout) == losses_of(torchrun.stdout)
    saved = torch.load(tmp_path / "ours.pt")
    other = torch.load(tmp_path / "torchrun.pt")
    assert saved.keys() == other.keys()
    assert all(torch.equal(saved[name], other[name]) for name in saved)

    # the whole model's keys, and the one-process result within fp32 rounding
    reference = reference_run(ModelConfig(), 3, 4, 5)
    assert set(saved) == set(build_model(ModelConfig(), 5).state_dict())
    for name, tensor in reference.state_dict.items():
        assert torch.allclose(saved[name], tensor, atol=1e-5, rtol=0), name
    assert losses_of(ours.stdout) == pytest.approx(reference.losses, abs=1e-5)

    # one trace, every rank, every instruction of every step
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["otherData"]["target"] == "1f1b"  # what `pipec render --trace` compiles again
    spans = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    for rank in (0, 1):
        names = [event["name"] for event in spans if event["pid"] == rank]
        assert sum(name == f"{rank}F0" for name in names) == 3  # one forward of microbatch 0 per step
        assert all(event["dur"] >= 0 for event in spans)

    # the run's own cost file: every chunk's F and B, measured
    assert main(["costs", "--trace", str(tmp_path / "trace.json"), "-o", str(tmp_path / "costs.json")]) == 0
    measured = json.loads((tmp_path / "costs.json").read_text())["compute"]["per_chunk"]
    assert set(measured) == {"0", "1"} and all(times["F"] > 0 and times["B"] > 0 for times in measured.values())


def test_the_demo_trains_on_four_ranks_and_its_loss_falls(tmp_path):
    trace = tmp_path / "demo.json"
    done = run_pipec("demo", "--steps", "6", "--trace", str(trace), cwd=tmp_path)
    assert done.status == 0, done.describe()
    assert not done.survivors
    losses = losses_of(done.stdout)
    assert len(losses) == 6 and losses[-1] < losses[0], done.stdout
    assert "loss fell" in done.stdout and str(trace) in done.stdout
    # the run's own costs priced into a prediction, beside the measured step
    assert re.search(r"median step \d+\.\d ms; the simulator, priced with the times this run measured, "
                     r"predicts \d+\.\d ms", done.stdout), done.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {event["pid"] for event in events if event["ph"] == "X"} == {0, 1, 2, 3}
