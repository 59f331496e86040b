"""What ``pipec run`` shows while it runs: each phase as it happens, every step with its speed and memory.

The launcher reports its own phases (``compile``, ``check``, ``launch``) and
those its workers report on their stdout (``runtime/report.py``: ``start``,
``load``, ``join``, ``build``, ``step``); workers' other lines are shown live,
stdout's on stdout and stderr's on stderr, behind ``[rank R] `` (rank 0's
stdout as it is). ``--log-format json`` writes every event as one JSON object
per line on stdout instead (the schema: docs/runtime.md, "What a run
reports"). Each node of a run over several machines reports its own workers:
node 0, which holds rank 0, adds the loss to its step lines.

Steps are shown once every worker of this node has reported the step; the
step time is rank 0's where it is here (its step ends with the loss reduce,
after every rank), else the slowest local rank's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

from pipec.compiler.guarded_read import parse_json_text
from pipec.errors import PipecError, UsageError, printable, printable_name
from pipec.runtime.report import EVENT_PREFIX, EVENTS_ENV

# The progress bar's width in characters (a terminal only).
BAR_WIDTH = 24
# Above this many ranks on one node, a step line gives the peak memory's range instead of every rank's.
MEMORY_RANKS_SHOWN = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` and ``--log-dir``, the options of what ``pipec run`` shows and keeps."""
    parser.add_argument("--log-format", dest="log_format", choices=("text", "json"), default="text",
                        help="text (default) or json: one JSON object per event on stdout, for tools")
    parser.add_argument("--log-dir", dest="log_dir", metavar="DIR",
                        help="keep every rank's stdout and stderr (and the program) in a new folder under DIR "
                             "(default: a temporary folder, removed after a successful run)")


