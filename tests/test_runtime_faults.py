"""Faults end a run cleanly: a killed worker and a hung one, through ``pipec run``.

A fault is planted with the worker's test-only ``--inject KIND:RANK:INDEX``
(runtime.worker): ``kill`` makes rank RANK SIGKILL itself before instruction
INDEX of its list, ``hang`` makes it sleep forever there (``late`` starts it
INDEX seconds late, which is not a fault). Either way the run
must end with exit status 1 and a one-line message naming the rank that
waited, the instruction index and text, and the rank it waited for; no
Python traceback; and no process of the run left alive.

GPipe at P = 2, N = 2 (``pipec compile gpipe -D P=2 -D N=2 --format text``):
    rank 0 | 0F0 0SEND_F0 0F1 (0SEND_F1;0RECV_B0)BATCH 0B0 0FREE_F0 0RECV_B1 0B1 0FREE_F1
    rank 1 | 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1FREE_F0 1SEND_B0 1B1 1FREE_F1 1SEND_B1
Rank 0 first needs rank 1 at 0B0 (index 4), which reads the gradient its
BATCH (index 3) receives; rank 1 sends it at index 6.
"""
from __future__ import annotations

import re

from test_run_cli import run_pipec

GPIPE_2 = ["gpipe", "-D", "P=2", "-D", "N=2", "--steps", "2"]
# rank 0's wait for rank 1, e.g. "rank 0, step 4 (0B0, reading ...): waited T s for rank 1: ..."
WAIT_FOR_RANK_1 = re.compile(r"^rank 0, step (\d+) \((0\S+?)\b.*?\): waited (\d+(?:\.\d+)?) s for rank 1\b.*$", re.M)
# Deadline of a whole faulty run: startup of three Pythons with torch on a loaded 2-core machine, plus the timeout.
DEADLINE_S = 90


def assert_clean_failure(done) -> re.Match:
    """Exit 1, rank 0's fault message naming its instruction and rank 1, no traceback, nothing left alive."""
    assert done.status == 1, done.describe()
    match = WAIT_FOR_RANK_1.search(done.stderr)
    assert match, done.describe()
    assert "Traceback" not in done.stderr, done.describe()
    assert not done.survivors, f"processes left behind: {done.survivors}\n{done.describe()}"
    return match


def test_a_killed_worker_ends_the_run_with_its_peers_message():
    # rank 1 dies after its first forward, before receiving microbatch 1's activation
    done = run_pipec("run", *GPIPE_2, "--timeout", "30", "--inject", "kill:1:2", deadline_s=DEADLINE_S)
    match = assert_clean_failure(done)
    # the peer's death is seen at once, not after the 30 s timeout
    assert float(match.group(3)) < 5, done.describe()
    assert "the peer failed or closed the connection" in match.group(0)
    assert re.search(r"^rank 1: killed by SIGKILL", done.stderr, re.M), done.describe()
    assert done.seconds < DEADLINE_S


def test_a_hung_worker_ends_the_run_at_the_timeout_with_the_waiters_message():
    # the phases before the fault (model build, ...) have until --timeout + 3 s: 3 s of timeout gives them 6 s on
    # a loaded machine, where 1.5 s gave 4.5 s and a slow model build ended the run before the hang was reached
    timeout = 3.0
    # rank 1 hangs before sending microbatch 0's gradient
    done = run_pipec("run", *GPIPE_2, "--timeout", str(timeout), "--inject", "hang:1:6", deadline_s=DEADLINE_S)
    match = assert_clean_failure(done)
    assert (match.group(1), match.group(2)) == ("4", "0B0"), done.describe()  # the first read of rank 1's data
    waited = float(match.group(3))
    assert timeout <= waited < timeout + 1.0, done.describe()
    assert "no answer within the timeout" in match.group(0)
    # the hung rank did not end by itself: the launcher stopped it once rank 0 failed
    # the hung rank is stopped by the launcher and says so
    assert re.search(r"^\s*rank 1: stopped by the launcher", done.stderr, re.M), done.describe()


def test_a_worker_hung_after_its_last_instruction_ends_the_run_at_the_loss_reduce():
    timeout = 3.0  # room for the phases before the fault, as above
    # rank 1 hangs after its whole list: rank 0 finishes the step (9 instructions, indices 0-8)
    # and waits in the loss reduce, "step 9" of its list
    done = run_pipec("run", *GPIPE_2, "--timeout", str(timeout), "--inject", "hang:1:99", deadline_s=DEADLINE_S)
    assert done.status == 1, done.describe()
    match = re.search(r"^rank 0, step 9 \(the step's loss reduce\): waited (\d+\.\d) s for rank 1: "
                      r"no answer within the timeout.*training step 1$", done.stderr, re.M)
    assert match, done.describe()
    assert timeout <= float(match.group(1)) < timeout + 1.0, done.describe()
    assert "Traceback" not in done.stderr and not done.survivors, done.describe()


def test_a_worker_that_starts_later_than_the_timeout_is_waited_for():
    # --timeout is the deadline of a step's waits; joining the group has its own allowance
    done = run_pipec("run", *GPIPE_2, "--timeout", "1", "--inject", "late:1:4", deadline_s=DEADLINE_S)
    assert done.status == 0, done.describe()
    assert len(re.findall(r"^step \d loss", done.stdout, re.M)) == 2, done.describe()
