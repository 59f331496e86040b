"""The phases of a run, each under a deadline: what a worker is doing, said cheaply, watched from two sides.

A worker announces each phase it enters (``announce``): group formation, model
build, checkpoint load, the first exchange, each step, ... Two watches read it:

* inside the worker, a daemon thread (``Watch``) ends the process with one
  line, ``rank R (host H), phase X: waited T s ...``, when a phase outlasts
  its deadline: a hang in Python (an import that never returns, a loop) is
  named by the rank itself, under ``pipec run`` and under torchrun alike;
* ``pipec run``'s launcher (``pipec/commands/_deadline.py``) reads the phase
  file every worker keeps in the run's folder and names a rank whose process
  is stopped (SIGSTOP, a debugger): a stopped process cannot speak for itself.

The thread imports nothing once started (an import that hangs holds the
import lock) and never raises. Nothing here loads torch.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time

from pipec.compiler.atomic_write import write_atomically

START_UP = "start-up"
CHECKPOINT_LOAD = "checkpoint load"
MODEL_BUILD = "model build"
GROUP_FORMATION = "group formation"
FIRST_EXCHANGE = "first exchange"
CHECKPOINT_SAVE = "checkpoint save"
TRACE = "trace"
GROUP_EXIT = "group exit"
# A worker's phases in the order it meets them; a training step is "step K".
PHASES = (START_UP, CHECKPOINT_LOAD, MODEL_BUILD, GROUP_FORMATION, FIRST_EXCHANGE, "step K", CHECKPOINT_SAVE,
          TRACE, GROUP_EXIT)
# The phases of getting ready, whose work grows with the model and the machine's load (importing torch and
# the user's module, reading a checkpoint, building the model, joining): their deadline is --join-timeout,
# never a step's --timeout, which bounds one wait of a training step and says nothing of them. A phase that
# waits for every rank to get ready (the barrier before the first step) is announced with ``JOIN_DEADLINE``.
GETTING_READY = frozenset({START_UP, CHECKPOINT_LOAD, MODEL_BUILD, GROUP_FORMATION})
# ``announce``'s deadline meaning "--join-timeout".
JOIN_DEADLINE = -2.0
# Any other phase's deadline is --timeout and this margin: a rank waiting on a stopped one must let the
# launcher (at --timeout) name the stopped rank first, and a phase of work must not fail a loaded machine.
MARGIN_S = 3.0
# The folder where a worker keeps its phase file (set by ``pipec run``; unset under torchrun).
PHASE_DIR_ENV = "PIPEC_PHASE_DIR"
# Test hook, read only by tests: "RANK:PHASE" makes rank RANK stop itself (SIGSTOP) on entering PHASE.
STOP_AT_ENV = "PIPEC_TEST_STOP_AT"
# How often the watch thread looks at the clock, seconds.
_TICK_S = 0.1


def step_phase(iteration: int) -> str:
    return f"step {iteration}"


def phase_file(folder: str, rank: int) -> str:
    """Where rank ``rank`` keeps its phase (one small JSON object) in ``folder``."""
    return os.path.join(folder, f"phase-{rank}.json")


def phase_line(speaker: str, phase: str, waited: float, why: str) -> str:
    """The one line that names a stalled phase: ``SPEAKER, phase X: waited T s (WHY)``, SPEAKER from ``who``."""
    return f"{speaker}, phase {phase}: waited {waited:.1f} s ({why})"


def who(rank: int | None, host: str | None = None) -> str:
    """``rank R (host H)``, or ``pipec run (host H)`` for the launcher's own phases."""
    name = "pipec run" if rank is None else f"rank {rank}"
    return f"{name} (host {host or socket.gethostname()})"


