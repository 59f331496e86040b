"""Reading the Chrome trace of a run (``pipec run --trace``, written by ``pipec.runtime.trace``).

Every instruction of every step is a complete event (``"ph": "X"``): ``pid``
is the rank, ``name`` the instruction's text, ``ts`` and ``dur`` microseconds,
``args`` holds ``step`` (from 1), ``index`` (the instruction's place in its
rank's list), ``wait_us`` (time it waited for its inputs first) and
``compute_us`` (the rest). ``otherData`` records what ran. The timeline
drawing (``render``) and the measured cost file (``measured_costs``) read
traces through these functions, so both accept and reject the same files.
A trace file itself is read by ``guarded_read`` (``TRACE``: a regular file,
at most 1 GiB, bounded nesting and numbers); a value of it an error shows is
quoted with ``guarded_read.quote`` (non-printable characters escaped).
"""
from __future__ import annotations

import math
from typing import Any

from pipec.compiler.guarded_read import quote  # values read from the trace: escaped and shortened in messages
from pipec.compiler.ir import Action, Program
from pipec.errors import UsageError


def compute_events(document: Any) -> list[dict]:
    """The complete "compute" events of a Chrome trace (a dict with traceEvents, or a bare list)."""
    return events_of(document, "compute")


def events_of(document: Any, category: str) -> list[dict]:
    """The complete events of ``category`` ("compute", "comm", ...) of a Chrome trace."""
    events = document.get("traceEvents") if isinstance(document, dict) else document
    if not isinstance(events, list):
        raise UsageError("not a Chrome trace: expected {\"traceEvents\": [...]} or a list of events")
    out = []
    for event in events:
        if isinstance(event, dict) and event.get("ph") == "X" and event.get("cat") == category:
            if not all(_is_number(event.get(key)) for key in ("ts", "dur")):
                raise UsageError(f"trace event {quote(event.get('name'))} has no finite numeric ts and dur")
            out.append(event)
    return out


def _is_number(value: Any) -> bool:
    """A finite JSON number (``true`` is not one, though Python's bool is an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def event_args(event: dict) -> dict:
    """The event's ``args`` object ({} when it has none, or something else)."""
    args = event.get("args")
    return args if isinstance(args, dict) else {}


def event_number(event: dict, key: str, default: float = 0.0) -> float:
    """``args[key]`` as a finite number, ``default`` when absent or not one."""
    value = event_args(event).get(key)
    return float(value) if _is_number(value) else default


def event_step(event: dict) -> int:
    """The training step of an event (1 when it does not say)."""
    step = event_args(event).get("step", 1)
    return step if _is_index(step) else 1


def event_action(event: dict, program: Program, name: str) -> tuple[int, Action]:
    """(rank, action) of an instruction's event, checked against ``program``.

    Raises:
        UsageError: the event's rank or instruction is not the program's
            (a trace of another schedule or other parameters).
    """
    rank, index = event.get("pid"), event_args(event).get("index")
    if not _is_index(rank) or not 0 <= rank < program.num_ranks:
        raise UsageError(f"{name}: event {quote(event.get('name'))} is on rank {quote(rank)}, "
                         f"but the program has {program.num_ranks} ranks (another schedule or other -D values?)")
    row = program.ranks[rank]
    if not _is_index(index) or not 0 <= index < len(row) or row[index].text() != event.get("name"):
        found = row[index].text() if _is_index(index) and 0 <= index < len(row) else "nothing"
        raise UsageError(f"{name}: rank {rank}'s event {quote(event.get('name'))} (instruction {quote(index)}) "
                         f"does not match "
                         f"the program, which has {found} there (another schedule or other -D values?)")
    return rank, row[index]


def recorded(document: Any, key: str, kind: type = str):
    """The trace's ``otherData[key]`` (what ran) when it is a ``kind``, else None."""
    other = document.get("otherData") if isinstance(document, dict) else None
    value = other.get(key) if isinstance(other, dict) else None
    return value if isinstance(value, kind) else None


__all__ = ["compute_events", "event_action", "event_args", "event_number", "event_step", "events_of", "recorded"]
