"""Launch ``python -m pipec.runtime`` workers from tests, the way torchrun would, with a hard deadline.

Each worker is a subprocess with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and OMP_NUM_THREADS=1,
in its own session so that it and anything it starts can be killed as a group.
A run that outlives its deadline is killed and reported as timed out, so a
hang fails a test instead of stalling the suite; no worker outlives ``launch_workers``.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

# How often the launcher looks at its workers, seconds.
_POLL_S = 0.02


@dataclass
class WorkerRun:
    """How a multi-process run ended.

    Attributes:
        returncodes: per rank (negative: killed by that signal).
        stdout, stderr: per rank, everything it wrote.
        timed_out: the deadline passed and the workers were killed.
        seconds: wall time of the run.
    """

    returncodes: list[int]
    stdout: list[str]
    stderr: list[str]
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def describe(self) -> str:
        """Everything the workers said, for an assertion message."""
        parts = [f"timed out: {self.timed_out}; return codes: {self.returncodes}; {self.seconds:.1f} s"]
        for rank, (out, err) in enumerate(zip(self.stdout, self.stderr)):
            parts.append(f"--- rank {rank} stdout:\n{out}--- rank {rank} stderr:\n{err}")
        return "\n".join(parts)


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (rank 0's store binds it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_workers(args: list[str], nproc: int, deadline_s: float, env: dict[str, str] | None = None) -> WorkerRun:
    """Run ``python -m pipec.runtime ARGS`` on ``nproc`` ranks and wait for all of them.

    Args:
        args: the worker's arguments (target, -D ..., options).
        nproc: the world size.
        deadline_s: wall-clock limit for the whole run; past it every worker is killed.
        env: extra environment variables.
    Returns:
        a ``WorkerRun``; every worker has exited when it returns.
    """
    return _launch([sys.executable, "-m", "pipec.runtime", *args], nproc, deadline_s, env)


def _launch(command: list[str], nproc: int, deadline_s: float, env: dict[str, str] | None) -> WorkerRun:
    """Start ``command`` once per rank; once more on a fresh port if another process took the port first."""
    run = _launch_once(command, nproc, deadline_s, env)
    if not run.ok and any(_PORT_TAKEN in err.lower() for err in run.stderr):
        run = _launch_once(command, nproc, deadline_s, env)
    return run


# What rank 0's store says when the free port was taken between our probe and its bind.
_PORT_TAKEN = "address already in use"


def _launch_once(command: list[str], nproc: int, deadline_s: float, env: dict[str, str] | None) -> WorkerRun:
    """Start ``command`` once per rank with torchrun's environment; wait, kill at the deadline."""
    port = free_port()
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    base.update(env or {})
    files, procs = [], []
    start = time.monotonic()
    try:
        for rank in range(nproc):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(subprocess.Popen(
                command,
                env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
            ))
        timed_out = False
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() - start > deadline_s:
                timed_out = True
                break
            time.sleep(_POLL_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    seconds = time.monotonic() - start
    stdout, stderr = [], []
    for out, err in files:
        out.seek(0)
        err.seek(0)
        stdout.append(out.read())
        stderr.append(err.read())
        out.close()
        err.close()
    return WorkerRun([proc.returncode for proc in procs], stdout, stderr, timed_out, seconds)


# ------------------------------------------------------------------ batches
#
# Starting a worker costs seconds of imports (torch, its optimizer's dynamo
# import); a test that runs many short trainings at one world size runs them
# all in one set of processes: this file, run as a script, joins the process
# group once and calls the worker's own ``make_plan`` and ``train`` per job.


# The folder of the tests (and their model specs), put on the workers' PYTHONPATH by ``train_saved_batch``.
TESTS = os.path.dirname(os.path.abspath(__file__))


def save_path(folder, name: str, resumed: dict[str, str], steps: int, *, pattern: bool = False):
    """Where job ``name`` saves its state: ``NAME.pt``, or for a job others resume from (a value of
    ``resumed``) its checkpoint every 2 steps, ``NAME-{step}.pt`` (``pattern``) or the last one's."""
    if name not in resumed.values():
        return folder / f"{name}.pt"
    return folder / (f"{name}-{{step}}.pt" if pattern else f"{name}-{steps}.pt")


def train_saved_batch(folder, jobs: list[list[str]], resumed: dict[str, str], schedule_of: dict[str, str],
                      steps: int, nproc: int, deadline_s: float) -> WorkerRun:
    """Run ``jobs`` and then each resumed run (name -> the job whose step-2 checkpoint it goes on from, read
    from ``FOLDER/SOURCE.json``, after its source in the same processes: the checkpoint is there) in one
    ``launch_batch``, with this folder on the workers' PYTHONPATH; asserts that every job finished."""
    jobs = list(jobs)
    for name, source in resumed.items():
        jobs.append([schedule_of[source], "--program", str(folder / f"{source}.json"), "--steps", str(steps),
                     "--timeout", "90", "--save", str(folder / f"{name}.pt"), "--resume",
                     str(folder / f"{source}-2.pt")])
    path = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
    run = launch_batch(jobs, nproc, deadline_s, env={"PYTHONPATH": path})
    assert run.ok, run.describe()
    assert run.stdout[0].count(" done") == len(jobs), run.describe()
    return run


def launch_batch(jobs: list[list[str]], nproc: int, deadline_s: float, env: dict[str, str] | None = None) -> WorkerRun:
    """Run several worker command lines, one after the other, in one set of ``nproc`` processes (gloo).

    Args:
        jobs: each a worker's arguments (as for ``python -m pipec.runtime``).
        nproc: the world size; every job must compile to this many ranks.
        deadline_s: limit for the whole batch.
        env: extra environment variables (``PYTHONPATH`` for a test's own model spec).
    Returns:
        a ``WorkerRun``; rank 0's stdout has a line ``job I done`` after each job.
    """
    return _launch([sys.executable, os.path.abspath(__file__), json.dumps(jobs)], nproc, deadline_s, env)


def _batch_main(jobs: list[list[str]]) -> None:
    import torch.distributed

    from pipec.runtime import worker

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with worker.fatal_errors(rank):
        first = worker.parse_run_config(jobs[0])
        device = worker.join_group(first.backend, rank, world, int(os.environ["LOCAL_RANK"]), first.timeout)
        for index, job in enumerate(jobs):
            worker.train(worker.make_plan(worker.parse_run_config(job), world), rank, world, device)
            torch.distributed.barrier()  # rank 0 has written the job's files: a later job may read them
            if rank == 0:
                print(f"job {index} done", flush=True)
        gc.collect()
        worker.leave_group()


# ------------------------------------------------------------------ isolated batches
#
# A batch whose jobs may fault (programs the checks reject, run anyway) cannot share one process group: a
# fault ends the process and leaves the group's messages half sent. Each rank's process imports once and
# forks a child per job; the children of one job join a group of their own (a file store per job, so no
# port is chosen twice) and end with the job, so that a fault or a hang ends that job and not the batch.


# What the process of a rank writes to stderr before each job's child starts: its messages follow.
JOB_MARK = "=== job {index}"
# How long a job's child may outlive its --timeout (joining, building the model, saving) before it is killed.
JOB_MARGIN_S = 30.0


@dataclass
class JobEnd:
    """How one job of ``launch_isolated`` ended.

    Attributes:
        returncodes: per rank (negative: killed by that signal, SIGKILL at the job's deadline; None: the rank's
            process ended before the job did).
        timed_out: some rank's child outlived the job's deadline and was killed.
        stderr: per rank, what the job's child wrote to stderr (a fault's message).
    """

    returncodes: list[int | None]
    timed_out: bool
    stderr: list[str]

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)


