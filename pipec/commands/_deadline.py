"""The launcher's side of the phase deadline: name a worker whose process is stopped, and end the run.

A stopped worker (SIGSTOP, a debugger, a machine that froze it) cannot run its
own watch (``runtime/phases.py``), and the ranks waiting on it see only a
silent peer. The launcher reads each worker's phase file and the kernel's
state of its process (``/proc/PID/stat``: ``T`` or ``t``); one stopped for
``--timeout`` seconds is named, ``rank R (host H), phase X: waited T s ...``,
and every worker of this node is killed with its whole process group, so that
the run ends within ``--timeout`` and the launcher's poll, and nothing is left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from pipec.runtime.phases import phase_line, read_phase, who

# How often the launcher looks at its workers' phases, seconds.
POLL_S = 0.25
# A worker stopped at least this long when the run fails is named in the report even before its deadline.
NOTED_STOP_S = 1.0


def process_stopped(pid: int) -> bool:
    """Whether the kernel holds process ``pid`` stopped (Linux ``/proc``; False where it cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            state = handle.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


class StopWatch:
    """A thread that watches this node's workers (global ranks ``first`` .. ``first + nproc - 1``).

    Attributes:
        lines: the phase lines of the ranks it named, for the report (first).
        ended: True once it killed the workers.
    """

    def __init__(self, folder: str, nproc: int, first: int, timeout: float):
        self.folder, self.ranks, self.timeout = folder, range(first, first + nproc), timeout
        self.lines: list[str] = []
        self.ended = False
        self._stopped_since: dict[int, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipec-stop-watch", daemon=True)

    def start(self) -> StopWatch:
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        """Stop watching; returns the lines to report: those it named, else the ranks seen stopped a while."""
        self._done.set()
        self._thread.join()
        if self.lines:
            return self.lines
        now = time.monotonic()
        return [self._line(record, now - since) for rank, since in sorted(self._stopped_since.items())
                if now - since >= NOTED_STOP_S and (record := read_phase(self.folder, rank))]

    def _run(self) -> None:
        while not self._done.wait(POLL_S):
            records = {rank: read_phase(self.folder, rank) for rank in self.ranks}
            stalled = [(record, stopped) for record, stopped in map(self._look, records.values()) if stopped]
            overdue = [(record, stopped) for record, stopped in stalled if stopped >= self.timeout]
            if overdue:
                self.lines = [self._line(record, stopped) for record, stopped in overdue]
                self._end([record for record in records.values() if record])
                return

    def _look(self, record: dict | None) -> tuple[dict | None, float]:
        """(the record, how long its process has been seen stopped: 0 when running)."""
        if not record or not isinstance(record.get("pid"), int):
            return record, 0.0
        rank, now = record.get("rank"), time.monotonic()
        if process_stopped(record["pid"]):
            return record, now - self._stopped_since.setdefault(rank, now)
        self._stopped_since.pop(rank, None)
        return record, 0.0

    def _line(self, record: dict, stopped: float) -> str:
        waited = max(time.time() - float(record.get("since", time.time())), stopped)
        why = f"the process is stopped (SIGSTOP or a debugger), for {stopped:.1f} s; --timeout {self.timeout:g}"
        return phase_line(who(record.get("rank"), str(record.get("host"))), str(record.get("phase")), waited, why)

    def _end(self, records: list[dict]) -> None:
        """Kill every worker of this node with its process group (each leads its own); the agent then
        sees them fail and ends the launch."""
        self.ended = True
        for record in records:
            pid = record.get("pid")
            if isinstance(pid, int) and pid > 1:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(OSError):  # in case it left its group
                    os.kill(pid, signal.SIGKILL)
