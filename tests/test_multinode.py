"""Runs over several machines, tried on this one: each "node" is a launcher of its own (``pipec run
--nnodes 2 --node-rank I`` or torchrun), meeting the other at 127.0.0.1 through torchrun's static rendezvous.

Every multi-process run has a hard deadline, after which everything it started is killed and the test
fails; a process of a run still alive after it ends is reported (``test_run_cli``'s marker). Training
is checked against one process; the failures must end both nodes, each with its own report.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from pipec.cli import main
from pipec.commands import run as run_command
from pipec.errors import UsageError
from pipec.runtime.agreement import MISMATCH_PREFIX, mismatch
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, free_port
from test_run_cli import MARKER, Finished, kill_survivors, losses_of

# The longest wall time of one two-node run before the test kills it and fails (a loaded machine
# starts 6 Pythons that import torch).
DEADLINE_S = 150
PIPEC = [sys.executable, "-m", "pipec"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ONE_F_ONE_B = ["1f1b", "-D", "P=4", "-D", "N=8"]
# The built-in model with one line per chunk built: a worker prints which chunk it builds, so the
# launcher's prefix shows whether it names the worker by its global rank.
PRINTING_MODEL = '''
import dataclasses

from pipec.runtime.model import LLAMA


def build_chunk(config, chunk, num_chunks, seed):
    print(f"building chunk {chunk}", flush=True)
    return LLAMA.build_chunk(config, chunk, num_chunks, seed)


SPEC = dataclasses.replace(LLAMA, build_chunk=build_chunk)
'''


def run_nodes(commands_at, cwd, deadline_s: float = DEADLINE_S) -> list[Finished]:
    """Run ``commands_at(port)`` at once, one command per node meeting at 127.0.0.1:PORT, a free port; once
    more on another port if another program took the port first.

    Returns:
        ``_run_once``'s. The worker logs a failed ``pipec run`` keeps are removed (its report, in
        ``stderr``, says what the test needs).
    """
    nodes = _run_once(commands_at(free_port()), cwd, deadline_s)
    if any(_PORT_TAKEN in node.stderr.lower() for node in nodes):
        nodes = _run_once(commands_at(free_port()), cwd, deadline_s)
    for node in nodes:
        for logs in re.findall(r"^worker logs: (\S+)$", node.stderr, re.M):
            shutil.rmtree(logs, ignore_errors=True)
    return nodes


# What node 0 says when the free port was taken between our probe and its bind.
_PORT_TAKEN = "address already in use"


def _run_once(commands: list[list[str]], cwd, deadline_s: float) -> list[Finished]:
    """Run the commands at once and wait for all of them, at most ``deadline_s``.

    Returns:
        per command how it ended; ``seconds`` is its end after the common start, and
        ``survivors`` (the same list for all) the run's processes still alive afterwards (killed).
    """
    marker = uuid.uuid4().hex
    path = os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))  # a --model module in cwd
    env = dict(os.environ, **{MARKER: marker}, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    start = time.monotonic()
    procs = [subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                              text=True, start_new_session=True) for command, (out, err) in zip(commands, outputs)]
    ends: dict[int, float] = {}
    while len(ends) < len(procs) and time.monotonic() - start < deadline_s:
        for index, proc in enumerate(procs):
            if index not in ends and proc.poll() is not None:
                ends[index] = time.monotonic() - start
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    survivors = kill_survivors(marker)
    finished = []
    for index, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        out.seek(0)
        err.seek(0)
        late = "" if index in ends else f"\n[test] killed after the {deadline_s} s deadline\n"
        finished.append(Finished(proc.returncode, out.read(), err.read() + late, ends.get(index, deadline_s),
                                 survivors))
        out.close()
        err.close()
    return finished


def pipec_nodes(per_node: list[list[str]], nproc: int):
    """port -> ``pipec run ARGS --nnodes M --node-rank I --rdzv-endpoint 127.0.0.1:PORT --nproc P``, one per node."""
    return lambda port: [[*PIPEC, "run", *args, "--nnodes", str(len(per_node)), "--node-rank", str(node),
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc", str(nproc)]
                         for node, args in enumerate(per_node)]


def describe(nodes: list[Finished]) -> str:
    return "\n".join(f"=== node {index}: {node.describe()}" for index, node in enumerate(nodes))


# --------------------------------------------------------------- training


def test_two_pipec_runs_as_two_nodes_of_two_ranks_train_1f1b_to_the_one_process_result(tmp_path):
    (tmp_path / "printing.py").write_text(PRINTING_MODEL)
    schedule = [*ONE_F_ONE_B, "--steps", "2", "--seed", "3", "--model", "printing:SPEC"]
    # every node is given --save and --trace (they must agree), only node 0 checks and writes them:
    # node 1's folder does not even exist
    nodes = run_nodes(pipec_nodes([
        [*schedule, "--save", "model.pt", "--trace", "trace.json"],
        [*schedule, "--save", "elsewhere/model.pt", "--trace", "elsewhere/trace.json"],
    ], nproc=2), tmp_path)
    assert all(node.status == 0 for node in nodes) and not nodes[0].survivors, describe(nodes)

    # node 0 prints rank 0's losses and its files; the lines of ranks 1, 2 and 3 carry their global rank
    assert len(losses_of(nodes[0].stdout)) == 2, describe(nodes)
    assert "[rank 1] building chunk 1" in nodes[0].stdout, describe(nodes)
    assert "[rank 2] building chunk 2" in nodes[1].stdout and "[rank 3] building chunk 3" in nodes[1].stdout
    assert "loss" not in nodes[1].stdout and "[rank 0]" not in nodes[1].stdout, describe(nodes)
    assert (tmp_path / "trace.json").is_file() and not (tmp_path / "elsewhere").exists()
    want = reference_run(ModelConfig(), 2, 8, 3)
    assert losses_of(nodes[0].stdout) == pytest.approx(want.losses, abs=1e-5)
    assert_same_parameters(torch.load(tmp_path / "model.pt"), want.state_dict, "pipec run on two nodes")


def test_two_torchruns_as_two_nodes_of_two_ranks_train_1f1b_to_the_one_process_result(tmp_path):
    nodes = run_nodes(lambda port: [
        [*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "static",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "pipec.runtime", *ONE_F_ONE_B, "--steps", "2",
         "--save", "model.pt"]
        for node in (0, 1)], tmp_path)
    assert all(node.status == 0 for node in nodes) and not nodes[0].survivors, describe(nodes)
    assert len(losses_of(nodes[0].stdout)) == 2 and not losses_of(nodes[1].stdout), describe(nodes)
    assert_same_parameters(torch.load(tmp_path / "model.pt"), reference_run(ModelConfig(), 2, 8, 0).state_dict,
                           "torchrun on two nodes")


# --------------------------------------------------------------- failures


def test_nodes_started_with_different_programs_both_stop_with_one_line_naming_them(tmp_path):
    nodes = run_nodes(pipec_nodes([["1f1b", "-D", "P=2", "-D", "N=4"], ["1f1b", "-D", "P=2", "-D", "N=2"]],
                                  nproc=1), tmp_path)
    assert [node.status for node in nodes] == [1, 1] and not nodes[0].survivors, describe(nodes)
    for node in nodes:
        [line] = [line for line in node.stderr.splitlines() if line.startswith(MISMATCH_PREFIX)]
        assert re.search(r"rank 0 \(node 0\): program 1f1b P=2 N=4 remat=false #\w+; rank 1 \(node 1\): "
                         r"program 1f1b P=2 N=2 remat=false ", line), describe(nodes)
        assert "Traceback" not in node.stderr and "loss" not in node.stdout, describe(nodes)


def test_a_failure_on_one_node_ends_the_other_nodes_run(tmp_path):
    # rank 1, node 1's only worker, kills itself before its third instruction: node 0's rank 0 names it
    schedule = ["1f1b", "-D", "P=2", "-D", "N=2", "--steps", "2", "--inject", "kill:1:2"]
    nodes = run_nodes(pipec_nodes([schedule, schedule], nproc=1), tmp_path)
    assert [node.status for node in nodes] == [1, 1] and not nodes[0].survivors, describe(nodes)
    assert re.search(r"^rank 0, step \d+ \(.*\): waited \d+\.\d s for rank 1: ", nodes[0].stderr, re.M), describe(nodes)
    assert re.search(r"^rank 1: killed by SIGKILL$", nodes[1].stderr, re.M), describe(nodes)
    assert abs(nodes[0].seconds - nodes[1].seconds) < 10, describe(nodes)


def test_a_node_that_never_joins_ends_the_run_within_the_join_timeout(capsys, monkeypatch):
    # node 0 alone waits for node 1, node 1 alone for node 0: both give up after --join-timeout, before any
    # worker starts; in this process, as no worker starts (the launcher sets this variable for itself)
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ""))
    node_0 = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    node_1 = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    for flags, said in ((node_0, r"not all 2 nodes joined at 127\.0\.0\.1:\d+ within 1 s \(--join-timeout\)"),
                        (node_1, r"node 1 found nothing listening at 127\.0\.0\.1:\d+ within 1 s \(--join-timeout\)")):
        start = time.monotonic()
        assert main(["run", "1f1b", "-D", "P=2", "--steps", "1", *flags, "--join-timeout", "1"]) == 1
        seconds = time.monotonic() - start
        err = capsys.readouterr().err
        # each node says first that it waits for the others, and for how long (issue 24, item 1)
        waits = (r"pipec run: node [01] of 2 waits for (node 0|the other 1 node) at 127\.0\.0\.1:\d+, "
                 r"at most 1 s \(--join-timeout\)")
        assert re.fullmatch(rf"{waits}\npipec run: {said}.*\n", err), err
        assert seconds < 30, f"{seconds:.1f} s: {err}"


# ------------------------------------------------------- checks before launching


@pytest.mark.parametrize("flags, said", [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29500"],
     "--node-rank 2: the nodes of --nnodes 2 are numbered 0 .. 1"),
    (["--nnodes", "2", "--node-rank", "1"], "--nnodes 2: every machine needs its --node-rank (0 .. 1) and the same "
                                            "--rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1"], "--rdzv-endpoint '127.0.0.1': expected "
                                                                            "HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "no-such-host.invalid:29500"],
     "--rdzv-endpoint no-such-host.invalid:29500: cannot resolve 'no-such-host.invalid'"),
    (["--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500"], "are for a run over several machines: pass --nnodes"),
    (["--rdzv-endpoint", "127.0.0.1:29500", "--join-timeout", "5"], "are for a run over several machines"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500", "--nproc", "4"],
     "--nproc 4 on each of 2 machines starts 8 workers, but 1f1b was compiled for 4 ranks: one worker runs one rank "
     "(pass --nproc 2"),
    (["--nnodes", "3", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500"],
     "1f1b was compiled for 4 ranks, which do not divide among --nnodes 3 machines"),
])
def test_node_flags_that_cannot_work_fail_before_any_worker_starts(flags, said, capsys, no_launch):
    assert main(["run", *ONE_F_ONE_B, *flags]) == 1
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_node_0_refuses_a_port_in_use_before_any_worker_starts(capsys, no_launch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["run", *ONE_F_ONE_B, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                     f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert f"node 0 listens on port {port}, which is in use on this machine" in err and err.count("\n") == 1, err


def test_the_device_map_is_checked_against_the_workers_of_one_node():
    # 3 nodes of 2: rank 2 (node 1: devices 2, 3) is sent to device 4, on node 2; ranks 0 and 1 stay home
    program = SimpleNamespace(devices=[1, 0, 4, 5, 2, 3], num_ranks=6)
    with pytest.raises(UsageError, match=r"puts rank 2 on device 4, which is on another node: with 2 ranks per node"):
        run_command._check_device_map(program, 2)
    run_command._check_device_map(program, 6)  # one node of 6: every move stays on it


def test_the_mismatch_line_names_each_group_of_ranks_and_what_differs():
    same = {"program": "1f1b P=4 N=8 #a", "steps": "5", "seed": "0"}
    other = dict(same, steps="3")
    nodes = [{"node": str(r // 2), "host": "h"} for r in range(4)]
    assert mismatch([same] * 4, nodes) is None
    line = mismatch([same, same, other, other], nodes)
    assert line.startswith(MISMATCH_PREFIX + "ranks 0-1 (node 0): steps 5; ranks 2-3 (node 1): steps 3; start every "
                                             "node with the same "), line
    # workers started by hand (no GROUP_RANK) on two machines: named by host
    line = mismatch([same, other], [{"node": None, "host": "a"}, {"node": None, "host": "b"}])
    assert "rank 0 (host a): steps 5; rank 1 (host b): steps 3;" in line, line