def launch_isolated(jobs: list[list[str]], nproc: int, folder, env: dict[str, str] | None = None
                    ) -> tuple[list[JobEnd], WorkerRun]:
    """Run worker command lines one after the other in ``nproc`` processes, each job in children of its own.

    The worker's own steps, as ``launch_batch`` (``make_plan``, then ``train``), without rank 0's check of a
    ``--program`` file: what the runtime does with a program whatever the checks say of it. The ranks start
    each job together; a job's child that outlives its ``--timeout`` by ``JOB_MARGIN_S`` is killed.

    Args:
        jobs: each a worker's arguments; every job must compile to ``nproc`` ranks.
        folder: an empty folder for the jobs' file stores and the ranks' meeting files.
    Returns:
        (per job, how it ended; the whole run).
    """
    from pipec.runtime.worker import parse_run_config

    deadlines = [parse_run_config(job).timeout + JOB_MARGIN_S for job in jobs]
    spec = {"jobs": jobs, "folder": str(folder), "deadlines": deadlines}
    run = _launch([sys.executable, os.path.abspath(__file__), json.dumps(spec)], nproc, sum(deadlines) + 120, env)
    ends = [JobEnd([], False, []) for _ in jobs]
    for out, err in zip(run.stdout, run.stderr):
        codes = dict(_job_ends(out))
        messages = _job_messages(err)
        for index, end in enumerate(ends):
            code, timed_out = codes.get(index, (None, False))
            end.returncodes.append(code)
            end.timed_out = end.timed_out or timed_out
            end.stderr.append(messages.get(index, ""))
    return ends, run


