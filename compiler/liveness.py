"""Liveness: free each saved activation right after its last use.

The forward F(s, m) of a stage saves what its backward needs (its input, the
autograd graph): the *saved activation* of (s, m). Its last reader is the
backward: B(s, m), or, when the backward is split, W(s, m), which runs after
I(s, m) and still needs the layer inputs. ``insert_frees`` places
``FREE_F(s, m)`` directly after that instruction, so the runtime drops the
tensors as early as the order allows.

Contract (what ``check_conflict`` then proves about the frees):

* every FREE_F(s, m) sits on the home rank of s, right after the B or W of
  (s, m), hence after the F that made the activation, after the SEND_F that
  shipped the output (a send follows its producer, long before the backward),
  and after every backward task of (s, m);
* each (s, m) is freed at most once: FREE_F actions already in the input are
  dropped first, so the pass is idempotent;
* nothing else moves: the output is the input with FREE_F actions inserted.
  A (s, m) with no B and no W gets no free (``check_well_formed`` reports the
  missing backward).
"""
from __future__ import annotations

from dataclasses import replace

from pipec.compiler.ir import B, FREE_F, W, Action, Program
from pipec.compiler.gc_pause import paused_gc

# The instructions after which the saved activation of their (stage, mb) is dead.
_LAST_USE_OPS = (B, W)
_new_action = tuple.__new__


def insert_frees(program: Program) -> Program:
    """Insert FREE_F(stage, mb) after the last use of each saved activation.

    Args:
        program: any program (compute-only or lowered); it is not modified.
    Returns:
        a new Program whose lists are the input's, without its FREE_F actions,
        with FREE_F(s, m) directly after each B(s, m) and W(s, m).
    """
    with paused_gc():
        return replace(program, ranks=[_with_frees(row) for row in program.ranks])


def _with_frees(row: list[Action]) -> list[Action]:
    out: list[Action] = []
    append = out.append
    for action in row:
        op = action[1]
        if op in _LAST_USE_OPS:
            append(action)
            append(_new_action(Action, (action[0], FREE_F, action[2], -1, ())))
        elif op != FREE_F:
            append(action)
    return out


__all__ = ["insert_frees"]
