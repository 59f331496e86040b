"""A context manager that pauses Python's cyclic garbage collector.

Passes over large programs build a few hundred thousand small tuples (Actions,
timeline slots, JSON objects) and no reference cycles. Each burst of
allocations triggers a full collection over the whole growing heap, which finds
nothing and costs as much as the pass itself; reference counting still frees
memory. Every bulk pass runs inside ``paused_gc()``.

On the way out the surviving objects are frozen (``gc.freeze``): the next
collections would otherwise walk all of them once more, for nothing. Frozen
objects are still freed by reference counting when they are dropped.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def paused_gc():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.enable()
