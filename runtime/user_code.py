"""How pipec words a failure inside code it does not own (a model spec's functions, its modules' forward
and backward), so that it reaches the user as one of pipec's errors, not a traceback.

A user's code may fail in any way: an ``Exception``, a ``BaseException`` of its own, ``sys.exit(0)``
(which must not end a run as a success) or a subclass of ``KeyboardInterrupt`` it raised itself. Only
a bare ``KeyboardInterrupt`` (what Python's SIGINT handler raises) is left to propagate: that one is
the user stopping the run, not the model failing.
"""
from __future__ import annotations

import os
import traceback


def is_interrupt(error: BaseException) -> bool:
    """Whether ``error`` is the user's Ctrl-C (a bare KeyboardInterrupt), which stays an interrupt."""
    return type(error) is KeyboardInterrupt


def failure_words(error: BaseException) -> str:
    """``TYPE: MESSAGE (raised at FILE:LINE in FUNCTION)``: what failed, and the innermost frame, which for a
    user's failure is the user's own line (the traceback itself stays out of the message)."""
    frames = traceback.extract_tb(error.__traceback__)
    text = str(error).strip().splitlines()
    words = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    if isinstance(error, SystemExit):
        words = f"it called sys.exit({error.code!r}), which does not end a run as a success"
    if frames:
        last = frames[-1]
        words += f" (raised at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return words


__all__ = ["failure_words", "is_interrupt"]