class Watch:
    """One process's current phase, its deadline, and the thread that ends the process when it passes.

    Args:
        rank: the worker's global rank; None for ``pipec run``'s own checks.
        timeout: ``--timeout``: with ``MARGIN_S``, the deadline of every phase but those of getting ready.
        join_timeout: the deadline of the phases of getting ready (``GETTING_READY``, ``--join-timeout``):
            ranks start at different moments, on other machines, and build models of any size.
        folder: where to keep the phase file for the launcher; None: keep none.
    """

    def __init__(self, rank: int | None, timeout: float, join_timeout: float, folder: str | None = None):
        self.rank, self.timeout, self.join_timeout, self.folder = rank, timeout, join_timeout, folder
        self.host = socket.gethostname()
        self.phase, self.since, self.deadline = START_UP, time.monotonic(), join_timeout
        self._stop_at = _stop_hook(rank)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pipec-phase-watch", daemon=True)

    def start(self) -> Watch:
        self.enter(START_UP, self.join_timeout)  # the launcher learns the process's pid from this first record
        self._thread.start()
        return self

    def enter(self, phase: str, deadline: float | None) -> None:
        """Announce ``phase``; ``deadline`` seconds from now it is overdue (None: not watched here)."""
        with self._lock:
            self.phase, self.since, self.deadline = phase, time.monotonic(), deadline
        if self.folder is not None:
            record = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "phase": phase,
                      "since": time.time(), "deadline": deadline}
            try:
                write_atomically(phase_file(self.folder, self.rank), json.dumps(record), what="the phase file")
            except Exception:  # the file only helps the launcher name the phase; the run goes on without it
                pass
        if self._stop_at == phase:  # the test hook: stop here, deterministically
            self._stop_at = None
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGSTOP)

    def stop(self) -> None:
        """End the watch: its thread returns and ends nothing (``launcher_checks`` stops the watch it started)."""
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(_TICK_S):
            with self._lock:
                phase, since, deadline = self.phase, self.since, self.deadline
            waited = time.monotonic() - since
            if deadline is not None and waited > deadline:
                self._overdue(phase, waited, deadline)

    def _overdue(self, phase: str, waited: float, deadline: float) -> None:
        why = (f"its deadline is {deadline:g} s: the phase hangs, or waits for a rank that does; "
               f"raise --timeout or --join-timeout if it is only slow")
        try:
            sys.stderr.write(phase_line(who(self.rank, self.host), phase, waited, why) + "\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(1)  # not sys.exit: the main thread is the one that hangs


def _stop_hook(rank: int | None) -> str | None:
    """The phase the test hook (``STOP_AT_ENV``) stops this rank in, or None."""
    text = os.environ.get(STOP_AT_ENV, "")
    hooked, _, phase = text.partition(":")
    return phase if rank is not None and hooked.isdigit() and int(hooked) == rank else None


# The process's watch: one per process (``start_watch``), which ``announce`` reports to.
_current: Watch | None = None


def start_watch(rank: int | None, timeout: float, join_timeout: float, folder: str | None = None) -> Watch:
    """Start this process's watch (in ``START_UP``, whose deadline is ``join_timeout``) and return it."""
    global _current
    _current = Watch(rank, timeout, join_timeout, folder).start()
    return _current


@contextlib.contextmanager
def launcher_checks(timeout: float, join_timeout: float):
    """Watch ``pipec run``'s own checks before launching (reading ``--resume``, importing and trying the
    model spec): inside, ``announce`` gives each phase its deadline; after, nothing is watched.

    A watch this started is stopped and forgotten at the end: ``pipec run`` called in a process that goes
    on (``pipec.cli.main`` from Python, a test) must leave no watch that a later ``announce`` in that
    process (an in-process training's checkpoint save, say) would arm, to end the process when it is overdue."""
    global _current
    started = _current is None
    if started:
        _current = Watch(None, timeout, join_timeout).start()
    _current.timeout, _current.join_timeout = timeout, join_timeout
    try:
        yield
    finally:
        if started:
            _current.stop()
            _current = None
        else:
            _current.enter(START_UP, None)


def announce(phase: str, *, deadline: float | None = -1.0) -> None:
    """Say that this process enters ``phase``; a no-op when no watch was started.

    Args:
        deadline: seconds the phase may last; by default ``--join-timeout`` for a phase of getting ready
            (``GETTING_READY``), else ``--timeout`` plus ``MARGIN_S``; ``JOIN_DEADLINE``: ``--join-timeout``;
            None: not watched by the process itself (each wait inside has its own deadline).
    """
    watch = _current
    if watch is None:
        return
    if deadline == -1.0:
        deadline = JOIN_DEADLINE if phase in GETTING_READY else watch.timeout + MARGIN_S
    watch.enter(phase, watch.join_timeout if deadline == JOIN_DEADLINE else deadline)


def read_phase(folder: str, rank: int) -> dict | None:
    """What rank ``rank`` last announced (``Watch.enter``'s record), or None when it has said nothing yet.

    The file is pipec's own, written whole (``write_atomically``); a worker may
    be replacing it as it is read, and a record that does not parse is taken as none.
    """
    try:
        with open(phase_file(folder, rank), encoding="utf-8") as handle:
            record = json.loads(handle.read(4096))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


__all__ = ["CHECKPOINT_LOAD", "CHECKPOINT_SAVE", "FIRST_EXCHANGE", "GETTING_READY", "GROUP_EXIT", "GROUP_FORMATION",
           "JOIN_DEADLINE", "MODEL_BUILD", "MARGIN_S", "PHASES", "PHASE_DIR_ENV", "START_UP", "STOP_AT_ENV", "TRACE", "Watch", "announce",
           "launcher_checks", "phase_file", "phase_line", "read_phase", "start_watch", "step_phase", "who"]
