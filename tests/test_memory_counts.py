"""Memory in bytes per size class, and the passes that read memory and dataflow from the rule table.

The counts live in ``compiler/memory_counts.py`` (shared by the memory check
and the simulator); the simulator, liveness and the conflict check derive
their tables from ``compiler/ops.py`` and declare what they cover.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_memory, peak_activations
from pipec.compiler.checks.memory import peak_waiting_w
from pipec.compiler.driver import compile_target
from pipec.compiler.memory_counts import live_counts, peak_bytes, size_class_deltas
from pipec.errors import CostFileError
from pipec.compiler.simulate import simulate
from pipec.errors import BudgetError

ACT_BYTES = 1000


@pytest.fixture(scope="module")
def one_f_one_b():
    return compile_target("1f1b", {"P": 4, "N": 8}).program


@pytest.fixture(scope="module")
def zb_h1():
    return compile_target("zb_h1", {"P": 4, "N": 8}).program


def _saved_plus_stash_peak(row) -> int:
    """The most saved activations and weight-gradient stashes alive at once, walked by hand."""
    live = peak = 0
    for action in row:
        live += {"F": 1, "B": -1, "W": -1}.get(action.op, 0)  # I: a saved activation becomes a stash
        peak = max(peak, live)
    return peak


def test_peak_bytes_of_1f1b_are_the_activation_count_times_the_size(one_f_one_b):
    result = simulate(one_f_one_b, sizes={ops.SIZE_ACTIVATION: ACT_BYTES})
    counts = peak_activations(one_f_one_b)
    assert counts == [4, 3, 2, 1]
    assert [rank.peak_bytes for rank in result.ranks] == [{ops.SIZE_ACTIVATION: ACT_BYTES * c} for c in counts]
    assert peak_bytes(one_f_one_b, {ops.SIZE_ACTIVATION: ACT_BYTES}) == [rank.peak_bytes for rank in result.ranks]


def test_peak_bytes_of_zb_h1_count_what_i_leaves_for_w(zb_h1):
    bytes_per_rank = peak_bytes(zb_h1, {ops.SIZE_ACTIVATION: ACT_BYTES, ops.SIZE_WEIGHT: 5})
    assert bytes_per_rank == [{ops.SIZE_ACTIVATION: ACT_BYTES * _saved_plus_stash_peak(row), ops.SIZE_WEIGHT: 0}
                              for row in zb_h1.ranks]
    # the last rank holds one saved activation at a time, but up to four stashes waiting for their W
    assert peak_activations(zb_h1)[3] == 1 and peak_waiting_w(zb_h1.ranks[3]) == 4
    assert bytes_per_rank[3][ops.SIZE_ACTIVATION] == 4 * ACT_BYTES


def test_size_class_deltas_come_from_the_rule_table():
    # F or R (a recomputed stage's recompute) makes the saved activation, B ends it, I swaps it for a stash W ends
    assert size_class_deltas(ops.SIZE_ACTIVATION) == {ops.F: 1, ops.B: -1, ops.W: -1, ops.R: 1}
    assert size_class_deltas(ops.SIZE_BOUNDARY) == {ops.FC: 1, ops.R: -1}  # the input a recomputed forward keeps
    assert size_class_deltas(ops.SIZE_WEIGHT) == {}  # weights have no counter: bytes only when one is added
    assert list(live_counts([], ops.memory_deltas("activations"))) == []


def test_simulate_json_has_peak_bytes_only_when_sizes_are_given(one_f_one_b):
    plain = simulate(one_f_one_b).to_json()
    assert all("peak_bytes" not in rank for rank in plain["ranks"])
    assert all(rank.peak_bytes is None for rank in simulate(one_f_one_b).ranks)
    sized = simulate(one_f_one_b, sizes={ops.SIZE_ACTIVATION: 2.5}).to_json()
    assert [rank["peak_bytes"] for rank in sized["ranks"]] == [{"activation": 2.5 * c} for c in (4, 3, 2, 1)]
    json.dumps(sized)  # plain numbers


def test_unknown_size_class_is_rejected(one_f_one_b):
    with pytest.raises(CostFileError, match="unknown size class 'activations'"):
        simulate(one_f_one_b, sizes={"activations": 1})
    with pytest.raises(CostFileError, match="not a non-negative number"):
        peak_bytes(one_f_one_b, {ops.SIZE_ACTIVATION: -1})


def test_byte_budget_passes_at_the_peak_and_fails_above_it(one_f_one_b):
    sizes = {ops.SIZE_ACTIVATION: ACT_BYTES}
    check_memory(one_f_one_b, None, byte_budget={ops.SIZE_ACTIVATION: 4 * ACT_BYTES}, sizes=sizes)
    with pytest.raises(BudgetError) as info:
        check_memory(one_f_one_b, None, byte_budget={ops.SIZE_ACTIVATION: 3 * ACT_BYTES + 999}, sizes=sizes)
    error = info.value
    assert error.message == ("4000 bytes of activation-sized values alive here (4 of 1000 bytes), over the "
                             "activation budget of 3999 bytes; this rank's peak is 4000 bytes")
    assert error.rank == 0
    assert [live for live in live_counts(one_f_one_b.ranks[0], ops.memory_deltas("activations"))][error.step] == 4
    assert all(live < 4 for live in list(live_counts(one_f_one_b.ranks[0], ops.memory_deltas("activations")))[:error.step])


def test_byte_budget_names_the_first_rank_over(zb_h1):
    # every zb_h1 rank peaks at 4 values; with a budget of 3 the lowest rank is named
    with pytest.raises(BudgetError) as info:
        check_memory(zb_h1, None, byte_budget={ops.SIZE_ACTIVATION: 3 * ACT_BYTES}, sizes={ops.SIZE_ACTIVATION: ACT_BYTES})
    assert info.value.rank == 0 and "activation budget of 3000 bytes" in info.value.message


def test_count_budget_is_checked_first_and_unchanged(one_f_one_b):
    with pytest.raises(BudgetError) as info:
        check_memory(one_f_one_b, 3, byte_budget={ops.SIZE_ACTIVATION: 0}, sizes={ops.SIZE_ACTIVATION: 1})
    assert info.value.message == ("4 activations alive here (forward done, backward pending), over the budget of 3; "
                                  "this rank's peak is 4")


def test_byte_budget_needs_sizes(one_f_one_b):
    with pytest.raises(ValueError, match="needs the bytes"):
        check_memory(one_f_one_b, None, byte_budget={ops.SIZE_ACTIVATION: 10})


@pytest.mark.parametrize("name", ["simulate", "liveness", "conflict", "memory"])
def test_pass_covers_every_op(name):
    import pipec.compiler.checks.conflict  # noqa: F401  (declares on import)
    import pipec.compiler.checks.memory  # noqa: F401
    import pipec.compiler.liveness  # noqa: F401
    import pipec.compiler.simulate  # noqa: F401

    assert name in ops.declared_passes()
    assert name not in ops.passes_missing_rules()


def test_simulator_imports_no_check():
    code = ("import sys, pipec.compiler.simulate; "
            "print([m for m in sys.modules if m.startswith('pipec.compiler.checks')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