def run_folder(log_dir: str | None) -> str:
    """The run's own folder: a new one under ``--log-dir DIR`` (made when missing), else a temporary one.

    Raises:
        UsageError: DIR cannot be made or written.
    """
    if log_dir is None:
        return tempfile.mkdtemp(prefix="pipec-run-")
    try:
        os.makedirs(log_dir, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return tempfile.mkdtemp(prefix=f"pipec-run-{stamp}-", dir=log_dir)
    except OSError as error:
        raise UsageError(f"--log-dir {printable(log_dir)!r}: cannot make a folder there: "
                         f"{error.strerror or error}") from None


class Console:
    """Our stdout and stderr, written a line at a time from several threads; a progress bar at the
    bottom of a terminal, erased before any other line and drawn again after it."""

    def __init__(self, bar: bool):
        self.bar = bar
        self.lock = threading.Lock()
        self.shown = ""

    def out(self, line: str) -> None:
        self._write(sys.stdout, line)

    def err(self, line: str) -> None:
        self._write(sys.stderr, line)

    def progress(self, text: str) -> None:
        if not self.bar:
            return
        with self.lock:
            self.shown = text
            sys.stdout.write("\r\x1b[K" + text)
            sys.stdout.flush()

    def close(self) -> None:
        with self.lock:
            if self.shown:
                sys.stdout.write("\r\x1b[K")
                sys.stdout.flush()
                self.shown = ""

    def _write(self, stream, line: str) -> None:
        with self.lock:
            if self.shown:
                sys.stdout.write("\r\x1b[K")
                sys.stdout.flush()
            stream.write(line + "\n")
            stream.flush()
            if self.shown:
                sys.stdout.write(self.shown)
                sys.stdout.flush()


def shows_bar(log_format: str) -> bool:
    """A progress bar only for people: text output to a terminal, not in CI, not on a dumb terminal."""
    isatty = getattr(sys.stdout, "isatty", None)
    return (log_format == "text" and callable(isatty) and isatty() and not os.environ.get("CI")
            and os.environ.get("TERM", "") != "dumb")


def _ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def _megabytes(value) -> str:
    return "?" if value is None else f"{value / 2**20:.0f} MB"


def _rate(amount, seconds: float, unit: str) -> str:
    if amount is None or not seconds > 0:
        return f"- {unit}/s"
    return f"{amount / seconds:,.1f} {unit}/s"


def _number(value) -> float | None:
    """A loss or norm from an event: a number, or ``"nan"``/``"inf"`` for one that diverged (``json_number``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return float(value) if value in ("nan", "inf", "-inf") else None


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class RunReport:
    """One ``pipec run`` launcher's report: its phases, its workers' events and output, its steps.

    Attributes:
        log_format: "text" or "json".
        node: this launcher's node (0 on one machine); nodes: how many.
        first, count: the global ranks of this node's workers (set by ``launching``).
        keep_logs: whether the run's folder outlives a successful run (``--log-dir``).
    """

    def __init__(self, log_format: str = "text", node: int = 0, nodes: int = 1, log_dir: str | None = None,
                 console: Console | None = None):
        self.log_format, self.node, self.nodes = log_format, node, nodes
        self.log_dir, self.keep_logs = log_dir, log_dir is not None
        self.console = console or Console(shows_bar(log_format))
        self.started = time.monotonic()
        self.first, self.count = 0, 0
        self.phase_ranks: dict[str, set[int]] = {}
        self.pending: dict[int, dict[int, dict]] = {}
        self.next_step: int | None = None
        self.step_seconds: list[float] = []
        self.held_joins: list[str] = []
        self.lock = threading.RLock()

    @classmethod
    def from_args(cls, args, nodes) -> RunReport:
        return cls(getattr(args, "log_format", "text") or "text", nodes.rank if nodes else 0,
                   nodes.count if nodes else 1, getattr(args, "log_dir", None))

    # ------------------------------------------------------------ the launcher's phases

    def compiled(self, program, seconds: float) -> None:
        params = dict(program.params)
        shown = " ".join(f"{name}={str(value).lower() if isinstance(value, bool) else value}"
                         for name, value in params.items())
        self.event("compile", f"{program.name} {shown} compiled and proved safe: {program.num_ranks} ranks, "
                   f"{program.num_microbatches} microbatches ({seconds:.2f} s)",
                   schedule=program.name, params=params, ranks=program.num_ranks,
                   microbatches=program.num_microbatches, seconds=round(seconds, 4))

    def checked(self, model: str, seconds: float) -> None:
        self.event("check", f"the model ({model}) fits the program and the launch is valid ({seconds:.2f} s)",
                   model=model, seconds=round(seconds, 4))

    def launching(self, nproc: int, first: int, endpoint: str | None) -> None:
        self.first, self.count = first, nproc
        where = f"; waiting for the other nodes at {endpoint}" if self.nodes > 1 and endpoint else ""
        self.event("launch", f"starting {nproc} worker{'s' if nproc > 1 else ''} ({_ranks(first, nproc)}){where}",
                   workers=nproc, ranks=[first, first + nproc - 1], nodes=self.nodes, endpoint=endpoint)

    def finished(self, ok: bool, run_dir: str | None) -> None:
        self.flush_steps()
        seconds = time.monotonic() - self.started
        logs = run_dir if (self.keep_logs or not ok) else None
        text = f"{'done' if ok else 'failed'} after {_duration(seconds)}" + (f"; worker logs: {logs}" if ok and logs
                                                                            else "")
        self.event("end", text, ok=ok, logs=logs, total_seconds=round(seconds, 3))
        self.console.close()

    # ------------------------------------------------------------ what the workers write

    def on_stdout(self, rank: int, line: str) -> None:
        """A line of worker ``rank``'s stdout: an event, or output shown as it is (rank 0) or behind its rank."""
        event = self._event_of(line)
        with self.lock:
            if event is not None:
                self._worker_event(rank, event)
            elif self.log_format == "json":
                self._json({"event": "output", "rank": rank, "stream": "stdout", "line": line})
            else:
                self.console.out(line if rank == 0 else f"[rank {rank}] {line}")

    def on_stderr(self, rank: int, line: str) -> None:
        """A line of worker ``rank``'s stderr, shown at once behind its rank."""
        with self.lock:
            if self.log_format == "json":
                self._json({"event": "output", "rank": rank, "stream": "stderr", "line": line})
            else:
                self.console.err(f"[rank {rank}] {printable(line)}")

    @staticmethod
    def _event_of(line: str) -> dict | None:
        if not line.startswith(EVENT_PREFIX):
            return None
        try:
            event = parse_json_text(line[len(EVENT_PREFIX):], "a worker's event", what="line")
        except PipecError:
            return None  # a line that only looks like one: shown as output
        return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None

    def _worker_event(self, rank: int, event: dict) -> None:
        kind = event["event"]
        if kind == "step":
            self._step(rank, event)
            return
        if self.log_format == "json":
            self._json({**event, "rank": rank, "worker_seconds": event.get("seconds")}, drop=("seconds",))
        elif kind == "join":
            # a rank joins only once every rank loaded, but its line may be read before another's load line
            self.held_joins.append(f"rank {rank} joined the process group ({event.get('device', '?')})")
        done = self.phase_ranks.setdefault(kind, set())
        done.add(rank)
        if len(done) == self.count and self.log_format == "text":
            self._all_ranks(kind, event)
        if self.log_format == "text" and len(self.phase_ranks.get("load", ())) == self.count:
            for text in self.held_joins:
                self._text("join", text)
            self.held_joins.clear()

    def _all_ranks(self, kind: str, event: dict) -> None:
        """The text line of a phase every worker of this node has passed."""
        ranks = _ranks(self.first, self.count)
        if kind == "start" and self.nodes > 1:
            self._text("join", f"all {self.nodes} nodes met; {ranks} started")
        elif kind == "start":
            self._text("launch", f"{ranks} started")
        elif kind == "load":
            self._text("load", f"{ranks} loaded the program and the model spec")
        elif kind == "build":
            self._text("build", f"{ranks} built their chunks")

    # ------------------------------------------------------------ steps

    def _step(self, rank: int, event: dict) -> None:
        step = event.get("step")
        if not isinstance(step, int):
            return
        self.pending.setdefault(step, {})[rank] = event
        if self.next_step is None:
            self.next_step = step
        while self.next_step in self.pending and len(self.pending[self.next_step]) == self.count:
            self._show_step(self.next_step, self.pending.pop(self.next_step))
            self.next_step += 1

    def flush_steps(self) -> None:
        """Show the steps some workers of this node reported and others never did (a run that failed)."""
        with self.lock:
            for step in sorted(self.pending):
                self._show_step(step, self.pending.pop(step))

    def _show_step(self, step: int, by_rank: dict[int, dict]) -> None:
        ranks = sorted(by_rank)
        lead = by_rank.get(0) or max(by_rank.values(), key=lambda e: e.get("step_s") or 0)
        seconds = float(lead.get("step_s") or 0.0)
        self.step_seconds.append(seconds)
        steps = lead.get("steps") if isinstance(lead.get("steps"), int) else step
        timed = self.step_seconds[1:] or self.step_seconds  # the first step also warms up
        eta = sum(timed) / len(timed) * max(0, steps - step)
        samples, tokens = lead.get("samples"), lead.get("tokens")
        memory = {rank: by_rank[rank].get("memory_bytes") for rank in ranks}
        if self.log_format == "json":
            self._json({"event": "step", "step": step, "steps": steps, "loss": lead.get("loss") if 0 in by_rank
                        else None, "grad_norm": lead.get("grad_norm"), "step_s": seconds,
                        "samples_per_s": samples / seconds if samples and seconds > 0 else None,
                        "tokens_per_s": tokens / seconds if tokens and seconds > 0 else None,
                        "memory_bytes": {str(rank): value for rank, value in memory.items()},
                        "memory_kind": lead.get("memory_kind"), "eta_s": round(eta, 3)})
            return
        stats = (f"step {seconds:.3f} s | {_rate(samples, seconds, 'samples')} | {_rate(tokens, seconds, 'tokens')}"
                 f" | peak memory {self._memory(memory)} | {step}/{steps}, eta {_duration(eta)}")
        loss, norm = _number(lead.get("loss")), _number(lead.get("grad_norm"))
        if 0 in by_rank and loss is not None:
            from pipec.runtime.worker import step_line

            self.console.out(f"{step_line(step, loss, norm)} | {stats}")
        else:
            self._text("step", f"{step} of {steps} done on {_ranks(ranks[0], len(ranks))} | {stats}")
        done = int(BAR_WIDTH * step / steps) if steps else BAR_WIDTH
        self.console.progress(f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] step {step}/{steps}, eta {_duration(eta)}")

    @staticmethod
    def _memory(memory: dict[int, int | None]) -> str:
        if len(memory) <= MEMORY_RANKS_SHOWN:
            return ", ".join(f"r{rank} {_megabytes(value)}" for rank, value in memory.items())
        known = {rank: value for rank, value in memory.items() if value is not None}
        if not known:
            return "?"
        high = max(known, key=known.get)
        return f"max {_megabytes(known[high])} (rank {high}), min {_megabytes(min(known.values()))}"

    # ------------------------------------------------------------ writing

    def event(self, kind: str, text: str, **fields) -> None:
        """One launcher event: a ``pipec run: PHASE: TEXT`` line, or its JSON object."""
        with self.lock:
            if self.log_format == "json":
                self._json({"event": kind, **fields})
            else:
                self._text(kind, text)

    def _text(self, kind: str, text: str) -> None:
        node = f" [node {self.node}]" if self.nodes > 1 else ""
        # one line, whatever names it quotes (a program's, a parameter's, --log-dir's): escaped for the terminal
        self.console.out(printable_name(f"pipec run{node}: {kind}: {text}"))

    def _json(self, record: dict, drop: tuple[str, ...] = ()) -> None:
        stamped = {"event": record["event"], "time": round(time.monotonic() - self.started, 3), "node": self.node}
        stamped.update((key, value) for key, value in record.items() if key not in drop)
        self.console.out(json.dumps(stamped, separators=(",", ":")))

    def worker_environment(self) -> dict[str, str]:
        """What the workers' environment needs for them to report their events."""
        return {EVENTS_ENV: "1"}
