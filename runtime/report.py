"""A worker's progress events, for the launcher that started it (``pipec run``) to show as they happen.

``pipec run`` sets ``EVENTS_ENV`` in the workers' environment; a worker then
writes one line per event to its stdout, ``EVENT_PREFIX`` and a JSON object
(the launcher follows each worker's stdout file already, so no other channel
or file is needed, and ``--log-dir`` keeps the events in each rank's log).
Under torchrun, or any launcher that does not ask for them, nothing is
written but rank 0's ``step k loss X`` line, as before.

The phases a worker reports, in order: ``start`` (the process is up),
``load`` (program and model spec loaded), ``join`` (in the process group),
``build`` (its chunks built), then one ``step`` per training step, every rank
(with its own step time and peak memory; rank 0 adds the loss).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

# Set (to "1") in a worker's environment by a launcher that reads the events.
EVENTS_ENV = "PIPEC_REPORT_EVENTS"
# How an event line begins; the rest of the line is one JSON object.
EVENT_PREFIX = "pipec-event: "
# The phases, in the order they happen (launcher phases first); simple words, so that other code can share them.
PHASES = ("compile", "check", "launch", "start", "load", "join", "build", "step")

_started = time.monotonic()
_rank: int | None = None


def enabled() -> bool:
    return os.environ.get(EVENTS_ENV) == "1"


def start(rank: int) -> None:
    """Name this worker's rank for its events, and report that the process is up."""
    global _rank
    _rank = rank
    emit("start")


def emit(event: str, **fields) -> None:
    """Write one event line (``EVENT_PREFIX`` + JSON) when the launcher asked for events; else nothing.

    Every event carries ``rank`` and ``seconds``, the time since the worker started.
    """
    if not enabled():
        return
    record = {"event": event, "rank": _rank, "seconds": round(time.monotonic() - _started, 4), **fields}
    sys.stdout.write(EVENT_PREFIX + json.dumps(record, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def built(stages) -> None:
    """Report the ``build`` phase: the chunks this rank holds and their parameter count."""
    if not enabled():
        return
    parameters = sum(p.numel() for module in stages.values() for p in module.parameters())
    emit("build", chunks=sorted(stages), parameters=parameters)


def peak_memory(device) -> tuple[int | None, str]:
    """This rank's peak memory so far: (bytes or None, what was measured).

    On a GPU the most the CUDA allocator ever held for tensors
    (``max_memory_allocated``); on the CPU the process's peak resident set
    (``getrusage``'s ``ru_maxrss``: kilobytes on Linux, bytes on macOS).
    """
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device)), "cuda max allocated"
    try:
        import resource
    except ImportError:  # not a Unix: no peak to read
        return None, "rss peak"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024), "rss peak"


def batch_size(spec_config, num_microbatches: int,
               rows_per_microbatch: int | None = None) -> tuple[int | None, int | None]:
    """(samples, tokens) one training step consumes, or None where the model does not say.

    Samples: N microbatches of the dataset's rows per microbatch, or the
    config's ``microbatch_size``. Tokens: samples times the config's
    ``seq_len``, for a model of token sequences.
    """
    rows = rows_per_microbatch or getattr(spec_config, "microbatch_size", None)
    if not isinstance(rows, int) or isinstance(rows, bool):
        return None, None
    samples = num_microbatches * rows
    seq_len = getattr(spec_config, "seq_len", None)
    tokens = samples * seq_len if isinstance(seq_len, int) and not isinstance(seq_len, bool) else None
    return samples, tokens


class StepClock:
    """Times a rank's training steps and reports each one: the ``step`` event, or (without a launcher
    that reads events) rank 0's ``step k loss X`` line as it always was."""

    def __init__(self, rank: int, steps: int, device, samples: int | None = None, tokens: int | None = None):
        self.rank, self.steps, self.device = rank, steps, device
        self.samples, self.tokens = samples, tokens
        self.mark = time.perf_counter()

    def done(self, iteration: int, loss: float | None, grad_norm: float | None = None) -> None:
        """Step ``iteration`` ended on this rank (``loss``: rank 0's batch loss, None elsewhere)."""
        now = time.perf_counter()
        seconds, self.mark = now - self.mark, now
        if not enabled():
            if self.rank == 0:
                from pipec.runtime.worker import step_line

                print(step_line(iteration, loss, grad_norm), flush=True)
            return
        memory, kind = peak_memory(self.device)
        emit("step", step=iteration, steps=self.steps, step_s=round(seconds, 6), loss=json_number(loss),
             grad_norm=json_number(grad_norm),
             samples=self.samples, tokens=self.tokens, memory_bytes=memory, memory_kind=kind)


def json_number(value: float | None) -> float | str | None:
    """``value`` as strict JSON holds it: a diverged loss (nan, inf) as the string ``"nan"``, ``"inf"``."""
    if value is None or math.isfinite(value):
        return value
    return str(float(value))