def _job_ends(out: str):
    """(job, (return code, timed out)) from a rank's ``job I exit CODE [timed out]`` lines."""
    for line in out.splitlines():
        words = line.split()
        if words[:1] == ["job"] and words[2:3] == ["exit"]:
            yield int(words[1]), (int(words[3]), "timed" in words)


def _job_messages(err: str) -> dict[int, str]:
    """job -> what its child wrote to the rank's stderr (after the job's ``JOB_MARK``)."""
    messages, index = {}, None
    for line in err.splitlines(keepends=True):
        if line.startswith(JOB_MARK.format(index="")):
            index = int(line.split()[2])
            messages[index] = ""
        elif index is not None:
            messages[index] += line
    return messages


# What a job's child imports on its way (the interpreter, the optimizer's dynamo): imported before the forks.
_CHILD_IMPORTS = ("pipec.runtime.interpreter", "pipec.runtime.data", "pipec.runtime.checkpoint", "torch._dynamo")


def _isolated_main(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from pipec.runtime import worker

    for module in _CHILD_IMPORTS:  # imported once: every child inherits them
        importlib.import_module(module)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for index, (job, deadline) in enumerate(zip(spec["jobs"], spec["deadlines"])):
        _meet(spec["folder"], index, rank, world)
        sys.stdout.flush()
        sys.stderr.write(JOB_MARK.format(index=index) + "\n")
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            with worker.fatal_errors(rank):  # a fault: its message on stderr, and the child ends at once
                config = worker.parse_run_config(job)
                plan = worker.make_plan(config, world)
                store = dist.FileStore(os.path.join(spec["folder"], f"store-{index}"), world)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                        timeout=timedelta(seconds=deadline))
                worker.train(plan, rank, world, torch.device("cpu"))  # gloo's
                worker.leave_group()
            worker.end_process(0)
        code, timed_out = _wait_child(child, deadline)
        print(f"job {index} exit {code}{' timed out' if timed_out else ''}", flush=True)


def _meet(folder: str, index: int, rank: int, world: int) -> None:
    """Wait until every rank's process is ready for job ``index`` (a file per rank; no group outlives a job)."""
    open(os.path.join(folder, f"ready-{index}-{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(folder, f"ready-{index}-{other}")) for other in range(world)):
        time.sleep(_POLL_S)


def _wait_child(pid: int, deadline_s: float) -> tuple[int, bool]:
    """Wait for child ``pid`` until ``deadline_s``, then kill it: (its return code, killed at the deadline)."""
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() - start > deadline_s:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL, True
        time.sleep(_POLL_S)


if __name__ == "__main__":
    from pipec.runtime.worker import end_process

    argument = json.loads(sys.argv[1])
    if isinstance(argument, dict):  # launch_isolated's
        _isolated_main(argument)
    else:
        _batch_main(argument)
    end_process(0)  # as a worker ends: no interpreter teardown after the group is left


# How close a pipelined run's parameters must come to one process's (fp32, a few steps).
TOLERANCE = 1e-5


def assert_same_parameters(got: dict, want: dict, label: str, tolerance: float = TOLERANCE) -> None:
    """``got`` (a saved state dict) has the whole model's keys and every parameter within ``tolerance`` of ``want``."""
    assert sorted(got) == sorted(want), f"{label}: saved keys differ from the whole model's"
    worst = max(want, key=lambda name: (got[name] - want[name]).abs().max().item())
    diff = (got[worst] - want[worst]).abs().max().item()
    assert diff <= tolerance, f"{label}: {worst} differs from the one-process run by {diff:.3g} (> {tolerance})"
