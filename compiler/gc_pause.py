"""A context manager that pauses Python's cyclic garbage collector.

Passes over large programs build a few hundred thousand small tuples (Actions,
timeline slots, JSON objects) and no reference cycles. Each burst of
allocations triggers a full collection over the whole growing heap, which finds
nothing and costs as much as the pass itself; reference counting still frees
memory. Every bulk pass runs inside ``paused_gc()``.

The collector is resumed on the way out, as it was found, and nothing else is
changed: freezing the survivors (``gc.freeze``, so that later collections skip
them) is a decision about the whole process, which only its owner, the command
line (``pipec.cli``) or a benchmark, can make; a library that froze on every
pass would also freeze its caller's objects, garbage included.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector inside the block; re-enable it after if it was enabled.

    Returns:
        a context manager; nests (an inner pause leaves the collector off).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
