"""Liveness: free each saved activation right after its last use.

The forward F(s, m) of a stage saves what its backward needs (its input, the
autograd graph): the *saved activation* of (s, m). Its last reader is the
backward: B(s, m), or, when the backward is split, W(s, m), which runs after
I(s, m) and still needs the layer inputs. ``insert_frees`` places
``FREE_F(s, m)`` directly after that instruction, so the runtime drops the
tensors as early as the order allows.

Which instructions are last uses comes from the rule table: for each free op
(``ops.FREE_OPS``), ``ops.last_uses`` gives the computes that end a value it
drops and make none it drops (B ends the saved activation; I ends it too but
leaves the weight-gradient inputs, which W ends).

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

from pipec.compiler import ops
from pipec.compiler.gc_pause import paused_gc
from pipec.compiler.ir import Action, Program

# compute op -> the free op that follows it: after it, what that free drops
# for its (stage, mb) is dead (B and W -> FREE_F).
_FREE_AFTER: dict[str, str] = {op: free_op for free_op in ops.FREE_OPS for op in ops.last_uses(free_op)}
_FREE_OPS = frozenset(ops.FREE_OPS)
# Every other op stays where it is: liveness's rule for an op is one of these three.
_KEPT = tuple(op for op in ops.OPS if op not in _FREE_AFTER and op not in _FREE_OPS)
ops.declare_pass("liveness", [*_FREE_AFTER, *_FREE_OPS, *_KEPT])
_new_action = tuple.__new__


def insert_frees(program: Program) -> Program:
    """Insert FREE_F(stage, mb) after the last use of each saved activation.

    Args:
        program: any program (compute-only or lowered); it is not modified.
    Returns:
        a new Program whose lists are the input's, without its free actions,
        with the free op directly after each of its last uses: FREE_F(s, m)
        after each B(s, m) and W(s, m).
    """
    with paused_gc():
        return replace(program, ranks=[_with_frees(row) for row in program.ranks])


def _with_frees(row: list[Action]) -> list[Action]:
    """One rank's list without its frees, with a free right after each last use."""
    out: list[Action] = []
    append = out.append
    free_after = _FREE_AFTER.get
    for action in row:
        free_op = free_after(action[1])
        if free_op is not None:
            append(action)
            append(_new_action(Action, (action[0], free_op, action[2], -1, ())))
        elif action[1] not in _FREE_OPS:
            append(action)
    return out


__all__ = ["insert_frees"]
